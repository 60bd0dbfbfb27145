"""A log line at most once a minute, with the count of those it kept quiet (:class:`OnceAMinute`):
for what a client or an engine can make happen thousands of times a second (malformed requests,
connections over a cap, an engine's output that cannot be written). Imports nothing of ours."""
from __future__ import annotations

import time
from collections.abc import Callable


class OnceAMinute:
    """A line at most every ``every_s``: :meth:`due` is None while it must keep quiet, else
    what to add to the line (the count of those not logged since the last one). ``clock``:
    seconds, never going back (a test's moves by hand)."""

    def __init__(self, every_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.suppressed = 0
        self._clock = clock
        self._last = -float("inf")

    def due(self) -> str | None:
        now = self._clock()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return None
        more = f" ({self.suppressed} more since the last such line)" if self.suppressed else ""
        self._last, self.suppressed = now, 0
        return more
