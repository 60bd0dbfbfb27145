"""Warmth by value (control/value.py, ``scheduler = "cost"``), on core_doubles' fake clock and
recording effects: an engine cheap to bring back rests once idle for ``min_idle_timeout_s``, never
sooner; one whose wake passes the SLO stays awake past its timeout while its next request is
likely soon (``held_for`` ``slo``) and rests before it when its gaps say nothing comes back soon;
fewer than 10 gaps keep the timeout. Here min_idle_timeout_s is 10 s, the SLO 5 s, the idle
timeout 60 s; the test's tiers say a level-1 wake costs 1 s (cheap) unless a test makes it 8 s."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, make

from ondemand.control import scheduler as schedulers
from ondemand.control.value import HOLD_AFTER, PRICE_GIB_S, hold_until, rest_at
from ondemand.model import State

SLO_S = 5.0


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def idle(world, *, wake_s: float = 1.0, gaps=(), sched: str = "cost", memory_gib: float = 10,
         sleep_s: float = 0.0):
    """1 (ready, idle timeout 60 s, sleeps when idle, its sleep's call taking ``sleep_s``) has
    just given its last slot back."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler(sched, SLO_S), min_idle_timeout_s=10)
    fx.rest_costs = {"asleep_1": wake_s, "asleep_2": 6.0, "stopped": 60.0}
    fx.sleep_costs[1] = sleep_s
    fx.add(1, memory_gib, idle_timeout_s=60, idle_action="sleep")
    fx.set(1, state=State.READY)
    if gaps:
        c.learn({1: list(gaps)})
    c.try_take(1).release()
    return c, fx, clock


def reaped_at(c, clock, until: float = 400.0) -> float | None:
    """The first whole second at which the reaper puts 1 away (None: not until ``until``)."""
    start = clock.t
    while clock.t - start < until:
        if 1 in c.reap():
            return clock.t - start
        clock.advance(1)
    return None


def test_hold_until_by_hand():
    # 10 gaps of 30 s and 10 of 1000 s; 10 GiB. At 10 s: 10 of 20 come back within 60 s more
    # (20 s from now); the rest hold 60 s: 10 x 20 + 10 x 60 = 800 / 20 = 40 s x 10 GiB = 400
    # GiB-s against price x 0.5: held. Past 30 s, none comes within 60 s: rest at 30.
    gaps = sorted([30.0] * 10 + [1000.0] * 10)
    assert hold_until(gaps, 10, 60, 10, PRICE_GIB_S) == 30
    # At a price near nothing nothing is worth holding: rest at the floor.
    assert hold_until(gaps, 10, 60, 10, 1.0) == 10
    # Past the longest gap nothing says a request comes back.
    assert hold_until([5.0] * 20, 10, 60, 10, PRICE_GIB_S) == 10


def test_a_model_cheap_to_wake_rests_at_min_idle_timeout_never_sooner(world):
    c, fx, clock = idle(world, wake_s=1.0)
    assert reaped_at(c, clock) == 10
    last = fx.taken("sleep")[-1]
    # Its event says how long its rule had it idle: 10 s, not its idle timeout's 60.
    assert last[1] == 1 and last[3] == "Put to sleep after 0.17 min idle"


def test_rest_at_by_hand():
    # Gaps past the floor of 10 s: 10 of 12 s and 10 of 1000 s; a window of 16 s (a 20 s sleep
    # and a 1 s wake against a 5 s SLO). At 10 s the 12 s gaps fall in the window: half a miss
    # at 3 GiB-h against nothing held; at 12 s they are past: 10 GiB x 2 s held, no miss.
    gaps = sorted([12.0] * 10 + [1000.0] * 10)
    assert rest_at(gaps, 10, 16, 10, PRICE_GIB_S) == 12
    # With no window (its sleep is quick) or no price, at the floor.
    assert rest_at(gaps, 10, 0, 10, PRICE_GIB_S) == 10
    assert rest_at(gaps, 10, 16, 10, 0.0) == 10
    # Gaps far past the window say nothing against the floor; none past the floor neither.
    assert rest_at(sorted([100.0] * 20), 10, 16, 10, PRICE_GIB_S) == 10
    assert rest_at(sorted([5.0] * 20), 10, 16, 10, PRICE_GIB_S) == 10
    # A giant pays more to hold than the misses it saves.
    assert rest_at(gaps, 10, 16, 100_000, PRICE_GIB_S) == 10


def test_a_cheap_model_whose_sleep_is_slow_rests_past_the_gaps_that_end_during_it(world):
    """A 1 s wake, but a 20 s sleep: a request 12 s after idle would come 2 s into a rest at
    10 s and wait 18 s + 1 s. Half its gaps end so: held until 12 s, then put away."""
    c, fx, clock = idle(world, wake_s=1.0, sleep_s=20.0, gaps=[12.0] * 10 + [1000.0] * 10)
    assert reaped_at(c, clock) == 12


def test_a_sleep_measured_slower_moves_the_rest_at_once(world):
    """The window is read at every reaper step: a sleep measured slower while the model idles
    (the start history's median moved) counts at once, not from its next learned gap. Gaps of
    20 s: a 4 s window (an 8 s sleep) misses none of them from 10 s on; a 16 s one would."""
    c, fx, clock = idle(world, wake_s=1.0, sleep_s=8.0, gaps=[20.0] * 10 + [1000.0] * 10)
    clock.advance(5)
    assert c.reap() == []  # its rest planned at 10 s
    fx.sleep_costs[1] = 20.0
    assert reaped_at(c, clock) == 15  # at 20 s idle


def test_a_cheap_model_whose_sleep_is_quick_rests_at_min_idle_timeout_whatever_its_gaps(world):
    c, fx, clock = idle(world, wake_s=1.0, sleep_s=2.0, gaps=[12.0] * 10 + [1000.0] * 10)
    assert reaped_at(c, clock) == 10


def test_under_seed_the_same_model_keeps_its_idle_timeout(world):
    c, fx, clock = idle(world, wake_s=1.0, sched="seed")
    assert reaped_at(c, clock) == 60


def test_a_dear_model_with_few_gaps_keeps_its_timeout(world):
    c, fx, clock = idle(world, wake_s=8.0, gaps=[30.0] * (HOLD_AFTER - 1))
    assert reaped_at(c, clock) == 60


def test_from_its_tenth_gap_a_dear_models_rhythm_decides(world):
    """Its gaps are 30 s: held until then (its next request likely soon), then nothing says one
    comes back."""
    c, fx, clock = idle(world, wake_s=8.0, gaps=[30.0] * HOLD_AFTER)
    assert reaped_at(c, clock) == 30


def test_a_dear_model_whose_next_request_is_likely_soon_is_held_past_its_timeout(world):
    """Its gaps are 50 and 100 s: at 50 s idle the rest are 50 s away, within its timeout more:
    held past its 60 s timeout (``slo``) until its longest gap."""
    c, fx, clock = idle(world, wake_s=8.0, gaps=[50.0] * 15 + [100.0] * 15)
    clock.advance(59)
    assert c.reap() == [] and c.held_for(1) is None  # within its timeout: no hold to tell of
    clock.advance(11)
    assert c.reap() == [] and c.held_for(1) == "slo"
    clock.advance(31)  # past its longest gap: nothing says a request comes back
    assert c.reap() == [1]


def test_a_dear_model_whose_gaps_say_nothing_soon_rests_before_its_timeout(world):
    """Its gaps are an hour: holding 10 GiB for 60 s more saves no miss."""
    c, fx, clock = idle(world, wake_s=8.0, gaps=[3600.0] * 30)
    assert reaped_at(c, clock) == 10
    assert c.held_for(1) is None


def test_a_giant_pays_more_to_hold_than_a_small_dear_model(world):
    """The same rhythm (half its gaps end 20 s after the floor, half an hour later): 10 GiB is
    worth holding, 1000 GiB is not."""
    gaps = [30.0] * 15 + [1800.0] * 15
    c, fx, clock = idle(world, wake_s=8.0, gaps=gaps)
    assert reaped_at(c, clock) == 30
    world2 = (Clock(), None)
    world2 = (world2[0], Effects(world2[0]))
    c2, fx2, clock2 = idle(world2, wake_s=8.0, gaps=gaps, memory_gib=1000)
    assert reaped_at(c2, clock2) == 10
