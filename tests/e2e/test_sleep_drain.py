"""A sleep drains first (issue 29): ``POST /api/deployments/{id}/sleep`` gives no new slot,
waits for the requests in flight (at most ``drain_s``), then sleeps; requests that came
meanwhile wait and wake it. Still busy at the deadline: 409 ``deployment_busy`` and it serves
on; ``force`` sleeps at once, and the engine (the simulator, as vLLM) aborts what it runs. An
administrator who hangs up during the drain ends it as its deadline does (nothing sleeps); one
who hangs up once the sleep began leaves the sleep to finish."""
from __future__ import annotations

import asyncio

import pytest
from helpers import wait_for
from test_warmth_admin import api, sim_state, sleeper

pytestmark = pytest.mark.server(reap_interval_s=3600, **{"budget.host_reserve_gib": 0})

STREAM = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 12}
PLAIN = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def ready_sleeper(server, token_delay: str = "0.1") -> int:
    _, view = await api(server, "POST", "/deployments", sleeper("a", "--token-delay", token_delay))
    i = view["id"]
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready", view
    return i


async def read_stream(http, server, i) -> bytes:
    async with http.post(server.gw(i, "chat/completions"), json=STREAM, headers=server.auth()) as r:
        assert r.status == 200
        return await r.read()


async def test_a_stream_through_a_sleep_arrives_whole_and_a_request_meanwhile_wakes_it(server, http):
    i = await ready_sleeper(server)
    stream = asyncio.ensure_future(read_stream(http, server, i))
    await wait_for(lambda: server.controller.inflight(i) == 1, what="the stream in flight")
    sleep = asyncio.ensure_future(api(server, "POST", f"/deployments/{i}/sleep", {"level": 1}))
    await wait_for(lambda: server.controller.draining(i), what="the drain")
    assert server.controller.try_take(i) is None  # no new slot while it drains
    late = asyncio.ensure_future(http.post(server.gw(i, "chat/completions"), json=PLAIN, headers=server.auth()))
    await wait_for(lambda: server.controller.waiting(i) == 1, what="the late request waiting")
    data = await stream
    assert data.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in data  # whole: the drain waited for it
    status, view = await sleep
    assert status == 200 and view["sleep_level"] == 1, view
    async with await late as r:  # it waited, then woke it: no request reached a sleeping engine
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"]
    assert server.state(i) == "ready"


async def test_still_busy_at_the_deadline_is_409_and_it_serves_on_and_force_sleeps_at_once(server, http):
    i = await ready_sleeper(server)
    stream = asyncio.ensure_future(read_stream(http, server, i))
    await wait_for(lambda: server.controller.inflight(i) == 1, what="the stream in flight")
    status, err = await api(server, "POST", f"/deployments/{i}/sleep", {"drain_s": 0.2})
    assert status == 409 and err["error"]["code"] == "deployment_busy" and "in flight" in err["error"]["message"]
    assert server.state(i) == "ready" and not server.controller.draining(i)
    async with http.post(server.gw(i, "chat/completions"), json=PLAIN, headers=server.auth()) as r:
        assert r.status == 200  # it serves on
    data = await stream
    assert data.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in data
    # force: at once; the engine aborts the stream it runs
    stream = asyncio.ensure_future(read_stream(http, server, i))
    await wait_for(lambda: server.controller.inflight(i) == 1, what="the stream in flight")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"force": True})
    assert status == 200 and view["state"] == "asleep", view
    data = await stream
    assert b'"finish_reason":"length"' not in data and not data.endswith(b"data: [DONE]\n\n")
    status, err = await api(server, "POST", f"/deployments/{i}/sleep", {"drain_s": -1})
    assert status == 400 and "drain_s" in err["error"]["message"]


