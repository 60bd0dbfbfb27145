"""A sleep drains first (issue 29): ``POST /api/deployments/{id}/sleep`` gives no new slot,
waits for the requests in flight (at most ``drain_s``), then sleeps; requests that came
meanwhile wait and wake it. Still busy at the deadline: 409 ``deployment_busy`` and it serves
on; ``force`` sleeps at once, and the engine (the simulator, as vLLM) aborts what it runs."""
from __future__ import annotations

import asyncio

import pytest
from helpers import wait_for
from test_warmth_admin import api, sleeper

pytestmark = pytest.mark.server(reap_interval_s=3600, **{"budget.host_reserve_gib": 0})

STREAM = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 12}
PLAIN = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def ready_sleeper(server) -> int:
    _, view = await api(server, "POST", "/deployments", sleeper("a", "--token-delay", "0.1"))
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
    await wait_for(lambda: i in server.controller._drains, what="the drain")
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
    assert server.state(i) == "ready" and i not in server.controller._drains
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
