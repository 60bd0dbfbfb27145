"""The clairvoyant reference's warmth (ondemand/replay/foresight.py) under a floor,
``clairvoyant=S``: no rest before S seconds idle, then the reference's own rule. The costs are
test_replay_run.py's defaults (test_replay_clairvoyant.py's doc): a cold start 60 s, a level-1
wake 3 s, a sleep 2 s; a request is 0.2 s of prefill and 2 s of decode."""
from __future__ import annotations

import pytest
from test_replay_clairvoyant import STOPS, a_day, memory
from test_replay_run import dep, req, run


def test_with_a_floor_it_rests_no_sooner_than_the_floor_then_by_the_same_rule():
    """``clairvoyant=60``: requests at 0 and 1000 s. Idle from 62.2 s, it rests at 122.2 s (not at
    once, as ``clairvoyant`` does), its sleep's call ending at 124.2 s, and is woken in time; a
    request at 100 s moves the floor (rest at 162.2 s, the first floor's look finding none due);
    one at 125 s, 2.8 s after the floor (a sleep and a wake take 5 s), keeps it awake; an engine
    that cannot sleep is stopped at its floor."""
    far = run([dep(1, "a", 40)], [req(0), req(1000)], "clairvoyant=60")
    assert far.total.waits == pytest.approx([60.0, 0.0])
    assert memory(far) == [(0.0, 0, "a", 40.0), (124.2, 0, "a", 2.0), (997.0, 0, "a", 40.0)]
    moved = run([dep(1, "a", 40)], [req(0), req(100), req(1000)], "clairvoyant=60")
    assert memory(moved) == [(0.0, 0, "a", 40.0), (164.2, 0, "a", 2.0), (997.0, 0, "a", 40.0)]
    assert moved.total.sleeps == 1
    near = run([dep(1, "a", 40)], [req(0), req(125)], "clairvoyant=60")
    assert (near.total.sleeps, near.total.wakes) == (0, 0)
    assert near.total.waits == pytest.approx([60.0, 0.0])
    stops = run([dep(1, "a", 40, **STOPS)], [req(0), req(1000)], "clairvoyant=60")
    assert memory(stops) == [(0.0, 0, "a", 40.0), (122.2, 0, "a", 0.0), (940.0, 0, "a", 40.0)]


def test_a_floor_holds_more_memory_and_never_less():
    """The same day under both: the floor only keeps engines awake longer (its point is the least
    memory a policy that keeps it holds)."""
    deps = [dep(1, "a", 50), dep(2, "b", 30), dep(3, "c", 40)]
    at_once, floored = (run(deps, a_day(), p) for p in ("clairvoyant", "clairvoyant=60"))
    assert floored.total.gpu_gib_seconds > at_once.total.gpu_gib_seconds
    assert floored.total.sleeps < at_once.total.sleeps
