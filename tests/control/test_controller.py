"""The controller's decision core, deterministic: a fake clock and a recording
fake of its effects, no event loop, no sleeps. One test (or a few) per
paragraph of the controller's behaviour (ondemand/BEHAVIOUR.md, "Controller").
The same rules against real engine processes, raced: test_controller_races.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from ondemand.control.controller import BACKOFF_FIRST_S, BACKOFF_MAX_S, Controller, Phase
from ondemand.control.eviction import Candidate, pick_victims
from ondemand.control.placement import Fit
from ondemand.control.queue import WaitQueue
from ondemand.engines import warmth
from ondemand.errors import InsufficientMemory, OndemandError
from ondemand.model import Deployment, Mode, Priority, Role, State


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        """Move time on, firing the timers that fall due, in order."""
        end = self.t + dt
        while True:
            due = sorted((t for t in self.timers if not t.cancelled and t.when <= end), key=lambda t: t.when)
            if not due:
                break
            timer = due[0]
            self.t = max(self.t, timer.when)
            self.timers.remove(timer)
            timer.callback()
        self.t = end


@dataclasses.dataclass
class FakeTimer:
    when: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class Effects:
    """Records what the core asks for; the test plays the deployer and reports back."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.deps: dict[int, Deployment] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.busy_engines: set[int] = set()
        self.controller: Controller | None = None
        self.rest_costs: dict[str, float] = {"asleep_1": 1.0, "asleep_2": 6.0, "stopped": 60.0}

    # reads
    def deployment(self, dep_id: int) -> Deployment | None:
        return self.deps.get(dep_id)

    def deployments(self) -> list[Deployment]:
        return list(self.deps.values())

    def engine_idle(self, dep_id: int) -> bool:
        return dep_id not in self.busy_engines

    def idle_level(self, dep: Deployment) -> int:
        return warmth.idle_level(dep, per_gpu=True)  # discrete GPUs: a vLLM recipe sleeps at level 1

    def tiers(self, dep: Deployment) -> dict[str, float]:
        return dict(self.rest_costs)  # what the test says the tiers cost (test_keepwarm sets them)

    # actions
    def admit(self, dep_id: int, *, text: str) -> None:
        assert self.controller is not None  # what the deployer would hold back, as of now
        # What the queue holds for others, summed over the GPUs (these tests use one pool).
        self.calls.append(("admit", dep_id, sum(self.controller.held_for_others(dep_id).values()), text))

    def stop(self, dep_id: int, *, text: str, for_dep: int | None) -> None:
        self.calls.append(("stop", dep_id, for_dep, text))

    def sleep(self, dep_id: int, *, text: str, for_dep: int | None, level: int | None = None) -> None:
        self.calls.append(("sleep", dep_id, for_dep, text) if level is None else ("sleep", dep_id, for_dep, text, level))

    def prewarm(self, dep_id: int, *, text: str) -> None:
        assert self.controller is not None  # what the deployer would hold back, as of now
        self.calls.append(("prewarm", dep_id, sum(self.controller.held_for_others(dep_id).values()), text))

    def settle(self, dep_id: int, within_s: float) -> None:
        self.calls.append(("settle", dep_id))

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        self.calls.append(("audit", action, dep_id, text))

    def counters_changed(self, dep_id: int) -> None:
        self.calls.append(("counters", dep_id, self.clock.t))

    def idle_gap(self, dep_id: int, gap_s: float) -> None:
        self.calls.append(("idle_gap", dep_id, gap_s))

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(self.clock.t + delay, callback)
        self.clock.timers.append(timer)
        return timer

    # the test's side of the deployer
    def add(self, dep_id: int, memory_gib: float = 10, *, state: State = State.STOPPED,
            mode: Mode = Mode.ON_DEMAND, **kw: Any) -> int:
        dep = Deployment(id=dep_id, name=f"d{dep_id}", served_name=f"D{dep_id}", memory_gib=memory_gib,
                         state=state, mode=mode).replace(**kw)  # plain values (strings) as typed ones
        self.deps[dep_id] = dep
        if self.controller is not None:
            self.controller.on_deployment(dep_id, dep, None)
        return dep_id

    def set(self, dep_id: int, **changes: Any) -> None:
        old = self.deps[dep_id]
        new = old.replace(**changes)
        self.deps[dep_id] = new
        assert self.controller is not None
        self.controller.on_deployment(dep_id, new, old)

    def remove(self, dep_id: int) -> None:
        old = self.deps.pop(dep_id)
        assert self.controller is not None
        self.controller.on_deployment(dep_id, None, old)

    def taken(self, kind: str) -> list[tuple[Any, ...]]:
        """The calls of ``kind`` since the last look, and forget them."""
        out = [c for c in self.calls if c[0] == kind]
        self.calls = [c for c in self.calls if c[0] != kind]
        return out


class Req:
    """A request's waiter as the async edge would hold it."""

    def __init__(self, c: Controller, dep_id: int, arrival: float | None = None):
        self.wakes = 0
        self.queued = 0
        self.waiter = c.join(dep_id, arrival=c.clock() if arrival is None else arrival,
                             notify=self._wake, on_queued=self._queued)
        self.c = c

    def _wake(self) -> None:
        self.wakes += 1

    def _queued(self) -> None:
        self.queued += 1

    def take(self):
        return self.c.take(self.waiter)

    def code(self) -> str:
        with pytest.raises(OndemandError) as exc:
            self.take()
        self.c.leave(self.waiter)
        return exc.value.code

    def leave(self) -> None:
        self.c.leave(self.waiter)


@pytest.fixture
def world():
    clock = Clock()
    fx = Effects(clock)
    return clock, fx


def make(world, **kw: Any) -> tuple[Controller, Effects, Clock]:
    clock, fx = world
    c = Controller(fx, clock=clock, wall=lambda: 1.7e9 + clock.t, idle_timeout_s=kw.pop("idle_timeout_s", 60),
                   min_idle_timeout_s=kw.pop("min_idle_timeout_s", 1), **kw)
    fx.controller = c
    return c, fx, clock


