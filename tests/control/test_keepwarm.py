"""Adaptive warmth in the decision core (control/keepwarm.py), deterministic: core_doubles'
fake clock and recording effects, the test playing the deployer and the reaper's clock. A
deployment with keep_warm adaptive learns its idle gaps; from its 20th, when they show a pattern,
each idle period's plan says when it rests (awake_for_s, within min_idle_timeout_s and its
idle_timeout_s), in which tier, and when a pre-warm brings it back, with memory free at that
moment only, yielding to any request that needs it."""
from __future__ import annotations

import random
from typing import Any

import pytest
from core_doubles import Clock, Effects, Req, make, start

from ondemand.control import rhythm
from ondemand.control.keepwarm import histogram, tier_costs
from ondemand.errors import InsufficientMemory
from ondemand.model import Mode, State

REAP_S = 15.0  # the reaper's step (reap_interval_s' default)


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


class Box:
    """The controller, its fake effects and clock, and the test's side of the deployer: what the
    reaper and the pre-warm asked is done (a stop stops, a sleep sleeps at the level asked, a
    pre-warm starts when ``fits``), each noted with the seconds since the idle period began."""

    def __init__(self, world: tuple[Clock, Effects], **kw: Any):
        kw.setdefault("idle_timeout_s", 600)
        kw.setdefault("min_idle_timeout_s", 60)
        self.c, self.fx, self.clock = make(world, **kw)
        self.fits = True
        self.log: list[tuple[float, str, Any]] = []
        self.idle_from = self.clock.t

    def add(self, dep_id: int, **kw: Any) -> int:
        kw.setdefault("state", State.READY)
        return self.fx.add(dep_id, keep_warm=kw.pop("keep_warm", "adaptive"), **kw)

    def serve(self, dep_id: int) -> None:
        """One request: served at once when the engine is ready, else it waits for the start or
        the wake. Its release begins an idle period."""
        c, fx = self.c, self.fx
        slot = c.try_take(dep_id)
        if slot is None:
            r = Req(c, dep_id)
            start(fx, c, dep_id)
            slot = r.take()
            r.leave()
        assert slot is not None
        slot.release()
        self.idle_from = self.clock.t

    def request(self, dep_id: int) -> bool:
        """As ``serve``; True when the engine was awake (ready) as the request came."""
        awake = self.fx.deps[dep_id].state is State.READY
        self.serve(dep_id)
        return awake

    def idle(self, seconds: float, step: float = REAP_S) -> None:
        """Time passes; every ``step`` the reaper's step; the deployer does what was asked."""
        end = self.clock.t + seconds
        while self.clock.t < end - 1e-9:
            self.clock.advance(min(step, end - self.clock.t))
            self.play()
            self.c.reap()
            self.play()

    def play(self) -> None:
        c, fx = self.c, self.fx
        at = round(self.clock.t - self.idle_from, 3)
        for kind in ("stop", "sleep"):
            for call in fx.taken(kind):
                _, dep_id, for_dep, text, *level = call
                self.log.append((at, kind, (dep_id, *level)))
                approved = c.is_idle(fx.deps[dep_id])
                if approved:
                    fx.set(dep_id, state=State.ASLEEP if kind == "sleep" else State.STOPPED,
                           sleep_level=(level or [1])[0] if kind == "sleep" else None)
                c.on_stopped(dep_id, approved, for_dep)
        for _, dep_id, held, _text in fx.taken("prewarm"):
            self.log.append((at, "prewarm", (dep_id, held)))
            if self.fits and c.prewarm_wanted(dep_id):
                fx.set(dep_id, state=State.STARTING)  # the deployer's mark, then its start
                c.on_prewarmed(dep_id, True)
                fx.set(dep_id, state=State.READY, sleep_level=None)
            else:
                c.on_prewarmed(dep_id, False)

    def taken(self, kind: str) -> list[tuple[float, Any]]:
        out = [(at, what) for at, k, what in self.log if k == kind]
        self.log = [e for e in self.log if e[1] != kind]
        return out


