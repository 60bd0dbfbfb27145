"""The gateway end to end: a real ondemand on loopback, the engine simulator
behind it, real sockets and the real state file.

Marked ``uvloop`` (run on both loops): the tests whose outcome rests on transports and
the engine pool (streams, hang-ups, crashes, connection reuse); the others test the
gateway's own logic, which is the same on either loop, and run once. The checks before the
admission and the gateway's own answers (ondemand/gateway/routes.py): test_gateway_routes.py."""
import asyncio
import contextlib
import os

import aiohttp
import orjson
import pytest
from helpers import two_pools, wait_for

from ondemand.gateway import keys

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hello"}]}


async def err(resp):
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    return resp.status, body["error"]["code"]


async def recorded(server, dep_id):
    async with two_pools() as s, s.get(server.deployer.base_url(dep_id) + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"].startswith("/v1/") and x["path"] != "/v1/models"]


async def test_cold_start_then_forward(server, http):
    a = await server.add("a", 10, "--startup-delay", "0.3")
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert server.state(a) == "ready"
    assert server.controller.inflight(a) == 0
    assert server.controller.status(a)["last_request_at"] is not None


async def test_nothing_secret_reaches_the_engine(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)
    headers = {**server.auth(), "Cookie": "session=1", "Connection": "keep-alive, X-Private",
               "X-Private": "secret", "Keep-Alive": "timeout=5", "Accept-Encoding": "gzip", "X-Custom": "kept"}
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=headers) as r:
        assert r.status == 200
    (req,) = await recorded(server, a)
    names = {k.lower(): v for k, v in req["headers"]}
    for banned in ("authorization", "cookie", "x-private", "keep-alive", "x-dgxmm-health-check",
                   "x-forwarded-for", "forwarded", "x-real-ip"):
        assert banned not in names, banned
    assert names["accept-encoding"] == "identity" and names["x-custom"] == "kept"
    assert req["path"] == "/v1/chat/completions"


@pytest.mark.uvloop
async def test_stream_is_byte_for_byte_the_engines(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)
    body = {**CHAT, "stream": True, "seed": 1}
    async with http.post(server.gw(a, "chat/completions"), json=body, headers=server.auth()) as r:
        via = await r.read()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert "Server" not in r.headers or "Python" in r.headers["Server"]
    async with http.post(server.deployer.base_url(a) + "/v1/chat/completions", json=body) as r:
        direct = await r.read()
    norm = lambda b: [orjson.loads(l[6:]) | {"id": 0, "created": 0} if l != b"data: [DONE]" else l
                      for l in b.split(b"\n\n") if l]
    assert norm(via) == norm(direct)
    assert via.endswith(b"data: [DONE]\n\n")


async def test_engine_errors_pass_through_unchanged(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)
    async with http.post(server.gw(a, "chat/completions"), json={**CHAT, "model": "nope"},
                         headers=server.auth()) as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"].startswith("The model `nope` does not exist")


async def test_key_rotation_without_restart(server, http):
    a = await server.add("a")
    old = server.key
    new = keys.generate_key()
    # The file is looked at at most once a second (tests/gateway/test_keys.py times that); here more
    # often, and the test waits until the watcher has the new key.
    server.keys.STAT_INTERVAL_S = 0.05
    keys.write_key_file(server.cfg.key_file, new)
    await wait_for(lambda: server.keys.current() == new, what="the rotated key picked up")
    async with http.get(server.gw(a, "models"), headers=server.auth(new)) as r:
        assert r.status == 200
    # the previous key: 401, but never counted towards the rate limit
    for _ in range(30):
        async with http.get(server.gw(a, "models"), headers=server.auth(old)) as r:
            assert await err(r) == (401, "invalid_api_key")
    async with http.get(server.gw(a, "models"), headers=server.auth(new)) as r:
        assert r.status == 200
    os.unlink(server.cfg.key_file)
    await wait_for(lambda: server.keys.current() is None, what="the removed key noticed")
    async with http.get(server.gw(a, "models"), headers=server.auth(new)) as r:
        assert await err(r) == (503, "ondemand_not_configured")


async def test_start_failure_is_503(server, http):
    a = await server.add("a", 10, "--fail", "exit-at-start")
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "start_failed")


