"""ondemand with a real vLLM (its CPU build) deployed through the recipe, end to end.

The deployment names only the engine and the model (a tiny Llama made here:
scripts/heavy/tiny-llama.sh); the vLLM recipe writes the command line after
``deployer.commands.vllm`` on the process backend. One engine serves the whole
module (a start costs ~35 s and ~3 GiB on an idle machine), in this order:

1. a cold start through the gateway: the recipe's argv and env as the engine runs
   them, readiness seeing the served name in the engine's /v1/models, and the wake
   check (a greedy one-token completion) recorded, as for every deployment that sleeps
   (``idle_action`` ``sleep``);
2. chat through the gateway against the same request sent to the engine directly,
   byte for byte but for the answer's id and time (greedy, fixed max_tokens);
3. the same for a stream, for what does not depend on timing (vLLM merges the
   chunks its API server is late to send): the role chunk, the text, the finish,
   the usage chunk;
4. the metrics sampler reading vLLM's real ``vllm:num_requests_running``;
5. an administrator's sleep asked while a stream runs: vLLM's own ``/sleep`` aborts what
   its engine runs, so ondemand drains first (no new slot, the stream arrives whole, then
   the sleep), and the next request wakes it;
6. an administrator's level-1 sleep (``POST /api/deployments/{id}/sleep``: vLLM's
   ``/sleep?level=1``) and the wake a request makes (``/wake_up``, then the wake
   check), on the same process;
7. the same at level 2: the wake makes vLLM's documented calls in order
   (``/wake_up?tags=weights``, ``/collective_rpc`` ``reload_weights``,
   ``/wake_up?tags=kv_cache``, ``/reset_prefix_cache``), as the engine's own access
   log shows, and its wake check matches;
8. the reaper putting it to sleep after its idle timeout, and a request waking it;
9. asleep past ``sleep_timeout_s``, the reaper stopping it, every process of it gone;
10. a second start whose ``--served-model-name`` override serves another name:
   the start fails with a reason naming both.

vLLM on a CPU refuses ``--enable-sleep-mode`` ("Sleep mode is not supported on
current platform"), so ``deployer.sleep_flags`` is false; its sleep routes still
answer with ``VLLM_SERVER_DEV_MODE=1``, given here through the deployment's env.
What they do there (vLLM 0.32's CPUWorker): ``sleep`` and ``wake_up`` only log "sleep
mode is not supported on CPU, ignore it." and keep the weights where they are; the
engine core still pauses its scheduler and tracks the sleeping tags, so ``/is_sleeping``
is true, chat waits, and ``/health`` and ``/v1/models`` answer 200 while asleep;
``reload_weights`` reads the weights from disk again, in place. So these tests show
ondemand's calls, their order and its state against the real routes, not memory freed.

Needs ``VLLM_PY`` (scripts/heavy/vllm-cpu.sh's last line) and ``TINY_LLAMA``
(scripts/heavy/tiny-llama.sh's); ``make test-vllm`` sets both. Unset: skipped.
Set but wrong (a setup script failed): failed, never skipped.
"""
from __future__ import annotations

import asyncio
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

from ondemand.engines import warmth
from ondemand.engines.deployer import StartFailed