def burst(box: Box, dep_id: int, *, per_burst: int = 5, inside_s: float = 3.0) -> list[bool]:
    """A burst of requests a few seconds apart; whether each found the engine awake."""
    awake = []
    for i in range(per_burst):
        if i:
            box.idle(inside_s)
        awake.append(box.request(dep_id))
    return awake


def between(rng: random.Random, every_s: float = 1800.0, jitter_s: float = 60.0) -> float:
    return every_s + rng.uniform(-jitter_s, jitter_s)


# --- the plan, learned ---------------------------------------------------------------

def test_a_periodic_pattern_is_learned_after_20_gaps_rests_after_the_burst_and_is_back_before_the_next(world):
    box = Box(world)
    box.add(1)
    c = box.c
    rng = random.Random(5)
    # Five bursts of four: 15 short gaps and 4 long ones learned, as fixed: awake for its full
    # timeout, then put away in its idle action's tier (a stop, here); every burst waits.
    for n in range(5):
        assert burst(box, 1, per_burst=4)[0] is (n == 0)
        assert c.adaptive(1) is None
        box.idle(between(rng))
        assert [at for at, _ in box.taken("stop")] == [pytest.approx(600, abs=REAP_S)]
        assert box.taken("prewarm") == [] and box.fx.deps[1].state is State.STOPPED
    assert len(c.rhythm(1)) == 19
    burst(box, 1, per_burst=4)  # its first request is the 20th gap
    assert len(c.rhythm(1)) == 23
    view = c.adaptive(1)
    assert view is not None and view["gaps"] == 23 and view["rest"] == "stopped"
    assert view["awake_for_s"] == 60 and 1500 < view["prewarm_in_s"] < 1740 - 60
    # From now on: stopped right after the minimum idle time, started again ahead of the next
    # burst, which finds it awake; and that pre-warm was a hit.
    for _ in range(3):
        box.idle(between(rng))
        (rest,) = box.taken("stop")
        assert 60 <= rest[0] <= 60 + REAP_S
        (prewarm,) = box.taken("prewarm")
        assert prewarm[1] == (1, 0.0)  # nothing held for anyone: its fit check keeps out nothing
        assert rest[0] + 1000 < prewarm[0] < 1740 - 60  # ready (a 60 s start) before the next burst
        assert box.fx.deps[1].state is State.READY
        assert burst(box, 1, per_burst=4) == [True] * 4
    assert c.prewarms(1) == {"hit": 3, "miss": 0}


def test_the_rest_is_the_plans_tier_sleep_levels_included(world):
    """Two minutes between bursts: too short for a one-minute cold start to pay, long enough
    for a level-2 wake (test_rhythm's case), so it sleeps at level 2 and is woken early."""
    box = Box(world, min_idle_timeout_s=10)
    box.add(1)
    c = box.c
    rng = random.Random(2)
    c.learn({1: rhythm_of_bursts(rng, 10, every_s=150, jitter_s=5)})
    burst(box, 1)
    box.idle(between(rng, 150, 5))
    (sleep,) = box.taken("sleep")
    assert sleep[1] == (1, 2) and 10 <= sleep[0] <= 10 + REAP_S
    (prewarm,) = box.taken("prewarm")
    assert prewarm[0] < 150 - 5 - 6
    assert box.fx.deps[1].state is State.READY and box.request(1)


def rhythm_of_bursts(rng: random.Random, n: int, *, every_s: float = 1800.0, jitter_s: float = 60.0,
                     per_burst: int = 5) -> list[float]:
    gaps: list[float] = []
    for _ in range(n):
        gaps += [rng.uniform(1.0, 3.0) for _ in range(per_burst - 1)]
        gaps.append(between(rng, every_s, jitter_s))
    return gaps


def assert_learned_without_a_plan(view: dict[str, Any] | None) -> None:
    """From the 20th gap the view shows what was learned; its plan's fields are null while it
    makes none (it behaves as fixed)."""
    assert view is not None and view["gaps"] >= rhythm.LEARN_AFTER
    assert (view["awake_for_s"], view["prewarm_in_s"], view["rest"], view["expected_at"]) == (None,) * 4
    assert sum(view["histogram"]["counts"]) == view["gaps"]


