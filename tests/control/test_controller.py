"""The controller, the decision core's coordinator (ondemand/control/controller.py), deterministic:
core_doubles.py's fake clock and recording fake of its effects, no event loop, no sleeps. A
request's wait (its slot, the refusals that need no wait, its deadline, ``max_inflight``), the start
backoff, the reaper's step and the idle timers, the views' counters and phases, shutdown, and an
administrator's drain (ondemand/BEHAVIOUR.md, "Controller"). Its parts on their own: the start side
(attempts, make-room, relocation's steps) in test_attempts.py, the memory queue in test_queue.py,
the slots in test_slots.py. The same rules against real engine processes, raced:
test_controller_races.py.
"""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, idle_ready, make, start

from ondemand.control.controller import BACKOFF_FIRST_S, BACKOFF_MAX_S
from ondemand.errors import InsufficientMemory, OndemandError
from ondemand.model import Mode, Role, State


@pytest.fixture
def world():
    clock = Clock()
    fx = Effects(clock)
    return clock, fx


# --- a request's wait: its slot, the refusals that need no wait, its deadline ---------------------

def test_ready_gives_a_slot_at_once_and_release_is_idempotent(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    slot = c.try_take(1)
    assert slot is not None and c.inflight(1) == 1 and c.status(1)["phase"] == "serving"
    slot.release()
    slot.release()
    assert c.inflight(1) == 0 and c.status(1)["phase"] == "idle"
    assert c.status(1)["last_request_at"] == 1.7e9 + clock.t
    assert fx.taken("admit") == []


def test_a_slot_is_counted_only_when_the_waiter_takes_it(world):
    """A waiter woken by ready that hangs up before its turn has taken nothing."""
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    start(fx, c, 1)
    assert r.wakes and c.inflight(1) == 0
    r.leave()  # the hang-up, before take()
    assert c.inflight(1) == 0 and c.waiting() == 0 and c.status(1)["queued"] == 0


def test_queue_full_fails_at_once(world):
    c, fx, clock = make(world, max_queued=3)
    fx.add(1)
    for _ in range(3):
        Req(c, 1)
    with pytest.raises(OndemandError) as exc:
        Req(c, 1)
    assert exc.value.code == "ondemand_queue_full" and exc.value.headers["Retry-After"] == "60"
    assert c.waiting() == 3


def test_the_deadline_counts_from_arrival_and_a_timeout_is_audited(world):
    c, fx, clock = make(world, queue_timeout_s=1)
    fx.add(1)
    r = Req(c, 1, arrival=clock.t - 0.8)
    assert c.next_wake(r.waiter) == pytest.approx(0.2)
    clock.advance(0.2)
    assert r.code() == "ondemand_queue_timeout"
    assert [a[1] for a in fx.taken("audit")] == ["ondemand_queue_timeout"]
    assert c.waiting() == 0


def test_planned_is_refused_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.PLANNED)
    with pytest.raises(OndemandError) as exc:
        Req(c, 1)
    assert exc.value.code == "ondemand_planned" and c.waiting() == 0


def test_unknown_is_not_found(world):
    c, fx, clock = make(world)
    with pytest.raises(OndemandError) as exc:
        Req(c, 9)
    assert exc.value.code == "not_found"


# --- max_inflight ---------------------------------------------------------------------------------

def test_max_inflight_refuses_at_once_with_429_and_frees_again(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, max_inflight=2)
    a, b = c.try_take(1), c.try_take(1)
    with pytest.raises(OndemandError) as exc:
        c.try_take(1)
    err = exc.value
    assert (err.status, err.code, err.type) == (429, "ondemand_busy", "rate_limit_error")
    assert err.headers == {"Retry-After": "1", "x-should-retry": "true"} and "max_inflight" in err.message
    assert c.inflight(1) == 2 and c.waiting() == 0 and c.busy_total(1) == 1
    assert c.backoff_left(1) == 0 and fx.taken("admit") == []  # no failed start, nothing queued
    a.release()
    assert c.try_take(1) is not None and c.inflight(1) == 2
    b.release()
    fx.set(1, max_inflight=None)  # an edit while it runs: no limit from now on
    assert all(c.try_take(1) for _ in range(50))


