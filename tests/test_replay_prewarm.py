"""The replay's world as adaptive warmth's effects (ondemand/replay/world.py: ``tiers``,
``prewarm``, a sleep at the plan's level): the same controller in virtual time, a deployment with
keep_warm adaptive called about every half hour. Once its 20th gap is learned it is stopped a
minute after each request and started again before the next, which finds it ready."""
from __future__ import annotations

import random

from test_replay_run import dep, req, run

from ondemand.control.keepwarm import rest_levels
from ondemand.model import Deployment, State


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