def test_gaps_with_no_regularity_behave_as_fixed(world):
    box = Box(world)
    box.add(1)
    rng = random.Random(3)
    box.c.learn({1: [rng.uniform(0, 7200) for _ in range(400)]})
    box.serve(1)
    assert_learned_without_a_plan(box.c.adaptive(1))
    box.idle(590)
    assert box.taken("stop") == [] and box.c.is_idle(box.fx.deps[1]) is False
    box.idle(30)
    assert [at for at, _ in box.taken("stop")] == [pytest.approx(600, abs=REAP_S)]
    box.idle(7200)
    assert box.taken("prewarm") == [] and box.fx.deps[1].state is State.STOPPED


def test_before_its_20th_gap_and_when_fixed_it_behaves_as_fixed(world):
    box = Box(world)
    box.add(1)
    box.add(2, keep_warm="fixed")
    gaps = rhythm_of_bursts(random.Random(1), 8)
    box.c.learn({1: gaps[:rhythm.LEARN_AFTER - 1], 2: gaps})
    for dep_id in (1, 2):
        box.serve(dep_id)
        assert box.c.adaptive(dep_id) is None
    box.idle(120)
    assert box.taken("stop") == []
    box.idle(500)
    assert sorted(what for _, what in box.taken("stop")) == [(1,), (2,)]


# --- the bounds ----------------------------------------------------------------------------

@pytest.mark.parametrize("floor, timeout", [(60, 600), (120, 600), (30, 45)])
def test_it_rests_no_sooner_than_the_minimum_and_no_later_than_its_idle_timeout(world, floor, timeout):
    box = Box(world, min_idle_timeout_s=floor)
    box.add(1, idle_timeout_s=timeout)
    rng = random.Random(7)
    # Always back 7 to 8 s later (a pattern: an eighth of the span up to the tail); no early rest.
    box.c.learn({1: [rng.uniform(7, 8) for _ in range(100)]})
    box.serve(1)
    view = box.c.adaptive(1)
    assert view is not None and view["rest"] is None and view["prewarm_in_s"] is None
    assert view["awake_for_s"] == floor  # the tail (8.8 s) is below the floor
    box.idle(floor - 1)
    assert box.taken("stop") == []
    box.idle(REAP_S + 1)
    (stop,) = box.taken("stop")
    assert floor <= stop[0] <= min(timeout, floor + REAP_S + 1)


def test_the_shortest_rest_scales_with_the_minimum_idle_time(world):
    """Issue 40: with min_idle_timeout_s = 1 (as a test box sets it), a 0.05 s wake and a 10 s idle
    timeout, a rhythm of a request every 6 s is learned from the traffic itself, and from its 20th
    gap the engine rests early between requests and is woken ahead of the next: the shortest rest
    worth making is half the minimum (0.5 s here), not the 30 s of the default's minute."""
    box = Box(world, min_idle_timeout_s=1, idle_timeout_s=10)
    box.add(1, idle_action="sleep")
    box.fx.rest_costs = {"asleep_1": 0.05, "asleep_2": 0.5, "stopped": 5.0}
    c = box.c
    for _ in range(rhythm.LEARN_AFTER):
        box.serve(1)
        assert box.taken("sleep") == [] and box.taken("prewarm") == []  # as fixed: awake 10 s idle
        box.idle(6.0, step=0.1)
    assert c.adaptive(1) is None  # 19 gaps: not learned yet
    for _ in range(3):
        assert box.request(1)  # the 20th gap and on: each request finds the engine awake
        view = c.adaptive(1)
        assert view is not None and view["rest"] == "asleep_1" and view["awake_for_s"] == 1
        assert 4.5 < view["prewarm_in_s"] < 6.0 - 0.05
        box.idle(6.0, step=0.1)
        (sleep,) = box.taken("sleep")
        assert sleep[1] == (1, 1) and 1.0 <= sleep[0] <= 1.2  # rested once the minimum had passed
        (prewarm,) = box.taken("prewarm")
        assert 4.5 < prewarm[0] < 6.0  # woken ahead of the next request
    assert c.prewarms(1)["hit"] == 2


