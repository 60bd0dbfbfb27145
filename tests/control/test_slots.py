"""The slots part of the decision core on its own (ondemand/control/slots.py): its records,
slots, drains, idle rule and backoff, driven directly with the fixed warmth policy, the fake
clock and the recording effects of core_doubles.py (the effects boundary the core asks).
What the whole controller makes of them: test_controller.py (and the start side's: test_attempts.py)."""
from __future__ import annotations

import math

import pytest
from core_doubles import Clock, Effects

from ondemand.control.record import Attempt, Phase
from ondemand.control.slots import ARRIVALS_KEPT, ARRIVALS_KNOWN, BACKOFF_FIRST_S, BACKOFF_MAX_S, Slots
from ondemand.control.warmth_policy import Fixed
from ondemand.errors import OndemandError
from ondemand.model import Mode, State


@pytest.fixture
def parts():
    clock = Clock()
    fx = Effects(clock)
    fixed = Fixed(lambda dep: dep.idle_timeout_s or 60)
    return clock, fx, lambda **kw: Slots(fx, clock=clock, wall=lambda: 1.7e9 + clock.t,
                                         warmth=lambda dep, rec: fixed, min_idle_timeout_s=1, **kw)


def test_a_read_holds_nothing_and_the_deployments_seen_at_start_get_a_full_idle_timeout(parts):
    clock, fx, make = parts
    fx.add(1, state=State.READY)
    slots = make()
    assert slots.record(1).last_activity == clock.t  # after a restart: idle from now, not from before
    assert slots.inflight(2) == 0 and slots.waiting(2) == 0 and slots.busy_total(2) == 0
    assert not slots.draining(2) and slots.backoff(2) is None and slots.attempt_phase(2) is None
    assert slots.record(2) is None  # reading a deployment it holds nothing of made no record


def test_the_last_release_begins_an_idle_period_and_a_release_too_many_counts_nothing(parts):
    clock, fx, make = parts
    fx.add(1, state=State.READY)
    slots = make()
    dep = fx.deployment(1)
    assert slots.take_ready(dep) and slots.take_ready(dep)
    clock.t += 5
    assert slots.release(1) is False and slots.record(1).idle_since is None  # one still in flight
    assert slots.release(1) is True and slots.record(1).idle_since == clock.t
    assert slots.release(1) is True and slots.inflight(1) == 0  # never below nothing


def test_a_deployments_rate_is_read_from_its_newest_requests_slots_and_waiters_alike(parts):
    """The mean time between its requests (the cost rule's count of what a full queue would
    refuse): none before ``ARRIVALS_KNOWN``; then over the newest ``ARRIVALS_KEPT``, the silence
    since the last one included, so a model gone quiet reads slower."""
    clock, fx, make = parts
    fx.add(1, state=State.READY)
    fx.add(2, state=State.STOPPED)
    slots = make()
    for _ in range(ARRIVALS_KNOWN - 1):
        assert slots.take_ready(fx.deps[1])
        clock.advance(2)
    assert slots.arrival_gap_s(1) is None
    slots.join(fx.deps[1], arrival=clock.t, notify=lambda: None, on_queued=None, queued=False)  # a waiter counts
    assert slots.arrival_gap_s(1) == pytest.approx(2 * (ARRIVALS_KNOWN - 1) / ARRIVALS_KNOWN)
    clock.advance(100)
    assert slots.arrival_gap_s(1) == pytest.approx((2 * (ARRIVALS_KNOWN - 1) + 100) / ARRIVALS_KNOWN)
    for _ in range(2 * ARRIVALS_KEPT):
        slots.take_ready(fx.deps[1])
        clock.advance(0.5)
    assert slots.arrival_gap_s(1) == pytest.approx(0.5)  # the old ones dropped
    assert slots.arrival_gap_s(2) is None


def test_a_request_is_counted_once_for_the_rate_drained_or_refused_for_a_full_queue(parts):
    """A request that finds its deployment drained is counted where it waits (``join``), not at
    each look before (the gateway asks ``take_ready`` twice); one the full queue refuses was
    asked all the same: the rate must not read low just when the queue overflows."""
    clock, fx, make = parts
    fx.add(1, state=State.READY)
    slots = make(max_queued=1)
    slots.drain(1, lambda: None)
    for _ in range(ARRIVALS_KNOWN - 1):
        assert not slots.take_ready(fx.deps[1]) and not slots.take_ready(fx.deps[1])
    assert slots.record(1).arrivals is None
    slots.join(fx.deps[1], arrival=clock.t, notify=lambda: None, on_queued=None, queued=False)
    for _ in range(ARRIVALS_KNOWN - 1):
        with pytest.raises(OndemandError) as e:
            slots.join(fx.deps[1], arrival=clock.t, notify=lambda: None, on_queued=None, queued=False)
        assert e.value.code == "ondemand_queue_full"
    assert len(slots.record(1).arrivals) == ARRIVALS_KNOWN