@pytest.mark.server(ondemand_max_queued=1)
async def test_queue_full(server, http):
    a = await server.add("a", 10, "--startup-delay", "0.5")  # the first waits while it starts
    first = asyncio.ensure_future(http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()))
    await wait_for(lambda: server.controller.waiting() == 1)
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "ondemand_queue_full") and r.headers["Retry-After"] == "60"
    r = await first
    assert r.status == 200
    r.release()


@pytest.mark.uvloop
async def test_upstream_unreachable_is_502(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)
    proc = server.deployer.engine(a).ref
    os.killpg(proc.pid, 19)  # frozen: accepts nothing new ... then gone
    server.deployer.engine(a).base_url = "http://127.0.0.1:1"
    try:
        async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
            assert await err(r) == (502, "ondemand_upstream_error")
    finally:
        os.killpg(proc.pid, 18)
    assert server.controller.inflight(a) == 0


async def _relieve(server, big, slot):
    """Let the queued deployment through: the busy one becomes idle for its full timeout."""
    slot.release()
    server.controller.record(big).last_activity = 0
    from ondemand import app as app_mod
    await server.app[app_mod.SAMPLER].sample_once()


def _queued_setup(server):
    async def go(second_args=()):
        big = await server.add("big", 15)
        x = await server.add("x", 12, *second_args)
        await server.deployer.restart(big)
        slot = await server.admission.acquire(big)  # busy: x must queue
        return big, x, slot
    return go


@pytest.mark.uvloop
async def test_streaming_chat_gets_the_queued_notice_then_the_engine(server, http):
    big, x, slot = await _queued_setup(server)()
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(server.gw(x, "chat/completions"), json=body, headers=server.auth()) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        first = await r.content.readuntil(b"\n\n")
        chunk = orjson.loads(first[6:])
        assert chunk["id"] == "ondemand-queued" and chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "X" and "GPU memory" in chunk["choices"][0]["delta"]["content"]
        slot.release()
        server.controller.record(big).last_activity = 0  # idle for its full timeout now
        await server.app[__import__("ondemand.app").app.SAMPLER].sample_once()
        rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    events = [orjson.loads(l[6:]) for l in rest.split(b"\n\n") if l and l != b"data: [DONE]"]
    assert all(e.get("object") == "chat.completion.chunk" and e.get("id") != "ondemand-queued" for e in events), events
    assert server.state(big) == "stopped" and server.state(x) == "ready"


@pytest.mark.server(ondemand_queue_timeout_s=1)
async def test_streaming_completions_notice_and_timeout_error(server, http):
    big, x, slot = await _queued_setup(server)()
    body = {"model": "X", "prompt": "hi", "stream": True}
    async with http.post(server.gw(x, "completions"), json=body, headers=server.auth()) as r:
        assert r.status == 200
        data = await r.read()
    parts = [p for p in data.split(b"\n\n") if p]
    assert orjson.loads(parts[0][6:])["object"] == "text_completion"
    assert orjson.loads(parts[1][6:])["error"]["code"] == "ondemand_queue_timeout"
    assert parts[2] == b"data: [DONE]"
    slot.release()
    assert server.controller.waiting() == 0


NO_NOTICE = [  # typed streams and structured output: their format has no room for a notice
    ("responses", {"model": "X", "input": "hi", "stream": True}),
    ("messages", {"model": "X", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("chat/completions", {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                          "response_format": {"type": "json_object"}}),
]


async def _queue_all(server, http, x, requests):
    """Send every (route, body) to the queued deployment ``x``; return when all wait."""
    tasks = [asyncio.ensure_future(http.post(server.gw(x, route), json=body, headers=server.auth()))
             for route, body in requests]
    await wait_for(lambda: server.controller.status(x)["queued"] == len(tasks), what=f"{len(tasks)} queued")
    return tasks


# The queued tests below send their kinds of request together, to one queued deployment:
# each kind separately would wait for a start (and a queue timeout) of its own.

@pytest.mark.server(ondemand_queue_timeout_s=1)
async def test_no_notice_for_typed_streams_and_structured_output(server, http):
    big, x, slot = await _queued_setup(server)()
    for (route, _), task in zip(NO_NOTICE, await _queue_all(server, http, x, NO_NOTICE)):
        async with await task as r:
            assert await err(r) == (503, "ondemand_queue_timeout"), route  # a plain 503
    slot.release()


async def test_typed_stream_and_structured_output_that_waited_are_exactly_the_engines(server, http):
    big, x, slot = await _queued_setup(server)()
    tools = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",
             "function": {"name": "f", "parameters": {}}}]}
    typed, structured = await _queue_all(server, http, x, [
        ("responses", {"model": "X", "input": "hi", "stream": True}), ("chat/completions", tools)])
    await _relieve(server, big, slot)
    async with await typed as r:
        assert (await r.read()).startswith(b"event: response.created\n")
    async with await structured as r:
        assert not (await r.json())["choices"][0]["message"]["content"].startswith("[ondemand]")


