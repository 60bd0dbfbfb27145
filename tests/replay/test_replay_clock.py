"""The replay's virtual clock (ondemand/replay/clock.py), alone: timers fire in time order,
those due at the same moment in the order they were set, a cancelled one never; ``run_until``
stands at its moment and ``run_while`` asks before each timer; ``next_due``, ``fired`` and
``horizon`` say what the reaper's step reads. Plain callbacks that note the time they ran at;
no controller, nothing sleeps."""
from __future__ import annotations

import math

from ondemand.replay.clock import VirtualClock


def test_the_virtual_clock_fires_in_time_order_and_same_times_in_the_order_set():
    clock, fired = VirtualClock(), []
    clock.call_later(5, lambda: fired.append(("b", clock())))
    clock.call_later(1, lambda: fired.append(("a", clock())))
    clock.call_later(5, lambda: fired.append(("c", clock())))
    clock.call_later(3, lambda: fired.append(("never", clock()))).cancel()
    clock.call_later(1, lambda: clock.call_later(0, lambda: fired.append(("a2", clock()))))
    clock.run_until(4)
    assert (fired, clock()) == ([("a", 1), ("a2", 1)], 4)
    clock.run_while(lambda: len(fired) < 3)
    assert (fired[2:], clock()) == ([("b", 5)], 5)
    assert (clock.fired, clock.next_due(), clock.horizon) == (4, 5, math.inf)  # 4 callbacks; "c" is next
    clock.call_at(7, lambda: fired.append(("d", clock())))
    clock.call_at(2, lambda: fired.append(("late", clock())))  # a moment past: now, after those set before
    clock.run_until(6)
    assert (fired[3:], clock.fired, clock.next_due(), clock.horizon) == ([("c", 5), ("late", 5)], 6, 7, 6)


def test_a_cancelled_timer_never_fires_nor_counts_and_is_never_next_due():
    clock, fired = VirtualClock(), []
    first = clock.call_later(1, lambda: fired.append("first"))
    clock.call_later(2, lambda: fired.append("second"))
    same = clock.call_later(2, lambda: fired.append("same"))
    first.cancel()
    assert clock.next_due() == 2  # the cancelled one, due earlier, is passed over
    same.cancel()
    clock.run_until(10)
    assert (fired, clock.fired, clock.next_due()) == (["second"], 1, math.inf)
    clock.run_while(lambda: True)  # nothing left: nothing runs, the time stays
    assert (fired, clock()) == (["second"], 10)


def test_run_until_fires_what_is_due_at_its_moment_and_never_turns_the_clock_back():
    clock, fired = VirtualClock(start=100), []
    clock.call_later(5, lambda: fired.append(clock()))
    clock.call_later(-3, lambda: fired.append(clock()))  # a delay below 0: now
    clock.call_later(6, lambda: clock.call_later(1, lambda: fired.append(clock())))  # at 107: after this run
    clock.run_until(105)
    assert (fired, clock(), clock.horizon, clock.next_due()) == ([100, 105], 105, 105, 106)
    clock.run_until(102)  # a moment past: nothing fires, the time stays
    assert (fired, clock(), clock.horizon) == ([100, 105], 105, 102)
    clock.run_until(106.5)
    assert (fired, clock(), clock.next_due()) == ([100, 105], 106.5, 107)


def test_run_while_asks_before_each_timer_and_stands_at_the_last_it_fired():
    clock, fired, asked = VirtualClock(), [], []
    for at in (3, 1, 2, 4):
        clock.call_at(at, lambda at=at: fired.append(at))

    def going() -> bool:
        asked.append(list(fired))
        return len(fired) < 2

    clock.run_until(0.5)
    clock.run_while(going)
    assert (fired, clock(), clock.horizon) == ([1, 2], 2, math.inf)
    assert asked == [[], [1], [1, 2]]  # before each, and once more to stop
    clock.run_while(lambda: True)
    assert (fired, clock(), clock.fired) == ([1, 2, 3, 4], 4, 4)


def test_cancelled_timers_leave_the_heap_once_they_are_most_of_it():
    """A served request cancels its deadline timer at once: a week's requests must not pile up
    in the heap until their deadlines pass. The order of what is left is kept."""
    clock, fired = VirtualClock(), []
    for i in range(10_000):
        clock.call_later(900, lambda i=i: fired.append(i)).cancel()
        assert len(clock) <= 2 * 101  # compacted whenever the cancelled ones are over half
    keep = [clock.call_later(900 - i, lambda i=i: fired.append(i)) for i in range(50)]
    for _ in range(150):
        clock.call_later(1000, lambda: fired.append("never")).cancel()
    keep[0].cancel()  # counted once, however often it is cancelled
    keep[0].cancel()
    clock.run_until(2000)
    assert fired == list(range(49, 0, -1)) and clock.fired == 49 and len(clock) == 0
    keep[1].cancel()  # fired already: nothing to drop, nothing counted
    assert clock.next_due() == math.inf and clock._cancelled == 0
