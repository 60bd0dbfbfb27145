"""Priorities and limits end to end: the whole ondemand on loopback with engine
simulators (process backend, a static 24 GiB budget), driven over HTTP
(BEHAVIOUR.md, "Priorities and limits"). The decisions themselves are tested
one by one in tests/control/test_queue.py and test_attempts.py.
"""
from __future__ import annotations

import asyncio

import orjson
import pytest
from helpers import wait_for

from ondemand import app as app_mod

# The reaper stays away (an hour): an idle model here is one that make-room may take.
pytestmark = pytest.mark.server(reap_interval_s=3600, ondemand_queue_timeout_s=30)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def idle_now(server, *dep_ids: int) -> None:
    """Idle for their full timeout (the clock is real: move their last use back)."""
    for dep_id in dep_ids:
        server.controller.record(dep_id).last_activity = 0.0


async def chat(http, server, dep_id: int, **kw):
    body = {"model": server.deployer.get(dep_id).served_name, **CHAT, **kw}
    async with http.post(server.gw(dep_id, "chat/completions"), json=body, headers=server.auth()) as r:
        return r.status, dict(r.headers), await r.read()


async def ready_and_idle(server, *dep_ids: int) -> None:
    for dep_id in dep_ids:
        await server.deployer.restart(dep_id)
    await server.app[app_mod.SAMPLER].sample_once()  # their engines' metrics say idle
    idle_now(server, *dep_ids)


async def audit(http, server) -> list[dict]:
    async with http.get(f"{server.url}/api/audit?limit=1000", headers=server.admin_headers()) as r:
        return await r.json()


@pytest.mark.server(ondemand_queue_timeout_s=2)
async def test_a_normal_request_never_stops_a_high_idle_model_it_times_out(server, http):
    high = await server.add("high", 16, priority="high")
    normal = await server.add("normal", 16)
    await ready_and_idle(server, high)
    status, _, body = await chat(http, server, normal)
    assert status == 503 and orjson.loads(body)["error"]["code"] == "ondemand_queue_timeout"
    assert server.state(high) == "ready" and server.state(normal) == "stopped"
    assert not [a for a in await audit(http, server) if a["action"] == "ondemand_sleep"]


async def test_a_high_request_stops_a_normal_idle_one(server, http):
    normal = await server.add("normal", 16)
    high = await server.add("high", 16, priority="high")
    await ready_and_idle(server, normal)
    status, _, body = await chat(http, server, high)
    assert status == 200, body
    assert server.state(normal) == "stopped" and server.state(high) == "ready"
    [sleep] = [a for a in await audit(http, server) if a["action"] == "ondemand_sleep"]
    assert sleep["deployment_id"] == normal and sleep["text"] == "Put to sleep to make room for HIGH"


@pytest.mark.server(ondemand_queue_timeout_s=6)
async def test_low_and_high_queued_behind_a_busy_model_the_high_one_starts_first(server, http):
    busy = await server.add("busy", 16)
    low = await server.add("low", 16, priority="low")
    high = await server.add("high", 16, priority="high")
    await server.deployer.restart(busy)
    slot = await server.admission.acquire(busy)  # busy: nothing can be stopped for now
    low_req = asyncio.ensure_future(chat(http, server, low))
    await wait_for(lambda: server.controller.queue.ids() == [low], what="the low request to queue")
    high_req = asyncio.ensure_future(chat(http, server, high))
    await wait_for(lambda: server.controller.queue.ids() == [high, low], what="the high one to take the head")
    assert server.controller.status(high)["queue_position"] == 1
    assert server.controller.status(low)["queue_position"] == 2
    slot.release()
    await server.app[app_mod.SAMPLER].sample_once()
    idle_now(server, busy)
    server.controller.tick()  # (the queue's next look, without waiting for its timer)
    status, _, body = await high_req
    assert status == 200, body
    # The low one may not stop the high one: it waits, and times out.
    status, _, body = await low_req
    assert status == 503 and orjson.loads(body)["error"]["code"] == "ondemand_queue_timeout"
    starts = [a["deployment_id"] for a in reversed(await audit(http, server)) if a["action"] == "ondemand_start"]
    assert starts == [high]
    assert server.state(low) == "stopped" and server.state(busy) == "stopped"


@pytest.mark.server(ondemand_queue_timeout_s=6)
async def test_memory_a_sleep_frees_for_the_high_head_is_not_taken_by_the_normal_entry_behind_it(server, http):
    """The budget counts nothing measured (static): a victim marked asleep counted only its
    residue while its sleep's call (1 s) was still out, so the normal entry queued behind the
    high head started in that memory, and the high request waited for it to idle out."""
    small = await server.add("small", 10, "--sleep-delay", "1", idle_action="sleep")
    normal = await server.add("normal", 16)
    high = await server.add("high", 16, priority="high")
    await server.deployer.restart(small)
    slot = await server.admission.acquire(small)  # busy: nothing can be put away for now
    normal_req = asyncio.ensure_future(chat(http, server, normal))
    await wait_for(lambda: server.controller.queue.ids() == [normal], what="the normal request to queue")
    high_req = asyncio.ensure_future(chat(http, server, high))
    await wait_for(lambda: server.controller.queue.ids() == [high, normal], what="the high one to take the head")
    slot.release()
    await server.app[app_mod.SAMPLER].sample_once()
    idle_now(server, small)
    server.controller.tick()  # make-room for the head: small is put to sleep
    status, _, body = await high_req
    assert status == 200, body
    status, _, body = await normal_req  # it may not put the high one away: it times out
    assert status == 503 and orjson.loads(body)["error"]["code"] == "ondemand_queue_timeout"
    starts = [a["deployment_id"] for a in reversed(await audit(http, server)) if a["action"] == "ondemand_start"]
    assert starts == [high]


