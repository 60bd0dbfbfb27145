"""ondemand behind the REAL LiteLLM: the proxy, and the `litellm` library as a client.

Everything runs for real on loopback: ondemand in-process (``run_app``: process
backend, engine simulator), LiteLLM in its own venv (``scripts/heavy/litellm-venv.sh``,
``LITELLM_PY`` = that venv's python). Nothing about LiteLLM is faked.

1. The proxy (one per module, ``litellm --config``, no database) with the model
   entries exactly as the sync registers them (``ondemand_entry``): a cold start,
   a stream, ``GET /health`` that reaches the gateway with the marker header and
   never wakes a model, and a held request that fails is never retried; the
   ``PATCH /model/{id}/update`` route the sync writes warmth with exists (its own
   "DB not connected" answer, not a 404/405), and the router keeps the lowest
   ``order`` (ready 1, asleep 2, cold 3), shown with three boxes.
2. The library (``tests/clients/litellm_client.py``, run with ``LITELLM_PY``):
   ``litellm.acompletion`` cold start, the queued notice as the first content of a
   streaming ``acompletion``, and ``litellm.ahealth_check`` called as the proxy calls
   it with our ``health_check_params``.

The gateway is observed by wrapping its public way in on the running instance
(``Gateway.handle`` sees every request past the peer guard, with its headers;
nothing is changed in ``ondemand/``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from helpers import ROOT, free_port, run_app

from ondemand import app as app_mod
from ondemand.litellm.client import LiteLLMClient, LiteLLMError
from ondemand.litellm.entries import HEALTH_CHECK_HEADER, ondemand_entry

CLIENT = ROOT / "tests" / "clients" / "litellm_client.py"
MASTER = "sk-ondemand-e2e-master"


def _litellm_python() -> tuple[Path | None, str]:
    """LITELLM_PY when set (it must then work: never a silent skip), else the cached venv."""
    if "LITELLM_PY" in os.environ:
        return Path(os.environ["LITELLM_PY"]), "LITELLM_PY"
    cache = Path(os.environ.get("ONDEMAND_CACHE") or Path.home() / ".cache" / "ondemand")
    default = cache / "litellm-venv" / "bin" / "python"
    return (default, "cache") if default.exists() else (None, str(default))


LITELLM_PY, _FROM = _litellm_python()

pytestmark = [
    pytest.mark.litellm,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(LITELLM_PY is None, reason=(
        f"LiteLLM venv not found: LITELLM_PY is unset and {_FROM} does not exist "
        "(run scripts/heavy/litellm-venv.sh, or make test-litellm)")),
]


def _python() -> Path:
    assert LITELLM_PY is not None
    if not os.environ.get("LITELLM_PY", "x") or not LITELLM_PY.is_file():
        # LITELLM_PY was set (maybe empty: the setup script failed): that fails, it never skips
        pytest.fail(f"LITELLM_PY={os.environ.get('LITELLM_PY')!r} is not a python executable "
                    "(scripts/heavy/litellm-venv.sh prints it as its last line)")
    return LITELLM_PY


def litellm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "LITELLM_MASTER_KEY")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # else litellm fetches a price list from the internet
    for var in ("NO_PROXY", "no_proxy"):  # loopback never through an HTTP proxy
        env[var] = ",".join(x for x in (env.get(var), "127.0.0.1", "localhost") if x)
    env.setdefault("LITELLM_LOG", "ERROR")
    return env


# --- watching the gateway and the engines ------------------------------------------------


class GatewaySpy:
    """Every request that reached the gateway (past the peer guard): method, path, headers."""

    def __init__(self, server):
        self.hits: list[dict] = []
        gateway = server.app[app_mod.GATEWAY]
        handle = gateway.handle

        async def spied(call):
            self.hits.append({"method": call.method, "path": call.path,
                              "headers": {k.lower(): v for k, v in call.headers.items()}})
            await handle(call)

        # The instance's attribute (the gateway's route looks it up per request): ondemand/ is not touched.
        gateway.handle = spied

    def to(self, server, dep_id: int, route: str = "chat/completions", *, health: bool | None = None) -> list[dict]:
        path = server.gw(dep_id, route).split("://", 1)[1].split("/", 1)[1]
        out = [h for h in self.hits if h["path"] == "/" + path]
        if health is not None:
            out = [h for h in out if (HEALTH_CHECK_HEADER in h["headers"]) == health]
        return out


async def engine_requests(server, dep_id: int) -> list[dict]:
    """What the engine simulator received (generation routes only)."""
    base = server.deployer.base_url(dep_id)
    if base is None:
        return []  # no engine running: it received nothing
    async with aiohttp.ClientSession() as s, s.get(base + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"].startswith("/v1/") and x["path"] != "/v1/models"]


async def starts(server, dep_id: int) -> int:
    """Engine starts of a deployment, from its recorded events."""
    events = await server.app[app_mod.STORE].events(dep_id, limit=1000)
    return sum(1 for e in events if (e.get("detail") or {}).get("to") == "starting")


def entry_for(server, dep_id: int) -> dict:
    """The entry LiteLLMSync would register for this deployment, reachable on loopback."""
    return ondemand_entry(server.deployer.get(dep_id).as_dict(), server.key, server.url, server.cfg.ondemand_queue_timeout_s,
                          instance=server.cfg.instance)


def sse_events(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block[6:]
        out.append(data if data == b"[DONE]" else json.loads(data))
    return out


# --- the LiteLLM proxy --------------------------------------------------------------------


class Proxy:
    def __init__(self, url: str, proc: asyncio.subprocess.Process, log: Path):
        self.url = url
        self.proc = proc
        self.log = log

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {MASTER}"}

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@contextlib.asynccontextmanager
async def litellm_proxy(tmp: Path, model_list: list[dict], *, ready_timeout: float = 120,
                        general_settings: dict | None = None, router_settings: dict | None = None):
    """``litellm --config`` on a free loopback port, without a database; stopped on exit."""
    cfg = {
        "model_list": model_list,
        # Live checks: GET /health probes the entries itself (background checks run the
        # same _run_model_health_check per entry, on a timer, and /health then answers
        # from their cache).
        "general_settings": {"master_key": MASTER, "background_health_checks": False,
                             **(general_settings or {})},
        "litellm_settings": {"drop_params": False},
        **({"router_settings": router_settings} if router_settings else {}),
    }
    path = tmp / "litellm-config.yaml"
    path.write_text(json.dumps(cfg, indent=2))  # JSON is YAML
    port = free_port()
    cli = _python().parent / "litellm"
    argv = ([str(cli)] if cli.exists() else [str(_python()), "-m", "litellm.proxy.proxy_cli"])
    log = tmp / "litellm-proxy.log"
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, "--config", str(path), "--host", "127.0.0.1", "--port", str(port),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
            env=litellm_env(), start_new_session=True)
    proxy = Proxy(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + ready_timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if proc.returncode is not None:
                    pytest.fail(f"litellm proxy exited with {proc.returncode}:\n{proxy.tail()}")
                try:
                    async with s.get(proxy.url + "/health/liveliness", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"litellm proxy not live after {ready_timeout:g} s:\n{proxy.tail()}")
                await asyncio.sleep(0.25)
        yield proxy
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: workers too
                await proc.wait()


class World:
    def __init__(self, server, proxy: Proxy, spy: GatewaySpy, a: int, b: int, f: int):
        self.server, self.proxy, self.spy = server, proxy, spy
        self.a, self.b, self.f = a, b, f  # cold start + stream, health only, fails at start


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("litellm-proxy")
    async with run_app(tmp, ondemand_idle_timeout_s=3600) as server:  # no reaper during the module
        a = await server.add("a", 4, "--startup-delay", "0.5")
        b = await server.add("b", 4)
        f = await server.add("f", 4, "--fail", "exit-at-start")
        spy = GatewaySpy(server)
        model_list = [entry_for(server, d) for d in (a, b, f)]
        for entry in model_list:  # what LiteLLM gets is the registration, unmodified
            assert entry["litellm_params"]["num_retries"] == 0
            assert entry["model_info"]["health_check_params"] == {"extra_headers": {HEALTH_CHECK_HEADER: "1"}}
        t0 = time.monotonic()
        async with litellm_proxy(tmp, model_list) as proxy:
            print(f"litellm proxy live in {time.monotonic() - t0:.1f} s")
            yield World(server, proxy, spy, a, b, f)


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
        yield s


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **kw}


async def test_proxy_cold_starts_a_stopped_model_and_answers(world, http):
    server, proxy, a = world.server, world.proxy, world.a
    assert server.state(a) == "stopped" and server.deployer.base_url(a) is None
    t0 = time.monotonic()
    async with http.post(proxy.url + "/v1/chat/completions", json=chat("A"), headers=proxy.headers()) as r:
        body = await r.json()
        assert r.status == 200, (body, proxy.tail())
    took = time.monotonic() - t0
    assert body["choices"][0]["message"]["content"] == " ".join(f"tok{i}" for i in range(16))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert server.state(a) == "ready" and await starts(server, a) == 1
    assert took >= 0.5  # it waited for the start-up delay: a real cold start
    (hit,) = world.spy.to(server, a)
    assert hit["method"] == "POST" and hit["headers"]["authorization"] == f"Bearer {server.key}"
    assert HEALTH_CHECK_HEADER not in hit["headers"]  # the marker rides on health checks only
    (req,) = await engine_requests(server, a)
    sent = {k.lower() for k, _ in req["headers"]}
    assert "authorization" not in sent and HEALTH_CHECK_HEADER not in sent
    assert json.loads(req["body"])["model"] == "A"
    assert server.controller.inflight(a) == 0


async def test_proxy_streams_through_the_gateway(world, http):
    server, proxy, a = world.server, world.proxy, world.a
    before = len(await engine_requests(server, a))
    body = chat("A", stream=True)
    async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=proxy.headers()) as r:
        assert r.status == 200, proxy.tail()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and raw.rstrip().endswith(b"data: [DONE]")
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " ".join(f"tok{i}" for i in range(16))
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert [x for x in finishes if x] == ["stop"]  # LiteLLM leaves out a null finish_reason
    reqs = await engine_requests(server, a)
    assert len(reqs) == before + 1 and json.loads(reqs[-1]["body"])["stream"] is True
    assert await starts(server, a) == 1 and server.controller.inflight(a) == 0


async def test_proxy_health_check_reaches_the_gateway_and_never_wakes(world, http):
    server, proxy, a, b, f = world.server, world.proxy, world.a, world.b, world.f
    c = server.controller
    before = {d: c.status(d) for d in (a, b, f)}
    waiting, events_b = c.waiting(), await server.app[app_mod.STORE].events(b, limit=1000)
    engine_a = len(await engine_requests(server, a))
    # GET /health probes every entry (ready A, stopped B and F) with a real completion.
    async with http.get(proxy.url + "/health", headers=proxy.headers()) as r:
        result = await r.json()
        assert r.status == 200, (result, proxy.tail())
    assert result["unhealthy_count"] == 0, result["unhealthy_endpoints"]
    assert sorted(e["model"] for e in result["healthy_endpoints"]) == ["openai/A", "openai/B", "openai/F"]
    for dep_id in (a, b, f):
        probes = world.spy.to(server, dep_id, health=True)
        assert len(probes) == 1, (dep_id, probes)
        assert probes[0]["method"] == "POST" and probes[0]["headers"][HEALTH_CHECK_HEADER] == "1"
        assert probes[0]["headers"]["authorization"] == f"Bearer {server.key}"
    # Answered by the gateway: nothing started, nothing forwarded, no counter moved.
    assert server.state(b) == "stopped" and server.deployer.base_url(b) is None
    assert server.state(f) == "stopped" and await starts(server, b) == 0 and await starts(server, f) == 0
    assert await server.app[app_mod.STORE].events(b, limit=1000) == events_b
    assert {d: c.status(d) for d in (a, b, f)} == before and c.waiting() == waiting
    assert len(await engine_requests(server, a)) == engine_a  # the ready one was not called either
    # A targeted check of the stopped model: healthy, and still stopped.
    async with http.get(proxy.url + "/health", params={"model": "B"}, headers=proxy.headers()) as r:
        result = await r.json()
        assert r.status == 200 and result["healthy_count"] == 1, result
    assert len(world.spy.to(server, b, health=True)) == 2 and server.state(b) == "stopped"
    assert await starts(server, b) == 0 and c.status(b) == before[b]
    # The probe changed nothing LiteLLM keeps: traffic after it carries no marker.
    async with http.post(proxy.url + "/v1/chat/completions", json=chat("A"), headers=proxy.headers()) as r:
        assert r.status == 200
    assert HEALTH_CHECK_HEADER not in world.spy.to(server, a, health=None)[-1]["headers"]
    assert len(await engine_requests(server, a)) == engine_a + 1


async def test_proxy_never_retries_a_request_the_gateway_failed(world, http):
    server, proxy, f = world.server, world.proxy, world.f
    assert server.state(f) == "stopped"
    t0 = time.monotonic()
    async with http.post(proxy.url + "/v1/chat/completions", json=chat("F"), headers=proxy.headers()) as r:
        status, text = r.status, await r.text()
    took = time.monotonic() - t0
    assert status == 503, (status, text)
    # LiteLLM keeps the status and our message (not our code): start_failed's text.
    assert "failed to start" in text and "No fallback was attempted" in text, text
    # LiteLLM retries before it answers, and it honours our Retry-After (59 s), so the
    # count is final and a retried request would have taken a minute. Without the
    # entry's num_retries: 0 the Router's default (openai.DEFAULT_MAX_RETRIES, 2) applies.
    assert took < 30, took
    traffic = world.spy.to(server, f, health=False)
    assert len(traffic) == 1, [h["headers"] for h in traffic]
    assert await starts(server, f) == 1 and server.state(f) == "failed"


# --- the litellm library as a client --------------------------------------------------------


class ClientRun:
    """tests/clients/litellm_client.py running under LITELLM_PY, its JSON lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.events: list[dict] = []

    async def next(self, timeout: float = 60) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            err = (await self.proc.stderr.read()).decode(errors="replace")
            pytest.fail(f"litellm client ended without 'done' (rc {await self.proc.wait()}):\n{err[-4000:]}")
        event = json.loads(line)
        self.events.append(event)
        return event

    async def rest(self, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not self.events or self.events[-1].get("event") != "done":
            await self.next(max(deadline - time.monotonic(), 0.1))
        assert await asyncio.wait_for(self.proc.wait(), 10) == 0
        return self.events


@contextlib.asynccontextmanager
async def litellm_client(job: dict):
    proc = await asyncio.create_subprocess_exec(
        str(_python()), str(CLIENT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=litellm_env(), limit=2**20)
    proc.stdin.write(json.dumps(job).encode())
    proc.stdin.close()
    run = ClientRun(proc)
    try:
        yield run
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def run_client(job: dict, timeout: float = 90) -> list[dict]:
    async with litellm_client(job) as run:
        return await run.rest(timeout)


def job_for(server, dep_id: int, *calls: dict, **extra) -> dict:
    return {"api_base": f"{server.url}/ondemand/{dep_id}/v1", "api_key": server.key,
            "model": f"openai/{server.deployer.get(dep_id).served_name}",
            "entry": entry_for(server, dep_id), "calls": list(calls), **extra}


def results(events: list[dict]) -> list[dict]:
    errors = [e for e in events if e.get("event") == "error"]
    assert not errors, errors
    return [e for e in events if e.get("event") == "result"]


@pytest.mark.clients
async def test_library_acompletion_cold_starts_the_model(tmp_path):
    async with run_app(tmp_path) as server:
        x = await server.add("x", 4, "--startup-delay", "0.3")
        spy = GatewaySpy(server)
        events = await run_client(job_for(server, x, {"kind": "completion"}, {"kind": "stream"}))
        done, streamed = results(events)
        assert done["content"] == " ".join(f"tok{i}" for i in range(16)) and done["finish_reason"] == "stop"
        assert done["model"].endswith("X")
        assert streamed["content"] == done["content"] and streamed["finish_reason"] == "stop"
        assert server.state(x) == "ready" and await starts(server, x) == 1
        assert len(spy.to(server, x, health=False)) == 2 and len(await engine_requests(server, x)) == 2


@pytest.mark.clients
async def test_library_stream_gets_the_queued_notice_first(tmp_path):
    async with run_app(tmp_path) as server:
        big = await server.add("big", 15)
        x = await server.add("x", 12)
        await server.deployer.restart(big)
        slot = await server.admission.acquire(big)  # busy: x (12 GiB of 24) must queue
        released = False
        try:
            async with litellm_client(job_for(server, x, {"kind": "stream"})) as run:
                first = await run.next(60)
                assert first["event"] == "chunk", first
                assert first["content"] and "GPU memory" in first["content"], first
                assert first["id"] == "ondemand-queued", first
                assert x in server.controller.queue and server.state(x) == "stopped"
                notice = first["content"]
                slot.release()
                released = True
                server.controller.record(big).last_activity = 0  # idle for its full timeout now
                await server.app[app_mod.SAMPLER].sample_once()
                events = await run.rest(60)
        finally:
            if not released:
                slot.release()
        (result,) = results(events)
        chunks = [e for e in events if e.get("event") == "chunk"]
        contents = [c["content"] for c in chunks if c["content"]]
        assert contents[0] == notice  # the notice is the first content the client saw
        assert all(c["id"] != "ondemand-queued" for c in chunks[1:] if c["content"])  # then the engine's
        assert "".join(contents[1:]) == " ".join(f"tok{i}" for i in range(16))
        assert result["content"] == notice + " ".join(f"tok{i}" for i in range(16))
        assert result["finish_reason"] == "stop"
        assert server.state(big) == "stopped" and server.state(x) == "ready"
        assert await starts(server, x) == 1


@pytest.mark.clients
async def test_library_health_check_as_the_proxy_makes_it_leaves_the_model_stopped(tmp_path):
    async with run_app(tmp_path) as server:
        x = await server.add("x", 4)
        f = await server.add("f", 4, "--fail", "exit-at-start")
        with pytest.raises(Exception):  # noqa: B017 (any failure: the test is about what follows)
            await server.deployer.restart(f)
        assert server.state(f) == "failed"
        spy = GatewaySpy(server)
        before, events_x = server.controller.status(x), await server.app[app_mod.STORE].events(x, limit=1000)
        events = await run_client(job_for(server, x, {"kind": "health"},
                                          {"kind": "health", "entry": entry_for(server, f)}))
        healthy, failed = results(events)
        assert healthy["healthy"] is True, healthy
        assert healthy["probe_extra_headers"] == {HEALTH_CHECK_HEADER: "1"}  # merged from model_info
        (probe,) = spy.to(server, x)
        assert probe["headers"][HEALTH_CHECK_HEADER] == "1"
        assert server.state(x) == "stopped" and server.deployer.base_url(x) is None
        assert await starts(server, x) == 0 and server.controller.status(x) == before
        assert await server.app[app_mod.STORE].events(x, limit=1000) == events_x
        # A failed deployment is reported unhealthy (503 ondemand_not_ready), not woken.
        # (LiteLLM keeps the status and our message, "F failed: ...", not our code.)
        assert failed["healthy"] is False and failed["status_code"] == 503, failed
        assert failed["error"].startswith("litellm.ServiceUnavailableError") and "F failed" in failed["error"], failed
        assert len(spy.to(server, f, health=True)) == 1 and not spy.to(server, f, health=False)
        assert server.state(f) == "failed" and await starts(server, f) == 1


# --- several boxes: warm first ----------------------------------------------------------------


async def test_warm_first_sends_traffic_to_the_ready_box_then_the_asleep_one_then_the_cold_one(tmp_path, http):
    """Three boxes serve M (the same deployment id on each): ready on A, asleep on C,
    stopped on B, with the entries their syncs write (A's order 1, C's 2, B's 3) in one
    proxy's config. Every request goes to A: C stays asleep, B never starts. Once A is gone,
    LiteLLM's health checks (health-check routing, as docs/several-boxes.md configures it)
    drop A's entry and C is woken and serves; B still never starts. Once C is gone too, B
    starts M and serves."""
    a_cm = run_app(tmp_path / "a", instance="box-a", ondemand_idle_timeout_s=3600)
    c_cm = run_app(tmp_path / "c", instance="box-c", ondemand_idle_timeout_s=3600)
    a = await a_cm.__aenter__()
    open_boxes = [a_cm]
    try:
        c = await c_cm.__aenter__()
        open_boxes.append(c_cm)
        async with run_app(tmp_path / "b", instance="box-b", ondemand_idle_timeout_s=3600) as b:
            ma, mb, mc = await a.add("m", 4), await b.add("m", 4, "--startup-delay", "0.3"), await c.add("m", 4)
            assert ma == mb == mc  # the same id on every box
            await a.deployer.restart(ma)
            await c.deployer.restart(mc)
            await c.deployer.sleep(mc)
            engine_c = c.deployer.base_url(mc)
            assert (a.state(ma), c.state(mc), b.state(mb)) == ("ready", "asleep", "stopped")
            entries = [entry_for(a, ma), entry_for(c, mc), entry_for(b, mb)]
            assert [(e["model_name"], e["litellm_params"]["order"], e["model_info"]["dgxmm_instance"],
                     e["model_info"]["dgxmm_state"]) for e in entries] == [
                ("M", 1, "box-a", "ready"), ("M", 2, "box-c", "asleep"), ("M", 3, "box-b", "cold")]
            spy_b, spy_c = GatewaySpy(b), GatewaySpy(c)
            settings = {"background_health_checks": True, "health_check_interval": 1,
                        "enable_health_check_routing": True}

            async def until_served(what: str) -> None:
                failed, t0 = 0, time.monotonic()
                while True:
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat("M"),
                                         headers=proxy.headers()) as r:
                        if r.status == 200:
                            break
                        failed += 1
                    assert time.monotonic() - t0 < 30, proxy.tail()
                    await asyncio.sleep(0.2)
                print(f"{what} gone: {failed} requests failed before LiteLLM's health check dropped its entry "
                      f"({time.monotonic() - t0:.1f} s)")

            async def served(n: int) -> None:
                for _ in range(n):
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat("M"),
                                         headers=proxy.headers()) as r:
                        assert r.status == 200, (await r.text(), proxy.tail())

            async with litellm_proxy(tmp_path, entries, general_settings=settings) as proxy:
                await served(12)
                reqs = await engine_requests(a, ma)
                assert len(reqs) == 12
                assert all("order" not in json.loads(r["body"]) for r in reqs)  # LiteLLM's, not sent on
                assert spy_c.to(c, mc, health=False) == [] and c.state(mc) == "asleep"
                assert spy_b.to(b, mb, health=False) == [] and b.state(mb) == "stopped"

                await a_cm.__aexit__(None, None, None)  # box A is gone: the asleep box is next
                open_boxes.remove(a_cm)
                await until_served("A")
                await served(5)
                assert c.state(mc) == "ready" and len(await engine_requests(c, mc)) == 6
                texts = [e["text"] for e in await c.app[app_mod.STORE].events(mc, limit=1000)]
                assert "Woken for a request" in texts and c.deployer.base_url(mc) == engine_c  # woken, not restarted
                assert spy_b.to(b, mb, health=False) == [] and b.state(mb) == "stopped"
                assert await starts(b, mb) == 0

                await c_cm.__aexit__(None, None, None)  # box C is gone too: now the cold one
                open_boxes.remove(c_cm)
                await until_served("C")
                await served(5)
                assert b.state(mb) == "ready" and await starts(b, mb) == 1
                assert len(await engine_requests(b, mb)) == 6
    finally:
        for cm in reversed(open_boxes):
            await cm.__aexit__(None, None, None)


