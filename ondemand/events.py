"""The in-process event bus: deployment views out to whoever listens.

Publishers (the deployer on every transition, the controller for live
counters) call ``publish(view)``; the admin API's SSE stream subscribes with
a bounded queue, and in-process listeners (the LiteLLM sync trigger) register
plain callbacks. Publishing never awaits and never blocks on a slow reader: a
subscriber whose queue is full loses its oldest event, because a view is a
full snapshot and the newest one is what matters. Imports nothing of ours.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Iterator

log = logging.getLogger("ondemand.events")

Listener = Callable[[str, dict[str, Any]], None]


class EventBus:
    def __init__(self, queue_size: int = 256):
        self._queue_size = queue_size
        self._queues: set[asyncio.Queue] = set()
        self._listeners: list[Listener] = []

    def publish(self, view: dict[str, Any], kind: str = "deployment") -> None:
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait((kind, view))
        for listener in list(self._listeners):
            try:
                listener(kind, view)
            except Exception:  # one broken listener must not stop the others
                log.exception("event listener %r failed", listener)

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(kind, view)`` on every publish; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue]:
        """A queue of (kind, view) for as long as the ``with`` block lasts."""
        queue: asyncio.Queue = asyncio.Queue(self._queue_size)
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)

    @property
    def subscribers(self) -> int:
        return len(self._queues)