NAME = SERVED = "tiny"
IDLE_S = 8  # the deployment's idle timeout: longer than any pause between two steps below
# sleep_timeout_s: asleep (and idle) this long, the reaper stops it. Longer than step 7 takes
# between the reaper's sleep and the request that wakes it.
SLEEP_S = 5
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
        self.check: str | None = None  # the wake check recorded by the cold start

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
        # A level-1 sleep stays level 1 whatever else this shared machine uses (the default
        # 16 GiB reserve would make it level 2 below 19 GiB available).
        "budget.host_reserve_gib": 0, "sleep_timeout_s": SLEEP_S,
        # A cold start is ~35 s on an idle machine, minutes on a busy one (three processes
        # each import torch and vLLM: API server, engine core, worker).
        "deployer.start_timeout_s": 600, "ondemand_queue_timeout_s": 600, "deployer.stop_timeout_s": 20,
    }
    w = None
    try:
        async with run_app(tmp, **overrides) as server:
            dep = await server.deployer.create(dict(
                name=NAME, served_name=SERVED, engine="vllm", model=model, env=ENGINE_ENV, args=ARGS, gpu_count=1,
                memory_gib=3, mode="on_demand", state="stopped", role="model", idle_timeout_s=IDLE_S,
                idle_action="sleep"))
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
            print(f"  the wake check's token: {w.check!r}")


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

    # It sleeps when idle (idle_action sleep), so its start recorded the wake check: vLLM's
    # greedy one-token answer, which every wake must give again. Asked again, it is the same.
    dep = server.deployer.get(d)
    assert isinstance(dep.wake_check, str), dep.wake_check
    async with http.post(world.base + "/v1/completions", json=warmth.check_body(dep)) as r:
        assert warmth.check_text(await r.json()) == dep.wake_check
    world.check = dep.wake_check


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


# A stream long enough to be still running when the sleep is asked after its first tokens,
# whatever the CPU's speed: close to the tiny Llama's whole context (2,048 positions, the chat
# prompt ~20). At the few hundred tokens a second it writes here that is ~5 s of stream; CI once
# ran 600 tokens out before the drain began (the drain then had nothing to wait for).
DRAIN_TOKENS = 1900


# --- 4. the metrics sampler ---------------------------------------------------------------

async def test_sampler_reads_vllms_running_gauge(world, http):
    """While a long generation runs, the sampler reads vLLM's real gauge: running 1, waiting 0,
    so the engine is not idle; once the abandoned stream is aborted, both gauges are back at 0.

    CI once failed here, no reading showing the request running within 10 s, and the old test
    kept nothing of what it read. So: the stream is read as it comes (a task beside the
    sampling), the sampler has as long as the stream runs (up to 30 s), and every reading goes
    into the failure's text. A try whose stream ended before a reading saw it running shows
    nothing either way and is made again (three at most); here the first reading, ~10 ms after
    the first token, sees it."""
    from ondemand import app as app_mod
    server, d = world.server, world.d
    await ready_again(world, http)
    sampler = server.app[app_mod.SAMPLER]
    readings: list[tuple[float, object]] = []  # (seconds into the try, the sample), for the failure's text
    busy = None
    for attempt in range(1, 4):
        # A long generation, closed as soon as the sampler has seen it: the gateway's closed
        # upstream connection makes vLLM abort the request.
        async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                             json=chat("Tell a long story.", stream=True, max_tokens=DRAIN_TOKENS,
                                       ignore_eos=True)) as r:
            assert r.status == 200
            t0 = time.monotonic()
            await r.content.readuntil(b"\n\n")  # the first event: vLLM runs it

            async def drain() -> None:
                async for _ in r.content.iter_any():
                    pass
            reader = asyncio.create_task(drain())
            try:
                while not reader.done() and time.monotonic() - t0 < 30:
                    await sampler.sample_once()
                    s = sampler.sample(d)
                    readings.append((round(time.monotonic() - t0, 2), s))
                    if s is not None and s.running >= 1 and not reader.done():
                        busy = s
                        assert not sampler.idle(d) and server.controller.inflight(d) == 1
                        break
                    await asyncio.sleep(0.05)
                if busy is None and not reader.done():
                    pytest.fail(f"the stream ran 30 s, the sampler never read a running request: {readings}")
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await reader
        if busy is not None:
            break
        print(f"\n  (try {attempt}: vLLM wrote the whole stream in {time.monotonic() - t0:.1f} s, "
              f"before a reading saw it: {readings})")
    world.figures["sampler: tries until a reading saw the stream running"] = attempt
    assert busy is not None, f"three streams ended before the sampler read one running: {readings}"
    assert busy.waiting == 0, busy

    async def idle():
        await sampler.sample_once()
        return sampler.idle(d)
    await wait_for(idle, timeout=15, interval=0.1, what="vLLM aborting the abandoned stream (gauges at 0)")
    s = sampler.sample(d)
    assert (s.running, s.waiting) == (0, 0)
    assert server.controller.inflight(d) == 0