# --- the PATCH route and the order filter of the installed LiteLLM ----------------------------


async def test_the_installed_litellm_has_the_patch_route_ondemand_writes_warmth_with(world, http):
    """PATCH /model/{id}/update (patch_model) exists: without a database (this suite's proxy
    runs from a config) it answers the route's own 500 "DB not connected", never the
    framework's 404/405, and LiteLLMClient reads that as litellm_no_db (the sync stops), not
    as a missing route. A path LiteLLM lacks answers {"detail": "Not Found"} and a method it
    lacks {"detail": "Method Not Allowed"}: those the client reads as no_route."""
    proxy = world.proxy
    body = {"litellm_params": {"order": 2}, "model_info": {"id": "1", "dgxmm_state": "asleep"}}
    async with http.patch(proxy.url + "/model/1/update", json=body, headers=proxy.headers()) as r:
        answer = await r.json()
        assert r.status not in (404, 405), answer
    assert r.status == 500 and "DB not connected" in json.dumps(answer), answer
    async with http.patch(proxy.url + "/model/1/update-nothing", json=body, headers=proxy.headers()) as r:
        assert r.status == 404 and await r.json() == {"detail": "Not Found"}
    async with http.patch(proxy.url + "/model/info", json=body, headers=proxy.headers()) as r:
        assert r.status == 405 and await r.json() == {"detail": "Method Not Allowed"}
    client = LiteLLMClient(proxy.url, MASTER)
    missing = LiteLLMClient(proxy.url + "/no-such-prefix", MASTER)
    try:
        with pytest.raises(LiteLLMError) as info:
            await client.patch_warmth("1", 2, "asleep")
        assert info.value.code == "litellm_no_db" and client.patch_route is None, info.value
        assert await missing.patch_warmth("1", 2, "asleep") == "no_route" and missing.patch_route is False
    finally:
        await client.close()
        await missing.close()


