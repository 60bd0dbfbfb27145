"""The start side of the decision core (ondemand/control/attempts.py), deterministic: the fake clock
and recording effects of core_doubles.py, the test playing the deployer. Each deployment's attempt
(one admit out at a time for all its waiters, and the states it waits in instead), the admit's
reports (does not fit, queued, the budget unread, a start that ends), make-room for the head of the
memory queue (which idle models, awake before asleep, put away, then the wait for their memory), the
queued notice, the queue's clock, relocation's steps, and make-room's account of its victims (then
through a real ondemand: the audit row, the metric, the view and ``ondemand status``). The queue's
order and holds: test_queue.py; the victims' rule alone: test_eviction.py."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, idle_ready, make
from helpers import wait_for
from test_relocation import stranded

from ondemand import app as app_mod
from ondemand.control import scheduler as schedulers
from ondemand.control.attempts import Attempts
from ondemand.control.controller import BACKOFF_FIRST_S, Phase
from ondemand.control.placement import Fit
from ondemand.control.scheduler import SeedScheduler
from ondemand.control.slots import Slots
from ondemand.control.warmth_policy import Fixed
from ondemand.errors import InsufficientMemory, OndemandError
from ondemand.model import Mode, Priority, State

LOW, NORMAL, HIGH = Priority.LOW, Priority.NORMAL, Priority.HIGH
SLO_S = 5.0  # make-room's account: the cost scheduler's SLO (lull)


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


# --- an attempt: one admit for all its waiters, and what it waits for instead ---------------------

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


def test_a_deployment_switched_to_always_on_while_waiting_is_not_started(world):
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    fx.set(1, mode=Mode.ALWAYS_ON)
    assert r.code() == "not_on_demand"


def test_an_attempt_whose_waiters_left_is_not_wanted(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    r = Req(c, 1)
    assert c.wanted(1)
    r.leave()
    assert not c.wanted(1)  # the deployer asks this in the step that would mark starting
    c.on_admitted(1, False)
    assert c.attempt_phase(1) is None


# --- the start side on its own, without the controller --------------------------------------------

class HoldsOnly:
    """What the recording effects ask of the core besides its reports: the holds, read as an admit
    goes out. (The deployer's changes of a deployment are the test's own here.)"""

    def __init__(self, scheduler: SeedScheduler):
        self.scheduler = scheduler

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        return self.scheduler.held_for_others(dep_id)

    def on_deployment(self, dep_id, dep, old) -> None:
        pass


def test_on_its_own_the_start_side_tells_its_owner_of_each_change_of_the_queue(world):
    """``Attempts`` over the slots part and the seed scheduler, as the controller makes them, with no
    controller: its owner hears of every change of the memory queue (``on_queue``: adaptive warmth's
    idle rule follows it), after the change, as a refused admit queues a deployment, as its admitted
    start takes it out, and as a removal drops one."""
    clock, fx = world
    fixed = Fixed(lambda dep: 60)
    slots = Slots(fx, clock=clock, wall=lambda: 1.7e9 + clock.t, warmth=lambda dep, rec: fixed, min_idle_timeout_s=1)
    scheduler = SeedScheduler()
    heard: list[list[int]] = []
    side = Attempts(fx, slots, scheduler, on_queue=lambda: heard.append(scheduler.queue.ids()), make_room_wait_s=20,
                    recent_stop_s=20, max_tick_s=15, asleep_residue_gib=2)
    fx.add(1, 10)
    fx.add(2, 10)
    fx.controller = HoldsOnly(scheduler)
    for dep_id in (1, 2):
        slots.join(fx.deployment(dep_id), arrival=clock.t, notify=lambda: None, on_queued=None, queued=False)
        side.advance(dep_id)
    assert [a[1] for a in fx.taken("admit")] == [1, 2] and side.wanted(1)
    side.on_refused(1, InsufficientMemory(10, 0, 24))  # fits once memory frees, nothing to take: queued
    side.on_refused(2, InsufficientMemory(10, 0, 24))
    assert heard == [[1], [1, 2]]
    fx.deps[1] = fx.deps[1].replace(state=State.STARTING)  # the deployer marks it as its start is admitted
    side.on_admitted(1, True)
    assert heard[2:] == [[2]] and scheduler.queue.ids() == [2]
    side.removed(2)
    assert heard[3:] == [[]] and len(scheduler.queue) == 0
    assert side.make_rooms == {}  # nothing was put away
    side.stop_ticking()


# --- the admit's reports: refused (does not fit, or queued), the budget unread, a start that ends ---

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


def test_a_start_that_needs_more_gpus_than_the_box_has_fails_with_both_numbers(world):
    c, fx, clock = make(world)
    fx.add(1, 40, gpu_count=4)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(40, 160, 160, fit=Fit(40, (80.0, 80.0), (80.0, 80.0), 4, None, True)))
    with pytest.raises(OndemandError, match=r"needs 4 GPUs \(gpu_count\), but this box has 2") as exc:
        r.take()
    assert exc.value.code == "does_not_fit"


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


def test_a_background_wake_that_fails_is_start_failed(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.ASLEEP)
    r = Req(c, 1)
    fx.taken("admit")
    fx.set(1, state=State.STARTING)
    c.on_admitted(1, True)
    fx.set(1, state=State.FAILED, state_reason="wake_up failed")
    assert r.code() == "start_failed" and c.backoff_left(1) == BACKOFF_FIRST_S


def test_a_start_by_hand_that_fails_fails_its_waiters_and_backs_off(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.STARTING)  # an administrator's start
    r = Req(c, 1)
    fx.set(1, state=State.FAILED, state_reason="exit 1")
    assert r.code() == "start_failed" and c.backoff_left(1) == BACKOFF_FIRST_S


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


# --- make-room: the head's victims, put away, then the wait for their memory ----------------------

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


def test_a_sleep_whose_call_is_out_is_waited_for_never_taken_and_its_end_offers_the_memory(world):
    """2 was put to sleep by the reaper; its call is still out, so its memory is not free yet
    (``rules.as_read``). The head takes no victim meanwhile (2 is no victim mid-call: stopping it
    would cost its next request a cold start) and does not relocate or stop others; the call's end
    (``on_slept``) offers the memory: the head asks again at once."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    idle_ready(fx, c, clock, 2)
    fx.set(2, state=State.ASLEEP, sleep_level=1)
    fx.sleep_calls_out.add(2)
    r = Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert fx.taken("stop") == [] and fx.taken("sleep") == [] and r.queued == 1
    fx.sleep_calls_out.discard(2)
    c.on_slept(2)
    assert [a[1] for a in fx.taken("admit")] == [1]


