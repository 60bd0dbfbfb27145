"""Tiered warmth in GET {base_path}/metrics (issue 22): the deployer's Slept and Woken events
on the app's real bus reach the telemetry, and a scrape of the real /metrics text shows
``ondemand_sleeps_total``, ``ondemand_wakes_total``, ``ondemand_wake_duration_seconds`` and
``ondemand_host_memory_asleep_bytes``. A sleep is no stop (``ondemand_stops_total`` does not
move for it); a stop of an asleep engine is one. Then real sleeps and wakes of engine
simulators, and the Grafana dashboard's panels for them."""
from __future__ import annotations

import json
import re

import pytest
from helpers import FAKES, ROOT, wait_for
from test_telemetry import GIB, scrape, v

from ondemand import app as app_mod
from ondemand.admin.telemetry import WAKE_BUCKETS
from ondemand.events import Slept, StopCause, Woken

pytestmark = pytest.mark.server(reap_interval_s=3600, **{"budget.host_reserve_gib": 0,
                                                         "budget.meminfo_path": str(FAKES / "meminfo")})


def series(m: dict, name: str) -> dict[tuple, float]:
    """{sorted labels: value} of one sample name."""
    return {labels: val for (n, labels), val in m.items() if n == name}


async def exposition(server, http) -> str:
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers()) as r:
        assert r.status == 200
        return await r.text()


async def test_slept_and_woken_events_are_counted_and_timed(server, http):
    bus = server.app[app_mod.BUS]
    a = await server.add("a", 4)
    b = await server.add("b", 4)
    bus.publish(Slept(a, "a", 1, StopCause.IDLE, 1.0))
    bus.publish(Slept(a, "a", 1, StopCause.IDLE, 1.0))
    bus.publish(Slept(a, "a", 2, StopCause.MAKE_ROOM, 1.0))
    bus.publish(Slept(b, "b", 1, StopCause.ADMIN, 1.0))
    bus.publish(Woken(a, "a", "ready", 0.08))
    bus.publish(Woken(a, "a", "ready", 3.0))
    bus.publish(Woken(a, "a", "failed", 300.0))
    bus.publish(Woken(b, "b", "mismatch", 1.5))

    text = await exposition(server, http)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    assert types["ondemand_sleeps_total"] == "counter" and types["ondemand_wakes_total"] == "counter"
    assert types["ondemand_wake_duration_seconds"] == "histogram"
    assert types["ondemand_host_memory_asleep_bytes"] == "gauge"
    m = await scrape(server, http)
    assert series(m, "ondemand_sleeps_total") == {
        (("deployment", "a"), ("level", "1"), ("reason", "idle")): 2,
        (("deployment", "a"), ("level", "2"), ("reason", "make_room")): 1,
        (("deployment", "b"), ("level", "1"), ("reason", "admin")): 1}
    assert series(m, "ondemand_wakes_total") == {
        (("deployment", "a"), ("result", "ready")): 2, (("deployment", "a"), ("result", "failed")): 1,
        (("deployment", "b"), ("result", "mismatch")): 1}
    # Only the wakes that ended ready are timed: a's two (0.08 s and 3 s), none of b's.
    assert v(m, "ondemand_wake_duration_seconds_count", deployment="a") == 2
    assert v(m, "ondemand_wake_duration_seconds_sum", deployment="a") == pytest.approx(3.08)
    buckets = {dict(labels)["le"]: val for labels, val in series(m, "ondemand_wake_duration_seconds_bucket").items()
               if dict(labels)["deployment"] == "a"}
    assert buckets == {**{repr(float(le)): (0 if le < 0.08 else 1 if le < 3.0 else 2) for le in WAKE_BUCKETS},
                       "+Inf": 2}
    assert WAKE_BUCKETS[0] == 0.05 and WAKE_BUCKETS[-1] == 120.0
    assert ("ondemand_wake_duration_seconds_count", (("deployment", "b"),)) not in m
    # A sleep is no stop; these events change no state either.
    assert series(m, "ondemand_stops_total") == {}
    assert v(m, "ondemand_host_memory_asleep_bytes") == 0  # nothing is asleep in the deployer
    assert not any(name.endswith("_created") for name, _ in m)


async def test_the_host_memory_gauge_sums_what_the_asleep_engines_hold(server, http):
    """Read at scrape time from the deployments: asleep ones count their ``host_gib``; a
    deployment holding host memory in another state (the row mid-wake) does not."""
    a = await server.add("a", 4)
    b = await server.add("b", 4)
    c = await server.add("c", 4)
    deployer = server.deployer
    deployer.amend(a, state="asleep", sleep_level=1, host_gib=1.5)
    deployer.amend(b, state="asleep", sleep_level=2, host_gib=0.25)
    deployer.amend(c, state="starting", sleep_level=1, host_gib=7.0)  # waking: no longer asleep
    m = await scrape(server, http)
    assert v(m, "ondemand_host_memory_asleep_bytes") == 1.75 * GIB
    assert v(m, "ondemand_deployment_state", deployment="a", state="asleep") == 1
    deployer.amend(b, host_gib=None)  # not measured: nothing known, counted as nothing
    m = await scrape(server, http)
    assert v(m, "ondemand_host_memory_asleep_bytes") == 1.5 * GIB
    for dep_id in (a, b, c):
        deployer.amend(dep_id, state="stopped", sleep_level=None, host_gib=None)


