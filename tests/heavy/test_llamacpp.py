"""ondemand with a real llama.cpp server and a real model, end to end.

One flow, through the gateway on loopback with the process backend, the
deployment made from the llama.cpp recipe (engine ``llamacpp``, ``model`` the
GGUF path, ``deployer.commands.llamacpp`` the binary: the recipe writes ``-m``,
``--alias``, the address, ``-ngl 999`` and ``--metrics``, and the deployment's
own ``args`` follow): a cold start (stopped → starting → ready), a streamed chat (SSE chunks, byte-level
sanity, ``data: [DONE]``), the metrics sampler reading llama.cpp's
``llamacpp:requests_processing`` / ``llamacpp:requests_deferred`` gauges
(busy in the middle of a long generation, idle after it), the reaper putting
the model to sleep after its idle timeout (audited ``ondemand_sleep``, the
process gone), and a second request that cold-starts it again.

Needs ``LLAMA_SERVER`` (a llama-server binary) and ``GEMMA_GGUF`` (the
Gemma-3-270M GGUF); ``make test-llamacpp`` sets both from the last lines of
``scripts/heavy/llama-server.sh`` and ``scripts/heavy/gemma-model.sh``.
Without them the test falls back to those scripts only when their cached
results already exist (a test never builds anything), else it is skipped.
"""
from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from helpers import ROOT, run_app, wait_for

pytestmark = pytest.mark.llamacpp

SERVED = "gemma-3-270m"
NAME = "gemma"
IDLE_S = 3  # the deployment's idle timeout (min_idle_timeout_s is 1 in run_app)
# The long stream must outlast IDLE_S: its length is sized from this machine's decode rate, measured
# on a warm engine just before (CI's decoded 88 tokens/s where 40 were assumed: 200 tokens took 2.3 s).
STREAM_AT_LEAST_S = IDLE_S + 3
RATE_PROBE_TOKENS = 48


# --- locating llama-server and the model ---------------------------------------

def _cache_dir() -> Path:
    return Path(os.environ.get("ONDEMAND_CACHE") or Path.home() / ".cache" / "ondemand")