def test_the_idle_rule_counts_from_the_last_activity_and_needs_the_engines_metrics_quiet(parts):
    clock, fx, make = parts
    fx.add(1, state=State.READY, idle_timeout_s=10)
    slots = make()
    dep = fx.deployment(1)
    assert slots.take_ready(dep)
    clock.t += 100
    assert not slots.is_idle(dep)  # a slot in flight, however long
    slots.release(1)
    assert slots.quiet_for(dep) == (0.0, 10) and not slots.is_idle(dep)
    assert slots.next_idle_expiry(clock.t) == pytest.approx(10.05)  # when the reaper may look again
    clock.t += 10
    assert slots.is_idle(dep) and slots.next_idle_expiry(clock.t) == math.inf
    fx.busy_engines.add(1)  # its engine still works on a request that came round the gateway
    assert slots.quiet_for(dep) is None and not slots.is_idle(dep)
    fx.busy_engines.clear()
    for other in (dict(mode=Mode.ALWAYS_ON), dict(state=State.STARTING), dict(pending_mode=Mode.ALWAYS_ON)):
        assert not slots.is_idle(dep.replace(**other)), other


def test_drains_nest_and_the_callback_comes_once_the_requests_in_flight_have_ended(parts):
    clock, fx, make = parts
    fx.add(1, state=State.READY)
    slots = make()
    dep = fx.deployment(1)
    assert slots.take_ready(dep)
    calls: list[str] = []
    first, second = (lambda: calls.append("first")), (lambda: calls.append("second"))
    slots.drain(1, first)
    slots.drain(1, second)
    assert calls == [] and slots.draining(1) and not slots.take_ready(dep)  # no new slot meanwhile
    assert not slots.is_idle(dep)
    slots.release(1)
    assert calls == ["first", "second"]
    assert slots.undrain(1, first) is False and slots.draining(1)  # the other still drains
    assert slots.undrain(1, second) is True and not slots.draining(1) and slots.take_ready(dep)
    third = lambda: calls.append("third")  # noqa: E731
    slots.drain(1, third)  # the slot just taken is in flight: it waits for it
    assert calls[-1] == "second"
    slots.release(1)
    assert calls[-1] == "third"


def test_a_removed_deployments_record_goes_unless_a_drain_or_an_attempt_still_ends(parts):
    clock, fx, make = parts
    for i in (1, 2, 3):
        fx.add(i, state=State.READY)
    slots = make()
    slots.record_failure(1, "boom")
    slots.removed(1)
    assert slots.record(1) is None and slots.backoff_left(1) == 0
    slots.drain(2, lambda: None)
    slots.removed(2)
    assert slots.record(2) is not None and slots.record(2).last_activity is None  # forgotten, kept
    slots.record_for(3).attempt = Attempt(phase=Phase.SETTLING)
    slots.forget_if_unused(3)
    assert slots.attempt(3) is not None  # an effect of its attempt is out
    slots.attempt(3).phase = Phase.IDLE
    slots.forget_if_unused(3)
    assert slots.attempt(3) is None and slots.attempts() == []


def test_the_start_backoff_doubles_up_to_its_cap_and_says_when_it_ends(parts):
    clock, fx, make = parts
    fx.add(1)
    slots = make()
    delays = [slots.record_failure(1, "exit 1").delay for _ in range(7)]
    assert delays[:3] == [BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S]
    assert delays[-1] == BACKOFF_MAX_S and max(delays) == BACKOFF_MAX_S
    clock.t += BACKOFF_MAX_S - 0.5
    err = slots.start_failed(fx.deployment(1), slots.backoff(1))
    assert err.headers == {"Retry-After": "1"}  # never 0: it is still refused
    assert slots.status(1, None)["backoff_until"] == round(1.7e9 + clock.t + 0.5, 3)
    clock.t += 0.5
    assert slots.backoff_left(1) == 0 and slots.status(1, None)["backoff_until"] is None
    slots.reset_backoff(1)
    assert slots.record_failure(1, "again").delay == BACKOFF_FIRST_S  # from the start again