def start(fx: Effects, c: Controller, dep_id: int) -> None:
    """Play the deployer: the admit effect started it, and it became ready."""
    assert fx.taken("admit")[-1][1] == dep_id
    fx.set(dep_id, state=State.STARTING)
    c.on_admitted(dep_id, True)
    fx.set(dep_id, state=State.READY)


def idle_ready(fx: Effects, c: Controller, clock: Clock, *ids: int) -> None:
    """Make deployments ready and idle for their full timeout."""
    for i in ids:
        fx.set(i, state=State.READY)
    clock.advance(61)


# --- slots -----------------------------------------------------------------------------

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


def test_a_burst_of_first_requests_asks_for_one_start(world):
    c, fx, clock = make(world)
    fx.add(1)
    reqs = [Req(c, 1) for _ in range(50)]
    assert [r.take() for r in reqs] == [None] * 50
    assert len(fx.taken("admit")) == 1  # one attempt shared by every waiter
    assert c.status(1)["queued"] == 50
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    assert c.status(1)["phase"] == "starting_for_request"
    fx.set(1, state=State.READY)
    assert all(r.wakes for r in reqs)
    slots = [r.take() for r in reqs]
    for r in reqs:
        r.leave()
    assert all(slots) and c.inflight(1) == 50 and c.waiting() == 0
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


def test_asleep_is_woken(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.ASLEEP)
    Req(c, 1)
    assert fx.taken("admit")[0][3] == "Woken for a request"


@pytest.mark.parametrize("state", [State.STARTING, State.STOPPING])
def test_states_that_wait_without_starting(world, state):
    c, fx, clock = make(world)
    fx.add(1, state=state)
    r = Req(c, 1)
    assert r.take() is None and fx.taken("admit") == []
    fx.set(1, state=State.READY)
    assert r.take() is not None


def test_a_pending_switch_to_always_on_is_waited_for(world):
    c, fx, clock = make(world)
    fx.add(1, pending_mode=Mode.ALWAYS_ON)
    r = Req(c, 1)
    assert fx.taken("admit") == []
    fx.set(1, state=State.STARTING)
    fx.set(1, state=State.READY, mode=Mode.ALWAYS_ON, pending_mode=None)
    assert r.take() is not None


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


# --- does not fit, make room ---------------------------------------------------------------

def test_does_not_fit_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, 30)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(30, 0, 24))
    assert r.code() == "does_not_fit"
    assert 1 not in c.queue


def test_too_big_is_queued_within_20_s_of_an_on_demand_stop(world):
    """Freed memory may still read as used right after a stop."""
    c, fx, clock = make(world)
    fx.add(1, 30)
    fx.add(2, 10, state=State.READY)
    c.on_stopped(2, True, None)  # the reaper stopped 2 just now
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(30, 0, 24))
    assert r.take() is None and 1 in c.queue and r.queued == 1
    clock.advance(21)
    c.on_settled(1)  # (an unrelated look again later)
    fx.taken("admit")
    c.tick()
    c.on_refused(1, InsufficientMemory(30, 0, 24))
    assert r.code() == "does_not_fit"


def test_the_queues_clock_called_early_takes_the_place_of_its_timer(world):
    """``tick`` called before its timer is due (the tests here, the replay's clairvoyant
    reference, which looks the moment an engine goes quiet) moves the one clock on: the timer it
    replaces is cancelled, else each early call left a second clock ticking beside the first."""
    c, fx, clock = make(world)
    fx.add(1, 30)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(30, 10, 30))  # queued: it fits once memory frees
    assert 1 in c.queue and r.queued == 1

    def clocks() -> int:
        return sum(1 for t in clock.timers if not t.cancelled and t.callback == c.start_side.tick)
    assert clocks() == 1
    c.tick()
    c.tick()
    assert clocks() == 1


def test_make_room_stops_lru_idle_victims_then_waits_for_memory(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    fx.add(3, 10)
    idle_ready(fx, c, clock, 2, 3)
    c.try_take(3).release()  # 3 used just now: 2 is least recently used...
    clock.advance(61)  # ...and both idle for their full timeout
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert [s[1:3] for s in fx.taken("stop")] == [(2, 1)]  # 6 GiB short: one victim, the LRU one
    assert c.attempt_phase(1) is Phase.STOPPING and r.queued == 0  # its victims free enough: no notice
    c.on_stopped(2, True, 1)
    assert fx.taken("settle") == [("settle", 1)]
    assert c.queue.reserved_for_others(99) == {0: 10}  # held for the head
    c.on_settled(1)
    assert fx.taken("admit")[0][1:3] == (1, 0.0)  # the head itself holds nothing against itself
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    assert 1 not in c.queue and c.queue.reserved_for_others(99) == {}
    fx.set(1, state=State.READY)
    assert r.take() is not None


@pytest.mark.parametrize("why", ["timeout", "metrics", "inflight", "waiters", "always_on", "pending"])
def test_who_is_never_a_victim(world, why):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, mode=Mode.ALWAYS_ON if why == "always_on" else Mode.ON_DEMAND)
    idle_ready(fx, c, clock, 2)
    if why == "timeout":
        fx.set(2, idle_timeout_s=600)  # idle 61 s of 600
    elif why == "metrics":
        fx.busy_engines.add(2)  # its engine still runs or queues requests
    elif why == "inflight":
        c.try_take(2)
    elif why == "waiters":
        fx.set(2, state=State.STOPPED)
        Req(c, 2)
        fx.taken("admit")
        fx.set(2, state=State.READY)  # its waiter has not taken its slot yet
    elif why == "pending":
        fx.set(2, pending_mode=Mode.ALWAYS_ON)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == [] and 1 in c.queue
    assert not c.is_idle(fx.deps[2])