def test_a_tail_beyond_its_idle_timeout_and_nowhere_to_rest_early_behaves_as_fixed(world):
    box = Box(world)
    box.add(1, idle_timeout_s=300)
    box.fx.rest_costs = {"stopped": 600.0}  # a ten-minute start: no quiet time here pays for it
    box.c.learn({1: rhythm_of_bursts(random.Random(4), 10)})
    box.serve(1)
    assert_learned_without_a_plan(box.c.adaptive(1))
    box.idle(400)
    assert [at for at, _ in box.taken("stop")] == [pytest.approx(300, abs=REAP_S)]


# --- the pre-warm ---------------------------------------------------------------------------

def learned_and_resting(box: Box, dep_id: int, rng: random.Random) -> None:
    box.c.learn({dep_id: rhythm_of_bursts(rng, 8)})
    burst(box, dep_id)
    box.idle(120)
    assert [what for _, what in box.taken("stop")] == [(dep_id,)]


def test_a_prewarm_yields_its_memory_to_a_request(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1, memory_gib=10)
    fx.add(2, 10, state=State.STOPPED)
    learned_and_resting(box, 1, random.Random(6))
    plan = c.adaptive(1)
    box.idle(plan["prewarm_in_s"] - (clock.t - box.idle_from) + 1)
    (prewarm,) = box.taken("prewarm")
    assert fx.deps[1].state is State.READY
    # Just pre-warmed, no request yet: idle for make-room at once, but not for the reaper.
    assert c.is_idle(fx.deps[1]) and c.reap() == []
    r = Req(c, 2)
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    (stop,) = fx.taken("stop")
    assert stop[1:3] == (1, 2)  # the pre-warmed engine is make-room's victim, for 2
    fx.set(1, state=State.STOPPED)
    c.on_stopped(1, True, 2)
    assert c.prewarms(1) == {"hit": 0, "miss": 1}  # it went away unused
    c.on_settled(2)
    start(fx, c, 2)
    assert r.take() is not None


def test_the_reaper_leaves_a_prewarmed_engine_awake_until_awake_until_then_follows_fixed(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    learned_and_resting(box, 1, random.Random(8))
    period = c.record(1).adaptive.period
    plan = period.plan
    box.idle(plan.prewarm_in_s - (clock.t - box.idle_from) + 1)
    assert len(box.taken("prewarm")) == 1 and fx.deps[1].state is State.READY
    # The view's idle_until says when the reaper takes it: at awake_until_s, not at once.
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + period.began + plan.awake_until_s, abs=1e-3)
    box.idle(plan.awake_until_s - (clock.t - box.idle_from) - 1)
    assert box.taken("stop") == [] and fx.deps[1].state is State.READY
    box.idle(REAP_S + 1)
    (stop,) = box.taken("stop")
    assert plan.awake_until_s <= stop[0] <= plan.awake_until_s + REAP_S + 1
    assert c.prewarms(1) == {"hit": 0, "miss": 1}
    box.idle(7200)
    assert box.taken("prewarm") == []  # one pre-warm per idle period
    assert box.request(1) is False  # the next request starts it, as ever; its gap is learned
    assert c.rhythm(1).gaps[-1] > 7200