# --- 5, 6, 7. sleep and wake ---------------------------------------------------------------

async def is_sleeping(http, base: str) -> bool:
    async with http.get(base + "/is_sleeping") as r:
        assert r.status == 200
        return (await r.json())["is_sleeping"]


def engine_log(server) -> Path:
    return server.cfg.state_dir / "logs" / f"{NAME}.log"


# uvicorn's access log in the engine's output: '... "POST /wake_up?tags=weights HTTP/1.1" 200 OK'
_ACCESS = re.compile(r'"POST (\S+) HTTP/1\.1" (\d{3})')


def engine_posts(server, since: int) -> list[tuple[str, int]]:
    """The POSTs the engine answered, in order, as its access log tells, from byte ``since`` of
    its log on (the sampler's and the watchdog's GETs left out)."""
    raw = engine_log(server).read_bytes()[since:].decode(errors="replace")
    return [(m[1], int(m[2])) for m in _ACCESS.finditer(raw)]


async def wake_seconds(server, d: int) -> float:
    """How long the last wake took as the deployer timed it (its calls and the wake check)."""
    for e in await server.deployer.store.events(d):  # newest first
        m = re.search(r"woken from sleep level \d in ([0-9.]+) s", e["text"])
        if m:
            return float(m[1])
    raise AssertionError("no wake recorded in the events")


async def admin_sleep(server, d: int, level: int, drain_s: float | None = None,
                      session: aiohttp.ClientSession | None = None) -> dict:
    """``POST /api/deployments/{id}/sleep {"level": N}`` (and ``drain_s``, when given), on a
    connection of its own (a connection that carried an admin request does not carry a
    gateway request): ``session``'s, when the caller opened one for the admin API, else a new one."""
    body = {"level": level} if drain_s is None else {"level": level, "drain_s": drain_s}
    async with contextlib.AsyncExitStack() as stack:
        if session is None:
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120 + (drain_s or 0))))
        async with session.post(f"{server.url}/api/deployments/{d}/sleep", json=body,
                                headers=server.admin_headers()) as r:
            view = await r.json()
            assert r.status == 200, view
            return view


async def ready_again(world, http) -> None:
    """Each test below begins with the engine ready, as the test before it left it. When that test
    failed half-way (asleep, or stopped), bring it back first, so that one failure is reported
    once and not again by every test after it."""
    server, d = world.server, world.d
    await wait_for(lambda: server.state(d) in ("ready", "asleep", "stopped", "failed"), timeout=120,
                   what="a settled state")
    state = server.state(d)
    if state != "ready":
        verb = "wake" if state == "asleep" else "start"
        async with aiohttp.ClientSession() as s, \
                s.post(f"{server.url}/api/deployments/{d}/{verb}?wait=1", headers=server.admin_headers()) as r:
            assert r.status == 200, await r.text()
        print(f"\n  ({state} after the test before: {verb} first)")
    assert server.state(d) == "ready"