def test_memory_offered_by_a_sleeps_end_takes_no_victim_the_queues_look_does(world):
    """An offer (a sleep's end, a measurement's update) lets whoever fits start; a head that does
    not fit takes no victim then: make-room waits for the queue's look (design.md)."""
    c, fx, clock = make(world)
    fx.add(1, 10)
    fx.add(2, 10)
    fx.add(3, 10)
    idle_ready(fx, c, clock, 2)
    fx.busy_engines.add(2)  # its engine's metrics show work: no victim for now
    Req(c, 1)
    fx.taken("admit")
    c.on_refused(1, InsufficientMemory(10, 4, 24))  # queued: nothing to take
    fx.set(3, state=State.ASLEEP, sleep_level=1)  # 3, awake elsewhere, is marked asleep: the queue looks
    assert [a[1] for a in fx.taken("admit")] == [1]
    c.on_refused(1, InsufficientMemory(10, 4, 24))  # its call is out: nothing freed yet, nothing to take
    fx.busy_engines.discard(2)  # 2 is quiet now; the queue has not looked since
    c.on_slept(3)
    assert [a[1] for a in fx.taken("admit")] == [1]
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert fx.taken("stop") == [] and fx.taken("sleep") == []  # the offer took no victim
    c.tick()
    assert [a[1] for a in fx.taken("admit")] == [1]
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    assert [v[1] for v in fx.taken("sleep") + fx.taken("stop")] == [2]  # the look makes room


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
    c.on_refused(1, InsufficientMemory(8, 0, 24))  # asleep, 2 keeps the default residue (2): frees 8
    (call,) = fx.taken("sleep")
    assert call[1:] == (2, 1, "Put to sleep to make room for D1") and fx.taken("stop") == []
    c.on_stopped(2, True, 1)  # the sleep effect reports as a stop does
    assert fx.taken("settle") == [("settle", 1)] and c.queue.reserved_for_others(99) == {0: 8}
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


