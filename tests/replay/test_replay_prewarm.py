"""The replay's world as adaptive warmth's effects (ondemand/replay/world.py: ``tiers``,
``prewarm``, a sleep at the plan's level) and the replay's ``adaptive`` policy: the same
controller in virtual time, a deployment called every half hour. Once its 20th gap is learned it
is stopped a minute after each request and started again before the next, which finds it ready;
its pre-warms and their hits are counted, also from a warm-up's end on."""
from __future__ import annotations

import random

import pytest
from test_replay_run import BOX, dep, req, run

from ondemand.control.keepwarm import rest_levels
from ondemand.model import Deployment, State
from ondemand.replay import report
from ondemand.replay.run import replay
from ondemand.replay.types import Policy

PERIOD = [req(k * 1800.0) for k in range(30)]  # a request every 30 minutes exactly, for 14.5 hours


def every_half_hour(n: int, model: str = "a", seed: int = 1) -> list:
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        out.append(req(at, model))
        at += 1800 + rng.uniform(-30, 30)
    return out


def test_a_learned_rhythm_stops_it_between_requests_and_starts_it_before_the_next():
    reqs = every_half_hour(40)
    fixed = run([dep(1, "a", 40)], reqs).total
    adaptive = run([dep(1, "a", 40, keep_warm="adaptive")], reqs).total
    # As fixed until its 20th gap: every request waits (a cold start, then wakes).
    assert fixed.waited["ready"] == 0 and fixed.waited["cold"] + fixed.waited["wake"] == 40
    # Then stopped soon after each request (less memory held), started before the next: ready.
    assert adaptive.waited["ready"] >= 40 - 21, adaptive.waited
    assert adaptive.stops >= 19 and adaptive.cold_starts >= 20
    assert adaptive.gpu_gib_seconds < fixed.gpu_gib_seconds


def test_the_levels_it_may_rest_at():
    d = Deployment(id=1, name="a", served_name="A", engine="vllm", model="m", state=State.READY, memory_gib=10)
    assert rest_levels(d, True, None, 16) == [1, 2]  # auto on discrete GPUs: level 1, or deeper
    assert rest_levels(d, True, 20.0, 16) == [2]  # a level-1 sleep would leave less than the reserve
    assert rest_levels(d.replace(idle_action="sleep2"), True, None, 16) == [2]
    assert rest_levels(d, False, None, 16) == []  # auto on one pool (unified memory): a stop
    assert rest_levels(d.replace(engine="sglang", idle_action="sleep"), True, None, 16) == [1]


def test_a_strict_period_learned_after_20_gaps_rests_between_calls_and_is_prewarmed_before_each():
    """The defaults' costs (cold 60 s, wake 3 s, sleep 2 s; 0.2 s of prefill, 2 s of decode),
    the reaper every 15 s, idle timeout 600 s, minimum 60 s.

    Request 0 starts it cold (TTFT 60.2 s); until its 20th gap it behaves as fixed: asleep at
    the reaper's step after 600 s idle, woken by each next request (TTFT 3.2 s, its end 5.2 s
    after its arrival: a gap of 1794.8 s; the first, 1800 - 62.2 = 1737.8 s). Request 20 brings
    the 20th gap. Its idle period's plan (from 36005.2 s): the gaps longer than the minimum, 60 s,
    are all; their 5th percentile 1737.8 + 0.95 x 57 = 1791.95 s, less 10 % of the way from 60 s:
    the head at 1618.755 s. A stop rests 1618.755 - 60 - 60 = 1498.755 s, over ten cold starts:
    stopped at the reaper's step after 60 s idle (36075 s), pre-warmed 1558.755 s after the idle
    period began (37563.955 s), ready 60 s later, and request 21 finds it ready (TTFT 0.2 s). So
    for every later request: 9 pre-warms, 9 hits."""
    r = run([dep(1, "a", 40)], PERIOD, "adaptive")
    t = r.total
    assert t.ttfts == pytest.approx([60.2] + [3.2] * 20 + [0.2] * 9)
    assert t.waited == {"ready": 9, "wake": 20, "cold": 1, "queue": 0}
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (10, 20, 20, 9)
    assert (t.prewarms, t.prewarm_hits) == (9, 9)
    assert r.per_deployment["a"].prewarm_hits == 9
    assert [(round(at, 3), gib) for at, _, _, gib in r.memory if 36000 <= at < 38000] == [
        (36000.0, 40.0), (36075.0, 0.0), (37563.955, 40.0), (37875.0, 0.0)]
    fixed = run([dep(1, "a", 40)], PERIOD, "fixed=600").total
    assert fixed.waited == {"ready": 0, "wake": 29, "cold": 1, "queue": 0} and fixed.prewarms == 0
    assert t.gpu_gib_seconds < fixed.gpu_gib_seconds


def test_a_warm_up_counts_from_its_end_a_prewarm_still_out_included():
    """Counted from 37799 s: requests 21 to 29, all ready. The pre-warm for request 21 began
    before (37563.955 s) and is still out: counted with the window's, so its hit is not alone;
    its cold start is not (it began before). Memory from 37799 s: 40 GiB until the stop after
    request 21 (37875 s), then each later period from its pre-warm to the stop after its request:
    a ready request ends 2.2 s after its arrival, where its idle period begins; with 21 gaps or
    more the head is the second smallest gap's, 60 + 0.9 x (1794.8 - 60) = 1621.32 s, so the
    pre-warm comes 2.2 + 1561.32 s after a request, and the stop 75 s after the next (the
    reaper's step after 60 s idle): 1800 + 75 - 1563.52 = 311.48 s held; the last period until
    the replay's end (52202.2 s)."""
    [r] = replay(PERIOD, [dep(1, "a", 40)], BOX, [Policy.parse("adaptive")], measure_from_s=37799)
    t = r.total
    assert (t.requests, t.waited) == (9, {"ready": 9, "wake": 0, "cold": 0, "queue": 0})
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops, t.prewarms, t.prewarm_hits) == (8, 0, 0, 8, 9, 9)
    assert t.gpu_gib_seconds == pytest.approx(40 * ((37875 - 37799) + 7 * 311.48 + (52202.2 - 50400 - 2.2 - 1561.32)))
    assert t.gpu_seconds == pytest.approx(t.gpu_gib_seconds / 40)


def test_adaptive_gives_the_same_bytes_for_the_same_inputs():
    reqs = every_half_hour(30) + [req(60.0 + 997.0 * i % 50000, "b") for i in range(40)]
    reqs.sort(key=lambda q: q.at_s)
    deps = [dep(1, "a", 40), dep(2, "b", 30)]
    policies = [Policy.parse("adaptive"), Policy.parse("fixed=300")]
    one, two = (report.json_bytes(report.to_json(replay(reqs, deps, BOX, policies, measure_from_s=9000), BOX, 70, 2))
                for _ in range(2))
    assert one == two
