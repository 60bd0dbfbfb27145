import re
from pathlib import Path

import pytest
from helpers import ROOT

from ondemand import config
from ondemand.errors import ConfigError


def test_defaults_follow_the_documents():
    cfg = config.load(env={})
    assert cfg.listen == "0.0.0.0:8090"
    assert cfg.base_path == "/dgxmm"
    assert cfg.internal_url == "http://dgxmm:8090/dgxmm"
    assert cfg.ondemand_allowed_cidrs == "auto"
    assert (cfg.ondemand_idle_timeout_s, cfg.ondemand_queue_timeout_s, cfg.ondemand_max_queued) == (600, 900, 256)
    assert (cfg.reap_interval_s, cfg.min_idle_timeout_s, cfg.metrics_interval_s) == (15, 60, 10)
    assert cfg.budget.source == "nvidia-smi" and cfg.deployer.backend == "docker"
    assert cfg.deployer.network == "dgxmm" and cfg.deployer.start_timeout_s == 1800
    assert cfg.litellm.url is None
    assert cfg.key_file == Path("state/ondemand.key")
    assert cfg.db_path == Path("state/ondemand.db")
    assert cfg.admin_socket == Path("state/admin.sock")


def test_file_then_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('state_dir = "/srv/od"\nondemand_queue_timeout_s = 60\n'
                 '[budget]\nsource = "static"\ncapacity_gib = 80\n'
                 '[deployer]\nbackend = "process"\n')
    cfg = config.load(f, env={"ONDEMAND_ONDEMAND_QUEUE_TIMEOUT_S": "120", "ONDEMAND_BUDGET_CAPACITY_GIB": "96"})
    assert cfg.state_dir == Path("/srv/od") and cfg.key_file == Path("/srv/od/ondemand.key")
    assert cfg.ondemand_queue_timeout_s == 120
    assert cfg.budget.source == "static" and cfg.budget.capacity_gib == 96.0
    assert cfg.deployer.backend == "process"


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('listen = "127.0.0.1:9000"\n')
    assert config.load(env={"ONDEMAND_CONFIG": str(f)}).listen == "127.0.0.1:9000"


@pytest.mark.parametrize("text, key", [
    ("bogus = 1\n", "bogus"),
    ("ondemand_queue_timeout_s = -1\n", "ondemand_queue_timeout_s"),
    ("ondemand_queue_timeout_s = 0\n", "ondemand_queue_timeout_s"),
    ("ondemand_max_queued = 100001\n", "ondemand_max_queued"),
    ("ondemand_idle_timeout_s = 30\n", "ondemand_idle_timeout_s"),
    ('ondemand_allowed_cidrs = ["10.0.0.0/33"]\n', "ondemand_allowed_cidrs"),
    ('ondemand_allowed_cidrs = ["10.0.0.1/8"]\n', "ondemand_allowed_cidrs"),
    ('[budget]\nsource = "gpu"\n', "budget.source"),
    ('[budget]\nsource = "static"\n', "budget.capacity_gib"),
    ('[budget]\nsource = "static"\ngpu_capacity_gib = [80, 0]\n', "budget.gpu_capacity_gib"),
    ('[budget]\nsource = "static"\ngpu_capacity_gib = []\n', "budget.gpu_capacity_gib"),
    ('[budget]\nsource = "static"\ncapacity_gib = 80\ngpu_capacity_gib = [80]\n', "budget.gpu_capacity_gib"),
    ('[budget]\ngpu_capacity_gib = [80, 80]\n', "budget.gpu_capacity_gib"),
    ('[budget]\nreserve_gib = -1\n', "budget.reserve_gib"),
    ('[deployer]\nbackend = "k8s"\n', "deployer.backend"),
    ('[deployer]\nwhat = 1\n', "deployer.what"),
    ('[deployer]\nshm_size_gib = -1\n', "deployer.shm_size_gib"),
    ('listen = "8090"\n', "listen"),
    ('ondemand_queue_timeout_s = "soon"\n', "ondemand_queue_timeout_s"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        config.load(f, env={})
    msg = str(exc.value)
    assert key in msg and "\n" not in msg


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "cannot be read: Is a directory"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "not valid TOML"),
    (lambda p: p.write_bytes(b'listen = "\xe9"\n'), "not valid TOML"),
], ids=["a directory", "not UTF-8", "Latin-1 in a string"])
def test_an_unreadable_config_file_is_a_config_error(tmp_path, make, says):
    """A directory or bytes that are not UTF-8 are one ConfigError, as a missing file is: not an
    OSError or UnicodeDecodeError the command line would print as a traceback."""
    f = tmp_path / "c.toml"
    make(f)
    with pytest.raises(ConfigError, match=re.escape(f"config file {f}: {says}")):
        config.load(f, env={})
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "missing.toml", env={})