def test_a_prewarm_that_finds_no_free_memory_does_nothing(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    fx.add(2, 10, state=State.READY, mode=Mode.ALWAYS_ON)
    learned_and_resting(box, 1, random.Random(9))
    box.fits = False  # the deployer's fit check: InsufficientMemory, reported as not started
    box.idle(c.adaptive(1)["prewarm_in_s"] - (clock.t - box.idle_from) + 1)
    assert len(box.taken("prewarm")) == 1
    assert fx.deps[1].state is State.STOPPED and fx.deps[2].state is State.READY
    assert fx.taken("stop") == [] and fx.taken("sleep") == [] and fx.taken("settle") == []
    assert c.prewarms(1) == {"hit": 0, "miss": 0}
    box.idle(3600)
    assert box.taken("prewarm") == [] and fx.deps[1].state is State.STOPPED


def test_no_prewarm_while_anything_waits_for_memory(world):
    """The queue's head needs what is free now: a pre-warm takes none of it, and asks nothing."""
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    fx.add(2, 20, state=State.STOPPED)
    learned_and_resting(box, 1, random.Random(10))
    r = Req(c, 2)
    c.on_refused(2, InsufficientMemory(20, 4, 24))
    assert 2 in c.queue
    box.idle(c.adaptive(1)["prewarm_in_s"] - (clock.t - box.idle_from) + 1)
    assert box.taken("prewarm") == [] and fx.deps[1].state is State.STOPPED
    r.leave()


def idle_with_a_plan_beside_a_stopped_20(world: tuple[Clock, Effects], seed: int) -> tuple[Box, float]:
    """Adaptive 1 (10 GiB), its rhythm learned, just idle after a burst; 2 (20 GiB) stopped: it
    does not fit beside 1 on the 24 GiB box. The box, and when 1's idle period began."""
    box = Box(world)
    box.add(1, memory_gib=10)
    box.fx.add(2, 20, state=State.STOPPED)
    box.c.learn({1: rhythm_of_bursts(random.Random(seed), 8)})
    burst(box, 1)
    return box, box.c.record(1).adaptive.period.began


def test_while_anything_waits_for_memory_it_rests_as_fixed(world):
    """A plan's early rest is a bet that the next request is far; with requests waiting for
    memory, what it frees goes to them at once, and if the bet fails its own next request waits
    for the newcomer's whole idle timeout, not a wake. So with the queue not empty it is idle
    (for the reaper and make-room) only after its idle timeout, as fixed; once the queue is
    empty, the plan counts again."""
    box, began = idle_with_a_plan_beside_a_stopped_20(world, 11)
    c, fx = box.c, box.fx
    assert c.adaptive(1)["awake_for_s"] == 60
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + began + 60, abs=1e-3)
    fx.taken("counters")
    r = Req(c, 2)
    c.on_refused(2, InsufficientMemory(20, 14, 24))  # 1 is idle for seconds only: no victim yet
    assert 2 in c.queue and fx.taken("stop") == []
    # The queue filled: 1's view is published again (within the second the publishes fold
    # into), its idle_until now its idle timeout's.
    box.clock.advance(1.01)
    assert any(call[1] == 1 for call in fx.taken("counters"))
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + began + 600, abs=1e-3)
    box.idle(120)
    c.on_refused(2, InsufficientMemory(20, 14, 24))  # make-room again, 120 s idle: still no victim
    assert fx.taken("stop") == [] and fx.taken("sleep") == []
    box.idle(180)
    assert box.taken("stop") == [] and box.taken("sleep") == [] and not c.is_idle(fx.deps[1])
    box.idle(300 + REAP_S)
    (stop,) = box.taken("stop")  # its idle timeout, as fixed
    assert 600 <= stop[0] <= 600 + REAP_S
    r.leave()
    assert not len(c.queue)
    burst(box, 1)
    box.idle(120)
    (stop,) = box.taken("stop")  # the plan's rest again
    assert 60 <= stop[0] <= 60 + REAP_S


def test_an_emptied_queue_gives_an_idle_adaptive_deployment_its_plan_back(world):
    box, began = idle_with_a_plan_beside_a_stopped_20(world, 12)
    c, fx = box.c, box.fx
    r = Req(c, 2)
    c.on_refused(2, InsufficientMemory(20, 14, 24))
    box.idle(30)
    fx.taken("counters")
    r.leave()  # the only waiter hangs up: the queue is empty
    box.clock.advance(1.01)
    assert any(call[1] == 1 for call in fx.taken("counters"))
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + began + 60, abs=1e-3)
    box.idle(60)
    (stop,) = box.taken("stop")
    assert 60 <= stop[0] <= 60 + REAP_S


