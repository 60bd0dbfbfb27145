"""Every background task goes through here: named, referenced, and cancelled
with a reason at shutdown (mitmproxy's rule, enforced by ruff's TID251; asyncio keeps only a
weak reference to tasks, so an unreferenced one can vanish mid-flight)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("ondemand.tasks")

T = TypeVar("T")


class TaskGroup:
    """A set of named long-lived tasks owned by one component."""

    def __init__(self, owner: str):
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def finish(self, within_s: float, reason: str = "shutdown") -> None:
        """Let the tasks out now end on their own for up to ``within_s`` (short writes that must
        not be lost at shutdown), then ``close`` what is left."""
        try:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=within_s)
        finally:  # a shutdown cancelled meanwhile still cancels what is left, before the store closes
            await self.close(reason)

    async def close(self, reason: str = "shutdown") -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel(reason)
        for task in tasks:
            # Cancel again until it ends: on Python 3.10 and 3.11, asyncio.wait_for
            # can swallow a cancellation that races with its inner result
            # (CPython gh-86296), and a task that lost it would keep shutdown waiting.
            while not task.done():
                await asyncio.wait({task}, timeout=1.0)
                if not task.done():
                    log.warning("task %s ignored its cancellation; cancelling again", task.get_name())
                    task.cancel(reason)

    def __len__(self) -> int:
        return len(self._tasks)