def test_max_inflight_counts_slots_not_waiters_and_refuses_past_it_when_ready(world):
    """Requests waiting for a start do not count; once it is ready, those past the limit
    are told 429 too (it is no queue for the limit)."""
    c, fx, clock = make(world)
    fx.add(1, max_inflight=2)
    reqs = [Req(c, 1) for _ in range(3)]  # three wait for the start: none is refused
    assert c.waiting() == 3
    start(fx, c, 1)
    outcomes = []
    for r in reqs:
        try:
            outcomes.append("slot" if r.take() else None)
        except OndemandError as exc:
            outcomes.append(exc.code)
        r.leave()
    assert outcomes == ["slot", "slot", "ondemand_busy"] and c.inflight(1) == 2 and c.waiting() == 0
    assert c.backoff_left(1) == 0


def test_the_limit_under_seeded_random_acquires_and_releases(world):
    """Many rounds of take / release / hang-up in a seeded random order, one step at a
    time as the event loop would run them: the count never passes the limit, and
    every refusal is a 429 that changed nothing."""
    import random
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, max_inflight=3)
    for seed in range(20):
        rnd = random.Random(seed)
        held = []
        busy = c.busy_total(1)
        for _ in range(500):
            if held and rnd.random() < 0.45:
                held.pop(rnd.randrange(len(held))).release()
            else:
                try:
                    held.append(c.try_take(1))
                except OndemandError as exc:
                    assert exc.code == "ondemand_busy" and len(held) == 3
                    busy += 1
            assert c.inflight(1) == len(held) <= 3
        assert c.busy_total(1) == busy
        for s in held:
            s.release()
    assert c.inflight(1) == 0


# --- the start backoff ----------------------------------------------------------------------------

def test_a_failed_start_backs_off_60_s_doubling_to_900(world):
    c, fx, clock = make(world)
    fx.add(1)
    delays = []
    for _ in range(6):
        r = Req(c, 1)
        fx.taken("admit")
        fx.set(1, state=State.STARTING)
        c.on_admitted(1, True)
        fx.set(1, state=State.FAILED, state_reason="engine exited with code 1")
        assert r.code() == "start_failed"
        delays.append(c.backoff_left(1))
        with pytest.raises(OndemandError) as exc:
            Req(c, 1)  # refused at once during the backoff
        assert exc.value.code == "start_failed" and "engine exited" in exc.value.message
        clock.advance(c.backoff_left(1))
    assert delays == [BACKOFF_FIRST_S, 120, 240, 480, BACKOFF_MAX_S, BACKOFF_MAX_S]


@pytest.mark.parametrize("reset", ["ready", "set_mode", "config"])
def test_what_resets_the_backoff(world, reset):
    c, fx, clock = make(world)
    fx.add(1)
    c.on_start_error(1, "x")  # nobody waits: nothing
    r = Req(c, 1)
    fx.taken("admit")
    c.on_start_error(1, "the engine cannot start from this state")
    assert r.code() == "start_failed" and c.backoff_left(1) == BACKOFF_FIRST_S
    if reset == "ready":
        fx.set(1, state=State.STARTING)
        fx.set(1, state=State.READY)
    elif reset == "set_mode":
        c.plan_mode(1, "on_demand")
    else:
        fx.set(1, memory_gib=12)
    assert c.backoff_left(1) == 0


def test_a_start_by_hand_during_the_backoff_is_waited_for(world):
    """Backoff refuses new starts, not a start an administrator made."""
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_start_error(1, "bad")
    assert r.code() == "start_failed" and c.backoff_left(1) > 0
    fx.set(1, state=State.STARTING)  # an administrator starts it
    waiting = Req(c, 1)
    assert waiting.take() is None and fx.taken("admit") == []
    fx.set(1, state=State.READY)
    assert waiting.take() is not None


# --- the reaper's step and the idle timers --------------------------------------------------------

def test_the_reaper_stops_what_is_idle_for_its_full_timeout(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, idle_timeout_s=120)
    fx.add(2, state=State.READY)
    fx.add(3, state=State.READY, mode=Mode.ALWAYS_ON)
    fx.add(4, state=State.ASLEEP)  # asleep stays asleep: no sleep_timeout_s
    fx.add(5, state=State.READY, role=Role.SYSTEM)
    clock.advance(60)
    assert c.reap() == [2]
    assert [s[3] for s in fx.taken("stop")] == ["Put to sleep after 1 min idle"]
    clock.advance(60)
    assert c.reap() == [1, 2]  # (2 again: the deployer refuses a second stop)