def test_gpu_capacities_from_the_file_and_the_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[budget]\nsource = "static"\ngpu_capacity_gib = [80, 80, 40.5]\nreserve_gib = 2\n')
    cfg = config.load(f, env={})
    assert cfg.budget.gpu_capacity_gib == (80.0, 80.0, 40.5) and cfg.budget.reserve_gib == 2.0
    cfg = config.load(env={"ONDEMAND_BUDGET_SOURCE": "static", "ONDEMAND_BUDGET_GPU_CAPACITY_GIB": "80, 80"})
    assert cfg.budget.gpu_capacity_gib == (80.0, 80.0) and cfg.budget.capacity_gib is None


def test_bad_environment_value_names_the_key():
    with pytest.raises(ConfigError, match="ondemand_queue_timeout_s"):
        config.load(env={"ONDEMAND_ONDEMAND_QUEUE_TIMEOUT_S": "-1"})
    with pytest.raises(ConfigError, match="ONDEMAND_QUEUE_TIMOUT"):
        config.load(env={"ONDEMAND_QUEUE_TIMOUT": "5"})


def test_an_empty_state_dir_is_refused_not_read_as_the_working_directory(tmp_path):
    """``ONDEMAND_STATE_DIR=`` (or ``state_dir = ""``) put the key, the token and the state file in
    the working directory; "." still says so on purpose."""
    with pytest.raises(ConfigError, match="state_dir"):
        config.load(env={"ONDEMAND_STATE_DIR": ""})
    path = tmp_path / "c.toml"
    path.write_text('state_dir = ""\n')
    with pytest.raises(ConfigError, match="state_dir"):
        config.load(path, env={})
    assert str(config.load(env={"ONDEMAND_STATE_DIR": "."}).state_dir) == "."


def test_idle_timeout_bound_follows_min_idle_timeout():
    cfg = config.load(env={"ONDEMAND_MIN_IDLE_TIMEOUT_S": "1", "ONDEMAND_ONDEMAND_IDLE_TIMEOUT_S": "2"})
    assert cfg.ondemand_idle_timeout_s == 2
    # The message states the range that applies with this min_idle_timeout_s.
    for bad in ("0", "5", "100000"):
        with pytest.raises(ConfigError) as exc:
            config.load(env={"ONDEMAND_MIN_IDLE_TIMEOUT_S": "10", "ONDEMAND_ONDEMAND_IDLE_TIMEOUT_S": bad})
        assert str(exc.value).endswith(f"ondemand_idle_timeout_s = {bad} is not allowed: "
                                       "whole seconds, 10 (min_idle_timeout_s) to 86400"), str(exc.value)


def test_cidr_list_from_environment():
    cfg = config.load(env={"ONDEMAND_ONDEMAND_ALLOWED_CIDRS": "127.0.0.0/8, 10.1.0.0/16"})
    assert cfg.ondemand_allowed_cidrs == ("127.0.0.0/8", "10.1.0.0/16")


def test_describe_lists_every_key():
    keys = [row[0] for row in config.describe()]
    assert "budget.capacity_gib" in keys and "ondemand_queue_timeout_s" in keys


def test_readme_configuration_names_every_key():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration\n"):readme.index("## Engine logs\n")]
    missing = [key for key, _, _ in config.describe() if f"`{key}`" not in table]
    assert not missing, f"the README's configuration table lacks {missing}"


@pytest.mark.parametrize("name", ["ondemand.example.toml", "ondemand.toml", "demo.toml", "real.toml"])
def test_shipped_configs_load(name):
    path = ROOT / "packaging" / name
    cfg = config.load(path, env={})
    assert cfg.listen and cfg.state_dir