ORDER_SNIPPET = """
import inspect, json
import litellm.router, litellm.utils
from litellm.utils import get_order_filtered_deployments as f
def d(i, order):
    return {"model_name": "M", "litellm_params": {"model": "openai/M", "order": order}, "model_info": {"id": i}}
out = {
    "all": [x["model_info"]["id"] for x in f([d("cold", 3), d("asleep", 2), d("ready", 1)])],
    "no_ready": [x["model_info"]["id"] for x in f([d("cold", 3), d("asleep", 2), d("cold2", 3)])],
    "cold_only": [x["model_info"]["id"] for x in f([d("cold", 3), d("cold2", 3)])],
    "model_info_order": [x["model_info"]["id"] for x in f([d("cold", 3), {"model_name": "M",
        "litellm_params": {"model": "openai/M"}, "model_info": {"id": "mi", "order": 2}}])],
}
src = inspect.getsource(litellm.router.Router.async_get_healthy_deployments)
out["order_after_cooldown"] = 0 < src.find("self._filter_cooldown_deployments(") < src.find("ORDER FILTERING")
print(json.dumps(out))
"""


async def test_the_installed_router_keeps_the_lowest_order_ready_then_asleep_then_cold():
    """utils.get_order_filtered_deployments, as Router.async_get_healthy_deployments's "ORDER
    FILTERING" calls it after _filter_cooldown_deployments: of a name's deployments only those
    of the lowest order are kept (1 ready < 2 asleep < 3 cold), litellm_params.order first,
    else model_info.order (get_deployment_order)."""
    proc = await asyncio.create_subprocess_exec(
        str(_python()), "-c", ORDER_SNIPPET, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=litellm_env())
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-3000:]
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got == {"all": ["ready"], "no_ready": ["asleep"], "cold_only": ["cold", "cold2"],
                   "model_info_order": ["mi"], "order_after_cooldown": True}, got