async def test_an_admin_sleep_waits_for_the_stream_in_flight_then_a_request_wakes_it(world, http):
    """vLLM's ``/sleep`` aborts the requests its engine runs (its ``mode`` "abort"), so an
    administrator's sleep drains first (``drain_s``): asked while a stream runs, the sleep
    waits, the stream arrives whole (every token asked for: ``ignore_eos``, its finish, its
    ``[DONE]``), and only then does the engine sleep; the next request wakes it.

    Tokens are counted by the chunks' logprobs, one entry a token: how many tokens one chunk
    carries depends on timing (test 3), so the number of chunks does not tell."""
    server, d = world.server, world.d
    assert world.answer is not None and world.check is not None, "tests 1 and 2 record what a wake must repeat"
    await ready_again(world, http)
    pid, base = server.deployer.engine(d).ref.pid, world.base
    mark = engine_log(server).stat().st_size
    body = chat("Tell a long story.", stream=True, max_tokens=DRAIN_TOKENS, ignore_eos=True, logprobs=True,
                stream_options={"include_usage": True})
    flowing = asyncio.Event()
    ended: list[float] = []

    async def read() -> bytes:
        async with http.post(server.gw(d, "chat/completions"), json=body, headers=server.auth()) as r:
            assert r.status == 200, await r.read()
            pieces: list[bytes] = []
            events = 0
            async for piece in r.content.iter_any():
                pieces.append(piece)
                if not flowing.is_set():
                    events += piece.count(b"\n\n")
                    if events >= 3:  # the role chunk and two of text
                        flowing.set()
            ended.append(time.monotonic())
            return b"".join(pieces)

    # The admin API's connection is open before the stream begins, so the sleep reaches the
    # drain within one request's time of the stream's first tokens.
    admin = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=420))
    stream = asyncio.ensure_future(read())
    sleep: asyncio.Future | None = None
    try:
        async with admin:
            async with admin.get(f"{server.url}/api/host", headers=server.admin_headers()) as r:
                assert r.status == 200
            await wait_for(lambda: flowing.is_set() or stream.done(), timeout=120, interval=0.005,
                           what="the stream's first tokens")
            assert not stream.done(), f"the stream ended before the sleep was asked: {stream.result()[-300:]!r}"
            t = time.monotonic()
            sleep = asyncio.ensure_future(admin_sleep(server, d, 1, drain_s=300, session=admin))
            await wait_for(lambda: server.controller.draining(d) or sleep.done(), timeout=30, interval=0.005,
                           what="the sleep's drain")
            drain_began = time.monotonic()
            assert not stream.done() and server.controller.inflight(d) == 1, (
                f"the stream had ended before the drain began ({drain_began - t:.3f} s after it was asked): "
                f"DRAIN_TOKENS too few to show anything (inflight {server.controller.inflight(d)}, "
                f"stream done {stream.done()}, sleep done {sleep.done()})")
            assert server.state(d) == "ready"  # draining: not marked asleep while the stream runs
            view = await sleep
            slept = time.monotonic()
        # The sleep answered once the engine's /sleep did, and the stream had ended before.
        assert stream.done() and ended and ended[0] <= slept, "the sleep answered before the stream ended"
        raw = await stream
    finally:
        for task in (stream, sleep):
            if task is not None and not task.done():
                task.cancel()
    world.figures["drain: sleep asked until the drain began, s"] = drain_began - t
    world.figures["drain: the drain began until the stream ended, s"] = ended[0] - drain_began
    world.figures["drain: sleep asked until answered (the stream's rest, then /sleep), s"] = slept - t

    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]", events[-3:]
    chunks = [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"], choices[-3:]
    tokens = sum(len((c.get("logprobs") or {}).get("content") or []) for c in choices)
    assert tokens == DRAIN_TOKENS, (tokens, len(choices))
    assert chunks[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS, chunks[-1]
    assert "".join(c["delta"].get("content") or "" for c in choices)

    # Then it slept, at the level asked, on the same engine.
    dep = server.deployer.get(d)
    assert (view["state"], view["sleep_level"]) == ("asleep", 1), view
    assert (dep.state.value, dep.sleep_level) == ("asleep", 1)
    assert await is_sleeping(http, base)
    assert not server.controller.draining(d) and server.controller.inflight(d) == 0

    # The next request wakes it (no cold start) and is answered as test 2 was.
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())
    assert orjson.loads(raw)["choices"] == world.answer
    assert server.state(d) == "ready" and not await is_sleeping(http, base)
    assert server.deployer.engine(d).ref.pid == pid == engine_pid(server)
    assert await audit(server, d, "ondemand_wake_failed") == []

    async def answered():
        posts = engine_posts(server, mark)
        return posts if len(posts) >= 5 else None
    # The stream (logged as its answer began), the sleep, the wake, its check, the request.
    posts = await wait_for(answered, timeout=10, what="the chat in the engine's access log")
    assert posts == [("/v1/chat/completions", 200), ("/sleep?level=1", 200), ("/wake_up", 200),
                     ("/v1/completions", 200), ("/v1/chat/completions", 200)], posts


async def sleep_then_a_request_wakes_it(world, http, level: int) -> list[tuple[str, int]]:
    """An administrator's sleep at ``level``, then a request through the gateway: the same
    engine wakes (no cold start), the wake check matches and the answer is test 2's.
    Returns the POSTs the engine answered from the sleep on."""
    server, d = world.server, world.d
    assert world.answer is not None and world.check is not None, "tests 1 and 2 record what a wake must repeat"
    await ready_again(world, http)
    pid, base = server.deployer.engine(d).ref.pid, world.base
    assert pid == engine_pid(server)
    mark = engine_log(server).stat().st_size

    view = await admin_sleep(server, d, level)  # answers once the engine's /sleep did
    dep = server.deployer.get(d)
    assert (view["state"], view["sleep_level"]) == ("asleep", level), view
    assert (dep.state.value, dep.sleep_level) == ("asleep", level)
    assert await is_sleeping(http, base)
    # What it holds asleep, measured before the sleep's answer: its process tree's resident
    # memory, and at level 1 how much that grew (the next level-1 sleep's prediction). On a
    # CPU nothing moves, so the growth is about 0.
    assert isinstance(dep.host_gib, float) and dep.host_gib > 0.5, dep.host_gib
    world.figures[f"level-{level} asleep: host_gib (RSS of its tree), GiB"] = dep.host_gib
    if level == 1:
        assert isinstance(dep.sleep_host_gib, float) and dep.sleep_host_gib >= 0, dep.sleep_host_gib
        world.figures["level-1 asleep: sleep_host_gib (growth), GiB"] = dep.sleep_host_gib
    # Asleep, vLLM still answers these (readiness could not tell it asleep by them).
    for path in ("/health", "/v1/models"):
        async with http.get(base + path) as r:
            assert r.status == 200, path

    t = time.monotonic()
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())
    world.figures[f"level-{level} wake + chat through the gateway, s"] = time.monotonic() - t
    world.figures[f"level-{level} wake as the deployer timed it, s"] = await wake_seconds(server, d)
    assert orjson.loads(raw)["choices"] == world.answer
    assert server.state(d) == "ready" and not await is_sleeping(http, base)
    # Woken, not started again: the same process, the same address, no failed wake.
    assert server.deployer.engine(d).ref.pid == pid == engine_pid(server)
    assert server.deployer.base_url(d) == base
    assert await audit(server, d, "ondemand_wake_failed") == []
    dep = server.deployer.get(d)
    assert dep.sleep_level is None and dep.host_gib is None and dep.wake_check == world.check
    latest = max(await audit(server, d, "ondemand_start"), key=lambda a: a["id"])
    assert "Woken" in latest["text"], latest

    async def answered():
        posts = engine_posts(server, mark)
        return posts if posts and posts[-1][0] == "/v1/chat/completions" else None
    return await wait_for(answered, timeout=10, what="the chat in the engine's access log")