def test_if_all_victims_are_not_enough_none_is_stopped(world):
    c, fx, clock = make(world)
    fx.add(1, 20)
    fx.add(2, 5)
    fx.add(3, 5)
    idle_ready(fx, c, clock, 2, 3)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(20, 4, 24))  # 16 short, 10 stoppable
    assert fx.taken("stop") == [] and 1 in c.queue


def test_victims_that_turned_busy_are_left_and_the_head_waits(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    idle_ready(fx, c, clock, 2)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.taken("stop")
    c.on_stopped(2, False, 1)  # the precheck refused: a request got there first
    assert fx.taken("settle") == [] and c.attempt_phase(1) is Phase.IDLE and r.take() is None


def test_only_the_head_makes_room_and_later_entries_see_its_hold(world):
    c, fx, clock = make(world)
    for i in (1, 2, 3):
        fx.add(i, 10)
    fx.add(4, 10)
    idle_ready(fx, c, clock, 4)
    head = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.taken("stop")
    c.on_stopped(4, True, 1)
    later = Req(c, 2)  # arrives while memory was freed for the head
    admit = [a for a in fx.taken("admit") if a[1] == 2][0]
    assert admit[2] == 10  # its fit check keeps the head's 10 GiB out of reach
    c.on_refused(2, InsufficientMemory(10, 4, 24))
    assert c.queue.ids() == [1, 2] and fx.taken("stop") == []  # queued behind, makes no room
    assert later.queued == 1 and head.queued == 0  # the head found its victim: no notice
    head.leave()  # the head gives up: its hold goes, and the next one looks again
    assert c.queue.ids() == [2] and c.queue.reserved_for_others(2) == {}
    c.on_settled(1)
    assert [a[1] for a in fx.taken("admit")] == [2]


def test_a_later_entry_that_fits_starts_while_the_head_is_blocked(world):
    c, fx, clock = make(world)
    fx.add(1, 30)
    fx.add(2, 4)
    fx.add(9, 10, state=State.READY)  # busy: the head can make no room
    c.try_take(9)
    c.on_stopped(9, True, None)  # a stop just now: 1 is queued, not refused
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(30, 14, 24))
    later = Req(c, 2)
    assert fx.taken("admit")[-1][1:3] == (2, 0.0)
    fx.set(2, state=State.STARTING)
    c.on_admitted(2, True)
    fx.set(2, state=State.READY)
    assert later.take() is not None and c.queue.ids() == [1]


def test_queue_order_is_first_arrival(world):
    c, fx, clock = make(world)
    for i in (1, 2, 3):
        fx.add(i, 10)
    late = Req(c, 3, arrival=clock.t)
    early = Req(c, 2, arrival=clock.t - 5)
    c.on_refused(3, InsufficientMemory(10, 0, 24))
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert c.queue.ids() == [2, 3] and c.queue.head() == 2
    assert c.status(2)["phase"] == "queued" and late.queued == early.queued == 1