def test_an_awake_victim_nothing_was_read_of_frees_all_but_the_default_residue_when_put_to_sleep(world):
    """Put to sleep, an engine never measured asleep keeps ``asleep_residue_gib`` per GPU, as the
    budget counts it: make-room counts that, so it does not put it to sleep for room it will not
    free (counting 0 once left a 76.7 GiB model 0.7 GiB short behind two small sleepers' residues
    on the replay's DGX, its requests timing out)."""
    c, fx, clock = make(world, asleep_residue_gib=3)
    fx.add(1, 20)
    fx.add(2, 30, idle_action="sleep", gpu_count=1, gpus=(0,))
    idle_ready(fx, c, clock, 2)
    clock.advance(61)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(20, 0, 80, fit=Fit(20, (0.0,), (80.0,), 1, None, True)))
    assert [s[1] for s in fx.taken("sleep")] == [2]
    assert c.record(1).attempt.frees == {2: {0: 27.0}}  # 30 less the 3 it keeps asleep


@pytest.mark.parametrize("need, stopped", [(70.0, []), (76.7, [2, 3])])
def test_victims_whose_sleep_would_not_make_room_are_stopped_instead(world, need, stopped):
    """Where putting the quiet engines to sleep makes room, they sleep; where it cannot (what they
    keep asleep is in the way: a model that needs nearly a whole GPU), make-room stops them
    instead, all that it takes (the GPU is cleared of what would stand in the model's way again),
    rather than leave the request to wait out its queue timeout beside free memory."""
    c, fx, clock = make(world, asleep_residue_gib=2)
    fx.add(1, need)
    fx.add(2, 29, idle_action="sleep", gpu_count=1, gpus=(0,))
    fx.add(3, 17.9, idle_action="sleep", gpu_count=1, gpus=(0,))
    idle_ready(fx, c, clock, 2, 3)
    clock.advance(61)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(need, 33.1, 80, fit=Fit(need, (33.1,), (80.0,), 1, None, True)))
    # asleep, 2 and 3 keep 2 each: 33.1 + 27 + 15.9 = 76, enough for 70, not for 76.7
    assert sorted(s[1] for s in fx.taken("sleep")) == [d for d in (2, 3) if d not in stopped]
    # the design document's text for every stop of an awake victim
    assert [(s[1], s[3]) for s in fx.taken("stop")] == [(d, "Put to sleep to make room for D1") for d in stopped]
    frees = {2: 29.0 if 2 in stopped else 27.0, 3: 17.9 if 3 in stopped else 15.9}
    assert c.record(1).attempt.frees == {d: {0: pytest.approx(gib)} for d, gib in frees.items()}


def test_a_stranded_sleeper_relocates_before_make_room_stops_awake_engines_for_it(world):
    """A sleeper that cannot wake where it is, under a scheduler that relocates: starting it cold
    elsewhere costs only its own requests, where stopping the awake engines on its GPU costs
    theirs too; so it relocates first."""
    c, fx, clock = make(world, asleep_residue_gib=2, scheduler=schedulers.cost(SLO_S))
    fx.add(1, 77, state=State.ASLEEP, sleep_level=1, gpu_count=1, gpus=(0,), idle_action="sleep")
    fx.add(2, 29, idle_action="sleep", gpu_count=1, gpus=(0,))
    idle_ready(fx, c, clock, 2)
    clock.advance(61)
    Req(c, 1)
    # GPU 0: 2 awake (29), which asleep would keep 2 (49 + 27 = 76 < 77; stopped, 78 would do);
    # GPU 1 empty: a cold start fits there now
    c.on_refused(1, InsufficientMemory(77, 49, 80, fit=Fit(77, (49.0, 80.0), (80.0, 80.0), 1, (0,), True)))
    assert [s[1:3] for s in fx.taken("stop")] == [(1, 1)] and fx.taken("sleep") == []


# --- the queued notice: only for the queue --------------------------------------------------------

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