def test_a_queue_emptied_by_a_removal_gives_the_plan_back_too(world):
    box, began = idle_with_a_plan_beside_a_stopped_20(world, 13)
    c, fx = box.c, box.fx
    Req(c, 2)
    c.on_refused(2, InsufficientMemory(20, 14, 24))
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + began + 600, abs=1e-3)
    box.idle(30)
    fx.taken("counters")
    fx.remove(2)  # the queued deployment is removed: the queue is empty
    assert not len(c.queue)
    box.clock.advance(1.01)
    assert any(call[1] == 1 for call in fx.taken("counters"))
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + began + 60, abs=1e-3)


def test_a_request_that_arrives_while_the_prewarm_starts_it_is_a_hit(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    learned_and_resting(box, 1, random.Random(12))
    clock.advance(c.adaptive(1)["prewarm_in_s"] - (clock.t - box.idle_from) + 1)
    (prewarm,) = fx.taken("prewarm")
    assert c.prewarm_wanted(1)
    fx.set(1, state=State.STARTING)  # the deployer marked it: the start runs
    r = Req(c, 1)  # the request waits for that start, makes none of its own
    assert fx.taken("admit") == []
    c.on_prewarmed(1, True)
    fx.set(1, state=State.READY)
    assert r.take() is not None
    assert c.prewarms(1) == {"hit": 1, "miss": 0}


def test_a_request_before_the_prewarm_marks_it_has_the_prewarm_do_nothing(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    learned_and_resting(box, 1, random.Random(13))
    clock.advance(c.adaptive(1)["prewarm_in_s"] - (clock.t - box.idle_from) + 1)
    assert len(fx.taken("prewarm")) == 1
    Req(c, 1)  # arrives while the pre-warm reads the budget: its own admit goes out
    assert len(fx.taken("admit")) == 1
    assert not c.prewarm_wanted(1)  # the deployer, at its mark, leaves the start to the request's admit
    c.on_prewarmed(1, False)
    assert c.prewarms(1) == {"hit": 0, "miss": 0}


def test_a_switch_to_fixed_ends_the_plan_and_a_removal_its_timer(world):
    box = Box(world)
    c, fx = box.c, box.fx
    box.add(1)
    box.add(2)
    for dep_id in (1, 2):
        c.learn({dep_id: rhythm_of_bursts(random.Random(14), 8)})
    box.serve(1)
    box.serve(2)
    box.idle(REAP_S)
    assert c.adaptive(1) is not None
    fx.set(1, keep_warm="fixed")
    fx.remove(2)
    box.idle(120)
    assert box.taken("stop") == [] and c.adaptive(1) is None  # fixed: its full idle timeout
    box.idle(3600)
    assert [what for _, what in box.taken("stop")] == [(1,)] and box.taken("prewarm") == []


def test_shutdown_stops_the_prewarms(world):
    box = Box(world)
    c, fx, clock = box.c, box.fx, box.clock
    box.add(1)
    learned_and_resting(box, 1, random.Random(15))
    c.shutdown()
    clock.advance(3600)
    assert fx.taken("prewarm") == []


# --- the pure helpers -------------------------------------------------------------------

def test_tier_costs_are_the_measured_medians_else_defaults():
    measured = {1: 0.8}
    assert tier_costs([1, 2], measured.get, 42.0) == {"asleep_1": 0.8, "asleep_2": 10.0, "stopped": 42.0}
    assert tier_costs([], measured.get, None) == {"stopped": 60.0}


def test_the_histogram_spans_seconds_to_hours_on_a_log_scale():
    h = histogram([1.0, 2.0, 3.0, 1800.0, 1850.0, 7200.0])
    assert len(h["edges_s"]) == 13 and h["edges_s"][0] == 1.0 and h["edges_s"][-1] == 7200.0
    assert sum(h["counts"]) == 6 and h["counts"][0] >= 1 and h["counts"][-1] == 1
    assert histogram([])["counts"] == [0] * 12

