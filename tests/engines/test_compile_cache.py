"""The compile cache (engines/compile_cache.py and the recipes' use of it): one directory per
configuration, stable across restarts, never one for two configurations; mounted at vLLM's cache
root on the docker backend (the Docker API double; real dockerd under ``make test-docker``),
``VLLM_CACHE_ROOT`` for a child process; warm on the next start; pruned when unused."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time

import aiohttp
import pytest
from docker_double import DockerDouble
from helpers import wait_for

from ondemand.engines import compile_cache
from ondemand.engines.backends.docker import DockerBackend
from ondemand.engines.backends.process import ProcessBackend
from ondemand.engines.recipes import SGLANG_CACHE, VLLM_CACHE, Box, Mount, launch
from ondemand.model import Deployment

SIM = ("ondemand", "sim-engine")


def dep(**kw) -> Deployment:
    fields = dict(id=1, name="tiny", served_name="tiny", engine="vllm", model="org/tiny", memory_gib=20,
                  gpu_count=1, port=8000)
    fields.update(kw)
    return Deployment.from_row(fields)


def box(tmp_path, backend="process", **kw) -> Box:
    return Box(backend=backend, images={"vllm": "ondemand-sim-engine:latest", "sglang": "sglang:1"},
               commands={"vllm": SIM, "sglang": SIM}, compile_cache=tmp_path / "cc", **kw)


def key_of(d: Deployment, b: Box, **kw) -> str | None:
    return launch(d, b, gpu_size_gib=80.0, **kw).compile_key


# --- the key -----------------------------------------------------------------------------

def test_the_key_is_stable_across_restarts_and_ports(tmp_path):
    b = box(tmp_path)
    first = key_of(dep(), b)
    assert first is not None and len(first) == 12 and int(first, 16) >= 0
    assert key_of(dep(), box(tmp_path)) == first  # a new box: ondemand restarted
    # In a new Python process too: no hash seed, no dict order in it.
    code = ("from ondemand.engines.recipes import Box, launch; from ondemand.model import Deployment; "
            "import pathlib; d = Deployment.from_row(dict(id=1, name='tiny', served_name='tiny', engine='vllm', "
            "model='org/tiny', memory_gib=20, gpu_count=1, port=8000)); "
            f"b = Box(backend='process', commands={{'vllm': {SIM!r}}}, compile_cache=pathlib.Path('/x')); "
            "print(launch(d, b, gpu_size_gib=80.0).compile_key)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first
    # Host, port and the served name change nothing compiled: not in the key.
    assert key_of(dep(port=9000, name="other", served_name="other"), b) == first
    assert compile_cache.config_args(["m", "--host", "h", "--port=1", "--served-model-name", "s", "-x"]) == ["m", "-x"]


def test_a_changed_argument_model_image_command_or_env_is_another_key(tmp_path):
    b = box(tmp_path)
    base = key_of(dep(), b)
    others = {
        "args": key_of(dep(args=("--max-num-seqs", "8")), b),
        "model": key_of(dep(model="org/other"), b),
        "memory share": key_of(dep(memory_gib=40), b),
        "env": key_of(dep(env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"}), b),
        "command": key_of(dep(), dataclasses.replace(b, commands={"vllm": ("vllm", "serve")})),
        "engine": key_of(dep(engine="sglang"), b),
    }
    assert base not in others.values() and len(set(others.values())) == len(others), others
    docker = box(tmp_path, "docker")
    assert key_of(dep(), docker) != key_of(dep(image="vllm/vllm-openai:v2"), docker)


def test_two_deployments_of_different_configurations_never_share_a_directory(tmp_path):
    b = box(tmp_path, "docker")
    a = launch(dep(id=1, name="a", served_name="a"), b, gpu_size_gib=80.0)
    c = launch(dep(id=2, name="c", served_name="c", args=("--enforce-eager",)), b, gpu_size_gib=80.0)
    same = launch(dep(id=3, name="same", served_name="same"), b, gpu_size_gib=80.0)
    assert a.mounts != c.mounts and a.mounts == same.mounts  # the same configuration: one cache, reused
    assert a.mounts == (Mount(str(tmp_path / "cc" / a.compile_key), VLLM_CACHE),)


def test_what_each_engine_gets(tmp_path):
    proc = launch(dep(), box(tmp_path))
    assert dict(proc.env)["VLLM_CACHE_ROOT"] == str(tmp_path / "cc" / proc.compile_key) and proc.mounts == ()
    docker = launch(dep(), box(tmp_path, "docker"))
    assert dict(docker.env)["VLLM_CACHE_ROOT"] == VLLM_CACHE
    # SGLang: its own cache root (its torch.compile cache, DeepGEMM's kernels) and the Inductor and
    # Triton caches its docs name, all in the one directory.
    sg = launch(dep(engine="sglang"), box(tmp_path, "docker"))
    assert sg.mounts == (Mount(str(tmp_path / "cc" / sg.compile_key), SGLANG_CACHE),)
    assert {k: v for k, v in sg.env if k != "HF_TOKEN"} == {
        "SGLANG_CACHE_DIR": SGLANG_CACHE, "SGLANG_DG_CACHE_DIR": SGLANG_CACHE + "/deep_gemm",
        "TORCHINDUCTOR_CACHE_DIR": SGLANG_CACHE + "/inductor", "TRITON_CACHE_DIR": SGLANG_CACHE + "/triton"}
    # llama.cpp on a GPU: the CUDA driver's JIT cache (its images carry PTX only for A100 and H100).
    llama = launch(dep(engine="llamacpp", model="/m/x.gguf"), box(tmp_path))
    assert dict(llama.env)["CUDA_CACHE_PATH"] == str(tmp_path / "cc" / llama.compile_key / "nv")
    assert dict(llama.env)["CUDA_CACHE_MAXSIZE"] == str(4 * 2**30)
    cpu = launch(dep(engine="llamacpp", model="/m/x.gguf", gpu_count=0, memory_gib=0), box(tmp_path))
    assert cpu.compile_key is None and "CUDA_CACHE_PATH" not in dict(cpu.env)  # nothing compiled at start
    assert launch(dep(), Box(backend="process", commands={"vllm": SIM})).compile_key is None  # not configured
    assert launch(dep(model=None, command=SIM), box(tmp_path)).compile_key is None  # no recipe: as given


# --- the directory -----------------------------------------------------------------------

def test_prepare_is_cold_then_warm_and_prune_removes_only_unused_keys(tmp_path):
    root = tmp_path / "cc"
    assert compile_cache.prepare(root, "0123456789ab") is False  # made: cold
    assert compile_cache.prepare(root, "0123456789ab") is False  # only our stamp in it: still cold
    (root / "0123456789ab" / "torch_compile_cache").mkdir()
    assert compile_cache.prepare(root, "0123456789ab") is True
    now = time.time()
    compile_cache.prepare(root, "aaaaaaaaaaaa", now=now - 40 * 86400)
    (root / "not-a-key").mkdir()
    old = now - 40 * 86400
    os.utime(root / "not-a-key", (old, old))
    assert compile_cache.prune(root, 30, now=now) == ["aaaaaaaaaaaa"]
    assert sorted(p.name for p in root.iterdir()) == ["0123456789ab", "not-a-key"]
    assert compile_cache.prune(tmp_path / "none", 30) == []


# --- the backends ----------------------------------------------------------------------------

async def _env_of(base_url: str) -> dict[str, str]:
    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as http, http.get(base_url + "/_sim/launch") as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False
    await wait_for(up, timeout=20, interval=0.05, what="the simulator")
    async with aiohttp.ClientSession() as http, http.get(base_url + "/_sim/launch") as r:
        return (await r.json())["env"]


async def test_the_variable_on_the_process_backend(tmp_path):
    backend = ProcessBackend(tmp_path / "state")
    d = dep(memory_gib=0, gpu_count=0)
    how = launch(d, box(tmp_path))
    engine = await backend.start(d, how)
    try:
        env = await _env_of(engine.base_url)
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cc" / how.compile_key)
    finally:
        await backend.stop(engine, 5)
        await backend.close()


async def test_the_mount_on_the_docker_backend_through_the_double(tmp_path):
    double = DockerDouble()
    double.add_network("ondemand-test", [("172.30.0.0/16", "172.30.0.1")])
    # The double runs a container as a host process: the image's entrypoint is the simulator.
    double.add_image("ondemand-sim-engine:latest", [sys.executable, "-m", "ondemand", "sim-engine"])
    await double.__aenter__()
    backend = DockerBackend(docker_url=double.url, network="ondemand-test", gpus=False, in_container=False)
    d = dep(memory_gib=0, gpu_count=0)
    how = launch(d, box(tmp_path, "docker"))
    try:
        engine = await backend.start(d, how)
        binds = double._container("ondemand-tiny")["HostConfig"]["Binds"]
        assert binds == [f"{tmp_path / 'cc' / how.compile_key}:{VLLM_CACHE}"]
        assert (await _env_of(engine.base_url))["VLLM_CACHE_ROOT"] == VLLM_CACHE
        await backend.stop(engine, 5)
    finally:
        await backend.close()
        await double.__aexit__(None, None, None)


@pytest.mark.docker
async def test_the_mount_on_real_dockerd(tmp_path, docker_env):
    """Real dockerd: the key's directory is what the container sees at vLLM's cache root."""
    import docker_real
    d = docker_real.deployment(docker_env)
    recipe = launch(d.replace(model="org/tiny"), Box(backend="docker", images={"vllm": d.image or ""},
                                                      compile_cache=tmp_path / "cc"))
    compile_cache.prepare(tmp_path / "cc", recipe.compile_key)
    (tmp_path / "cc" / recipe.compile_key / "seen").write_text("from the host\n")
    backend = DockerBackend(docker_url=None, network=docker_env["network"], gpus=False, in_container=False)
    try:  # the simulator's own command line, with the recipe's mount
        engine = await backend.start(d, dataclasses.replace(backend.as_given(d), mounts=recipe.mounts))
        out = await asyncio.to_thread(docker_real.docker, "exec", f"ondemand-{d.name}", "cat", f"{VLLM_CACHE}/seen")
        assert out.stdout == "from the host\n"
        await backend.stop(engine, 5)
        await backend.remove(d)
    finally:
        await backend.close()