def test_admin_token_and_ondemand_key_must_be_two_files(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    (tmp_path / "link").symlink_to(state)
    (state / "key").write_text("odk-x\n")
    (state / "hard").hardlink_to(state / "key")
    same = [
        # the token file names the default key file
        {"ONDEMAND_STATE_DIR": str(state), "ONDEMAND_ADMIN_TOKEN_FILE": str(state / "ondemand.key")},
        # the key file names the default token file, through ".."
        {"ONDEMAND_STATE_DIR": str(state), "ONDEMAND_ONDEMAND_KEY_FILE": str(state / "x" / ".." / "admin.token")},
        # one through a symbolic link to the directory
        {"ONDEMAND_ONDEMAND_KEY_FILE": str(state / "k"), "ONDEMAND_ADMIN_TOKEN_FILE": str(tmp_path / "link" / "k")},
        # a hard link of an existing file
        {"ONDEMAND_ONDEMAND_KEY_FILE": str(state / "key"), "ONDEMAND_ADMIN_TOKEN_FILE": str(state / "hard")},
    ]
    for env in same:
        with pytest.raises(ConfigError) as exc:
            config.load(env=env)
        msg = str(exc.value)
        assert "admin_token_file" in msg and "ondemand_key_file" in msg and "\n" not in msg, msg
    cfg = config.load(env={"ONDEMAND_STATE_DIR": str(state)})  # the defaults are two files
    assert cfg.key_file != cfg.token_file


def test_admin_token_and_ondemand_key_same_file_relative_in_toml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "c.toml"
    f.write_text('state_dir = "st"\nadmin_token_file = "./st/ondemand.key"\n')
    with pytest.raises(ConfigError, match="admin_token_file .* ondemand_key_file"):
        config.load(f, env={})


def test_instance_defaults_to_a_valid_host_name_and_is_validated():
    assert config.default_instance("DGX-Box_1.lab") == "dgx-box_1.lab"
    assert config.default_instance("Ünïcode box") == "n-code-box"
    assert config.default_instance("---") == "ondemand"
    assert config.load(env={}).instance == config.default_instance()
    assert config.load(env={"ONDEMAND_INSTANCE": "box-b"}).instance == "box-b"
    for bad in ("Box", "-box", "box b", "", "a" * 64):
        with pytest.raises(ConfigError) as exc:
            config.load(env={"ONDEMAND_INSTANCE": bad})
        assert "instance" in str(exc.value)


def test_connection_caps_are_keys_and_per_peer_is_at_most_the_total():
    cfg = config.load(env={"ONDEMAND_MAX_CONNECTIONS": "100", "ONDEMAND_MAX_CONNECTIONS_PER_PEER": "10"})
    assert (cfg.max_connections, cfg.max_connections_per_peer) == (100, 10)
    with pytest.raises(ConfigError, match="max_connections_per_peer = 200 .*1 to 100"):
        config.load(env={}, overrides={"max_connections": 100, "max_connections_per_peer": 200})
    # Unset, the per-peer cap follows a total below its default (2,048), and stays put above it.
    assert config.load(env={}, overrides={"max_connections": 100}).max_connections_per_peer == 100
    assert config.load(env={}, overrides={"max_connections": 10_000}).max_connections_per_peer == 2048
    with pytest.raises(ConfigError, match="max_connections = 0"):
        config.load(env={}, overrides={"max_connections": 0})


def test_admin_listen_is_host_port_or_nothing():
    assert config.load(env={}).admin_listen is None
    assert config.load(env={"ONDEMAND_ADMIN_LISTEN": "127.0.0.1:8091"}).admin_listen_host_port == ("127.0.0.1", 8091)
    with pytest.raises(ConfigError, match="admin_listen"):
        config.load(env={}, overrides={"admin_listen": "8091"})


def test_the_scheduler_key_takes_the_schedulers_of_the_core_and_names_them():
    """``scheduler`` (default seed) is one of the decision core's schedulers, each made by name
    (control/scheduler.py); another value is refused with the key and the names."""
    from ondemand.control.scheduler import SCHEDULERS, SeedScheduler, scheduler

    assert config.load(env={}).scheduler == "seed"
    assert config.load(env={"ONDEMAND_SCHEDULER": "cost"}).scheduler == "cost"
    with pytest.raises(ConfigError) as exc:
        config.load(env={"ONDEMAND_SCHEDULER": "lru"})
    assert str(exc.value).startswith("configuration key scheduler = 'lru' is not allowed: seed or cost")
    for name in SCHEDULERS:  # every scheduler the core can make is a value the key takes
        assert config.load(env={"ONDEMAND_SCHEDULER": name}).scheduler == name
    made = scheduler("seed")
    assert isinstance(made, SeedScheduler) and made is not scheduler("seed")  # a queue of its own each
    with pytest.raises(ValueError, match="unknown scheduler 'lru': one of seed, cost"):
        scheduler("lru")


def test_slo_s_is_bounded_and_reaches_the_cost_scheduler():
    assert config.load(env={}).slo_s == 5.0
    assert config.load(env={"ONDEMAND_SLO_S": "2.5"}).slo_s == 2.5
    for bad in ("0.1", "601", "nan"):
        with pytest.raises(ConfigError, match="slo_s"):
            config.load(env={"ONDEMAND_SLO_S": bad})
    from ondemand.control.scheduler import scheduler
    assert scheduler("cost", 2.5).take.slo_s == 2.5  # type: ignore[attr-defined]

