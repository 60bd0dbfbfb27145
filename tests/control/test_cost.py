"""Make-room by cost (control/cost.py, ``scheduler = "cost"``) in the decision core, on
core_doubles' fake clock and recording effects: a victim idle for less than its timeout is
taken only when the requester's wait without it outweighs its expected loss; never one with a
slot in flight, of higher priority, or always on. The requester here starts cold (60 s, the test
effects' cost), min_idle_timeout_s is 1 s and the SLO 5 s, so it could give the memory back 61 s
from now; the victim sleeps when put away and wakes in 1 s."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, make

from ondemand.control import scheduler as schedulers
from ondemand.control.cost import ByCost, expected_loss, refused
from ondemand.errors import InsufficientMemory
from ondemand.model import Mode, Priority, State

SLO_S = 5.0


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def lull(world, *, timeout: int, idle: float, gaps=(), every: float = 0.0, max_queued: int = 256, **victim):
    """2 (10 GiB, idle timeout ``timeout``) was used ``idle`` s ago; 1 (10 GiB) is refused for 6.
    The take rule alone: the cost scheduler's warmth by value (test_value) would move 2's idle
    rule to ``min_idle_timeout_s``, its wake being cheap. ``every``: 2 was asked 64 times before,
    one request each ``every`` seconds (its rate)."""
    c, fx, clock = make(world, scheduler=schedulers.SeedScheduler(ByCost(SLO_S)), max_queued=max_queued)
    fx.add(1, 10)
    fx.add(2, 10, idle_timeout_s=timeout, idle_action="sleep", **victim)
    fx.set(2, state=State.READY)
    if gaps:
        c.learn({2: list(gaps)})
    clock.advance(timeout + 1)
    for _ in range(64 if every else 0):
        c.try_take(2).release()
        clock.advance(every)
    if victim.get("mode") is not Mode.ALWAYS_ON:
        c.try_take(2).release()
    clock.advance(idle)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    return c, fx, r


def taken(fx) -> list[int]:
    return [s[1] for s in fx.taken("stop")] + [s[1] for s in fx.taken("sleep")]


def test_the_loss_by_hand():
    # Few gaps: asked again at once; its next request waits the requester's hold and its wake.
    assert expected_loss([], 5, hold_s=61, come_back_s=1, slo_s=5) == 57
    # Its next arrivals 10 and 100 s away: 61 - 10 + 1 - 5 = 47 for the first, and behind it, at
    # one request per mean gap (60 s), 47^2 / (2 x 60) more; nothing when it comes back first.
    gaps = [15.0] * 10 + [105.0] * 10
    assert expected_loss(gaps, 5, hold_s=61, come_back_s=1, slo_s=5) == pytest.approx((47 + 47 ** 2 / 120) / 2)
    # Only the gaps longer than the idle time it has had count: past 15 s, the next is 100 s away.
    assert expected_loss(gaps, 20, hold_s=61, come_back_s=1, slo_s=5) == 0


def test_a_victim_in_a_lull_is_taken_when_the_wait_outweighs_its_loss(world):
    """Idle 5 s of 600: the requester would wait 595 s without it; its loss is 57 s."""
    c, fx, r = lull(world, timeout=600, idle=5)
    assert taken(fx) == [2] and r.queued == 0
    assert c.precheck(1)(fx.deps[2]) and not c.precheck(None)(fx.deps[2])  # the reaper's rule would wait


def test_a_hot_model_is_kept_when_its_loss_outweighs_the_wait(world):
    """Idle 5 s of 60: 55 s of wait against a loss of 57 s: kept, and the request queues."""
    c, fx, r = lull(world, timeout=60, idle=5)
    assert taken(fx) == [] and r.queued == 1
    assert not c.precheck(1)(fx.deps[2])


def test_learned_gaps_that_put_its_next_request_far_make_it_cheap(world):
    """The same lull, but its requests come every 1000 s: it will not be asked before the
    requester can give the memory back, so it costs nothing to take."""
    c, fx, r = lull(world, timeout=60, idle=5, gaps=[1000.0] * 30)
    assert taken(fx) == [2] and r.queued == 0


def test_a_hot_model_counts_the_burst_behind_its_next_request(world):
    """Idle 5 s of 600, its gaps half a second when busy: its next request comes 1 s from now,
    within the requester's hold, and about 40 more behind it. Its gaps say it will not stay idle
    for its timeout, so the requester would wait out the queue (900 s): more than one request's
    loss (57 s), less than the burst's; kept."""
    gaps = [0.5] * 25 + [6.0] * 5
    assert expected_loss(gaps[:0], 5, hold_s=61, come_back_s=1, slo_s=5) == 57
    assert expected_loss(gaps, 5, hold_s=61, come_back_s=1, slo_s=5) > 900
    c, fx, r = lull(world, timeout=600, idle=5, gaps=gaps)
    assert taken(fx) == [] and r.queued == 1