def test_joining_a_queued_deployment_is_told_at_once(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    late = Req(c, 1)
    assert late.queued == 1


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


# --- the queue's clock ----------------------------------------------------------------------------

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


# --- relocation's steps (where it may go: relocation.py; when it does not: test_relocation.py) ----

def test_a_stranded_sleeper_is_stopped_to_start_where_it_fits(world):
    c, fx, r = stranded(world)
    assert [s[1:3] for s in fx.taken("stop")] == [(1, 1)]  # its own stop, for itself
    assert r.queued == 0  # it never waited in the memory queue
    assert c.precheck(1)(fx.deps[1])  # the stop's precheck: still asleep
    fx.set(1, state=State.STOPPED, sleep_level=None, gpus=())
    c.on_stopped(1, True, 1)
    assert fx.taken("settle")[-1][1] == 1
    c.on_settled(1)
    assert fx.taken("admit")[-1][1] == 1  # asked again: a cold start, anywhere


def test_a_relocation_stop_is_refused_once_it_woke(world):
    c, fx, r = stranded(world)
    fx.set(1, state=State.READY)
    assert not c.precheck(1)(fx.deps[1])


def test_no_relocation_while_its_own_sleep_for_another_is_under_way(world):
    """1 is being put to sleep for 3 (marked asleep, its sleep call not yet reported): a request
    for 1 waits for that sleep, and is no reason to stop it."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler("cost", 5.0))
    fx.add(1, 10, state=State.READY, gpus=(0,), gpu_count=1, idle_action="sleep", idle_timeout_s=1)
    fx.add(3, 10)
    c.try_take(1).release()
    clock.advance(2)  # past its idle timeout: make-room's to take
    Req(c, 3)
    c.on_refused(3, InsufficientMemory(10, 4, 24))
    assert [s[1:3] for s in fx.taken("sleep")] == [(1, 3)]
    fx.set(1, state=State.ASLEEP, sleep_level=1)  # the deployer's mark, before its call ends
    r = Req(c, 1)
    fit = Fit(10.0, (2.0, 40.0), (80.0, 80.0), 1, (0,), True)
    c.on_refused(1, InsufficientMemory(10, 2, 80, fit=fit))
    assert fx.taken("stop") == [] and r.queued == 1


# --- make-room's account of its victims: counted by rule, audited when taken early ----------------

def lull(world, scheduler: str, *, idle: float):
    """2 (10 GiB, idle timeout 600 s, sleeps when idle) was used ``idle`` s ago; 1 (10 GiB) is
    refused for 6 GiB and asks make-room."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler(scheduler, SLO_S))
    fx.rest_costs = {"asleep_1": 4.0, "asleep_2": 6.0, "stopped": 60.0}
    fx.add(1, 10)
    fx.add(2, 10, idle_timeout_s=600, idle_action="sleep")
    fx.set(2, state=State.READY)
    clock.advance(601)
    c.try_take(2).release()
    clock.advance(idle)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    return c, fx, r


def put_to_sleep(c, fx, victim: int, for_dep: int, approved: bool = True) -> None:
    """Play the deployer: the sleep make-room asked for is done (or its precheck kept it)."""
    assert [s[1:3] for s in fx.taken("sleep")] == [(victim, for_dep)]
    if approved:
        fx.set(victim, state=State.ASLEEP, sleep_level=1)
    c.on_stopped(victim, approved, for_dep)


def test_a_victim_taken_before_its_timeout_by_cost_is_audited_counted_and_shown(world):
    c, fx, r = lull(world, "cost", idle=42)
    assert fx.audits == []  # nothing is said before the sleep is done
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"cost": 1}
    [(action, dep_id, text, detail)] = fx.audits
    assert action == "ondemand_make_room" and dep_id == 1  # the requester's row
    assert text == ("Put d2 to sleep for d1 after 42 s idle of its 600 s idle timeout "
                    "(cost: wait 558 s > expected loss 60 s)")
    assert detail == {"victim_id": 2, "victim": "d2", "for": "d1",
                      "reason": {"rule": "cost", "wait_s": 558.0, "loss_s": 60.0, "hold_s": 61.0, "come_back_s": 4.0,
                                 "slo_s": SLO_S, "refused": 0.0, "idle_for_s": 42.0, "idle_after_s": 600.0}}
    early = c.status(2)["put_away_early"]
    assert early["for"] == "d1" and early["for_id"] == 1 and early["rule"] == "cost" and early["loss_s"] == 60.0
    assert early["at"] == 1.7e9 + c.clock()
    assert ("counters", 2, c.clock()) in fx.calls  # its view is published again with it
    assert c.status(1)["put_away_early"] is None and c.status(1)["held_for"] is None
    fx.set(2, state=State.STARTING)
    assert c.status(2)["put_away_early"] is not None  # still resting until its wake is done
    fx.set(2, state=State.READY)
    assert c.status(2)["put_away_early"] is None