NOTICE_IN = [
    ("chat/completions", {"model": "X", "messages": [{"role": "user", "content": "hi"}]},
     lambda b: b["choices"][0]["message"]["content"]),
    ("completions", {"model": "X", "prompt": "hi"}, lambda b: b["choices"][0]["text"]),
    ("responses", {"model": "X", "input": "hi"}, lambda b: b["output"][0]["content"][0]["text"]),
]


async def test_non_streaming_answer_of_a_queued_request_gets_the_notice(server, http):
    big, x, slot = await _queued_setup(server)()
    tasks = await _queue_all(server, http, x, [(route, body) for route, body, _ in NOTICE_IN])
    await _relieve(server, big, slot)
    for (route, body, where), task in zip(NOTICE_IN, tasks):
        async with await task as r:
            raw = await r.read()
            assert int(r.headers["Content-Length"]) == len(raw), route
        text = where(orjson.loads(raw))
        assert text.startswith("[ondemand] X is waiting for GPU memory"), route
        # a request that did not queue gets the engine's answer untouched
        async with http.post(server.gw(x, route), json=body, headers=server.auth()) as r2:
            assert not where(await r2.json()).startswith("[ondemand]"), route


# The reaper stays away: big, idle for its full timeout, would otherwise be put away by the reaper's
# step (every 0.2 s here) just as x arrives, and x, finding no victim while big is on its way down,
# rightly queues and is told so (a busy-core make test saw it).
@pytest.mark.server(reap_interval_s=3600)
async def test_a_make_room_that_found_its_victim_sends_no_notice_streaming_or_not(server, http):
    """Issue 29: the notice only for the queue. x needs big's memory and big is idle: its
    make-room finds the victim at once, so neither a stream nor a plain answer gets a notice;
    both are exactly the engine's."""
    big = await server.add("big", 15)
    x = await server.add("x", 12)
    await server.deployer.restart(big)
    server.controller.record(big).last_activity = 0  # idle for its full timeout
    from ondemand import app as app_mod
    await server.app[app_mod.SAMPLER].sample_once()
    stream = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    plain = {"model": "X", "messages": [{"role": "user", "content": "hi"}]}
    tasks = [asyncio.ensure_future(http.post(server.gw(x, "chat/completions"), json=b, headers=server.auth()))
             for b in (stream, plain)]
    async with await tasks[0] as r:
        assert r.status == 200
        data = await r.read()
    assert b"ondemand-queued" not in data and b"[ondemand]" not in data and data.endswith(b"data: [DONE]\n\n")
    assert orjson.loads(data.split(b"\n\n")[0][6:])["object"] == "chat.completion.chunk"
    async with await tasks[1] as r:
        assert r.status == 200
        answer = await r.json()
    assert not answer["choices"][0]["message"]["content"].startswith("[ondemand]")
    assert server.state(big) in ("stopped", "asleep") and server.state(x) == "ready"


