"""Adaptive warmth's learning in the decision core: an idle gap runs from the moment a
deployment's last slot was released to the next request's arrival (a ready model's slot or a
stopped one's waiter), is learned once, and only when it is idleness (at least MIN_GAP_S, on
demand, no slot out). The recording fake of core_doubles plays the deployer; the clock is
virtual. A restart keeps what was learned: ``learn`` takes the state file's gaps back."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, make

from ondemand.control.slots import MIN_GAP_S
from ondemand.model import Mode, State


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def gaps(fx: Effects) -> list[tuple[int, float]]:
    return [(dep_id, round(gap, 6)) for _, dep_id, gap in fx.taken("idle_gap")]


def test_a_gap_runs_from_the_last_release_to_the_next_arrival_and_is_learned_once(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    assert c.rhythm(1) is None
    first = c.try_take(1)
    assert gaps(fx) == []  # no slot had ended yet: nothing to measure from
    second = c.try_take(1)
    clock.advance(5)
    first.release()  # one still out: not idle
    clock.advance(5)
    second.release()  # idle from here
    clock.advance(42)
    third = c.try_take(1)
    assert gaps(fx) == [(1, 42.0)] and c.rhythm(1).gaps == [42.0]
    c.try_take(1).release()  # arrives while the third is out: no gap
    third.release()
    assert gaps(fx) == []


def test_a_stopped_models_first_waiter_ends_its_gap(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    c.try_take(1).release()
    fx.set(1, state=State.STOPPED)  # the reaper took it meanwhile: the gap goes on
    clock.advance(300)
    Req(c, 1)
    Req(c, 1)  # the second waiter ends nothing
    assert gaps(fx) == [(1, 300.0)]


def test_a_busy_models_breath_and_an_always_on_model_are_not_learned(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    fx.add(2, state=State.READY, mode=Mode.ALWAYS_ON)
    for dep_id in (1, 2):
        c.try_take(dep_id).release()
    clock.advance(MIN_GAP_S / 2)
    c.try_take(1).release()  # half a second apart: busy, not idle
    clock.advance(30)
    c.try_take(2)  # always on: it never rests, there is nothing to learn
    assert gaps(fx) == [] and c.rhythm(2) is None
    c.try_take(1)
    assert gaps(fx) == [(1, 30.0)]


def test_learn_takes_back_the_kept_gaps_of_deployments_that_exist(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.STOPPED)
    c.learn({1: [10.0, 20.0], 7: [5.0]})  # 7 was removed while ondemand was down
    assert c.rhythm(1).gaps == [10.0, 20.0] and c.rhythm(7) is None
    fx.add(2, state=State.READY)
    c.try_take(2).release()
    clock.advance(3)
    fx.set(1, state=State.READY)
    c.try_take(1).release()
    clock.advance(8)
    c.try_take(1)
    assert c.rhythm(1).gaps == [10.0, 20.0, 8.0]


def test_a_removed_deployment_forgets_what_it_learned(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    c.try_take(1).release()
    clock.advance(10)
    c.try_take(1).release()
    assert c.rhythm(1).gaps == [10.0]
    del fx.deps[1]
    c.on_deployment(1, None, None)
    assert c.rhythm(1) is None
