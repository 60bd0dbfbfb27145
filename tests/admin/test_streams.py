"""ondemand/admin/streams.py: the answers that stream, read from the whole ondemand on loopback
with the engine simulator behind it: the views' Server-Sent Events (a burst of changes folded
into at most one event a second) and an engine's log (its tail and its errors, a follow that
lasts until the engine stops, and a follower that hangs up leaving no task behind)."""
import asyncio

import aiohttp
import orjson
from helpers import sim_command, two_pools, wait_for
from test_admin import api, new_dep


async def test_events_stream_views_and_folds_counters(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    i = v["id"]
    await server.deployer.restart(i)
    got = []

    async def reader():
        async with two_pools() as s:
            async with s.get(f"{server.url}/api/events", headers=server.admin_headers()) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(orjson.loads(line[6:]))
    task = asyncio.ensure_future(reader())
    await wait_for(lambda: got, what="initial views")
    got.clear()
    slots = [await server.admission.acquire(i) for _ in range(10)]
    for s in slots:
        s.release()
    # the last of the folded changes arrives (the burst is held back, at most one event a second)
    await wait_for(lambda: any(e.get("id") == i and e.get("ondemand", {}).get("inflight") == 0 for e in got),
                   timeout=5, what="the event with the counters back at 0")
    task.cancel()
    counters = [e for e in got if e.get("id") == i]
    assert 1 <= len(counters) <= 2  # twenty changes, at most one event a second
    assert counters[0]["ondemand"]["inflight"] >= 1 and counters[-1]["ondemand"]["inflight"] == 0



async def _logs(server, dep_id, query=""):
    async with two_pools() as s, \
            s.get(f"{server.url}/api/deployments/{dep_id}/logs{query}", headers=server.admin_headers()) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()



async def test_logs_route_tail_and_its_errors(server):
    status, body = await api(server, "POST", "/deployments", new_dep("lg"))
    dep_id = body["id"]
    assert await _logs(server, dep_id) == (200, "text/plain; charset=utf-8", b"")  # never ran: empty
    status, _, raw = await _logs(server, 999)
    assert status == 404 and orjson.loads(raw)["error"]["code"] == "not_found"
    for bad in ("?tail=-1", "?tail=x", "?tail=10001", "?follow=2"):
        status, _, raw = await _logs(server, dep_id, bad)
        assert status == 400 and orjson.loads(raw)["error"]["code"] == "invalid_field", bad
        assert orjson.loads(raw)["error"]["message"].startswith(bad[1:].split("=")[0])
    assert (await api(server, "POST", f"/deployments/{dep_id}/start?wait=1"))[0] == 200
    status, _, raw = await _logs(server, dep_id, "?tail=1")
    assert status == 200 and b"serving lg" in raw and raw.count(b"\n") == 1
    status, _, raw = await _logs(server, dep_id, "?tail=0&follow=0")
    assert (status, raw) == (200, b"")
    # Over the socket too, as the command line reads it.
    conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
    async with aiohttp.ClientSession(connector=conn) as s, \
            s.get(f"http://ondemand{server.cfg.base_path}/api/deployments/{dep_id}/logs?tail=5") as r:
        assert r.status == 200 and b"serving lg" in await r.read()



async def test_logs_follow_a_start_live_until_the_engine_stops(server):
    status, body = await api(server, "POST", "/deployments", new_dep("fl", command=sim_command(
        "FL", "--startup-delay", "30")))
    dep_id = body["id"]
    assert (await api(server, "POST", f"/deployments/{dep_id}/start"))[0] == 200
    got = b""
    # tail=10, not 0: on a loaded machine the engine may print its first line before the follow
    # is open, and a follow that missed it waited for the start's timeout (then, the stream ended,
    # read b"" for ever: a hang; now an assertion says so).
    async with two_pools() as s, s.get(f"{server.url}/api/deployments/{dep_id}/logs?follow=1&tail=10",
                                                   headers=server.admin_headers()) as r:
        assert r.status == 200
        while b"serving FL" not in got:
            chunk = await asyncio.wait_for(r.content.readany(), 20)
            assert chunk, f"the log stream ended before the engine's line: {got!r}"
            got += chunk
        assert server.state(dep_id) == "starting"  # followed while it starts
        assert (await api(server, "POST", f"/deployments/{dep_id}/stop"))[0] == 200
        got += await asyncio.wait_for(r.content.read(), 20)  # the answer ends with the engine's log
    assert b"serving FL" in got



async def test_a_follower_that_hangs_up_leaves_nothing_behind(server):
    status, body = await api(server, "POST", "/deployments", new_dep("hu"))
    dep_id = body["id"]
    assert (await api(server, "POST", f"/deployments/{dep_id}/start?wait=1"))[0] == 200
    backend = server.deployer.backend
    before = {t.get_name() for t in asyncio.all_tasks()}
    async with two_pools() as s:
        r = await s.get(f"{server.url}/api/deployments/{dep_id}/logs?follow=1", headers=server.admin_headers())
        assert b"serving hu" in await asyncio.wait_for(r.content.readany(), 10)
        assert backend.followers("hu") == 1
        r.close()  # hang up while the engine runs on
    await wait_for(lambda: backend.followers("hu") == 0, what="the follower gone with its client")
    await wait_for(lambda: {t.get_name() for t in asyncio.all_tasks()} <= before, what="no task left")
    assert server.state(dep_id) == "ready"
