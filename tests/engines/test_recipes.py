"""Engine recipes (ondemand/engines/recipes.py): the command line, environment and mounts an engine
runs with, derived from the deployment and the box; the checks of an admin's fields; and,
end to end, a recipe deployment on the engine simulator through a running ondemand."""
from __future__ import annotations

import os

import aiohttp
import pytest
from helpers import run_app, wait_for

from ondemand.engines import recipes
from ondemand.engines.recipes import Box, FieldError, Mount, launch, share
from ondemand.model import Deployment

DOCKER = Box(backend="docker", images={"vllm": "vllm/vllm-openai:v1", "sglang": "lmsysorg/sglang:v2",
                                        "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda"})
PROCESS = Box(backend="process", commands={"vllm": ("vllm", "serve"), "sglang": ("python3", "-m",
                                                                                 "sglang.launch_server"),
                                           "llamacpp": ("llama-server",)})


def dep(**kw) -> Deployment:
    fields = dict(id=1, name="qwen", served_name="qwen", engine="vllm", model="Qwen/Qwen3-8B", memory_gib=40,
                  gpu_count=1, port=8000)
    fields.update(kw)
    return Deployment.from_row(fields)


# --- what each recipe derives (golden argv) ------------------------------------------------

def test_vllm_in_a_container():
    how = launch(dep(), DOCKER, gpu_size_gib=79.6)
    assert how.image == "vllm/vllm-openai:v1" and how.entrypoint == ("vllm", "serve")
    assert how.argv == ["vllm", "serve", "Qwen/Qwen3-8B", "--served-model-name", "qwen", "--host", "0.0.0.0",
                        "--port", "8000", "--gpu-memory-utilization", "0.50", "--enable-sleep-mode"]
    assert dict(how.env) == {"VLLM_SERVER_DEV_MODE": "1"} and how.mounts == ()


def test_vllm_as_a_child_process_on_four_gpus_with_an_override_last():
    how = launch(dep(gpu_count=4, memory_gib=300, args=("--max-model-len", "8192", "--served-model-name", "x")),
                 PROCESS, gpu_size_gib=80)
    assert how.image is None and how.entrypoint is None
    assert how.argv == ["vllm", "serve", "Qwen/Qwen3-8B", "--served-model-name", "qwen", "--host", "127.0.0.1",
                        "--port", "{port}", "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.93",
                        "--enable-sleep-mode", "--max-model-len", "8192", "--served-model-name", "x"]


def test_sglang_and_llamacpp():
    how = launch(dep(engine="sglang", gpu_count=2, memory_gib=64), DOCKER, gpu_size_gib=80)
    assert how.entrypoint == ("python3", "-m", "sglang.launch_server") and how.image == "lmsysorg/sglang:v2"
    assert list(how.args) == ["--model-path", "Qwen/Qwen3-8B", "--served-model-name", "qwen", "--host", "0.0.0.0",
                              "--port", "8000", "--tp", "2", "--mem-fraction-static", "0.40", "--enable-metrics",
                              "--enable-memory-saver", "--enable-weights-cpu-backup"]
    level2 = launch(dep(engine="sglang", idle_action="sleep2"), DOCKER, gpu_size_gib=80)
    assert list(level2.args)[-2:] == ["--enable-metrics", "--enable-memory-saver"]  # no CPU backup: level 2
    gguf = launch(dep(engine="llamacpp", model="/srv/models/g.gguf", served_name="g"), PROCESS, gpu_size_gib=80)
    assert gguf.argv == ["llama-server", "-m", "/srv/models/g.gguf", "--alias", "g", "--host", "127.0.0.1",
                         "--port", "{port}", "-ngl", "999", "--metrics"]
    hub = launch(dep(engine="llamacpp", model="ggml-org/gemma-3-270m-GGUF", gpu_count=0), DOCKER)
    assert hub.entrypoint is None  # the image's own llama-server
    assert list(hub.args) == ["-hf", "ggml-org/gemma-3-270m-GGUF", "--alias", "qwen", "--host", "0.0.0.0",
                              "--port", "8000", "--metrics"]  # no GPU: no -ngl


def test_sleep_flags_only_where_a_wake_is_reliable():
    assert "--enable-sleep-mode" not in launch(dep(), DOCKER, gpu_size_gib=80, per_gpu=False).argv  # unified memory
    off = launch(dep(), dataclass_replace(DOCKER, sleep_flags=False), gpu_size_gib=80)
    # vLLM on a CPU refuses --enable-sleep-mode; its sleep routes still answer with the dev mode.
    assert "--enable-sleep-mode" not in off.argv and dict(off.env)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-memory-saver" not in launch(dep(engine="sglang"), dataclass_replace(
        DOCKER, sleep_flags=False), gpu_size_gib=80).argv