@pytest.mark.uvloop
async def test_hang_up_while_waiting_releases_everything(server, http):
    a = await server.add("a", 10, "--startup-delay", "0.5")  # a start long enough to hang up in
    task = asyncio.ensure_future(http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()))
    await wait_for(lambda: server.controller.waiting() == 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_for(lambda: server.controller.waiting() == 0, what="waiter removed")
    await wait_for(lambda: server.state(a) == "ready", what="the shared start still finished")
    assert server.controller.inflight(a) == 0


@pytest.mark.uvloop
async def test_hang_up_mid_stream_closes_the_engine_connection(server, http):
    a = await server.add("a", 10, "--token-delay", "0.1", "--tokens", "100")
    await server.deployer.restart(a)
    body = {**CHAT, "stream": True}
    r = await http.post(server.gw(a, "chat/completions"), json=body, headers=server.auth())
    await r.content.readuntil(b"\n\n")
    assert server.controller.inflight(a) == 1
    r.close()  # the client goes away
    await wait_for(lambda: server.controller.inflight(a) == 0, what="slot released")
    from ondemand import app as app_mod
    sampler = server.app[app_mod.SAMPLER]

    async def engine_idle():
        await sampler.sample_once()
        return sampler.idle(a)
    await wait_for(engine_idle, what="engine saw the disconnect")


@pytest.mark.uvloop
async def test_hang_up_on_a_queued_stream_releases(server, http):
    big, x, slot = await _queued_setup(server)()
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = await http.post(server.gw(x, "chat/completions"), json=body, headers=server.auth())
    await r.content.readuntil(b"\n\n")  # the notice
    r.close()
    await wait_for(lambda: server.controller.waiting() == 0 and x not in server.controller.queue)
    slot.release()


@pytest.mark.uvloop
async def test_engine_crash_mid_stream_is_not_a_clean_end(server, http):
    a = await server.add("a", 10, "--fail", "crash-mid-stream", "--token-delay", "0.05")
    body = {**CHAT, "stream": True}
    async with http.post(server.gw(a, "chat/completions"), json=body, headers=server.auth()) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    await wait_for(lambda: server.controller.inflight(a) == 0)


@pytest.mark.server(ondemand_allowed_cidrs=["127.0.0.2/32"])
async def test_peer_guard_on_the_raw_peer(server):
    a = await server.add("a")

    def client(addr):
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(addr, 0)))
    async with client("127.0.0.2") as ok, client("127.0.0.3") as no:
        async with ok.get(server.gw(a, "models"), headers=server.auth()) as r:
            assert r.status == 200
        async with no.get(server.gw(a, "models"), headers=server.auth()) as r:
            assert await err(r) == (404, "not_found")
        for h in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
            # a header never makes a peer: even from the allowed address it is refused
            async with ok.get(server.gw(a, "models"), headers={**server.auth(), h: "127.0.0.2"}) as r:
                assert await err(r) == (404, "not_found")
        async with no.get(server.url + "/api/host", headers=server.admin_headers()) as r:
            assert r.status == 200  # the guard is the gateway's, not the admin API's


@pytest.mark.server(ondemand_allowed_cidrs="auto", **{"deployer.docker_url": "unix:///nonexistent.sock"})
async def test_auto_outside_docker_allows_nobody(server):
    a = await server.add("a")
    async with two_pools() as s, s.get(server.gw(a, "models"), headers=server.auth()) as r:
        assert await err(r) == (404, "not_found")


@pytest.mark.uvloop
async def test_race_hang_ups_around_the_grant_release_every_slot(server, http):
    """Streaming requests that queued (acquire runs in a task of its own) hang up at random
    moments around the grant: every slot is released, nothing waits, nothing hangs."""
    import random
    rng = random.Random(7)
    big, x, slot = await _queued_setup(server)()
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    # The sleeps of this race are its random timing: hang-ups before, at and after the grant.
    async def one():
        try:
            async with http.post(server.gw(x, "chat/completions"), json=body, headers=server.auth()) as r:
                await asyncio.sleep(rng.random() * 1.5)
                if rng.random() < 0.7:
                    return  # hang up (the response is closed unread)
                await r.read()
        except aiohttp.ClientError:
            pass
    tasks = [asyncio.ensure_future(one()) for _ in range(30)]
    await wait_for(lambda: x in server.controller.queue)
    await asyncio.sleep(0.3)  # some hang up while queued, before the grant
    await _relieve(server, big, slot)
    done, pending = await asyncio.wait(tasks, timeout=30)
    assert not pending
    await wait_for(lambda: server.controller.inflight(x) == 0 and server.controller.waiting() == 0,
                   what="every slot released")
    assert server.state(x) == "ready"


async def test_engine_cookies_never_reach_another_request(server, http):
    from helpers import FAKES
    c = (await server.deployer.create(dict(
        name="c", served_name="C", engine="vllm", memory_gib=1, mode="on_demand", state="stopped", role="model",
        command=["python3", str(FAKES / "cookie_engine.py"), "{port}"]))).id
    for _ in range(2):
        async with http.post(server.gw(c, "chat/completions"), json={"model": "C"}, headers=server.auth()) as r:
            assert r.status == 200
            assert (await r.json())["cookie"] is None
            assert "engine_session" in r.headers.get("Set-Cookie", "")  # passed back to its client
            # headers pass back, except hop-by-hop ones (also those named in Connection) and Server
            assert r.headers["X-Engine"] == "kept"
            assert "X-Hop" not in r.headers and "fake-engine" not in r.headers.get("Server", "")
        http.cookie_jar.clear()