async def hang_up_during(server, path: str, body: bytes, until) -> None:
    """Send an admin request over the socket, wait for ``until()``, then close the connection
    without reading the answer (an administrator's Ctrl-C)."""
    reader, writer = await asyncio.open_unix_connection(str(server.cfg.admin_socket))
    writer.write(f"POST {server.cfg.base_path}/api{path} HTTP/1.1\r\nHost: ondemand\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    try:
        await until()
    finally:
        writer.close()
        await writer.wait_closed()


async def test_an_admin_hang_up_during_the_drain_leaves_it_awake_undrained_and_serving(server, http):
    # The hang-up cancels the sleep's handler while it waits for the stream: nothing has slept
    # yet, so nothing does (as at the deadline): the drain ends, the waiter it held is served by
    # the engine still awake, and no slot, waiter or drain callback is left behind.
    i = await ready_sleeper(server, "0.3")  # a stream of 3.6 s: the hang-up comes well before its end
    stream = asyncio.ensure_future(read_stream(http, server, i))
    await wait_for(lambda: server.controller.inflight(i) == 1, what="the stream in flight")
    late = None

    async def drained_with_a_waiter():
        nonlocal late
        await wait_for(lambda: server.controller.draining(i), what="the drain")
        late = asyncio.ensure_future(http.post(server.gw(i, "chat/completions"), json=PLAIN, headers=server.auth()))
        await wait_for(lambda: server.controller.waiting(i) == 1, what="the late request held by the drain")
    await hang_up_during(server, f"/deployments/{i}/sleep", b'{"level": 1, "drain_s": 60}', drained_with_a_waiter)
    await wait_for(lambda: not server.controller.draining(i), timeout=2, what="the drain ended by the hang-up")
    assert not stream.done() and server.controller.inflight(i) >= 1  # ended by the hang-up, not by a sleep
    assert not server.controller.record(i).drained  # its drained() callback went with it
    assert late is not None
    async with await late as r:  # held by the drain, then served: it was not held for 60 s
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"]
    data = await stream
    assert server.state(i) == "ready" and server.deployer.get(i).sleep_level is None
    sim = await sim_state(server, i)
    assert sim["sleeps"] == 0 and sim["level"] == 0, sim  # nothing slept: no sleep call reached the engine
    assert data.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in data  # never aborted
    await wait_for(lambda: server.controller.inflight(i) == 0, what="every slot given back")
    assert server.controller.waiting(i) == 0
    async with http.post(server.gw(i, "chat/completions"), json=PLAIN, headers=server.auth()) as r:
        assert r.status == 200  # new requests take slots at once
    assert server.controller.try_take(i) is not None  # not drained: a slot at once (given back below)
    server.controller.release(i)
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1})  # a later sleep drains anew
    assert status == 200 and view["state"] == "asleep", view
    assert not server.controller.draining(i) and server.controller.inflight(i) == 0


async def test_an_admin_hang_up_once_the_sleep_began_leaves_the_sleep_to_finish(server, http):
    # Past the drain, the sleep is marked and its engine call under way: the hang-up cancels the
    # request, not the sleep, which ends as it would have (its event, its measurement, the drain).
    _, view = await api(server, "POST", "/deployments", sleeper("a", "--sleep-delay", "1", "--host-mib", "300"))
    i = view["id"]
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready", view

    async def marked():
        await wait_for(lambda: server.state(i) == "asleep", what="the mark to asleep")
        assert server.deployer.unit(i).sleeping  # the engine's sleep call under way
    await hang_up_during(server, f"/deployments/{i}/sleep", b'{"level": 1}', marked)
    await wait_for(lambda: not server.deployer.unit(i).sleeping, timeout=5, what="the sleep call's end")
    await wait_for(lambda: server.deployer.get(i).host_gib is not None, what="the sleeper measured")
    assert server.state(i) == "asleep" and server.deployer.get(i).sleep_level == 1
    assert not server.controller.draining(i) and server.controller.inflight(i) == 0
    sim = await sim_state(server, i)
    assert sim["level"] == 1 and sim["sleeps"] == 1, sim
    async with http.post(server.gw(i, "chat/completions"), json=PLAIN, headers=server.auth()) as r:
        assert r.status == 200  # a request wakes it, as after any sleep
    assert server.state(i) == "ready"