def test_the_idle_timer_restarts_on_grant_release_ready_and_the_switch(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    fx.add(2)
    clock.advance(59)
    c.try_take(1).release()
    clock.advance(59)
    assert c.reap() == []
    clock.advance(1)
    assert c.reap() == [1]
    fx.set(2, state=State.STARTING)
    clock.advance(100)
    fx.set(2, state=State.READY)  # ready: the timer restarts
    clock.advance(59)
    assert 2 not in c.reap()
    fx.set(2, mode=Mode.ALWAYS_ON)
    clock.advance(100)
    fx.set(2, mode=Mode.ON_DEMAND)  # switched to on demand: a full timeout again
    clock.advance(59)
    assert 2 not in c.reap()


def test_after_a_restart_every_deployment_waits_a_full_idle_timeout(world):
    clock, fx = world
    fx.add(1, state=State.READY)
    c, fx, clock = make(world)  # made after the deployment: first seen now
    clock.advance(59)
    assert c.reap() == []
    clock.advance(1)
    assert c.reap() == [1]


def test_the_reaper_sleeps_what_sleeps_stops_the_rest_and_leaves_sleepers_asleep(world):
    c, fx, clock = make(world, sleep_timeout_s=300)
    fx.add(1, 10, idle_action="sleep")
    fx.add(2, 10)  # no model: auto is stop
    fx.add(3, 10, idle_action="stop")
    fx.add(4, 10, idle_action="sleep")
    idle_ready(fx, c, clock, 1, 2, 3, 4)
    fx.set(4, state=State.ASLEEP)
    clock.advance(61)
    assert c.reap() == [1, 2, 3]
    assert [s[1] for s in fx.taken("sleep")] == [1]
    assert sorted(s[1] for s in fx.taken("stop")) == [2, 3]
    clock.advance(240)  # asleep 301 s: past sleep_timeout_s
    assert 4 in c.reap()
    stops = {s[1]: s[3] for s in fx.taken("stop")}
    assert stops[4] == "Stopped after 5.02 min asleep (sleep_timeout_s)"


def test_without_sleep_timeout_an_asleep_engine_sleeps_on_and_a_request_wakes_it(world):
    c, fx, clock = make(world)
    fx.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    clock.advance(86400)
    assert c.reap() == []
    r = Req(c, 1)
    assert fx.taken("admit")[0][3] == "Woken for a request" and r.queued == 0  # no queued notice for a wake
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    fx.set(1, state=State.READY)
    assert r.take() is not None


def test_an_asleep_view_says_when_the_reaper_stops_it_only_with_a_sleep_timeout(world):
    c, fx, clock = make(world, sleep_timeout_s=600)
    fx.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + clock.t + 600)
    c2, fx2, clock2 = make((Clock(), Effects(Clock())))
    fx2.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    assert c2.status(1)["idle_until"] is None  # no sleep_timeout_s: asleep until a request or make-room


# --- counters, phases and shutdown ----------------------------------------------------------------

def test_counters_publish_at_most_once_a_second_first_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    slots = [c.try_take(1) for _ in range(5)]
    assert len(fx.taken("counters")) == 1  # the first change at once
    clock.advance(0.5)
    slots[0].release()
    assert fx.taken("counters") == []
    clock.advance(0.6)  # folded into one, a second after the previous one
    assert fx.taken("counters") == [("counters", 1, 1001.0)]
    clock.advance(5)
    assert fx.taken("counters") == []


def test_status_phases_in_order_of_precedence(world):
    c, fx, clock = make(world)
    fx.add(1)
    assert c.status(1)["phase"] == "sleeping"
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert c.status(1)["phase"] == "queued"
    c.tick()
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    assert c.status(1)["phase"] == "starting_for_request"
    fx.add(2, state=State.FAILED)
    assert c.status(2)["phase"] == "failed" and c.status(99)["phase"] == "failed"
    fx.add(3, state=State.READY)
    assert c.status(3)["phase"] == "idle"
    c.try_take(3)
    assert c.status(3)["phase"] == "serving"