def dataclass_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_a_row_without_a_model_runs_as_given():
    old = dep(model=None, image="my/vllm:1", args=("--model", "Qwen/Qwen3-8B"), command=("sim", "{port}"))
    box = dataclass_replace(DOCKER, model_cache="/srv/cache", hf_token_file="/nonexistent")
    how = launch(old, box, gpu_size_gib=80, secrets=True)  # the token file is not even read
    assert (how.image, how.entrypoint, how.args, how.env, how.mounts) == (
        "my/vllm:1", None, ("--model", "Qwen/Qwen3-8B"), (), ())
    assert launch(old, PROCESS).args == ("sim", "{port}")
    custom = launch(dep(engine="custom", model=None, image="x:1", env={"A": "b"}), DOCKER)
    assert custom.args == () and dict(custom.env) == {"A": "b"}


def test_the_box_gives_cache_token_env_and_volumes(tmp_path):
    token = tmp_path / "hf.token"
    token.write_text("hf_secret\n")
    box = dataclass_replace(DOCKER, model_cache=tmp_path / "cache", hf_token_file=token)
    d = dep(env={"VLLM_LOGGING_LEVEL": "DEBUG", "MY_API_KEY": "k1"}, volumes=("/srv/m:/models:ro",))
    how = launch(d, box, gpu_size_gib=80, secrets=True)
    env = dict(how.env)
    assert env["HF_HOME"] == "/root/.cache/huggingface" and env["HF_TOKEN"] == "hf_secret"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert how.mounts == (Mount(str(tmp_path / "cache"), "/root/.cache/huggingface"), Mount("/srv/m", "/models", True))
    shown = how.shown_env()
    assert shown["MY_API_KEY"] == shown["HF_TOKEN"] == "***" and shown["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert launch(d, box, gpu_size_gib=80).shown_env()["HF_TOKEN"] == "***"  # a view never reads the file
    child = launch(d, dataclass_replace(box, backend="process"), gpu_size_gib=80, secrets=True)
    assert dict(child.env)["HF_HOME"] == str(tmp_path / "cache") and child.mounts == ()
    llama = launch(dep(engine="llamacpp", model="a/b-GGUF"), box, gpu_size_gib=80)
    assert dict(llama.env)["LLAMA_CACHE"] == "/root/.cache/huggingface/llama.cpp"
    token.write_text("")
    with pytest.raises(ValueError):
        launch(d, box, gpu_size_gib=80, secrets=True)


def test_secret_flags_are_masked_in_argv():
    how = launch(dep(args=("--api-key", "sk-1", "--hf-token=hf_2", "--max-num-seqs", "8")), DOCKER, gpu_size_gib=80)
    assert how.argv[-5:] == ["--api-key", "***", "--hf-token=***", "--max-num-seqs", "8"]
    assert "sk-1" in how.args  # the engine gets the value; only views mask it


# --- the memory share ---------------------------------------------------------------------

@pytest.mark.parametrize("memory, gpus, size, expected", [
    (40, 1, 79.6, 0.50), (24, 1, 80, 0.30), (30, 1, 80, 0.37), (76, 1, 80, 0.95), (300, 4, 80, 0.93),
    (1, 1, 24, 0.04),
])
def test_share_rounds_down(memory, gpus, size, expected):
    assert share(memory, gpus, size) == expected
    assert share(memory, gpus, size) * size <= memory / gpus + 1e-9  # never more than was booked


def test_share_is_never_zero():
    assert share(0.5, 1, 79.6) == 0.01  # the engines refuse 0


def test_share_over_the_limit_names_memory_gib():
    with pytest.raises(FieldError) as err:
        share(77, 1, 80)
    assert err.value.field == "memory_gib" and "0.95" in err.value.message
    with pytest.raises(FieldError):
        launch(dep(memory_gib=79), DOCKER, gpu_size_gib=80)


def test_one_pool_is_one_device():
    how = launch(dep(memory_gib=32, gpu_count=1), DOCKER, gpu_size_gib=128, per_gpu=False)
    assert "0.25" in how.argv


# --- the checks of an admin's fields ------------------------------------------------------

def test_env_rules():
    assert recipes.check_env({"VLLM_X": "1", "_Y2": ""}) == {"VLLM_X": "1", "_Y2": ""}
    for bad in ({"lower": "1"}, {"1X": "1"}, {"A-B": "1"}, {"X": 1}, {"X": "a\0b"}, ["X=1"],
                {"CUDA_VISIBLE_DEVICES": "0"}, {"NVIDIA_VISIBLE_DEVICES": "all"}, {"HF_TOKEN": "t"}, None):
        with pytest.raises(FieldError) as err:
            recipes.check_env(bad)
        assert err.value.field == "env", bad


def test_volume_rules(tmp_path):
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    os.symlink("/", root / "escape")
    os.symlink("/run/docker.sock", root / "sock")
    box = dataclass_replace(DOCKER, volume_roots=(root,))
    ok = [f"{root}/m:/models:ro", f"{root}:/all", f"{root}/m:/w:rw"]
    assert recipes.check_volumes(ok, box) == ok
    for bad in ([f"{root}/m"], ["m:/models"], [f"{root}/m:models"], [f"{root}/m:/x:rx"], [f"{root}/../x:/x"],
                [f"{root}/escape:/x"], ["/:/host"], [f"{root}/m:/"], ["/var/run/docker.sock:/var/run/docker.sock"],
                [f"{root}/sock:/d.sock"], ["/etc:/etc"], "x", [1], None):
        with pytest.raises(FieldError) as err:
            recipes.check_volumes(bad, box)
        assert err.value.field == "volumes", bad
    with pytest.raises(FieldError, match="docker backend"):
        recipes.check_volumes(ok, dataclass_replace(box, backend="process"))


def test_model_and_engine_rules():
    assert recipes.check_model("vllm", "Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert recipes.check_model("llamacpp", "/srv/m.gguf") == "/srv/m.gguf"
    assert recipes.check_model("vllm", "/srv/modèles/ü") == "/srv/modèles/ü"  # non-ASCII letters are a path's
    # DEL and the C1 controls (U+0080 to U+009F) would reach the engine's command line and the logs
    # as they do C0's: refused alike.
    for engine, model in (("vllm", "--trust-remote-code"), ("vllm", "a b"), ("vllm", ""), ("vllm", 3),
                          ("custom", "x/y"), ("vllm", "Qwen/x\x7f"), ("vllm", "Qwen/\x85x"), ("vllm", "a\x9bb"),
                          ("vllm", "a\x1bb")):
        with pytest.raises(FieldError) as err:
            recipes.check_model(engine, model)
        assert err.value.field == "model"
    with pytest.raises(FieldError) as err:
        recipes.check_engine("tgi")
    assert err.value.field == "engine"


def test_fits_the_box():
    recipes.check_fits_box(40, 1, (80.0,) * 8, True, True)
    recipes.check_fits_box(600, 8, (80.0,) * 8, True, True)
    with pytest.raises(FieldError) as err:
        recipes.check_fits_box(40, 9, (80.0,) * 8, True, True)
    assert err.value.field == "gpu_count"
    with pytest.raises(FieldError) as err:
        recipes.check_fits_box(78, 1, (80.0,) * 8, True, True)
    assert err.value.field == "memory_gib"
    recipes.check_fits_box(78, 1, (80.0,) * 8, True, False)  # no recipe: no share to derive


# --- through the admin API and a running ondemand ----------------------------------------

SIM = ["ondemand", "sim-engine", "--startup-delay", "0.2"]


@pytest.fixture
async def server(tmp_path):
    token = tmp_path / "hf.token"
    token.write_text("hf_from_the_box\n")
    token.chmod(0o600)
    (tmp_path / "roots").mkdir()
    async with run_app(tmp_path, **{"budget.capacity_gib": None, "budget.gpu_capacity_gib": [80, 80],
                                    "deployer.commands.vllm": SIM, "deployer.model_cache": str(tmp_path / "cache"),
                                    "deployer.hf_token_file": str(token)}) as s:
        yield s


async def api(server, method, path, body=None):
    async with aiohttp.ClientSession() as s, s.request(method, f"{server.url}/api{path}", json=body,
                                                       headers=server.admin_headers()) as r:
        return r.status, await r.json()


async def test_a_recipe_deployment_starts_and_serves_as_derived(server, tmp_path):
    body = {"name": "tiny", "engine": "vllm", "model": "org/tiny", "memory_gib": 20, "mode": "on_demand",
            "env": {"SIM_NOTE": "hello", "MY_API_KEY": "k-secret"}}
    status, dry = await api(server, "POST", "/deployments?dry_run=1", body)
    assert status == 200 and dry["dry_run"] is True and server.deployer.all() == []  # nothing written
    status, view = await api(server, "POST", "/deployments", body)
    assert status == 201 and view["gpu_count"] == 1  # one GPU unless told
    assert view["argv"] == dry["argv"] == [*SIM, "org/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1",
                                           "--port", "{port}", "--gpu-memory-utilization", "0.25",
                                           "--enable-sleep-mode"]
    assert view["env"] == {"SIM_NOTE": "hello", "MY_API_KEY": "***"}
    assert view["env_names"] == ["HF_HOME", "HF_TOKEN", "MY_API_KEY", "SIM_NOTE", "VLLM_SERVER_DEV_MODE"]
    assert "hf_from_the_box" not in str(view) and "k-secret" not in str(view)
    row = await server.deployer.store.deployment(view["id"])
    assert "hf_from_the_box" not in str(row)  # the box's token is never in the state file
    async with aiohttp.ClientSession() as http:
        async with http.post(server.gw(view["id"], "chat/completions"), headers=server.auth(),
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200, await r.text()
        engine = server.deployer.engine(view["id"])
        async with http.get(engine.base_url + "/_sim/launch") as r:
            launched = await r.json()
    assert launched["env"]["HF_TOKEN"] == "hf_from_the_box" and launched["env"]["SIM_NOTE"] == "hello"
    assert launched["env"]["HF_HOME"] == str(tmp_path / "cache") and launched["env"]["MY_API_KEY"] == "k-secret"
    assert launched["env"]["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    port = engine.base_url.rpartition(":")[2]
    assert launched["argv"][-10:] == ["org/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
                                      port, "--gpu-memory-utilization", "0.25", "--enable-sleep-mode"]


async def test_an_engine_serving_another_name_fails_its_start_naming_both(server):
    status, view = await api(server, "POST", "/deployments", {
        "name": "tiny", "engine": "vllm", "model": "org/tiny", "memory_gib": 20, "mode": "on_demand",
        "args": ["--served-model-name", "other"]})  # the admin's args come last and win
    assert status == 201 and view["argv"][-2:] == ["--served-model-name", "other"]
    async with aiohttp.ClientSession() as http:
        async with http.post(server.gw(view["id"], "chat/completions"), headers=server.auth(),
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "start_failed"
    dep = server.deployer.get(view["id"])
    assert dep.state == "failed" and "serves other, not tiny" in dep.state_reason
    await wait_for(lambda: server.deployer.engine(view["id"]) is None, what="the engine stopped")


@pytest.mark.parametrize("body, field", [
    ({"engine": "tgi"}, "engine"),
    ({"model": None}, "model"),  # no model and no command: nothing to run
    ({"engine": "custom"}, "model"),
    ({"volumes": ["/etc:/etc"]}, "volumes"),  # the process backend has no mounts
    ({"env": {"CUDA_VISIBLE_DEVICES": "3"}}, "env"),
    ({"env": {"HF_TOKEN": "mine"}}, "env"),
    ({"memory_gib": 77}, "memory_gib"),  # a share of 0.96 of an 80 GiB GPU
    ({"gpu_count": 3}, "gpu_count"),  # the box has two
    ({"gpu_ids": [5]}, "gpu_ids"),
])
async def test_bad_input_names_the_field_and_writes_nothing(server, body, field):
    full = {"name": "tiny", "engine": "vllm", "model": "org/tiny", "memory_gib": 20, **body}
    status, err = await api(server, "POST", "/deployments", full)
    assert status == 400 and err["error"]["code"] == "invalid_field", err
    assert err["error"]["message"].startswith(field + ":"), err
    assert server.deployer.all() == [] and await server.deployer.store.deployments() == []


async def test_an_edit_keeps_a_masked_secret_and_audits_it_masked(server):
    _, view = await api(server, "POST", "/deployments", {
        "name": "tiny", "engine": "vllm", "model": "org/tiny", "memory_gib": 20, "mode": "on_demand",
        "env": {"MY_API_KEY": "k-secret", "A": "1"}})
    status, edited = await api(server, "PATCH", f"/deployments/{view['id']}",
                               {"env": {"MY_API_KEY": "***", "A": "2"}})
    assert status == 200 and edited["env"] == {"MY_API_KEY": "***", "A": "2"}
    assert dict(server.deployer.get(view["id"]).env) == {"MY_API_KEY": "k-secret", "A": "2"}
    audit = [r for r in await server.deployer.store.audit(view["id"]) if r["action"] == "deployment_update"]
    assert audit and "k-secret" not in str(audit)
