"""What the decision core holds of a deployment (ondemand/control/record.py): a ``Record``
forgotten when its deployment goes keeps only what still ends on its own (its attempt, its
drains), and cancels the timers it held; an adaptive deployment's idle period ends with its
pre-warm's timer."""
from __future__ import annotations

import math

from core_doubles import FakeTimer

from ondemand.control.record import NOTHING, AdaptiveState, Attempt, Backoff, Period, Record, Waiter


def waiter() -> Waiter:
    return Waiter(1, arrival=0.0, deadline=30.0, on_queued=None, notify=lambda: None)


def test_a_new_record_holds_nothing():
    rec = Record()
    assert rec.unused() and rec.waiters() == 0 and rec.inflight == 0
    assert rec.last_activity is None and rec.backoff is None and rec.published_at == -math.inf
    assert NOTHING.unused() and NOTHING.waiters() == 0  # what a read of an unknown deployment sees


def test_forget_keeps_the_attempt_and_the_drains_and_cancels_the_timers():
    rec = Record()
    rec.inflight, rec.last_activity, rec.last_request_at, rec.asleep_since, rec.idle_since = 2, 5.0, 1.7e9, 3.0, 4.0
    rec.backoff, rec.busy, rec.published_at, rec.learned = Backoff(60.0, 60.0, "exit 1"), 3, 9.0, 4
    rec.publish_timer = publish = FakeTimer(10.0, lambda: None)
    prewarm = FakeTimer(20.0, lambda: None)
    rec.adaptive = AdaptiveState(period=Period(began=4.0, timer=prewarm), hits=1)
    rec.attempt = Attempt(waiters=[waiter()])
    drained = [lambda: None]
    rec.drains, rec.drained = 1, drained
    rec.forget()
    assert (rec.inflight, rec.busy, rec.learned, rec.published_at) == (0, 0, 0, -math.inf)
    assert None is rec.last_activity is rec.last_request_at is rec.asleep_since is rec.idle_since
    assert rec.backoff is None and rec.adaptive is None and rec.rhythm is None and rec.publish_timer is None
    assert publish.cancelled and prewarm.cancelled  # nothing fires for a deployment that is gone
    assert rec.waiters() == 1 and rec.drains == 1 and rec.drained is drained  # they end on their own
    assert not rec.unused()
    rec.attempt, rec.drains = None, 0
    assert not rec.unused()  # a drain's callback still waits for its requests
    rec.drained = []
    assert rec.unused()


def test_the_end_of_an_idle_period_cancels_its_prewarm_and_keeps_the_counts():
    timer = FakeTimer(30.0, lambda: None)
    state = AdaptiveState(period=Period(began=1.0, timer=timer), hits=2, misses=1)
    state.end()
    assert timer.cancelled and state.period is None and (state.hits, state.misses) == (2, 1)
    state.end()  # no period: nothing to end
    assert state.period is None