def test_a_queued_entry_looks_again_when_an_idle_timeout_runs_out(world):
    """No event announces that a model became idle: a timer does, at the latest after 15 s."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, state=State.READY)
    c.try_take(2).release()  # used just now: idle in 60 s
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == []
    clock.advance(45)  # three 15 s looks, each asking again
    for _ in fx.taken("admit"):
        c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == []
    clock.advance(15.1)  # the idle timeout ran out just before this look
    admits = fx.taken("admit")
    assert admits
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [2]


def test_the_queued_notice_fires_once_per_request(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    a = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    b = Req(c, 1)  # joins a queued deployment: told at once
    c.tick()
    for _ in fx.taken("admit"):
        c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert (a.queued, b.queued) == (1, 1)


def test_a_hang_up_while_queued_removes_the_entry(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert c.status(1) == {"inflight": 0, "queued": 1, "last_request_at": None, "phase": "queued", "queue_position": 1,
                           "idle_until": None, "backoff_until": None, "held_for": None, "put_away_early": None}
    r.leave()
    assert 1 not in c.queue and c.waiting() == 0 and c.status(1)["phase"] == "sleeping"


def test_an_attempt_whose_waiters_left_is_not_wanted(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    r = Req(c, 1)
    assert c.wanted(1)
    r.leave()
    assert not c.wanted(1)  # the deployer asks this in the step that would mark starting
    c.on_admitted(1, False)
    assert c.attempt_phase(1) is None


# --- stopped, removed, failed --------------------------------------------------------------

def test_stopped_while_starting_for_a_request(world):
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.taken("admit")
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    fx.set(1, state=State.STOPPING)
    assert r.code() == "ondemand_stopped"
    fx.set(1, state=State.STOPPED)
    assert c.backoff_left(1) == 0  # not a start failure: the next request starts it again
    Req(c, 1)
    assert len(fx.taken("admit")) == 1


def test_removed_while_waiting(world):
    c, fx, clock = make(world)
    fx.add(1)
    fx.add(2, state=State.STARTING)  # started by hand
    starting = Req(c, 1)
    fx.taken("admit")
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    other = Req(c, 2)
    fx.remove(1)
    fx.remove(2)
    assert starting.code() == "ondemand_stopped" and other.code() == "not_found"


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


def test_an_unreadable_budget_is_no_start_failure(world):
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_budget_error(1, "nvidia-smi did not answer within 15 s")
    with pytest.raises(OndemandError) as exc:
        r.take()
    assert exc.value.code == "budget_unavailable" and "nvidia-smi" in exc.value.message
    r.leave()
    assert c.backoff_left(1) == 0  # nothing started: the next request tries again
    Req(c, 1)
    assert len(fx.taken("admit")) == 1


def test_a_background_wake_that_fails_is_start_failed(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.ASLEEP)
    r = Req(c, 1)
    fx.taken("admit")
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    fx.set(1, state=State.FAILED, state_reason="wake_up failed")
    assert r.code() == "start_failed" and c.backoff_left(1) == BACKOFF_FIRST_S


# --- the reaper, idle timers, modes ----------------------------------------------------------

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


def test_switch_to_always_on_plans(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.STOPPED)
    fx.add(2, state=State.READY)
    fx.add(3, state=State.STARTING)
    fx.add(4, state=State.READY, mode=Mode.ALWAYS_ON, role=Role.SYSTEM)
    p = c.plan_mode(1, "always_on")
    assert p.start and p.fields == {"pending_mode": Mode.ALWAYS_ON} and "(pending the start)" in p.text
    p = c.plan_mode(2, "always_on")
    assert not p.start and p.fields == {"mode": Mode.ALWAYS_ON, "pending_mode": None}
    p = c.plan_mode(3, "always_on")
    assert not p.start and p.fields == {"pending_mode": Mode.ALWAYS_ON}
    p = c.plan_mode(2, "on_demand", idle_timeout_s=300, set_idle_timeout=True)
    assert p.detail == {"old": {"mode": "on_demand", "idle_timeout_s": None, "pending_mode": None},
                        "new": {"mode": "on_demand", "idle_timeout_s": 300, "pending_mode": None}}
    for bad, code in (({"mode": "sometimes"}, "invalid_mode"),
                      ({"mode": "on_demand", "idle_timeout_s": 0, "set_idle_timeout": True}, "invalid_idle_timeout")):
        with pytest.raises(OndemandError) as exc:
            c.plan_mode(1, **bad)
        assert exc.value.code == code
    with pytest.raises(OndemandError) as exc:
        c.plan_mode(4, "on_demand")
    assert exc.value.code == "invalid_mode"


def test_a_deployment_switched_to_always_on_while_waiting_is_not_started(world):
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.set(1, mode=Mode.ALWAYS_ON)
    assert r.code() == "not_on_demand"


# --- counters and phases ----------------------------------------------------------------------

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


# --- the eviction rule ------------------------------------------------------------------------

def test_pick_victims_is_the_shortest_lru_prefix_that_covers_the_shortfall():
    def one_pool(need):  # one pool with nothing free: the victims must free ``need``
        return lambda free, victims=(): (0,) if free[0] + 1e-9 >= need else None

    cands = [Candidate(1, {0: 10}, last_used=30), Candidate(2, {0: 5}, last_used=10),
             Candidate(3, {0: 8}, last_used=20)]
    assert [v.id for v in pick_victims(cands, [0], one_pool(12))[0]] == [2, 3]
    assert [v.id for v in pick_victims(cands, [0], one_pool(5))[0]] == [2]
    assert pick_victims(cands, [0], one_pool(24)) == ([], ())  # all of them are not enough: none
    ties = [Candidate(5, {0: 1}, 0), Candidate(4, {0: 1}, 0)]
    assert [v.id for v in pick_victims(ties, [0], one_pool(1))[0]] == [4]  # ties: lower id


def test_pick_victims_per_gpu_stops_only_those_on_the_chosen_set():
    """2 GPUs of 80 GiB, both full: the LRU victim is on GPU 1, but the model
    (60 GiB on one GPU) fits on GPU 0 once the two smaller models there are gone
    too; only the victims on the chosen GPU are stopped."""
    def one_gpu(need):
        return lambda free, victims=(): next(((i,) for i in sorted(range(len(free)), key=lambda i: free[i])
                                  if free[i] + 1e-9 >= need), None)

    cands = [Candidate(1, {1: 40}, last_used=1), Candidate(2, {0: 30}, last_used=2),
             Candidate(3, {0: 30}, last_used=3), Candidate(4, {1: 40}, last_used=4)]
    victims, chosen = pick_victims(cands, [20, 0], one_gpu(60))
    assert chosen == (0,) and [v.id for v in victims] == [2, 3]  # 1 is older, but on GPU 1
    # A two-GPU victim frees memory on both: it counts on each.
    wide = [Candidate(7, {0: 30, 1: 30}, last_used=1)]
    assert pick_victims(wide, [10, 0], one_gpu(35)) == (wide, (0,))


def test_make_room_on_a_two_gpu_box_stops_only_the_victim_on_the_chosen_gpu(world):
    """GPU 0 holds the least recently used model (40 GiB), GPU 1 a 70 GiB one used
    later. A 60 GiB single-GPU model fits on GPU 0 once its victim is gone, so only
    that one is stopped, and the memory freed there is held for the head on GPU 0."""
    c, fx, clock = make(world)
    fx.add(1, 60, gpu_count=1)
    fx.add(2, 40, gpu_count=1, gpus=(0,))
    fx.add(3, 70, gpu_count=1, gpus=(1,))
    idle_ready(fx, c, clock, 2, 3)
    c.try_take(3).release()
    clock.advance(61)
    r = Req(c, 1)
    fit = Fit(60, free=(40, 10), ondemand=(80, 80), count=1, allowed=None, per_gpu=True)
    c.on_refused(1, InsufficientMemory(60, 50, 160, fit=fit))
    assert [s[1:3] for s in fx.taken("stop")] == [(2, 1)] and r.queued == 0
    c.on_stopped(2, True, 1)
    assert c.queue.reserved_for_others(99) == {0: 40}  # on GPU 0 only
    assert fx.taken("settle") == [("settle", 1)]


def test_a_model_that_fits_on_no_allowed_gpu_set_is_does_not_fit_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, 100, gpu_count=1)
    r = Req(c, 1)
    fit = Fit(100, free=(80, 80), ondemand=(80, 80), count=1, allowed=None, per_gpu=True)
    c.on_refused(1, InsufficientMemory(100, 160, 160, fit=fit))
    with pytest.raises(OndemandError) as exc:
        r.take()
    assert exc.value.code == "does_not_fit" and "100 GiB on one GPU" in exc.value.message
    assert "at most 80 GiB on one GPU" in exc.value.message and 1 not in c.queue


def test_a_release_while_something_is_queued_brings_the_next_look_forward(world):
    """The last slot of a model ends: its idle timeout starts, and the queue looks again as
    soon as it runs out, not at the next 15 s look."""
    c, fx, clock = make(world, idle_timeout_s=5)
    fx.add(1, 10)
    fx.add(2, 10, state=State.READY)
    slot = c.try_take(2)
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == []
    slot.release()
    clock.advance(5.1)  # well before the 15 s look
    assert [a[1] for a in fx.taken("admit")] == [1]
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [2]


# --- rules a reviewer found untested --------------------------------------------------------

def test_memory_is_held_for_the_head_as_each_victim_stops(world):
    """Not only once the last victim has stopped: a later entry that looks in between must
    not see the first victim's memory as free."""
    c, fx, clock = make(world)
    for i in (1, 2):
        fx.add(i, 10)
    for i in (3, 4):
        fx.add(i, 5)
    idle_ready(fx, c, clock, 3, 4)
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert sorted(s[1] for s in fx.taken("stop")) == [3, 4]
    c.on_stopped(3, True, 1)
    Req(c, 2)  # looks while 4 is still stopping
    assert fx.taken("admit")[-1][1:3] == (2, 5)  # 3's memory is already held for the head