async def test_level_one_sleep_then_a_request_wakes_the_same_engine(world, http):
    posts = await sleep_then_a_request_wakes_it(world, http, 1)
    # The sleep, the wake, the wake check (greedy, one token), then the request itself.
    assert posts == [("/sleep?level=1", 200), ("/wake_up", 200), ("/v1/completions", 200),
                     ("/v1/chat/completions", 200)], posts


async def test_level_two_wake_reloads_the_weights_in_vllms_order(world, http):
    """Level 2 drops the weights (on a GPU), so the wake is vLLM's documented order: the
    weights' memory, their reload from disk, the KV cache, a reset of the prefix cache; then
    the wake check, which must give the cold start's token again.

    What the CPU build really does (seen in its log): the sleep and the two wake_ups are no-ops
    in the worker ("sleep mode is not supported on CPU, ignore it."), the engine core pauses
    and resumes its scheduler; ``reload_weights`` does read the checkpoint again and writes it
    in place (~0.04 s for this model; the same float32-into-bfloat16 warnings as the cold
    start's load, and "RotaryEmbedding: Failed to load weights", vLLM putting back that layer's
    buffers, which have no checkpoint weights). It answers 200, and the wake check and the
    24-token answer are the cold start's: no wake fails, nothing starts cold. As nothing was
    dropped, this shows the reload leaves the weights whole, not that it restores dropped
    ones (only a GPU can show that)."""
    posts = await sleep_then_a_request_wakes_it(world, http, 2)
    assert posts == [("/sleep?level=2", 200), ("/wake_up?tags=weights", 200), ("/collective_rpc", 200),
                     ("/wake_up?tags=kv_cache", 200), ("/reset_prefix_cache", 200), ("/v1/completions", 200),
                     ("/v1/chat/completions", 200)], posts