@pytest.mark.uvloop
async def test_slot_granted_at_the_moment_of_the_hang_up_is_released(server, http):
    """On the notice path the wait runs in a task of its own; when the grant and the
    hang-up land in the same turn of the loop, the handler never takes the slot, and
    a done callback must release it."""
    big, x, slot = await _queued_setup(server)()
    c = server.controller
    adm = server.admission
    real_wait = adm.wait

    def wait(dep_id, **kw):
        handler = asyncio.current_task()  # the request's handler creates this coroutine

        async def granted_then_hang_up():
            s = await real_wait(dep_id, **kw)
            # The client goes away in the same turn of the loop as the grant: the handler
            # is cancelled before it resumes to take the slot.
            asyncio.get_running_loop().call_soon(handler.cancel)
            return s
        return granted_then_hang_up()
    adm.wait = wait
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    task = asyncio.ensure_future(http.post(server.gw(x, "chat/completions"), json=body, headers=server.auth()))
    await wait_for(lambda: x in c.queue)
    await _relieve(server, big, slot)
    with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
        r = await task
        await r.read()
    await wait_for(lambda: server.state(x) == "ready")
    await wait_for(lambda: c.inflight(x) == 0 and c.waiting() == 0, what="the granted slot released")


# --- what the controller decides, as a client and an admin see it ----------------------------

async def test_a_start_by_hand_during_the_backoff_is_waited_for(server, http, tmp_path):
    """A failed start refuses new starts for a while; a start an administrator makes in
    that time is waited for by the requests that arrive, not refused."""
    import sys
    flag = tmp_path / "engine-fixed"
    engine = (f"test -e {flag} || exit 3; exec {sys.executable} -m ondemand sim-engine --port {{port}} "
              "--model A --startup-delay 1")
    a = await server.add("a", 10, command=["sh", "-c", engine])
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "start_failed")
    assert server.controller.backoff_left(a) > 50
    flag.touch()  # the administrator fixed the engine, and starts it by hand
    async with http.post(f"{server.url}/api/deployments/{a}/start", headers=server.admin_headers()) as r:
        assert r.status == 200, await r.text()
    assert server.state(a) == "starting"
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert r.status == 200, await r.text()
    assert server.state(a) == "ready" and server.controller.backoff_left(a) == 0


@pytest.mark.server(**{"budget.source": "nvidia-smi"})
async def test_an_unreadable_budget_is_503_and_sets_no_backoff(server, http, fake_nvidia_smi, monkeypatch):
    server.deployer.budget.nvidia_smi = fake_nvidia_smi("24576, 0")
    a = await server.add("a", 10)
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FAIL", "1")
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "budget_unavailable")
        assert r.headers["Retry-After"] == "10"
    assert server.state(a) == "stopped" and server.controller.backoff_left(a) == 0
    async with http.post(f"{server.url}/api/deployments/{a}/start", headers=server.admin_headers()) as r:
        assert await err(r) == (503, "budget_unavailable")  # the admin API says the same
    monkeypatch.delenv("FAKE_NVIDIA_SMI_FAIL")
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert r.status == 200  # nothing started before: the next request starts it at once
    actions = [r["action"] for r in await server.deployer.store.audit(a)]
    assert actions == ["ondemand_start"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_planned_deployment_answers_503_at_once(server, http, stream):
    async with http.post(f"{server.url}/api/deployments", headers=server.admin_headers(),
                         json={"name": "p", "served_name": "P", "engine": "vllm", "mode": "on_demand",
                               "start": False, "command": ["ondemand", "sim-engine", "--port", "{port}"]}) as r:
        view = await r.json()
        assert r.status == 201 and view["state"] == "planned", view
    async with http.post(server.gw(view["id"], "chat/completions"), json={**CHAT, "stream": stream},
                         headers=server.auth()) as r:
        assert await err(r) == (503, "ondemand_planned")
        assert r.headers["x-should-retry"] == "false"
    assert server.state(view["id"]) == "planned" and server.controller.waiting() == 0