def test_status_says_when_the_reaper_may_take_it_and_when_the_backoff_ends(world):
    """Wall times the web page counts down to: the idle deadline of a ready on-demand model
    nobody uses (none while it serves or is waited for), and the end of a start backoff."""
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, idle_timeout_s=120)
    wall = 1.7e9 + clock.t
    assert c.status(1)["idle_until"] == pytest.approx(wall + 120)
    clock.advance(30)
    assert c.status(1)["idle_until"] == pytest.approx(wall + 120)  # counted from the last activity
    slot = c.try_take(1)
    assert c.status(1)["idle_until"] is None  # serving: no deadline
    slot.release()
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + clock.t + 120)
    fx.add(2, state=State.STOPPED)
    assert c.status(2)["idle_until"] is None and c.status(2)["backoff_until"] is None
    r = Req(c, 2)
    fx.taken("admit")
    c.on_start_error(2, "no such command")
    with pytest.raises(OndemandError):
        r.take()
    assert c.status(2)["backoff_until"] == pytest.approx(1.7e9 + clock.t + 60)


def test_at_shutdown_waiters_hear_it_at_once_and_nothing_starts_or_stops_for_them(world):
    c, fx, clock = make(world)
    fx.add(1, 10)  # queued for memory
    fx.add(2, 10)  # its start is out
    fx.add(3, 10)
    idle_ready(fx, c, clock, 3)  # a victim the reaper or make-room could take
    queued = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.taken("stop")
    starting = Req(c, 2)
    fx.taken("admit")
    c.shutdown()
    for r in (queued, starting):
        with pytest.raises(OndemandError) as exc:
            r.take()
        assert exc.value.code == "ondemand_shutting_down" and exc.value.status == 503
    assert not c.wanted(2)  # the admit still out starts nothing
    assert len(c.queue) == 0 and c.reap() == []
    c.on_refused(2, InsufficientMemory(10, 0, 24))  # the admit's report: no make-room now
    assert fx.taken("stop") == [] and fx.taken("admit") == []
    with pytest.raises(OndemandError) as exc:
        Req(c, 1)
    assert exc.value.code == "ondemand_shutting_down"


# --- an administrator's sleep drains first (issue 29) ---------------------------------------------

def test_a_drain_grants_nothing_and_reports_once_the_last_request_ends(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    a, b = c.try_take(1), c.try_take(1)
    drained: list[int] = []

    def on_drained() -> None:
        drained.append(1)
    c.drain(1, on_drained)
    assert c.try_take(1) is None  # the fast path gives nothing while it drains
    late = Req(c, 1)
    assert late.take() is None and late.wakes == 0 and fx.taken("admit") == []  # it waits, starts nothing
    a.release()
    assert drained == []  # one still in flight
    b.release()
    b.release()  # a second release of one slot drains nothing twice
    assert drained == [1] and c.inflight(1) == 0
    fx.set(1, state=State.ASLEEP)  # the sleep call ended
    c.undrain(1, on_drained)  # called and forgotten already: undrain only ends the drain
    assert fx.taken("admit")[0][3] == "Woken for a request"  # the request that came meanwhile wakes it


def test_a_drain_with_nothing_in_flight_reports_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    drained: list[int] = []
    c.drain(1, lambda: drained.append(1))
    assert drained == [1] and c.try_take(1) is None


def test_a_drain_past_its_deadline_serves_on_and_its_waiters_get_slots(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    busy = c.try_take(1)
    drained: list[int] = []

    def on_drained() -> None:
        drained.append(1)
    c.drain(1, on_drained)
    late = Req(c, 1)
    assert late.take() is None
    c.undrain(1, on_drained)  # the deadline: nothing slept
    assert late.wakes and late.take() is not None  # served by the engine that stayed ready
    late.leave()
    busy.release()
    assert drained == []  # the callback went with the deadline: no sleep after it
    assert c.try_take(1) is not None and fx.taken("admit") == []


def test_a_draining_deployment_is_nobody_s_victim(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    idle_ready(fx, c, clock, 1)
    assert c.is_idle(fx.deps[1])
    c.drain(1, lambda: None)
    assert not c.is_idle(fx.deps[1])  # the reaper and make-room leave an administrator's sleep alone
    c.drain(1, lambda: None)  # two drains at once: slots only after both are over
    c.undrain(1, lambda: None)
    assert c.try_take(1) is None
    c.undrain(1, lambda: None)
    assert c.try_take(1) is not None
