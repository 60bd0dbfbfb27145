"""packaging/compose.yaml and packaging/ondemand.toml describe one setup: what one names, the
other must find. No YAML loader is a dependency, so the compose file is read as text here; its
syntax was checked with `docker-compose config` (see the README's "Install")."""
import re

from helpers import ROOT

from ondemand import config

COMPOSE = (ROOT / "packaging" / "compose.yaml").read_text()
CFG = config.load(ROOT / "packaging" / "ondemand.toml", env={})


def test_engines_join_the_network_compose_makes():
    assert re.search(rf"^networks:\n  {CFG.deployer.network}:\n    name: {CFG.deployer.network}\b", COMPOSE, re.M)


def test_litellm_is_reached_by_its_service_name_and_its_master_key_is_a_secret_of_both():
    assert CFG.litellm.url == "http://litellm:4000"
    assert re.search(r"^  litellm:\n", COMPOSE, re.M) and '"--port", "4000"' in COMPOSE
    secret = CFG.litellm.master_key_file.removeprefix("/run/secrets/")
    assert f"cat /run/secrets/{secret}" in COMPOSE  # LiteLLM's LITELLM_MASTER_KEY
    assert re.search(rf"^      - {secret}\b", COMPOSE, re.M)  # ondemand's secrets


def test_internal_url_is_ondemands_alias_and_port():
    assert CFG.internal_url == "http://dgxmm:8090/dgxmm" and CFG.listen.endswith(":8090")
    assert "aliases: [dgxmm]" in COMPOSE and "/dgxmm/healthz" in COMPOSE


def test_config_state_and_host_paths_are_mounted():
    assert "./ondemand.toml:/etc/ondemand/ondemand.toml:ro" in COMPOSE
    assert "ONDEMAND_CONFIG: /etc/ondemand/ondemand.toml" in COMPOSE
    assert f"ondemand-state:{CFG.state_dir}" in COMPOSE
    assert "/var/run/docker.sock:/var/run/docker.sock" in COMPOSE
    # model_cache and volume_roots are host paths, seen by ondemand at the same place.
    mounted = re.findall(r"^      - (/[^:\s]+):\1$", COMPOSE, re.M)
    for path in (CFG.deployer.model_cache, *CFG.deployer.volume_roots):
        assert any(str(path).startswith(m + "/") or str(path) == m for m in mounted), path


def test_litellm_image_is_the_version_the_tests_run():
    pin = re.search(r'"litellm\[proxy\]==([0-9.]+)"', (ROOT / "scripts/heavy/litellm-venv.sh").read_text())
    assert f"image: ghcr.io/berriai/litellm:main-v{pin.group(1)}\n" in COMPOSE