def test_a_new_head_respects_the_hold_of_the_old_one(world):
    """A request that arrived earlier but was refused later goes in front; the memory freed
    for the old head stays out of its reach."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, state=State.STOPPING)
    fx.add(3, 10)
    idle_ready(fx, c, clock, 3)
    early = Req(c, 2, arrival=clock.t - 30)  # waits for a stop, not yet queued
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.taken("stop")
    c.on_stopped(3, True, 1)
    fx.set(3, state=State.STOPPED)
    fx.set(2, state=State.STOPPED)  # the stop ends: 2 asks, and is the earlier arrival
    assert fx.taken("admit")[-1][1:3] == (2, 10)
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert c.queue.head() == 2 and early.queued == 1
    c.tick()  # the new head asks again: the old head's hold is still out of its reach
    assert fx.taken("admit")[-1][1:3] == (2, 10)


def test_victims_out_for_one_attempt_are_not_picked_again(world):
    c, fx, clock = make(world)
    for i in (1, 2):
        fx.add(i, 10)
    for i in (3, 4):
        fx.add(i, 10)
    idle_ready(fx, c, clock, 3, 4)
    first = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [3]
    assert c.reap() == [4]  # the reaper leaves 3 to the attempt that stops it
    fx.taken("stop")
    first.leave()  # the head gives up while 3 is still stopping
    Req(c, 2)
    fx.taken("admit")
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [4]


def test_no_does_not_fit_after_this_attempt_stopped_a_victim(world):
    """Long after any stop, a too-big answer right after our own make-room is queued:
    the freed memory may not show yet."""
    c, fx, clock = make(world)
    fx.add(1, 20)
    fx.add(2, 10)
    idle_ready(fx, c, clock, 2)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(20, 12, 24))
    fx.taken("stop")
    c.on_stopped(2, True, 1)
    clock.advance(25)  # past the 20 s after any on-demand stop
    c.on_settled(1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(20, 12, 16))
    assert r.take() is None and 1 in c.queue


def test_joining_a_queued_deployment_is_told_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    late = Req(c, 1)
    assert late.queued == 1


def test_removal_drops_the_queue_entry_and_its_hold(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    fx.add(3, 10)
    idle_ready(fx, c, clock, 3)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    c.on_stopped(3, True, 1)
    assert c.held_for_others(2) == {0: 10}
    fx.remove(1)
    assert 1 not in c.queue and c.held_for_others(2) == {}
    assert r.code() == "not_found"


def test_a_model_with_waiters_is_no_victim_even_asleep_and_long_idle(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, state=State.ASLEEP)
    clock.advance(100)  # 2 idle for far longer than its timeout
    Req(c, 1)
    Req(c, 2)  # a request wants 2 woken; it waits for memory too
    fx.taken("admit")
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == [] and not c.is_idle(fx.deps[2])


def test_a_start_by_hand_that_fails_fails_its_waiters_and_backs_off(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.STARTING)  # an administrator's start
    r = Req(c, 1)
    fx.set(1, state=State.FAILED, state_reason="exit 1")
    assert r.code() == "start_failed" and c.backoff_left(1) == BACKOFF_FIRST_S


def test_a_queued_entry_looks_again_at_least_every_15_s(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, state=State.READY, mode=Mode.ALWAYS_ON)  # no idle timeout will ever run out
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    clock.advance(14.9)
    assert fx.taken("admit") == []
    clock.advance(0.2)
    assert [a[1] for a in fx.taken("admit")] == [1]


# --- priorities and limits (BEHAVIOUR.md, "Priorities and limits") ---------------------------------

LOW, NORMAL, HIGH = Priority.LOW, Priority.NORMAL, Priority.HIGH


def test_queue_order_is_priority_then_first_arrival_then_id():
    q = WaitQueue()
    q.add(1, 10.0, NORMAL.rank)
    q.add(2, 5.0, LOW.rank)  # earliest, but low
    q.add(3, 10.0, HIGH.rank)
    q.add(4, 10.0, NORMAL.rank)  # equal arrival and priority to 1: the lower id first
    q.add(5, 9.0, NORMAL.rank)
    q.add(6, 10.0, HIGH.rank)
    assert q.ids() == [3, 6, 5, 1, 4, 2]
    assert q.place(5) == (3, 6) and q.place(2) == (6, 6) and q.place(9) is None
    assert q.overtaken_by(1) == 3 and q.overtaken_by(6) is None and q.overtaken_by(3) is None


def test_a_higher_head_takes_the_reservation_and_what_is_freed_later():
    q = WaitQueue()
    q.add(1, 0.0, LOW.rank)
    q.reserve(1, {0: 10})
    q.add(2, 5.0, NORMAL.rank)  # a later normal: takes the head and the 10 GiB
    assert q.head() == 2 and q.reserved_for_others(1) == {0: 10} and q.reserved_for_others(2) == {}
    q.reserve(1, {1: 4})  # a stop made for the old head ends now: held for the new head too
    assert q.reserved_for_others(1) == {0: 10, 1: 4}
    q.add(3, 1.0, NORMAL.rank)  # the same priority, earlier: it goes first, but takes nothing
    assert q.ids() == [3, 2, 1] and q.reserved_for_others(2) == {}
    q.remove(2)  # the new head gives up: its hold goes (nothing freed goes back to 1)
    assert q.reserved_for_others(3) == {}


def test_queued_requests_start_by_priority_then_arrival(world):
    """Equal arrivals: high first. And a high entry that arrives later still goes first."""
    c, fx, clock = make(world)
    fx.add(9, 10, state=State.READY)
    c.try_take(9)  # busy: nobody can make room
    c.on_stopped(9, True, None)  # (a stop just now: refusals queue, none is does_not_fit)
    for i, p in ((1, LOW), (2, NORMAL), (3, HIGH), (4, NORMAL)):
        fx.add(i, 10, priority=p)
    reqs = {i: Req(c, i, arrival=clock.t) for i in (1, 2, 4)}
    for a in fx.taken("admit"):
        c.on_refused(a[1], InsufficientMemory(10, 0, 24))
    assert c.queue.ids() == [2, 4, 1]
    reqs[3] = Req(c, 3, arrival=clock.t + 1)
    c.on_refused(3, InsufficientMemory(10, 0, 24))
    assert c.queue.ids() == [3, 2, 4, 1] and c.queue.head() == 3
    assert [c.status(i)["queue_position"] for i in (3, 2, 4, 1)] == [1, 2, 3, 4]
    assert c.queue_place(1) == (4, 4) and c.queue_place(9) is None


def test_a_lower_entry_lets_the_higher_head_ask_first(world):
    """Memory freed by a stop nobody made for the head (the reaper here): the head's fit
    check runs first, and the lower entry asks only once the head's answer is in."""
    c, fx, clock = make(world)
    fx.add(9, 10, state=State.READY)
    c.try_take(9)
    c.on_stopped(9, True, None)
    fx.add(1, 10, priority=LOW)
    fx.add(2, 10, priority=HIGH)
    low = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    high = Req(c, 2)
    fx.taken("admit")
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert c.queue.ids() == [2, 1]
    assert [a[1] for a in fx.taken("admit")] == [1]  # after the head's answer, the low one asks again
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.set(9, state=State.STOPPED)  # memory frees: everyone looks again, in the queue's order
    assert [a[1] for a in fx.taken("admit")] == [2]  # the low one waits for the head's answer
    fx.set(2, state=State.STARTING)
    c.on_admitted(2, True)
    assert [a[1] for a in fx.taken("admit")] == [1]  # now the low one asks (and will not fit)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.set(2, state=State.READY)
    assert high.take() is not None and low.take() is None and c.queue.ids() == [1]