def test_a_victim_unlikely_to_reach_its_timeout_counts_the_queue_timeout(world):
    """Idle 5 s of 60, its gaps mostly 20 s: it will most likely be asked again before its
    timeout and never go idle for it, so the requester would wait out the queue (900 s), not 55 s:
    against its loss (one request every 19 s behind the first), taken."""
    gaps = [20.0] * 28 + [100.0] * 2
    c, fx, r = lull(world, timeout=60, idle=5, gaps=gaps)
    assert taken(fx) == [2] and r.queued == 0
    figures = c.scheduler.take.figures(fx.deps[1], fx.deps[2], 5.0, 60.0)
    assert figures["wait_s"] == pytest.approx(55 * 2 / 30 + 900 * 28 / 30)


def test_the_refused_by_hand():
    # Away 62 s at a request every half second: 124 come, and the queue has room for 100.
    assert refused(62, 0.5, 100) == pytest.approx(24)
    assert refused(62, 0.5, 200) == 0 and refused(62, None, 0) == 0  # room enough; no rate known


@pytest.mark.parametrize("room, kept", [(256, False), (40, True)])
def test_a_victim_whose_requests_would_overflow_the_queue_is_kept(world, room, kept):
    """Idle 5 s of 600, taken when nothing more is known (the first test); asked every second
    lately, its 62 s away bring 62 requests: with room for them in the queue it is taken; where
    the queue would refuse some (each a failure, counted as a request that waited out the queue)
    it is kept. Its learned idle gaps cannot say so: a hot model is rarely idle."""
    c, fx, r = lull(world, timeout=600, idle=5, every=1.0, max_queued=room)
    assert taken(fx) == ([] if kept else [2])
    figures = c.scheduler.take.figures(fx.deps[1], fx.deps[2], 5.0, 600.0)
    # the newest 64 of its 65 arrivals: 63 s to the last, 5 s since, one each 68/64 s; 1 waits
    assert figures["refused"] == pytest.approx(max(0.0, 62 / (68 / 64) - (room - 1)))


@pytest.mark.parametrize("why", ["inflight", "priority", "always_on"])
def test_never_a_busy_a_higher_priority_or_an_always_on_victim(world, why):
    kw = {"priority": Priority.HIGH} if why == "priority" else {"mode": Mode.ALWAYS_ON} if why == "always_on" else {}
    c, fx, clock = make(world, scheduler=schedulers.scheduler("cost", SLO_S))
    fx.add(1, 10)
    fx.add(2, 10, idle_timeout_s=600, **kw)
    fx.set(2, state=State.READY)
    clock.advance(601)
    slot = c.try_take(2)
    if why != "inflight" and slot is not None:
        slot.release()
    clock.advance(5)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert taken(fx) == [] and r.queued == 1


def test_an_asleep_requesters_wake_is_priced_as_a_wake_even_where_it_may_not_rest_now(world):
    """The tiers the effects offer are where a deployment may rest now (the host reserve can leave
    level 1 out); a requester already asleep at level 1 still wakes from it: its default, not a
    cold start. An awake victim whose sleep is left out would be stopped: a cold start."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler("cost", SLO_S))
    fx.add(1, 10, idle_action="sleep")
    fx.set(1, state=State.ASLEEP, sleep_level=1)
    fx.rest_costs = {"stopped": 60.0}
    assert c.start_s(fx.deps[1]) == 3.0
    fx.rest_costs = {"asleep_1": 0.5, "stopped": 60.0}
    assert c.start_s(fx.deps[1]) == 0.5
    fx.set(1, state=State.STOPPED, sleep_level=None)
    assert c.start_s(fx.deps[1]) == 60.0
