"""GET {base_path}/metrics against a real ondemand on loopback with the engine simulator
behind it: what a scripted scenario leaves in it, who may read it, and GPU memory."""
import asyncio

import aiohttp
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

from ondemand import app as app_mod
from ondemand.admin.telemetry import START_BUCKETS

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hello"}]}


def chat(model: str) -> dict:
    return {**CHAT, "model": model}


GIB = 1024 ** 3


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value}; raises unless the text is valid exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(server, http, **kw) -> dict:
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers(), **kw) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(await r.text())


# The reaper only when the test calls it: an idle stop and a make-room stop must not race.
@pytest.mark.server(reap_interval_s=3600)
async def test_the_metrics_are_what_happened(server, http):
    big = await server.add("big", 15, "--startup-delay", "0.3")
    x = await server.add("x", 12)  # does not fit beside big (24 GiB)
    n = 3
    # A cold start, and n requests in all to big.
    for _ in range(n):
        async with http.post(server.gw(big, "chat/completions"), json=chat("BIG"), headers=server.auth()) as r:
            assert r.status == 200
    # A 401, and a health check answered here.
    async with http.post(server.gw(big, "chat/completions"), json=CHAT) as r:
        assert r.status == 401
    async with http.post(server.gw(x, "chat/completions"), json=CHAT,
                         headers={**server.auth(), "x-dgxmm-health-check": "1"}) as r:
        assert r.status == 200
    # A request for x queues for memory while big is busy, then big is stopped to make room.
    slot = await server.admission.acquire(big)
    queued = asyncio.ensure_future(http.post(server.gw(x, "chat/completions"), json=chat("X"),
                                             headers=server.auth()))
    await wait_for(lambda: server.controller.status(x)["queued"] == 1)
    during = await scrape(server, http)
    assert v(during, "ondemand_queued", deployment="x", priority="normal") == 1
    assert v(during, "ondemand_inflight", deployment="big") == 1
    slot.release()
    server.controller.record(big).last_activity = 0  # idle for its full timeout
    await server.app[app_mod.SAMPLER].sample_once()
    server.controller.tick()
    async with await queued as r:
        assert r.status == 200
    assert server.state(big) == "stopped" and server.state(x) == "ready"
    # x idles out: the reaper's step, by hand.
    server.controller.record(x).last_activity = 0
    await server.app[app_mod.SAMPLER].sample_once()
    assert server.controller.reap() == [x]
    await wait_for(lambda: server.state(x) == "stopped")

    m = await scrape(server, http)
    assert v(m, "ondemand_requests_total", deployment="big", code="200") == n
    assert v(m, "ondemand_requests_total", deployment="", code="401") == 1  # no deployment named before the key
    assert v(m, "ondemand_requests_total", deployment="x", code="200") == 2  # the health check and the queued one
    assert sum(val for (name, _), val in m.items() if name == "ondemand_requests_total") == n + 3
    assert v(m, "ondemand_request_duration_seconds_count", deployment="big") == n
    assert v(m, "ondemand_request_duration_seconds_bucket", deployment="big", le="+Inf") == n
    # Two waited: the cold start's first request, and the queued one.
    assert v(m, "ondemand_queue_wait_seconds_count", deployment="big") == 1
    assert v(m, "ondemand_queue_wait_seconds_count", deployment="x") == 1
    assert v(m, "ondemand_queue_wait_seconds_sum", deployment="big") >= 0.3  # the simulator's start-up delay
    assert v(m, "ondemand_auth_failures_total") == 1 and v(m, "ondemand_rate_limited_total") == 0
    assert v(m, "ondemand_health_checks_total", deployment="x") == 1
    assert v(m, "ondemand_starts_total", deployment="big", result="ready") == 1
    assert v(m, "ondemand_starts_total", deployment="x", result="ready") == 1
    assert v(m, "ondemand_start_duration_seconds_count", deployment="big") == 1
    assert 0.3 <= v(m, "ondemand_start_duration_seconds_sum", deployment="big") < 20
    # The start falls in the first bucket at or above its duration (about 0.3 s of delay, plus the
    # simulator's own start: over 1 s on 2 busy cores), and in none below it.
    took = v(m, "ondemand_start_duration_seconds_sum", deployment="big")
    first = min(le for le in START_BUCKETS if le >= took)
    assert v(m, "ondemand_start_duration_seconds_bucket", deployment="big", le=repr(first)) == 1
    below = [le for le in START_BUCKETS if le < first]
    assert not below or v(m, "ondemand_start_duration_seconds_bucket", deployment="big", le=repr(below[-1])) == 0
    stops = {dict(labels)["deployment"] + "/" + dict(labels)["reason"]: val
             for (name, labels), val in m.items() if name == "ondemand_stops_total"}
    assert stops == {"big/make_room": 1, "x/idle": 1}
    for dep in ("big", "x"):
        assert v(m, "ondemand_inflight", deployment=dep) == 0
        assert v(m, "ondemand_queued", deployment=dep, priority="normal") == 0 and v(m, "ondemand_busy_total", deployment=dep) == 0
        states = {dict(labels)["state"]: val for (name, labels), val in m.items()
                  if name == "ondemand_deployment_state" and dict(labels)["deployment"] == dep}
        assert len(states) == 7 and states["stopped"] == 1 and sum(states.values()) == 1
    assert v(m, "ondemand_gpu_memory_capacity_bytes", gpu="0") == 24 * GIB
    assert v(m, "ondemand_gpu_memory_free_bytes", gpu="0") <= 24 * GIB
    assert not any(name.endswith("_created") for name, _ in m)
    assert v(m, "ondemand_litellm_syncs_total", result="ok") == 0  # LiteLLM is not configured here


