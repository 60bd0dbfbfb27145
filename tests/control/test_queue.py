"""The memory queue (ondemand/control/queue.py): one entry per deployment, by priority, then first
arrival; what is held for its head (per GPU) out of every later entry's reach; a head of higher
priority that takes the place, and the hold with it. On its own, then in the decision core on the
fake clock and recording effects of core_doubles.py (BEHAVIOUR.md, "Priorities and limits"). What
the start side does for the head (make-room): test_attempts.py; the same hold against a real
budget: test_controller_races.py."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, idle_ready, make

from ondemand.control.controller import Phase
from ondemand.control.queue import WaitQueue
from ondemand.errors import InsufficientMemory
from ondemand.model import Priority, State

LOW, NORMAL, HIGH = Priority.LOW, Priority.NORMAL, Priority.HIGH


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


# --- the queue on its own -------------------------------------------------------------------------

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


def test_an_entry_is_queued_once_and_what_is_held_for_it_adds_up_per_gpu():
    """Memory freed for the head is reserved for it, GPU by GPU, out of every other entry's reach,
    until it leaves the queue."""
    q = WaitQueue()
    assert q.add(2, 5.0) and q.add(1, 3.0) and not q.add(2, 1.0)
    assert q.ids() == [1, 2] and q.head() == 1
    q.reserve(1, {0: 8})
    q.reserve(1, {0: 1, 3: 2})  # per GPU, adding up
    assert q.reserved_for_others(2) == {0: 9, 3: 2} and q.reserved_for_others(1) == {}
    q.remove(1)
    assert q.head() == 2 and q.reserved_for_others(3) == {}


# --- its order in the core: first arrival, priority, an edit while queued, leaving ----------------

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


def test_a_hang_up_while_queued_removes_the_entry(world):
    c, fx, clock = make(world)
    fx.add(1, 10)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 0, 24))
    assert c.status(1) == {"inflight": 0, "queued": 1, "last_request_at": None, "phase": "queued", "queue_position": 1,
                           "idle_until": None, "backoff_until": None, "held_for": None, "put_away_early": None}
    r.leave()
    assert 1 not in c.queue and c.waiting() == 0 and c.status(1)["phase"] == "sleeping"


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


# --- what is held for the head, and a head of higher priority that takes it over ------------------

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