async def test_a_real_sleep_is_no_stop_and_the_stop_of_an_asleep_engine_is(server, http):
    """An engine simulator put to sleep (by an administrator, at level 1 then 2), woken by a
    request, stopped asleep (the reaper's cause); another whose wake answers garbage."""
    deployer = server.deployer
    a = await server.add("a", 2, "--host-mib", "32", idle_action="sleep")
    await deployer.restart(a)
    assert await deployer.sleep(a, 1) == 1
    dep = await wait_for(lambda: (d := deployer.get(a)).host_gib and d, what="the sleep's measurement")
    m = await scrape(server, http)
    assert series(m, "ondemand_sleeps_total") == {(("deployment", "a"), ("level", "1"), ("reason", "admin")): 1}
    assert series(m, "ondemand_stops_total") == {}  # the change to asleep (no cause) is no stop
    assert v(m, "ondemand_deployment_state", deployment="a", state="asleep") == 1
    assert v(m, "ondemand_host_memory_asleep_bytes") == pytest.approx(dep.host_gib * GIB)
    assert v(m, "ondemand_host_memory_asleep_bytes") > 32 * 1024 ** 2  # the weights' host copy, and the process

    # A request wakes it: one wake, ready, timed; starts count cold starts only (issue 29).
    async with http.post(server.gw(a, "chat/completions"), headers=server.auth(),
                         json={"model": "A", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
    m = await scrape(server, http)
    assert series(m, "ondemand_wakes_total") == {(("deployment", "a"), ("result", "ready")): 1}
    assert v(m, "ondemand_wake_duration_seconds_count", deployment="a") == 1
    assert 0 < v(m, "ondemand_wake_duration_seconds_sum", deployment="a") < 10
    assert v(m, "ondemand_starts_total", deployment="a", result="ready") == 1
    assert v(m, "ondemand_start_duration_seconds_count", deployment="a") == 1
    assert v(m, "ondemand_host_memory_asleep_bytes") == 0 and series(m, "ondemand_stops_total") == {}

    # Asleep at level 2, then stopped asleep as the reaper stops an idle sleeper: that is a stop.
    assert await deployer.sleep(a, 2) == 2
    assert await deployer.stop(a, actor="reaper", cause=StopCause.IDLE)
    assert server.state(a) == "stopped"
    m = await scrape(server, http)
    assert v(m, "ondemand_sleeps_total", deployment="a", level="2", reason="admin") == 1
    assert series(m, "ondemand_stops_total") == {(("deployment", "a"), ("reason", "idle")): 1}
    assert v(m, "ondemand_host_memory_asleep_bytes") == 0

    # A wake whose check answers otherwise: mismatch, not timed; the cold start after it is a start.
    b = await server.add("b", 2, "--fail", "wake-garbage", idle_action="sleep")
    await deployer.restart(b)
    assert await deployer.sleep(b, 1) == 1
    await deployer.restart(b)  # an administrator's wake: it fails the check and starts cold
    assert server.state(b) == "ready"
    m = await scrape(server, http)
    assert series(m, "ondemand_wakes_total") == {(("deployment", "a"), ("result", "ready")): 1,
                                                 (("deployment", "b"), ("result", "mismatch")): 1}
    assert ("ondemand_wake_duration_seconds_count", (("deployment", "b"),)) not in m
    assert v(m, "ondemand_sleeps_total", deployment="b", level="1", reason="admin") == 1
    assert v(m, "ondemand_stops_total", deployment="b", reason="admin") == 0  # the failed wake's stop is none
    # The cold start after the failed wake is a start (its first, and its second: two in all).
    assert v(m, "ondemand_starts_total", deployment="b", result="ready") == 2
    assert v(m, "ondemand_start_duration_seconds_count", deployment="b") == 2


async def test_the_app_subscribes_the_telemetry_to_sleeps_and_wakes(server, http):
    """app.py subscribes the telemetry to Slept and Woken (``_observe``): an event on the app's
    own bus is in the next scrape."""
    a = await server.add("a", 4)
    bus = server.app[app_mod.BUS]
    bus.publish(Slept(a, "a", 1, StopCause.IDLE, 1.0))
    bus.publish(Woken(a, "a", "ready", 0.5))
    m = await scrape(server, http)
    assert v(m, "ondemand_sleeps_total", deployment="a", level="1", reason="idle") == 1
    assert v(m, "ondemand_wakes_total", deployment="a", result="ready") == 1


def panels() -> list[dict]:
    board = json.loads((ROOT / "packaging" / "grafana-dashboard.json").read_text())
    return board["panels"]


async def test_the_dashboard_plots_sleeps_wakes_and_host_memory(server, http):
    exprs = {p["title"]: [t["expr"] for t in p.get("targets", ())] for p in panels()}
    joined = "\n".join(e for es in exprs.values() for e in es)
    assert "sum by (deployment, level) (rate(ondemand_sleeps_total[$__rate_interval]))" in joined
    assert "sum by (deployment, result) (rate(ondemand_wakes_total[$__rate_interval]))" in joined
    for q in ("0.5", "0.95"):
        assert (f"histogram_quantile({q}, sum by (le, deployment) "
                "(rate(ondemand_wake_duration_seconds_bucket[1h])))") in joined  # wakes are rare: an hour's
    assert "ondemand_host_memory_asleep_bytes" in joined
    assert 'ondemand_deployment_state{state="asleep"}' in joined
    # Every series the dashboard reads is exposed (with nothing asleep yet: the names are there).
    wanted = set(re.findall(r"\bondemand_[a-z_]+", joined))
    await server.add("m", 4)
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)", await exposition(server, http), re.M))
    names = set(exposed) | {f"{n}_{s}" for n, t in exposed.items() if t == "histogram"
                            for s in ("bucket", "sum", "count")} \
        | {f"{n}_total" for n, t in exposed.items() if t == "counter"}
    assert wanted <= names, wanted - names


def test_the_dashboard_is_whole():
    """Valid JSON (read above), one id per panel, and no two panels over each other."""
    ps = panels()
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in ps:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[x, y] = p["title"]
