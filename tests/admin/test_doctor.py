"""``ondemand doctor``'s checks of the engine recipes' box (issue #21): the images on the
Docker host, Docker's GPU runtime, the model cache, the token file, and each deployment
against the box's GPUs. Docker is the API double (tests/docker_double.py); files are
tmp files. The command line's own doctor tests (output, exit code) are in test_cli."""
from __future__ import annotations

import os

import pytest
from docker_double import DockerDouble

from ondemand import config
from ondemand.admin import doctor


def make_cfg(tmp_path, **overrides):
    settings = {"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", "deployer.backend": "docker",
                "budget.source": "static", "budget.gpu_capacity_gib": [80, 80]}
    settings.update(overrides)
    return config.load(env={}, overrides=settings)


def row(name, **fields):
    return {"id": fields.pop("id", 1), "name": name, "served_name": name, "engine": "vllm", "state": "stopped",
            "role": "model", **fields}


# --- the token file ----------------------------------------------------------------------

def test_token_file_unset_missing_empty_open_and_private(tmp_path):
    assert doctor.check_hf_token(make_cfg(tmp_path))["ok"] is None
    token = tmp_path / "hf.token"
    cfg = make_cfg(tmp_path, **{"deployer.hf_token_file": str(token)})
    missing = doctor.check_hf_token(cfg)
    assert missing["ok"] is False and str(token) in missing["detail"] and "No such file" in missing["detail"]
    token.mkdir()  # unreadable as a file, even for root
    unreadable = doctor.check_hf_token(cfg)
    assert unreadable["ok"] is False and "cannot read" in unreadable["detail"] and "directory" in unreadable["detail"]
    token.rmdir()
    token.write_text("\n")
    empty = doctor.check_hf_token(cfg)
    assert empty["ok"] is False and "is empty" in empty["detail"]
    token.write_text("hf_s3cret\n")
    token.chmod(0o640)
    group = doctor.check_hf_token(cfg)
    assert group["ok"] is False and "mode 640" in group["detail"] and "chmod 600" in group["detail"]
    token.chmod(0o600)
    good = doctor.check_hf_token(cfg)
    assert good == {"check": "hf-token", "ok": True, "detail": f"{token} holds a token (mode 600)"}
    for c in (group, good):
        assert "s3cret" not in c["detail"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_token_file_unreadable(tmp_path):
    token = tmp_path / "hf.token"
    token.write_text("hf_x")
    token.chmod(0)
    c = doctor.check_hf_token(make_cfg(tmp_path, **{"deployer.hf_token_file": str(token)}))
    assert c["ok"] is False and "cannot read" in c["detail"] and "Permission denied" in c["detail"]


# --- the model cache ---------------------------------------------------------------------

def test_model_cache_unset_missing_a_file_and_writable(tmp_path):
    assert doctor.check_model_cache(make_cfg(tmp_path))["ok"] is None
    cache = tmp_path / "hf"
    cfg = make_cfg(tmp_path, **{"deployer.model_cache": str(cache)})
    c = doctor.check_model_cache(cfg)
    assert c["ok"] is False and f"mkdir -p {cache}" in c["detail"]
    cache.write_text("")
    assert "not a directory" in doctor.check_model_cache(cfg)["detail"]
    cache.unlink()
    cache.mkdir()
    assert doctor.check_model_cache(cfg) == {"check": "cache", "ok": True, "detail": f"{cache} is writable"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_model_cache_read_only(tmp_path):
    cache = tmp_path / "hf"
    cache.mkdir(mode=0o555)
    c = doctor.check_model_cache(make_cfg(tmp_path, **{"deployer.model_cache": str(cache)}))
    assert c["ok"] is False and "not writable" in c["detail"]


def test_compile_cache_unset_to_be_made_a_file_and_writable(tmp_path):
    assert doctor.check_compile_cache(make_cfg(tmp_path))["ok"] is None
    cache = tmp_path / "cc"
    cfg = make_cfg(tmp_path, **{"deployer.compile_cache": str(cache)})
    c = doctor.check_compile_cache(cfg)
    assert c["ok"] is True and "made at the first start" in c["detail"]
    cache.write_text("")
    assert "not a directory" in doctor.check_compile_cache(cfg)["detail"]
    cache.unlink()
    (cache / "0123456789ab").mkdir(parents=True)
    assert doctor.check_compile_cache(cfg) == {"check": "compile cache", "ok": True,
                                               "detail": f"{cache} is writable (1 configuration(s) cached)"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_compile_cache_read_only(tmp_path):
    cache = tmp_path / "cc"
    cache.mkdir(mode=0o555)
    c = doctor.check_compile_cache(make_cfg(tmp_path, **{"deployer.compile_cache": str(cache)}))
    assert c["ok"] is False and "not writable" in c["detail"]


# --- the box's GPUs ----------------------------------------------------------------------

def test_each_deployment_against_the_box():
    sizes = (80.0, 80.0)
    rows = [row("small", model="Qwen/Qwen3-8B", memory_gib=40, gpu_count=1),
            row("old", id=2, memory_gib=10, command=["x"])]  # no model, gpu_count NULL: every GPU
    assert doctor.check_fits(rows, sizes, True) == {
        "check": "fits", "ok": True, "detail": "2 deployments fit the box (2 GPUs of 80 GiB)"}
    assert doctor.check_fits(rows, (128.0,), False)["detail"] == "2 deployments fit the box (one pool of 128 GiB)"
    rows += [row("wide", id=3, model="m", memory_gib=40, gpu_count=4),
             row("greedy", id=4, model="m", memory_gib=78, gpu_count=1),
             row("pinned", id=5, memory_gib=8, gpu_count=1, gpu_ids=[5], command=["x"])]
    c = doctor.check_fits(rows, sizes, True)
    assert c["ok"] is False
    detail = c["detail"]
    assert detail.startswith("wide: 4 GPUs, but this box has 2 (deploy set 3 --gpu-count ...); greedy: 78 GiB on 1 ")
    assert "share of 0.97 of each; at most 0.95" in detail and "(deploy set 4 --memory-gib ...); pinned:" in detail
    assert detail.endswith("; pinned: pinned to GPU 5, but this box has GPUs 0 to 1 (deploy set 5 --gpu-ids ...)")
    assert "small" not in detail and "old" not in detail
    # nothing to say without deployments or without the box's sizes (the budget check says why)
    assert doctor.check_fits([], sizes, True) is None and doctor.check_fits(rows, None, True) is None


def test_a_deployment_that_can_never_fit_is_named_with_the_503_it_gets():
    """A deployment without a recipe has no memory share to check: 30 GiB on the demo's one GPU of
    24 was said to fit, while every request for it got 503 does_not_fit. Its words are the 503's."""
    rows = [row("demo-small", model="demo/demo-small", memory_gib=10, gpu_count=1),
            row("big", id=3, memory_gib=30, gpu_count=1, command=["x"], mode="on_demand")]
    c = doctor.check_fits(rows, (24.0,), True)
    assert c == {"check": "fits", "ok": False, "detail": (
        "big: can never fit, a request for it gets 503 does_not_fit: big needs 30 GiB on one GPU, more than what "
        "on-demand models can ever use on this box's 1 GPUs (at most 24 GiB on one GPU) "
        "(deploy set 3 --memory-gib ... or --gpu-count ...)")}
    one_pool = doctor.check_fits(rows, (24.0,), False)["detail"]
    assert one_pool.startswith("big: can never fit") and "than the 24 GiB that on-demand models can ever use here" \
        in one_pool and "demo-small" not in one_pool
    assert doctor.check_fits(rows[:1], (24.0,), True)["ok"] is True


def test_never_fits_counts_what_always_on_deployments_hold_and_the_reserve():
    """As the controller counts it: an always-on engine holding memory leaves the rest to the
    on-demand ones (not when it is stopped); budget.reserve_gib is never theirs."""
    from ondemand.control.budget import Budget, Reading
    resident = row("resident", id=1, memory_gib=16, gpu_count=1, command=["x"], mode="always_on", state="ready",
                   gpus=[0])
    od = row("od", id=2, memory_gib=10, gpu_count=1, command=["x"], mode="on_demand")
    c = doctor.check_fits([resident, od], (24.0,), True)
    assert c["ok"] is False and c["detail"].startswith("od: can never fit") and "at most 8 GiB on one GPU" in c["detail"]
    assert doctor.check_fits([dict(resident, state="stopped"), od], (24.0,), True)["ok"] is True
    reserved = Budget("static", gpu_capacity_gib=(24.0,), reserve_gib=16)
    c = doctor.check_fits([od], (24.0,), True, reserved, Reading(None))
    assert c["ok"] is False and "at most 8 GiB on one GPU" in c["detail"]


def test_a_recipe_with_no_size_yet_is_not_counted_as_nothing_and_always_on_is_worded_as_a_start():
    """With no server running, a recipe without memory_gib has no booking yet (the server books it
    from its checkpoint): counted as 0 GiB, an always-on one beside a 10 GiB model said "fits"
    where the box refused it; doctor says it could not check instead. An always-on deployment
    gets no 503: its start is refused."""
    unsized = row("resident", id=1, model="org/model", gpu_count=1, mode="always_on", state="ready", gpus=[0])
    od = row("od", id=2, memory_gib=10, gpu_count=1, command=["x"], mode="on_demand")
    c = doctor.check_fits([unsized, od], (24.0,), True)
    assert c["ok"] is True and "not checked beside each other: resident have no size" in c["detail"]
    big = row("big", id=3, memory_gib=30, gpu_count=1, command=["x"], mode="always_on")
    c = doctor.check_fits([big], (24.0,), True)
    assert c["ok"] is False and c["detail"].startswith("big: can never fit, its start is refused: big needs 30 GiB")


async def test_run_says_which_stored_deployment_can_never_fit(tmp_path):
    """doctor against the configured box (its reserve) and the state file's deployments."""
    from ondemand.state.store import Store
    cfg = make_cfg(tmp_path, **{"deployer.backend": "process", "budget.gpu_capacity_gib": [24],
                                "budget.reserve_gib": 4})
    store = await Store.open(cfg.db_path)
    try:
        await store.insert_deployment(dict(name="big", served_name="big", engine="custom", command=["x"],
                                           memory_gib=22, gpu_count=1, mode="on_demand", state="stopped"))
    finally:
        await store.close()
    by = {c["check"]: c for c in await doctor.run(cfg)}
    assert by["fits"]["ok"] is False and "big needs 22 GiB on one GPU" in by["fits"]["detail"]
    assert "(at most 20 GiB on one GPU)" in by["fits"]["detail"]


# --- Docker: the images and the GPU runtime --------------------------------------------------

def test_gpu_runtime_from_docker_info():
    assert doctor.gpu_runtime({"Runtimes": {"runc": {}, "nvidia": {}}})["ok"] is True
    cdi = doctor.gpu_runtime({"Runtimes": {"runc": {}}, "CDISpecDirs": ["/etc/cdi"],
                              "DiscoveredDevices": [{"Source": "cdi", "ID": "nvidia.com/gpu=0"},
                                                    {"Source": "cdi", "ID": "nvidia.com/gpu=all"}]})
    assert cdi["ok"] is True and "nvidia.com/gpu=0, nvidia.com/gpu=all" in cdi["detail"]
    # an older Docker lists no devices, only where it reads CDI specs
    assert doctor.gpu_runtime({"Runtimes": {"runc": {}}, "CDISpecDirs": ["/etc/cdi"]})["ok"] is True
    # a newer one that found no GPU among its CDI devices
    none = doctor.gpu_runtime({"Runtimes": {"runc": {}}, "CDISpecDirs": ["/etc/cdi"], "DiscoveredDevices": []})
    assert none["ok"] is False
    assert "NVIDIA Container Toolkit" in none["detail"] and "deployer.gpus = false" in none["detail"]
    assert doctor.gpu_runtime({})["ok"] is False


async def test_images_and_runtime_against_the_docker_api(tmp_path):
    double = DockerDouble()
    double.add_image("vllm/vllm-openai:latest", ["vllm"])
    async with double:
        cfg = make_cfg(tmp_path, **{"deployer.docker_url": double.url})
        rows = [row("qwen", model="Qwen/Qwen3-8B"),  # read from the state file: the recipe's image
                row("gemma", id=2, model="google/gemma-3-4b-it", engine_image="vllm/vllm-openai:latest"),
                row("tiny", id=3, engine="llamacpp", model="/m/tiny.gguf",
                    engine_image="ghcr.io/ggml-org/llama.cpp:server-cuda"),
                row("sim", id=4, image="sim:1", engine_image="sim:1")]
        images, runtime = await doctor.check_docker_host(cfg, rows)
        assert images["check"] == "images" and images["ok"] is False
        assert images["detail"] == (
            "not on the Docker host, and ondemand never pulls: "
            "ghcr.io/ggml-org/llama.cpp:server-cuda (for tiny): docker pull ghcr.io/ggml-org/llama.cpp:server-cuda; "
            "sim:1 (for sim): docker pull sim:1")
        assert runtime["check"] == "runtime" and runtime["ok"] is False
        assert not [p for p in double.requests if "pull" in p or "create" in p]  # nothing pulled
        double.add_image("ghcr.io/ggml-org/llama.cpp:server-cuda", ["llama-server"])
        double.add_image("sim:1", ["python3"])
        double.info["Runtimes"]["nvidia"] = {"path": "nvidia-container-runtime"}
        images, runtime = await doctor.check_docker_host(cfg, rows)
        assert images["ok"] is True and "vllm/vllm-openai:latest, ghcr.io" in images["detail"]
        assert runtime == {"check": "runtime", "ok": True, "detail": "Docker has the nvidia runtime"}
        # without GPUs there is no runtime to check; without deployments no image
        cfg = make_cfg(tmp_path, **{"deployer.docker_url": double.url, "deployer.gpus": False})
        assert await doctor.check_docker_host(cfg, []) == []


async def test_docker_host_checks_skip_without_docker_or_with_the_process_backend(tmp_path):
    cfg = make_cfg(tmp_path, **{"deployer.docker_url": f"unix://{tmp_path}/none.sock"})
    images, runtime = await doctor.check_docker_host(cfg, [row("qwen", model="Qwen/Qwen3-8B")])
    assert images["ok"] is None and runtime["ok"] is None and "see the docker check" in runtime["detail"]
    assert await doctor.check_docker_host(make_cfg(tmp_path, **{"deployer.backend": "process"}), []) == []


async def test_run_has_the_new_checks_in_order(tmp_path):
    double = DockerDouble()
    double.add_network("dgxmm")
    double.add_image("vllm/vllm-openai:latest", ["vllm"])
    cache = tmp_path / "hf"
    cache.mkdir()
    async with double:
        cfg = make_cfg(tmp_path, **{"deployer.docker_url": double.url, "deployer.model_cache": str(cache)})
        checks = await doctor.run(cfg)
    names = [c["check"] for c in checks]
    assert names[:8] == ["docker", "budget", "key", "files", "hf-token", "cache", "compile cache", "litellm"]
    by = {c["check"]: c for c in checks}
    assert by["docker"]["ok"] and by["cache"]["ok"] and by["hf-token"]["ok"] is None
    assert by["runtime"]["ok"] is False  # the double's Docker has no NVIDIA toolkit
    assert "images" not in by and "fits" not in by  # no state file: no deployment to check