# --- 8, 9. the reaper ---------------------------------------------------------------------

async def test_the_reaper_puts_it_to_sleep_and_a_request_wakes_it(world, http):
    server, d = world.server, world.d
    await ready_again(world, http)
    pid, base = server.deployer.engine(d).ref.pid, world.base
    # The sleeps before this test (an earlier failure's reaper among them) are not this one's.
    before = {a["id"] for a in await audit(server, d, "ondemand_sleep")}
    t = time.monotonic()  # the last request ended a moment ago
    await wait_for(lambda: server.state(d) == "asleep", timeout=IDLE_S + 60, interval=0.05,
                   what="the reaper putting the idle vLLM to sleep")
    idle_for = time.monotonic() - t
    world.figures["idle until asleep, s"] = idle_for
    assert idle_for >= IDLE_S - 1, idle_for
    assert server.deployer.get(d).sleep_level == 1  # idle_action sleep
    # Marked asleep first (no request gets a slot from then on), then the engine's /sleep.
    await wait_for(lambda: is_sleeping(http, base), timeout=30, what="vLLM's /is_sleeping true")
    (row,) = [a for a in await audit(server, d, "ondemand_sleep") if a["id"] not in before]
    assert row["actor"] == "ondemand" and "idle" in row["text"] and "level 1" in row["text"], row

    t = time.monotonic()
    raw = await post_raw(http, server.gw(d, "chat/completions"), chat(), server.auth())
    world.figures["reaper's sleep: wake + chat through the gateway, s"] = time.monotonic() - t
    world.figures["reaper's sleep: wake as the deployer timed it, s"] = await wake_seconds(server, d)
    assert orjson.loads(raw)["choices"] == world.answer
    assert server.state(d) == "ready" and not await is_sleeping(http, base)
    assert server.deployer.engine(d).ref.pid == pid
    assert await audit(server, d, "ondemand_wake_failed") == []


async def test_asleep_past_sleep_timeout_the_reaper_stops_it(world, http):
    server, d = world.server, world.d
    await ready_again(world, http)
    pid = engine_pid(server)
    await wait_for(lambda: server.state(d) == "asleep", timeout=IDLE_S + 60, interval=0.05,
                   what="the reaper putting the idle vLLM to sleep again")
    t = time.monotonic()
    await wait_for(lambda: server.state(d) == "stopped", timeout=SLEEP_S + 60, interval=0.1,
                   what="the reaper stopping the vLLM asleep past sleep_timeout_s")
    asleep_for = time.monotonic() - t
    world.figures["asleep until stopped, s"] = asleep_for
    assert asleep_for >= SLEEP_S - 1, asleep_for
    newest = max(await audit(server, d, "ondemand_sleep"), key=lambda a: a["id"])
    assert newest["actor"] == "ondemand" and "sleep_timeout_s" in newest["text"], newest
    assert not group_alive(pid), "a process of the engine survived its stop"
    assert server.deployer.base_url(d) is None


# --- 10. another served name fails the start ----------------------------------------------

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
