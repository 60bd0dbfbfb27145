"""Virtual time: a clock that is read as ``clock()`` and an event heap that ``call_later``
schedules on, as the controller's ``Effects.call_later`` and the event loop's do. Nothing
sleeps: running the heap jumps from one event to the next, so an hour of a busy box takes
seconds. Timers due at the same moment fire in the order they were set (as the event loop's
callbacks do); a cancelled one never fires. Cancelled timers leave the heap when they come due, or
all at once when they are more than half of it (asyncio's rule): a request's deadline timer is
set for the queue's timeout and cancelled at once when it is served, so without this the heap
would hold every request of the last 15 minutes.

For a timer that wants to know whether anything else happened meanwhile (the reaper's step,
run.py), the clock counts the callbacks it has fired (``fired``), says when the next timer is
due (``next_due``) and how far the current run goes (``horizon``)."""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

# The heap is compacted when cancelled timers are more than this share of it (and than
# COMPACT_AFTER): asyncio's _MIN_CANCELLED_TIMER_HANDLES_FRACTION and _MIN_SCHEDULED_TIMER_HANDLES.
COMPACT_SHARE = 0.5
COMPACT_AFTER = 100


class Timer:
    """One scheduled callback (the ``Timer`` protocol of control/protocol.py)."""
    __slots__ = ("when", "callback", "cancelled", "clock")

    def __init__(self, when: float, callback: Callable[[], None], clock: VirtualClock):
        self.when = when
        self.callback = callback
        self.cancelled = False
        self.clock: VirtualClock | None = clock  # None once it left the heap

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            if self.clock is not None:
                self.clock._cancelled_one()


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start
        self.fired = 0  # callbacks run so far
        self.horizon = math.inf  # the moment the current run stops at (run_until's)
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._cancelled = 0  # cancelled timers still in the heap

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self.now + max(0.0, delay), callback)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """At ``when`` exactly (now if it has passed): a period's steps land on its grid, not
        on a sum of periods."""
        timer = Timer(max(when, self.now), callback, self)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def next_due(self) -> float:
        """When the next timer that will fire is due (inf: none is set)."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            self._left(heapq.heappop(heap)[2])
        return heap[0][0] if heap else math.inf

    def __len__(self) -> int:
        """Timers in the heap, cancelled ones not yet dropped included."""
        return len(self._heap)

    def _cancelled_one(self) -> None:
        self._cancelled += 1
        if self._cancelled > COMPACT_AFTER and self._cancelled > COMPACT_SHARE * len(self._heap):
            kept = []
            for entry in self._heap:
                if entry[2].cancelled:
                    entry[2].clock = None
                else:
                    kept.append(entry)
            heapq.heapify(kept)  # the same order: (when, sequence) keys are unique
            self._heap = kept
            self._cancelled = 0

    def _left(self, timer: Timer) -> None:
        """A timer left the heap (fired, or dropped as cancelled)."""
        timer.clock = None
        if timer.cancelled:
            self._cancelled -= 1

    def run_until(self, until: float) -> None:
        """Fire every timer due by ``until``, in order, then stand at ``until``."""
        self.horizon = until
        while self._heap and self._heap[0][0] <= until:
            self._fire(heapq.heappop(self._heap))
        if until > self.now:
            self.now = until

    def run_while(self, going: Callable[[], bool]) -> None:
        """Fire timers in order while ``going()`` (asked before each), or until none is left."""
        self.horizon = math.inf
        while self._heap and going():
            self._fire(heapq.heappop(self._heap))

    def _fire(self, entry: tuple[float, int, Timer]) -> None:
        when, _, timer = entry
        self._left(timer)
        if not timer.cancelled:
            self.now = when
            self.fired += 1
            timer.callback()