def test_head_takeover_with_a_reservation_in_flight(world):
    """A low head is stopping a victim when a high request queues: the high one takes the
    head, stops nothing more, and gets what the victim frees; the low one keeps its deadline."""
    c, fx, clock = make(world, queue_timeout_s=100)
    fx.add(1, 10, priority=LOW)
    fx.add(2, 10, priority=HIGH)
    fx.add(3, 10, priority=LOW)
    fx.add(4, 10, priority=LOW)
    idle_ready(fx, c, clock, 3, 4)
    low = Req(c, 1)
    deadline = low.waiter.deadline
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1:3] for s in fx.taken("stop")] == [(3, 1)]  # the low head's victim, out
    high = Req(c, 2)
    assert fx.taken("admit")[-1][1:3] == (2, 0)
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert c.queue.head() == 2 and fx.taken("stop") == []  # 3's memory is coming to it: no second victim
    c.on_stopped(3, True, 1)  # the stop made for the low head ends
    fx.set(3, state=State.STOPPED)
    assert c.queue.reserved_for_others(1) == {0: 10} and c.queue.reserved_for_others(2) == {}
    assert fx.taken("settle") == [("settle", 1)] and c.settle_target(1) == 2
    c.on_settled(1)
    assert [a[1:3] for a in fx.taken("admit")] == [(2, 0)]  # the high one asks with the hold; the low one waits
    fx.set(2, state=State.STARTING)
    c.on_admitted(2, True)
    assert [a[1] for a in fx.taken("admit")] == [1]
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    # The head now, the low one makes room for itself (4 had stayed untouched until here).
    assert [s[1:3] for s in fx.taken("stop")] == [(4, 1)]
    fx.set(2, state=State.READY)
    assert high.take() is not None
    assert low.waiter.deadline == deadline and low.take() is None and c.queue.ids() == [1]


def test_a_head_taken_over_while_settling_hands_the_settle_on(world):
    c, fx, clock = make(world)
    fx.add(1, 10, priority=NORMAL)
    fx.add(2, 10, priority=HIGH)
    fx.add(3, 10, priority=NORMAL)
    idle_ready(fx, c, clock, 3)
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.taken("stop")
    c.on_stopped(3, True, 1)
    assert c.attempt_phase(1) is Phase.SETTLING and c.queue.reserved_for_others(2) == {0: 10}
    Req(c, 2)
    fx.taken("admit")
    c.on_refused(2, InsufficientMemory(10, 0, 24))  # 3's memory does not read free yet
    assert c.queue.reserved_for_others(1) == {0: 10} and fx.taken("stop") == []
    assert c.settle_target(1) == 2  # the settle out now waits for the high head's fit
    c.on_settled(1)
    assert [a[1:3] for a in fx.taken("admit")] == [(2, 0)]  # the head asks, with the hold; 1 waits for it
    fx.set(2, state=State.STARTING)
    c.on_admitted(2, True)
    assert [a[1:3] for a in fx.taken("admit")] == [(1, 0)]