def _cached_result(script: str) -> str | None:
    """The script's last stdout line, but only when its result is cached already
    (its stamp files exist), so that running it is instant and builds nothing."""
    cache = _cache_dir()
    if script == "llama-server.sh":
        ready = (cache / "llama/bin/llama-server").is_file() and glob.glob(str(cache / "llama/.built-*"))
    else:
        ready = (cache / "gemma/gemma-3-270m-q4_k_m.gguf").is_file() and (cache / "gemma/.verified").is_file()
    if not ready:
        return None
    try:
        # The timeout guards against a cache key that changed (then the script
        # would build): a cached run takes well under a second.
        out = subprocess.run(["bash", str(ROOT / "scripts/heavy" / script)], capture_output=True,
                             text=True, timeout=20, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else None


@pytest.fixture(scope="module")
def engine_files() -> tuple[str, str]:
    found = {}
    for var, script in (("LLAMA_SERVER", "llama-server.sh"), ("GEMMA_GGUF", "gemma-model.sh")):
        value = os.environ.get(var) or _cached_result(script)
        if not value:
            pytest.skip(f"{var} is not set and scripts/heavy/{script} has no cached result: "
                        f"run `make test-llamacpp` (it sets {var}), or "
                        f"{var}=$(bash scripts/heavy/{script} | tail -1)")
        if not Path(value).is_file():
            pytest.fail(f"{var}={value}: no such file")
        found[var] = value
    if not os.access(found["LLAMA_SERVER"], os.X_OK):
        pytest.fail(f"LLAMA_SERVER={found['LLAMA_SERVER']} is not executable")
    return found["LLAMA_SERVER"], found["GEMMA_GGUF"]


# The deployment's own args, after what the recipe writes (-m, --alias, --host, --port, -ngl, --metrics).
# --no-jinja: with jinja (this llama.cpp's default) "gemma" would be read as a literal
# Jinja template. Small context and two slots keep memory low. -t 1: llama.cpp's worker
# threads spin while they wait for each other, so on a busy 2-core machine two threads
# ran ~7x slower than one (2.6 vs 17 tokens/s).
LLAMA_ARGS = ["--no-jinja", "--chat-template", "gemma", "-c", "2048", "-np", "2", "-t", "1"]


# --- small tools ------------------------------------------------------------------

def engine_pid(server, name: str) -> int:
    """The engine's pid, from the process backend's pid file beside its log."""
    pid_file = server.cfg.state_dir / "logs" / f"{name}.pid"
    return int(pid_file.read_text().split()[0])


def alive(pid: int) -> bool:
    """Running (not merely a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")[:-1]


async def port_open(base_url: str) -> bool:
    host, port = base_url.rsplit("/", 1)[-1].split(":")
    try:
        _, w = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    w.close()
    return True


def chat(content: str, **kw) -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}], **kw}


class Timeline:
    """Every state change of one deployment, with the time and the controller's phase."""

    def __init__(self, server, dep_id: int):
        self.server = server
        self.dep_id = dep_id
        self.events: list[tuple[float, str, str]] = []
        from ondemand.admin import components
        from ondemand.events import DeploymentChanged
        server.app[components.BUS].subscribe(DeploymentChanged, self._on_change)

    def _on_change(self, e) -> None:
        if e.dep_id == self.dep_id and e.dep is not None and e.new_state != e.old_state:
            self.events.append((time.monotonic(), e.dep.state.value,
                                self.server.controller.status(e.dep_id)["phase"]))

    def states(self, since: int = 0) -> list[str]:
        return [s for _, s, _ in self.events[since:]]

    def at(self, state: str, since: int = 0) -> float:
        return next(t for t, s, _ in self.events[since:] if s == state)


async def audit(server, dep_id: int, action: str) -> list[dict]:
    return [a for a in await server.deployer.store.audit(dep_id) if a["action"] == action]


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into events; each must be exactly one ``data:`` line."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    for ev in events:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev[:200]
    return events


# --- the flow ---------------------------------------------------------------------

async def test_llamacpp_on_demand_end_to_end(tmp_path, engine_files):
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    llama_server, gguf = engine_files
    async with run_app(tmp_path, **{"deployer.start_timeout_s": 60, "deployer.stop_timeout_s": 10,
                                    "deployer.commands.llamacpp": [llama_server]}) as server, \
            aiohttp.ClientSession() as http:
        from ondemand import app as app_mod
        sampler = server.app[app_mod.SAMPLER]
        dep = await server.deployer.create(dict(
            # gpu_count 1: the recipe adds -ngl 999 (this CPU build of llama.cpp ignores it).
            name=NAME, served_name=SERVED, engine="llamacpp", model=gguf, args=LLAMA_ARGS, gpu_count=1,
            memory_gib=1, mode="on_demand", state="stopped", role="model", idle_timeout_s=IDLE_S))
        d = dep.id
        tl = Timeline(server, d)

        # /v1/models is answered from the record: it never wakes the model.
        async with http.get(server.gw(d, "models"), headers=server.auth()) as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == [SERVED]
        assert server.state(d) == "stopped" and tl.states() == []

        # 1. Cold start through the gateway: a real answer from the real model.
        t = time.monotonic()

        async def first_request():
            async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                                 json=chat("Say hello.", max_tokens=16)) as r:
                assert r.status == 200, await r.text()
                assert r.headers["Content-Type"].startswith("application/json")
                return await r.json()
        first = asyncio.ensure_future(first_request())
        # While llama-server loads the model, the deployment is starting for this request.
        await wait_for(lambda: server.state(d) == "starting" or first.done(), timeout=10, interval=0.005)
        await wait_for(lambda: server.controller.status(d)["phase"] == "starting_for_request" or first.done(),
                       timeout=5, interval=0.005, what="phase starting_for_request")
        assert not first.done(), "the cold start was too fast to observe"
        assert server.controller.status(d)["inflight"] == 0 and server.controller.waiting(d) == 1
        body = await first
        marks["cold start + chat"] = time.monotonic() - t
        assert body["object"] == "chat.completion"
        assert body["model"] == SERVED  # llama-server answers with its --alias
        text = body["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text.strip(), body
        assert body["usage"]["completion_tokens"] > 0
        assert tl.states() == ["starting", "ready"], tl.events
        assert server.state(d) == "ready" and server.controller.inflight(d) == 0
        assert len(await audit(server, d, "ondemand_start")) == 1
        pid1 = engine_pid(server, NAME)
        base1 = server.deployer.base_url(d)
        port = base1.rpartition(":")[2]
        assert alive(pid1) and cmdline(pid1) == [llama_server, "-m", gguf, "--alias", SERVED, "--host", "127.0.0.1",
                                                 "--port", port, "-ngl", "999", "--metrics", *LLAMA_ARGS], cmdline(pid1)
        log_text = (server.cfg.state_dir / "logs" / f"{NAME}.log").read_text(errors="replace")
        assert "llama" in log_text.lower() and "gemma" in log_text.lower(), log_text[-2000:]

        # llama.cpp's own 4xx passes through unchanged.
        async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                             json={"model": SERVED, "messages": "not a list"}) as r:
            assert r.status == 400
            err = await r.json()
            assert err["error"]["type"] == "invalid_request_error", err

        # 2. A long streamed chat: the sampler sees it running, the reaper leaves it
        #    alone for longer than the idle timeout, and the SSE bytes are sane.
        t = time.monotonic()
        async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                             json=chat("Count to a hundred.", max_tokens=RATE_PROBE_TOKENS, ignore_eos=True)) as r:
            assert r.status == 200, await r.text()
            probed = (await r.json())["usage"]["completion_tokens"]
        rate = probed / max(time.monotonic() - t, 1e-3)
        stream_tokens = max(200, int(rate * STREAM_AT_LEAST_S * 1.5))
        t = time.monotonic()
        busy_sample = None
        raw = b""
        async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                             json=chat("Tell me a long story about a lighthouse.", stream=True,
                                       max_tokens=stream_tokens, ignore_eos=True)) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for piece in r.content.iter_any():
                raw += piece
                if busy_sample is None and raw.count(b"\n\n") >= 5:
                    # Mid-stream: the engine reports the request as processing.
                    assert server.controller.inflight(d) == 1
                    assert server.controller.status(d)["phase"] == "serving"
                    await sampler.sample_once()
                    busy_sample = sampler.sample(d)
                    assert busy_sample is not None and busy_sample.running >= 1, busy_sample
                    assert not sampler.idle(d)
        marks["streamed chat"] = time.monotonic() - t
        stream_end = time.monotonic()
        assert busy_sample is not None, raw[:500]
        assert marks["streamed chat"] > IDLE_S  # longer than the idle timeout ...
        assert server.state(d) == "ready" and tl.states() == ["starting", "ready"]  # ... and never reaped

        events = sse_events(raw)
        assert events[-1] == b"data: [DONE]"
        chunks = [orjson.loads(ev[len(b"data: "):]) for ev in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1 and all(c["model"] == SERVED for c in chunks)
        streamed = "".join((c["choices"][0].get("delta") or {}).get("content") or ""
                           for c in chunks if c.get("choices"))
        content_chunks = [c for c in chunks if c.get("choices") and (c["choices"][0].get("delta") or {}).get("content")]
        assert len(content_chunks) > 50 and streamed.strip(), streamed
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])
        raw.decode("utf-8")  # the whole body is valid UTF-8 (chunk boundaries aside)

        # 3. After the request: the slot is back and the engine reads idle.
        assert server.controller.inflight(d) == 0

        async def sampled_idle():
            await sampler.sample_once()
            return sampler.idle(d)
        await wait_for(sampled_idle, timeout=5, what="llamacpp gauges back at 0")
        s = sampler.sample(d)
        assert (s.running, s.waiting) == (0, 0)

        # 4. Three streams on two slots: llama.cpp defers the third, and the sampler
        #    reads it as waiting. Clients that hang up release their slots, and the
        #    gateway's closed upstream connections make llama.cpp cancel the work
        #    (900 tokens each would otherwise keep it busy for much longer).
        assert server.state(d) == "ready" and len(tl.events) == 2
        t = time.monotonic()
        long_body = chat("Write a long poem about the sea.", stream=True, max_tokens=900, ignore_eos=True)
        opened = [asyncio.ensure_future(http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                                                  json=long_body)) for _ in range(3)]
        try:
            async def two_running_one_deferred():
                await sampler.sample_once()
                got = sampler.sample(d)
                return got is not None and (got.running, got.waiting) == (2, 1)
            await wait_for(lambda: sum(o.done() for o in opened) == 2, timeout=10, what="two streams answered")
            await wait_for(two_running_one_deferred, timeout=10, interval=0.05, what="2 processing + 1 deferred")
            assert server.controller.inflight(d) == 3 and not sampler.idle(d)
            assert sum(o.done() for o in opened) == 2  # the deferred one has no answer yet
            assert all(o.result().status == 200 for o in opened if o.done())
        finally:
            for o in opened:
                if o.done() and not o.cancelled() and o.exception() is None:
                    o.result().close()
                else:
                    o.cancel()
            await asyncio.gather(*opened, return_exceptions=True)
        await wait_for(lambda: server.controller.inflight(d) == 0, timeout=5, what="slots released")
        stream_end = time.monotonic()
        await wait_for(sampled_idle, timeout=5, what="llama.cpp cancelled the abandoned generations")
        marks["3 streams on 2 slots, then hang-ups"] = time.monotonic() - t

        # 5. The reaper stops it after its idle timeout: audited, the process gone.
        before = len(tl.events)
        # Wait on the timeline, not on server.state(): the deployer changes the
        # in-memory state first and tells its listeners only after the state
        # file's transaction, so "stopped" is readable a moment before the
        # listener (and the audit row) has it.
        await wait_for(lambda: tl.states(before)[-1:] == ["stopped"], timeout=IDLE_S + 15, interval=0.05,
                       what="the reaper stopping the idle model")
        assert tl.states(before) == ["stopping", "stopped"], tl.events
        idle_for = tl.at("stopping", before) - stream_end
        marks["idle until reaped"] = idle_for
        marks["stopping → stopped (SIGTERM)"] = tl.at("stopped", before) - tl.at("stopping", before)
        # Not before its idle timeout (stream_end is a little late: the margin is
        # for a busy event loop, well below IDLE_S and above the 0.2 s reap period).
        assert idle_for >= IDLE_S - 0.5, idle_for
        sleeps = await audit(server, d, "ondemand_sleep")
        assert len(sleeps) == 1 and sleeps[0]["actor"] == "ondemand" and sleeps[0]["user"] is None
        assert "idle" in sleeps[0]["text"], sleeps[0]
        assert not alive(pid1)
        assert not await port_open(base1)
        assert server.deployer.base_url(d) is None
        await sampler.sample_once()
        assert sampler.sample(d) is None  # a stopped engine is no longer sampled
        assert server.controller.status(d)["phase"] == "sleeping"

        # 6. The next request cold-starts it again, on a new process.
        before = len(tl.events)
        t = time.monotonic()
        async with http.post(server.gw(d, "chat/completions"), headers=server.auth(),
                             json=chat("What is the capital of France?", max_tokens=12)) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
        marks["second cold start + chat"] = time.monotonic() - t
        assert body["choices"][0]["message"]["content"].strip()
        assert tl.states(before) == ["starting", "ready"]
        assert len(await audit(server, d, "ondemand_start")) == 2
        pid2 = engine_pid(server, NAME)
        assert pid2 != pid1 and alive(pid2)
    # Shutting ondemand down stops the engines of the process backend.
    assert not alive(pid2)
    marks["total"] = time.monotonic() - t0
    print("\n" + "\n".join(f"  {k}: {v:.2f} s" for k, v in marks.items()))
