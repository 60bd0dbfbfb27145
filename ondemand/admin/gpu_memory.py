"""The GPU memory the metrics show (``ondemand_gpu_memory_*``), read without ever making a scrape wait."""
from __future__ import annotations

import asyncio
import logging
import time

from ..control.budget import Budget
from ..engines.deployer import Deployer
from ..errors import BudgetError
from ..tasks import TaskGroup

log = logging.getLogger("ondemand.app")


class GpuMemory:
    """``gpu_memory()`` for the metrics: (GPU, capacity GiB, free GiB) of each GPU (one
    pool, GPU 0, for unified memory or a one-pool budget) from the budget's last
    snapshot. A scrape never
    waits for nvidia-smi: it reads the last snapshot and, when that is older than
    ``max_age_s``, has a new one read in the background. No samples while the budget
    cannot be read."""

    def __init__(self, deployer: Deployer, budget: Budget, max_age_s: float = 5.0):
        self._deployer = deployer
        self._budget = budget
        self._max_age_s = max_age_s
        self._tasks = TaskGroup("gpu memory")
        self._last: list[tuple[int, float, float]] = []
        self._read_at = -float("inf")
        self._reading: asyncio.Task[None] | None = None

    def __call__(self) -> list[tuple[int, float, float]]:
        if time.monotonic() - self._read_at >= self._max_age_s and (self._reading is None or self._reading.done()):
            self._reading = self._tasks.spawn(self._read(), "read")
        return self._last

    async def _read(self) -> None:
        deployer = self._deployer
        try:
            snap = await self._budget.snapshot(deployer.as_read())  # as a start's fit check counts it
            self._last = [(p.index, p.capacity, p.free) for p in snap.pools]
        except BudgetError as exc:
            log.debug("GPU memory for the metrics: %s", exc)
            self._last = []
        finally:
            self._read_at = time.monotonic()

    async def close(self) -> None:
        await self._tasks.close()