async def test_over_the_limit_is_429_at_once_and_200_again_after(server, http):
    dep = await server.add("lim", 10, max_inflight=1)
    await server.deployer.restart(dep)
    slot = await server.admission.acquire(dep)  # the one request it may serve at once
    status, headers, body = await chat(http, server, dep)
    err = orjson.loads(body)["error"]
    assert status == 429 and err["code"] == "ondemand_busy" and err["type"] == "rate_limit_error"
    assert headers["Retry-After"] == "1" and headers["x-should-retry"] == "true"
    assert server.controller.waiting() == 0 and server.controller.backoff_left(dep) == 0
    # A health check is no request of the limit's: answered, and counts nothing.
    async with http.post(server.gw(dep, "chat/completions"), json={"model": "LIM", **CHAT},
                         headers={**server.auth(), "x-dgxmm-health-check": "1"}) as r:
        assert r.status == 200
    assert server.controller.inflight(dep) == 1
    slot.release()
    status, _, body = await chat(http, server, dep)
    assert status == 200, body
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers()) as r:
        text = await r.text()
    assert 'ondemand_busy_total{deployment="lim"} 1.0' in text
    assert 'ondemand_rate_limited_total 0.0' in text  # a 429 of the limit is no failed-key lockout
    assert 'ondemand_queued{deployment="lim",priority="normal"} 0.0' in text


async def test_the_limit_can_change_while_the_model_runs(server, http):
    dep = await server.add("lim", 10, max_inflight=1)
    await server.deployer.restart(dep)
    slot = await server.admission.acquire(dep)
    async with http.patch(f"{server.url}/api/deployments/{dep}", json={"max_inflight": 2, "priority": "high"},
                          headers=server.admin_headers()) as r:
        view = await r.json()
        assert r.status == 200, view
    assert view["max_inflight"] == 2 and view["priority"] == "high" and view["state"] == "ready"
    status, _, body = await chat(http, server, dep)
    assert status == 200, body
    async with http.patch(f"{server.url}/api/deployments/{dep}", json={"max_inflight": 0},
                          headers=server.admin_headers()) as r:
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "invalid_field" and err["message"].startswith("max_inflight:")
    async with http.patch(f"{server.url}/api/deployments/{dep}", json={"memory_gib": 11, "max_inflight": 3},
                          headers=server.admin_headers()) as r:
        assert r.status == 409  # anything else still needs it stopped
    slot.release()


async def test_the_notice_names_the_place_in_the_queue(server, http):
    busy = await server.add("busy", 16)
    first = await server.add("first", 16)
    second = await server.add("second", 16)
    await server.deployer.restart(busy)
    slot = await server.admission.acquire(busy)
    try:
        body = {"model": "FIRST", **CHAT, "stream": True}
        async with http.post(server.gw(first, "chat/completions"), json=body, headers=server.auth()) as r1:
            c1 = orjson.loads((await r1.content.readuntil(b"\n\n"))[6:])
            body = {"model": "SECOND", **CHAT, "stream": True}
            async with http.post(server.gw(second, "chat/completions"), json=body, headers=server.auth()) as r2:
                c2 = orjson.loads((await r2.content.readuntil(b"\n\n"))[6:])
                assert c1["choices"][0]["delta"]["content"].startswith(
                    "[ondemand] FIRST is waiting for GPU memory (place 1 of 1);")
                assert c2["choices"][0]["delta"]["content"].startswith(
                    "[ondemand] SECOND is waiting for GPU memory (place 2 of 2);")
                async with http.get(f"{server.url}/api/deployments", headers=server.admin_headers()) as r:
                    views = {v["id"]: v["ondemand"] for v in await r.json()}
                assert [views[i]["queue_position"] for i in (first, second, busy)] == [1, 2, None]
                r2.close()
            r1.close()
    finally:
        slot.release()


async def test_the_dashboard_reads_metrics_that_exist(server, http):
    """Every series the Grafana dashboard queries (its priority and busy panels among them)
    is one ondemand exposes."""
    import json
    import re

    from helpers import ROOT
    board = json.loads((ROOT / "packaging" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    wanted = {m for e in exprs for m in re.findall(r"\bondemand_[a-z_]+", e)}
    assert {"ondemand_busy_total", "ondemand_queued"} <= wanted
    assert any("by (priority)" in e for e in exprs)
    await server.add("m", 4)
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers()) as r:
        text = await r.text()
    exposed = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    names = {n for n, _ in exposed} | {f"{n}_{s}" for n, t in exposed if t == "histogram"
                                         for s in ("bucket", "sum", "count")} \
        | {f"{n}_total" for n, t in exposed if t == "counter"}
    assert wanted <= names, wanted - names