def test_victims_by_class_lower_priority_first_then_lru(world):
    c, fx, clock = make(world)
    fx.add(1, 10, priority=NORMAL)
    fx.add(2, 10, priority=NORMAL)  # the least recently used
    fx.add(3, 10, priority=LOW)
    fx.add(4, 10, priority=HIGH)  # never a victim of a normal request
    idle_ready(fx, c, clock, 2)
    clock.advance(5)
    idle_ready(fx, c, clock, 3, 4)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [3]  # the low one, though 2 is older
    c.on_stopped(3, True, 1)
    fx.set(3, state=State.STOPPED)
    c.on_settled(1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))  # (freed less than thought) one more
    assert [s[1] for s in fx.taken("stop")] == [2]
    c.on_stopped(2, True, 1)
    fx.set(2, state=State.STOPPED)
    c.on_settled(1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == [] and 1 in c.queue  # only the high one is left: it waits


def test_a_normal_request_never_stops_a_high_idle_model_and_times_out(world):
    c, fx, clock = make(world, queue_timeout_s=30)
    fx.add(1, 10, priority=NORMAL)
    fx.add(2, 10, priority=HIGH)
    idle_ready(fx, c, clock, 2)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("stop") == [] and r.queued == 1
    clock.advance(30)
    assert r.code() == "ondemand_queue_timeout"
    assert fx.deps[2].state is State.READY


def test_a_high_request_against_a_busy_high_model_and_an_idle_low_one(world):
    c, fx, clock = make(world)
    fx.add(1, 10, priority=HIGH)
    fx.add(2, 10, priority=HIGH)
    fx.add(3, 10, priority=LOW)
    idle_ready(fx, c, clock, 2, 3)
    c.try_take(2)  # the high model is busy
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1:4] for s in fx.taken("stop")] == [(3, 1, "Put to sleep to make room for D1")]
    # Both needed: the busy one cannot go, so nothing is stopped at all.
    fx.add(5, 20, priority=HIGH)
    Req(c, 5)
    c.on_refused(5, InsufficientMemory(20, 0, 24))
    assert fx.taken("stop") == []


def test_a_low_request_stops_only_low_models(world):
    c, fx, clock = make(world)
    fx.add(1, 10, priority=LOW)
    fx.add(2, 10, priority=NORMAL)
    fx.add(3, 10, priority=LOW)
    idle_ready(fx, c, clock, 2)
    clock.advance(1)
    idle_ready(fx, c, clock, 3)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [3]


def test_pick_victims_orders_by_rank_then_lru():
    def one_pool(need):
        return lambda free, victims=(): (0,) if free[0] + 1e-9 >= need else None

    cands = [Candidate(1, {0: 10}, last_used=1, rank=NORMAL.rank), Candidate(2, {0: 10}, last_used=9, rank=LOW.rank),
             Candidate(3, {0: 10}, last_used=5, rank=LOW.rank)]
    assert [v.id for v in pick_victims(cands, [0], one_pool(10))[0]] == [3]
    assert [v.id for v in pick_victims(cands, [0], one_pool(25))[0]] == [3, 2, 1]


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


def test_a_priority_edited_while_queued_moves_the_entry(world):
    c, fx, clock = make(world)
    fx.add(9, 10, state=State.READY)
    c.try_take(9)
    c.on_stopped(9, True, None)
    fx.add(1, 10, priority=NORMAL)
    fx.add(2, 10, priority=NORMAL)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    c.queue.reserve(1, {0: 4})  # (as if a stop had freed memory for the head)
    late = Req(c, 2)
    c.on_refused(2, InsufficientMemory(10, 0, 24))
    assert c.queue.ids() == [1, 2]
    fx.set(2, priority=HIGH)  # an administrator's edit (deploy set --priority) while it waits
    assert c.queue.ids() == [2, 1] and c.status(2)["queue_position"] == 1
    assert c.queue.reserved_for_others(1) == {0: 4}  # the hold went with the head's place
    fx.set(2, priority=LOW)
    assert c.queue.ids() == [1, 2] and c.queue.reserved_for_others(1) == {0: 4}  # nothing comes back
    assert late.waiter.deadline == late.waiter.arrival + c.queue_timeout_s


# --- tiered warmth: sleep before stop ----------------------------------------------------------

def test_make_room_puts_awake_engines_to_sleep_before_it_stops_asleep_ones(world):
    """Within a priority: awake first (a sleep frees all but what it kept at its last sleep), then
    asleep (a stop frees what it keeps), least recently used first in each tier."""
    c, fx, clock = make(world)
    fx.add(1, 30)
    fx.add(2, 10, idle_action="sleep", asleep_gib=1)  # sleeps: frees 9
    fx.add(3, 6)  # cannot sleep (no model, auto): stopped, frees 6
    fx.add(4, 10, idle_action="sleep", asleep_gib=2)
    fx.add(5, 10, idle_action="sleep", asleep_gib=3)
    idle_ready(fx, c, clock, 2, 3, 4, 5)
    fx.set(4, state=State.ASLEEP)  # asleep: keeps 2
    fx.set(5, state=State.ASLEEP)  # keeps 3
    clock.advance(61)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(30, 12, 80))  # 18 short
    assert [s[1:3] for s in fx.taken("sleep")] == [(2, 1)]
    # 2 and 3 (awake) free 15, then 4 (asleep, least recently used) 2 and 5 another 3: 20 >= 18
    assert sorted(s[1] for s in fx.taken("stop")) == [3, 4, 5]
    assert c.attempt_phase(1) is Phase.STOPPING