async def test_metrics_need_the_admin_token_over_tcp_and_nothing_on_the_socket(server, http):
    async with http.get(f"{server.url}/metrics") as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_admin_token"
    async with http.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.key}"}) as r:
        assert r.status == 401  # the on-demand key never opens it
    m = await scrape(server, http)
    assert v(m, "ondemand_auth_failures_total") == 2
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(server.cfg.admin_socket))) as s:
        async with s.get(f"http://localhost{server.cfg.base_path}/metrics") as r:
            assert r.status == 200
            parse(await r.text())


@pytest.mark.server(metrics_public=True)
async def test_metrics_public_needs_no_token_and_the_api_still_does(server, http):
    async with http.get(f"{server.url}/metrics") as r:
        assert r.status == 200
        assert ("ondemand_auth_failures_total", ()) in parse(await r.text())
    async with http.get(f"{server.url}/api/host") as r:
        assert r.status == 401


@pytest.mark.server(**{"budget.source": "nvidia-smi", "budget.nvidia_smi": "/nonexistent/nvidia-smi"})
async def test_an_unreadable_budget_leaves_out_the_gpu_samples_only(server, http):
    await asyncio.sleep(0.1)  # the start-up's reading has failed by now
    m = await scrape(server, http)
    assert not any(name.startswith("ondemand_gpu_") for name, _ in m)
    assert ("ondemand_auth_failures_total", ()) in m  # the rest is there


def test_a_failing_gpu_memory_leaves_the_scrape_whole():
    from ondemand.admin.telemetry import Telemetry

    def broken():
        raise RuntimeError("no budget")
    t = Telemetry(deployments=list, inflight=lambda i: 0, queued=lambda i: 0, gpu_memory=broken)
    m = parse(t.exposition().decode())
    assert not any(name.startswith("ondemand_gpu_") for name, _ in m) and ("ondemand_rate_limited_total", ()) in m


def test_a_failed_wakes_cold_start_is_timed_from_its_own_beginning():
    """A failed wake ends (its StartEnded, and its Woken), then the cold start after it begins in
    the same starting: its duration is from its own beginning, which the deployer's StartEnded
    says (tests/engines/test_start.py), not from the wake's; the wake is no start. A start taken back
    after ondemand's restart is counted, not timed (part of it ran before these metrics)."""
    from ondemand.admin.telemetry import Telemetry
    from ondemand.events import StartEnded, Woken

    t = Telemetry(deployments=list, inflight=lambda i: 0, queued=lambda i: 0, gpu_memory=lambda: [])

    def ended(kind: str, result: str, duration_s: float, taken_back: bool = False) -> StartEnded:
        return StartEnded(1, "a", kind, 1 if kind == "wake" else None, duration_s, result, 0.0, taken_back, None)
    t.on_woken(Woken(1, "a", "failed", 30.0))
    t.on_start_ended(ended("wake", "failed", 50.0))  # the wake, its engine's stop included
    t.on_start_ended(ended("cold", "ready", 10.0))
    m = parse(t.exposition().decode())
    assert m[("ondemand_start_duration_seconds_count", (("deployment", "a"),))] == 1
    assert m[("ondemand_start_duration_seconds_sum", (("deployment", "a"),))] == 10.0
    assert m[("ondemand_starts_total", (("deployment", "a"), ("result", "ready")))] == 1
    assert ("ondemand_starts_total", (("deployment", "a"), ("result", "failed"))) not in m  # the wake is none
    assert m[("ondemand_wakes_total", (("deployment", "a"), ("result", "failed")))] == 1
    t.on_start_ended(ended("cold", "ready", 99.0, taken_back=True))
    t.on_start_ended(ended("cold", "stopped", 5.0))  # interrupted: neither counted nor timed
    m = parse(t.exposition().decode())
    assert m[("ondemand_starts_total", (("deployment", "a"), ("result", "ready")))] == 2
    assert m[("ondemand_start_duration_seconds_count", (("deployment", "a"),))] == 1
