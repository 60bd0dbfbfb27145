"""Virtual time: a clock that is read as ``clock()`` and an event heap that ``call_later``
schedules on, as the controller's ``Effects.call_later`` and the event loop's do. Nothing
sleeps: running the heap jumps from one event to the next, so an hour of a busy box takes
seconds. Timers due at the same moment fire in the order they were set (as the event loop's
callbacks do); a cancelled one never fires."""
from __future__ import annotations

import heapq
import itertools
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
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(self.now + max(0.0, delay), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def run_until(self, until: float) -> None:
        """Fire every timer due by ``until``, in order, then stand at ``until``."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, timer = heapq.heappop(heap)
            if not timer.cancelled:
                self.now = when
                timer.callback()
        if until > self.now:
            self.now = until

    def run_while(self, going: Callable[[], bool]) -> None:
        """Fire timers in order while ``going()`` (asked before each), or until none is left."""
        heap = self._heap
        while heap and going():
            when, _, timer = heapq.heappop(heap)
            if not timer.cancelled:
                self.now = when
                timer.callback()