def test_an_awake_engine_that_sleeps_is_put_to_sleep_for_make_room_with_the_old_text(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, idle_action="sleep2")
    idle_ready(fx, c, clock, 2)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    (call,) = fx.taken("sleep")
    assert call[1:] == (2, 1, "Put to sleep to make room for D1") and fx.taken("stop") == []
    c.on_stopped(2, True, 1)  # the sleep effect reports as a stop does
    assert fx.taken("settle") == [("settle", 1)] and c.queue.reserved_for_others(99) == {0: 10}
    assert r.take() is None


def test_the_priority_class_comes_before_the_tier(world):
    """An awake normal engine is never put to sleep while an asleep low one can be stopped."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, idle_action="sleep", priority="normal")
    fx.add(3, 10, idle_action="sleep", priority="low", asleep_gib=10)
    idle_ready(fx, c, clock, 2, 3)
    fx.set(3, state=State.ASLEEP)
    clock.advance(61)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert [s[1] for s in fx.taken("stop")] == [3] and fx.taken("sleep") == []


@pytest.mark.parametrize("why", ["inflight", "waiters", "metrics"])
def test_a_busy_engine_is_never_put_to_sleep(world, why):
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10, idle_action="sleep")
    idle_ready(fx, c, clock, 2)
    if why == "inflight":
        c.try_take(2)
    elif why == "metrics":
        fx.busy_engines.add(2)
    else:
        fx.set(2, state=State.ASLEEP)
        Req(c, 2)  # waits for its wake
        fx.taken("admit")
    assert c.reap() == []
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert fx.taken("sleep") == [] and fx.taken("stop") == []


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


def test_a_wake_raced_by_a_stop_or_a_removal_gives_its_waiters_an_answer(world):
    c, fx, clock = make(world)
    fx.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    fx.add(2, 10, idle_action="sleep", state=State.ASLEEP)
    r1, r2 = Req(c, 1), Req(c, 2)
    assert [a[1] for a in fx.taken("admit")] == [1, 2]
    for dep_id in (1, 2):
        fx.set(dep_id, state=State.STARTING)
        c.on_admitted(dep_id, True)
    fx.set(1, state=State.STOPPING)  # an administrator's stop during the wake
    fx.set(1, state=State.STOPPED)
    assert r1.code() == "ondemand_stopped"
    fx.remove(2)
    assert r2.code() == "ondemand_stopped"
    assert c.waiting() == 0 and c.backoff_left(1) == 0


def test_an_asleep_view_says_when_the_reaper_stops_it_only_with_a_sleep_timeout(world):
    c, fx, clock = make(world, sleep_timeout_s=600)
    fx.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    assert c.status(1)["idle_until"] == pytest.approx(1.7e9 + clock.t + 600)
    c2, fx2, clock2 = make((Clock(), Effects(Clock())))
    fx2.add(1, 10, idle_action="sleep", state=State.ASLEEP)
    assert c2.status(1)["idle_until"] is None  # no sleep_timeout_s: asleep until a request or make-room


def test_the_queued_notice_only_for_the_queue_not_for_a_make_room_that_found_its_victims(world):
    """Issue 29: the notice goes out when a request enters the queue because the idle models
    make-room may take do not free enough; a make-room that found its victims, a start or a
    wake tell nothing (nor one who joins meanwhile); a later refusal with no victims tells."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    fx.add(3, 10, state=State.ASLEEP, sleep_level=1)
    idle_ready(fx, c, clock, 2)
    cold = Req(c, 3)  # a wake only waits for its engine
    assert cold.queued == 0
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert [s[1] for s in fx.taken("sleep") + fx.taken("stop")] == [2] and r.queued == 0
    joined = Req(c, 1)  # joins while its victim is put away: no notice either
    assert joined.queued == 0
    fx.set(2, state=State.STOPPED)
    c.on_stopped(2, True, 1)
    c.on_settled(1)
    assert [a[1] for a in fx.taken("admit")][-1] == 1
    c.on_refused(1, InsufficientMemory(10, 8, 24))  # still short, and nothing idle is left
    assert (r.queued, joined.queued) == (1, 1)
    assert Req(c, 1).queued == 1  # told at once now


# --- issue 29: an asleep engine always holds something; more GPUs than the box has ------------

def test_an_asleep_engine_nothing_was_read_of_is_stopped_for_room_as_freeing_the_default_residue(world):
    """A sleeper whose residue nvidia-smi could not give (no per-process rows, a static budget):
    counted as keeping ``asleep_residue_gib`` per GPU, so stopping it frees that and it is a
    victim, where counting 0 left the request waiting out its queue timeout."""
    c, fx, clock = make(world, asleep_residue_gib=3)
    fx.add(1, 20)
    fx.add(2, 30, idle_action="sleep", gpu_count=1, gpus=(0,))
    idle_ready(fx, c, clock, 2)
    fx.set(2, state=State.ASLEEP)  # asleep_gib None: nothing read after its sleep
    clock.advance(61)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(20, 18, 80, fit=Fit(20, (18.0,), (80.0,), 1, None, True)))  # 2 short
    assert [s[1] for s in fx.taken("stop")] == [2]
    assert c.record(1).attempt.frees == {2: {0: 3.0}}  # what it keeps: 3 on its GPU


def test_a_start_that_needs_more_gpus_than_the_box_has_fails_with_both_numbers(world):
    c, fx, clock = make(world)
    fx.add(1, 40, gpu_count=4)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(40, 160, 160, fit=Fit(40, (80.0, 80.0), (80.0, 80.0), 4, None, True)))
    with pytest.raises(OndemandError, match=r"needs 4 GPUs \(gpu_count\), but this box has 2") as exc:
        r.take()
    assert exc.value.code == "does_not_fit"


# --- an administrator's sleep drains first (issue 29) -----------------------------------

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
