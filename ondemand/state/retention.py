"""Retention: events and audit rows older than ``retention_days`` are deleted, forever (a
background task the composition runs; ``Store.prune`` deletes). The first pass comes shortly
after the start, then one an hour. A pass deletes at most ``RETENTION_BATCH`` rows of each
table in one transaction, so the state file's lock is never held for long; when it had more to
delete, the next pass follows after ``RETENTION_AGAIN_S``. A pass the disk refuses (full) is one
line in the log, and the next pass tries again. Imports nothing of ours but the store and its error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..errors import log_unwritten
from .store import Store

__all__ = ["prune_old_rows", "RETENTION_FIRST_S", "RETENTION_INTERVAL_S", "RETENTION_BATCH", "RETENTION_AGAIN_S"]

log = logging.getLogger("ondemand.state.retention")

RETENTION_FIRST_S = 60.0
RETENTION_INTERVAL_S = 3600.0
RETENTION_BATCH = 10_000
RETENTION_AGAIN_S = 1.0


async def prune_old_rows(store: Store, retention_days: int, *, clock: Callable[[], float] = time.time,
                         first_s: float | None = None, interval_s: float | None = None) -> None:
    """Delete events and audit rows older than ``retention_days``, forever (a background task).
    The audit rows of queue timeouts, written on every one, are among them."""
    await asyncio.sleep(RETENTION_FIRST_S if first_s is None else first_s)
    while True:
        counts = {"events": 0, "audit": 0}
        try:
            counts = await store.prune(clock() - retention_days * 86400.0, RETENTION_BATCH)
        except Exception as exc:  # a full disk: one line an hour, not a traceback
            log_unwritten(log, exc, "retention: cannot delete old rows")
        if any(counts.values()):
            log.info("retention: deleted %d events, %d audit rows older than %d days", counts["events"],
                     counts["audit"], retention_days)
        more = max(counts["events"], counts["audit"]) >= RETENTION_BATCH
        await asyncio.sleep(RETENTION_AGAIN_S if more else
                            RETENTION_INTERVAL_S if interval_s is None else interval_s)