# --- several boxes: a box at its max_inflight -------------------------------------------------

SDK_CLIENT = """
import json, sys
from openai import OpenAI
url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=2)  # the SDK's default retries
out = []
for _ in range(n):
    try:
        r = client.chat.completions.create(model="M", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        out.append(200)
    except Exception as exc:
        out.append(getattr(exc, "status_code", repr(exc)))
print(json.dumps(out))
"""


async def sdk_requests(proxy: Proxy, n: int) -> list:
    """``n`` chat requests, one after another, by the OpenAI SDK with its default retries."""
    proc = await asyncio.create_subprocess_exec(
        str(_python()), "-c", SDK_CLIENT, proxy.url, MASTER, str(n), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=litellm_env())
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_a_box_at_its_limit_answers_429_and_litellm_sends_the_next_requests_to_the_other(tmp_path, http):
    """M is ready on two boxes (both order 1); box A allows one request at once
    (max_inflight 1) and is serving it. What moves traffic to box B, read in LiteLLM
    1.106.12's source and shown here (docs/several-boxes.md, "A box at its limit"):

    1. the entries keep num_retries 0, so the request that landed on A gets the 429 back
       (LiteLLM does not retry it: the client sees exactly as many 429s as A refused), with
       our headers as llm_provider-retry-after / llm_provider-x-should-retry; LiteLLM cools A's
       entry down for Retry-After = 1 s (router.py deployment_callback_on_failure, which
       prefers the answer's Retry-After to router_settings.cooldown_time;
       cooldown_handlers._should_cooldown_deployment: a 429 in a group of more than one entry);
    2. the client's own retry of a 429 (the OpenAI SDK retries a 429 twice by default,
       0.5 s then 1 s later) is routed again, to B while A cools down, or to A once A has
       room: every SDK request is answered;
    3. with router_settings.retry_policy {RateLimitErrorRetries: N}, LiteLLM itself retries
       the 429 at once (the policy overrides the entry's num_retries 0 for rate-limit errors
       only): a client without retries sees no 429."""
    async with run_app(tmp_path / "a", instance="box-a", ondemand_idle_timeout_s=3600) as a, \
            run_app(tmp_path / "b", instance="box-b", ondemand_idle_timeout_s=3600) as b:
        ma, mb = await a.add("m", 4, max_inflight=1), await b.add("m", 4)
        await a.deployer.restart(ma)
        await b.deployer.restart(mb)
        entries = [entry_for(a, ma), entry_for(b, mb)]
        assert [(e["litellm_params"]["order"], e["litellm_params"]["num_retries"]) for e in entries] == [(1, 0), (1, 0)]
        held = await a.admission.acquire(ma)  # A serves its one request, all along
        try:
            async with litellm_proxy(tmp_path / "a", entries) as proxy:
                statuses = []
                for _ in range(30):
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat("M"),
                                         headers=proxy.headers()) as r:
                        statuses.append(r.status)
                        if r.status == 429:
                            err = await r.json()
                            headers = {k.lower(): v for k, v in r.headers.items()}
                            assert "max_inflight" in err["error"]["message"], err  # our message (not our code)
                            assert headers["llm_provider-x-should-retry"] == "true", headers
                            assert headers["llm_provider-retry-after"] == "1", headers
                        else:
                            assert r.status == 200, (await r.text(), proxy.tail())
                refused = statuses.count(429)
                print(f"30 plain requests: {statuses.count(200)} answered by B, {refused} refused by A (429)")
                assert refused >= 1, "LiteLLM never picked box A"
                assert a.controller.busy_total(ma) == refused  # LiteLLM retried none of them
                assert len(await engine_requests(b, mb)) == statuses.count(200)
                # The OpenAI SDK's own retries: each 429 is tried again, and lands on B.
                busy0, served0 = a.controller.busy_total(ma), len(await engine_requests(b, mb))
                sdk = await sdk_requests(proxy, 10)
                print(f"OpenAI SDK (max_retries=2): {sdk.count(200)} of 10 answered; A refused "
                      f"{a.controller.busy_total(ma) - busy0} tries on the way")
                assert sdk == [200] * 10, sdk
                assert len(await engine_requests(b, mb)) == served0 + 10
            # A router retry policy for rate-limit errors: LiteLLM moves the request itself.
            settings = {"retry_policy": {"RateLimitErrorRetries": 3}}
            async with litellm_proxy(tmp_path / "b", entries, router_settings=settings) as proxy:
                busy0 = a.controller.busy_total(ma)
                for i in range(20):
                    async with http.post(proxy.url + "/v1/chat/completions", json=chat("M"),
                                         headers=proxy.headers()) as r:
                        assert r.status == 200, (await r.text(), proxy.tail())
                    if i % 4 == 3:
                        await asyncio.sleep(1.1)  # past A's cooldown now and then: A is picked again
                print(f"retry_policy RateLimitErrorRetries 3: 20 of 20 answered; A refused "
                      f"{a.controller.busy_total(ma) - busy0} tries, retried by LiteLLM")
                assert a.controller.busy_total(ma) > busy0  # some went to A first
            assert a.controller.inflight(ma) == 1 and await starts(a, ma) == 1 and await starts(b, mb) == 1
        finally:
            held.release()
