"""Failed key checks per peer, and the lock-out they earn.

BEHAVIOUR.md, "Checks, in order", check 4: "a peer with 20 failed key checks in a minute gets 429 rate_limited
with Retry-After: 60 for the rest of that minute". Each peer has a fixed window that opens at its
first failure; once ``limit`` failures fall in the window the peer is refused until the window
ends. "Key rotation": the counts are cleared when the key changes (``clear`` is hooked into the
bus's ``KeyRotated``). Imports nothing of ours.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

__all__ = ["FailureLimiter"]


class FailureLimiter:
    """Counts failed key checks per peer in fixed windows; memory stays bounded.

    Peers are the raw TCP peer addresses that already passed the peer guard, so there are few of
    them; still, expired windows are pruned whenever the table has doubled since the last prune,
    and past ``max_peers`` live windows the oldest are dropped down to 3/4 of it (forgetting a
    window only ever unblocks a peer early, it never blocks one).
    """

    def __init__(self, limit: int = 20, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, *, max_peers: int = 65536):
        if limit < 1 or window_s <= 0 or max_peers < 1:
            raise ValueError("limit, window_s and max_peers must be positive")
        self.limit = limit
        self.window_s = window_s
        self.max_peers = max_peers
        self._clock = clock
        # The header value: the design says 60, i.e. the window length, whatever is left of it.
        self._retry_after = max(1, math.ceil(window_s))
        # peer -> [window start, failures]; insertion order is window-start order because a
        # window that restarts is deleted and re-inserted, so the oldest are at the front.
        self._windows: dict[Hashable, list[float]] = {}
        self._prune_at = min(1024, max_peers + 1)

    def retry_after(self, peer: Hashable) -> int | None:
        """``None`` when ``peer`` may try its key; else the Retry-After value (seconds)."""
        w = self._windows.get(peer)
        if w is None or w[1] < self.limit:
            return None
        if self._clock() - w[0] >= self.window_s:
            del self._windows[peer]
            return None
        return self._retry_after

    def fail(self, peer: Hashable) -> None:
        """Count one failed key check of ``peer``."""
        now = self._clock()
        windows = self._windows
        w = windows.get(peer)
        if w is not None and now - w[0] < self.window_s:
            w[1] += 1
            return
        if w is not None:
            del windows[peer]
        windows[peer] = [now, 1]
        if len(windows) >= self._prune_at:
            self._prune(now)

    def clear(self) -> None:
        """Forget every count (the key changed)."""
        self._windows.clear()

    def __len__(self) -> int:
        return len(self._windows)

    def _prune(self, now: float) -> None:
        windows = self._windows
        window_s = self.window_s
        for peer in [p for p, w in windows.items() if now - w[0] >= window_s]:
            del windows[peer]
        if len(windows) > self.max_peers:
            # Drop the oldest down to 3/4 of the cap so a full table is not rescanned per failure.
            for peer in list(windows)[:len(windows) - self.max_peers * 3 // 4]:
                del windows[peer]
        self._prune_at = min(self.max_peers + 1, max(1024, 2 * len(windows)))