def test_a_victim_the_precheck_kept_is_neither_counted_nor_audited(world):
    c, fx, r = lull(world, "cost", idle=42)
    put_to_sleep(c, fx, 2, 1, approved=False)
    assert c.make_rooms() == {} and fx.audits == []
    assert c.status(2)["put_away_early"] is None


def test_under_seed_a_victim_idle_for_its_whole_timeout_counts_idle_timeout_and_is_not_audited(world):
    c, fx, r = lull(world, "seed", idle=601)
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"idle_timeout": 1}
    assert fx.audits == [] and c.status(2)["put_away_early"] is None


def test_under_cost_a_victim_idle_for_its_whole_timeout_counts_idle_timeout_too(world):
    c, fx, r = lull(world, "cost", idle=601)
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"idle_timeout": 1} and fx.audits == []


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.mark.server(reap_interval_s=3600, scheduler="cost", slo_s=0.5)
async def test_a_real_make_room_by_cost_is_in_the_audit_the_metrics_the_view_and_status(tmp_path, server, http):
    """big (15 GiB) served a request a moment ago, of its 600 s idle timeout; x (12 GiB) does not fit
    beside it (24 GiB): the request for x would wait 600 s without big, and big's loss is what x's
    cold start (60 s, nothing measured) and its 1 s minimum hold cost big's next request, with big's
    own cold start, less the 0.5 s SLO: big is stopped for x at once. (Its start, half a second, is
    dear against that SLO: warmth by value keeps its idle timeout, so the take is cost's.)"""
    from test_cli import cli, write_config
    from test_telemetry import scrape, v
    big = await server.add("big", 15, "--startup-delay", "0.5", idle_timeout_s=600)
    x = await server.add("x", 12)
    async with http.post(server.gw(big, "chat/completions"), json={**CHAT, "model": "BIG"},
                         headers=server.auth()) as r:
        assert r.status == 200, await r.text()
    await server.app[app_mod.SAMPLER].sample_once()  # its engine's metrics say idle
    async with http.post(server.gw(x, "chat/completions"), json={**CHAT, "model": "X"}, headers=server.auth()) as r:
        assert r.status == 200, await r.text()
    assert server.state(big) == "stopped"

    rows: list[dict] = []

    async def audited() -> bool:  # written by a task of the effects, just after the stop's report
        async with http.get(f"{server.url}/api/audit", headers=server.admin_headers()) as r:
            rows[:] = [row for row in await r.json() if row["action"] == "ondemand_make_room"]
        return bool(rows)
    await wait_for(audited, what="the ondemand_make_room row")
    [row] = rows
    assert row["deployment_id"] == x and row["actor"] == "ondemand"
    assert row["text"].startswith("Stopped big for x after ") and "(cost: wait " in row["text"]
    reason = row["detail"]["reason"]
    assert row["detail"]["victim_id"] == big and reason["rule"] == "cost" and reason["idle_after_s"] == 600
    assert reason["wait_s"] > reason["loss_s"], row
    m = await scrape(server, http)
    assert v(m, "ondemand_make_room_total", rule="cost") == 1
    assert v(m, "ondemand_make_room_total", rule="idle_timeout") == 0
    assert ("ondemand_make_room_total", (("rule", "idle_timeout"),)) in m  # both series, from 0
    async with http.get(f"{server.url}/api/deployments/{big}", headers=server.admin_headers()) as r:
        early = (await r.json())["ondemand"]["put_away_early"]
    assert early["for"] == "x" and early["rule"] == "cost"
    rc, out, err = await cli("status", config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert any(line.startswith("big: put away early for x by cost (") for line in out.splitlines()), out
    rc, out, err = await cli("deploy", "show", str(big), config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert any(line.startswith("big: put away early for x by cost (") for line in out.splitlines()), out
