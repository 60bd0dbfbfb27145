"""Virtual time: a clock that is read as ``clock()`` and an event heap that ``call_later``
schedules on, as the controller's ``Effects.call_later`` and the event loop's do. Nothing
sleeps: running the heap jumps from one event to the next, so an hour of a busy box takes
seconds. Timers due at the same moment fire in the order they were set (as the event loop's
callbacks do); a cancelled one never fires.

For a timer that wants to know whether anything else happened meanwhile (the reaper's step,
run.py), the clock counts the callbacks it has fired (``fired``), says when the next timer is
due (``next_due``) and how far the current run goes (``horizon``)."""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable


class Timer:
    """One scheduled callback (the ``Timer`` protocol of control/protocol.py)."""
    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], None]):
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start
        self.fired = 0  # callbacks run so far
        self.horizon = math.inf  # the moment the current run stops at (run_until's)
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self.now + max(0.0, delay), callback)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """At ``when`` exactly (now if it has passed): a period's steps land on its grid, not
        on a sum of periods."""
        timer = Timer(max(when, self.now), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def next_due(self) -> float:
        """When the next timer that will fire is due (inf: none is set)."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def run_until(self, until: float) -> None:
        """Fire every timer due by ``until``, in order, then stand at ``until``."""
        heap = self._heap
        self.horizon = until
        while heap and heap[0][0] <= until:
            self._fire(heapq.heappop(heap))
        if until > self.now:
            self.now = until

    def run_while(self, going: Callable[[], bool]) -> None:
        """Fire timers in order while ``going()`` (asked before each), or until none is left."""
        heap = self._heap
        self.horizon = math.inf
        while heap and going():
            self._fire(heapq.heappop(heap))

    def _fire(self, entry: tuple[float, int, Timer]) -> None:
        when, _, timer = entry
        if not timer.cancelled:
            self.now = when
            self.fired += 1
            timer.callback()
