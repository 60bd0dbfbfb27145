"""The one in-process event bus, and its typed events.

Owners publish what happened (the deployer every transition, change and
removal, and each start's beginning and end; the controller a change of its
live counters; the key watcher a rotation; the app a deployment view for the
admin API's stream). Subscribers
register a handler per event type; every subscription is made in ``app``, so
who hears what is visible in one place.

``publish`` is synchronous and never blocks: handlers are plain functions that
must not await (they note, decide or spawn a named task). A handler that
raises is logged and the others still run. ``stream`` hands an async reader
(the SSE route) a bounded queue of one event type; a reader that falls so far
behind that its queue is full gets :data:`RESYNC` instead of what it missed (the
queue is emptied): it reads the whole state again (issue 23: the oldest events
were dropped without a word). Imports only the deployment value type.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

from .model import Deployment, State

log = logging.getLogger("ondemand.events")


class StopCause(str, enum.Enum):
    """Why an engine was stopped: carried by the change that starts the stop (to
    ``stopping``; to ``stopped`` at shutdown; to ``failed`` from ready or asleep)."""
    IDLE = "idle"  # the reaper: idle for its timeout
    MAKE_ROOM = "make_room"  # a victim for a queued deployment's memory
    ADMIN = "admin"  # an administrator's stop or removal
    FAILED = "failed"  # the engine exited or stopped answering while it served
    SHUTDOWN = "shutdown"  # ondemand stopped its engines on the way out

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentChanged:
    """A deployment was created, changed, moved to another state, or removed (``dep`` None)."""
    dep_id: int
    dep: Deployment | None
    old: Deployment | None  # None when it was just created
    cause: StopCause | None = None  # set on the one change that records a stop

    @property
    def created(self) -> bool:
        return self.old is None

    @property
    def removed(self) -> bool:
        return self.dep is None

    @property
    def old_state(self) -> State | None:
        return self.old.state if self.old is not None else None

    @property
    def new_state(self) -> State | None:
        return self.dep.state if self.dep is not None else None


# A start is cold (an engine created) or a wake (an asleep engine woken).
StartKind = Literal["cold", "wake"]
# How a start ended: ready; failed (a cold start, or a wake whose engine call failed or timed
# out); mismatch (a wake whose check answered otherwise); stopped or removed (an administrator,
# make-room, ...); interrupted (ondemand shut down during it).
StartResult = Literal["ready", "failed", "mismatch", "stopped", "removed", "interrupted"]


@dataclasses.dataclass(frozen=True, slots=True)
class StartBegan:
    """A start or a wake began: the deployer marked the deployment ``starting`` (a failed
    wake's cold start begins in the same ``starting``, right after the wake's ``StartEnded``);
    or, with ``taken_back``, ondemand found it starting at its own start-up and follows it on
    (it began before: ``at`` is its stored row's stamp). Published before the step's
    ``DeploymentChanged``. ``start``: the unit's ``Start`` (engines/start.py), for the details."""
    dep_id: int
    name: str
    kind: StartKind
    level: int | None  # the sleep level a wake wakes from; None for a cold start
    at: float  # wall clock: when it began
    gpus: tuple[int, ...]
    taken_back: bool
    start: Any  # engines.start.Start (this module imports nothing of the engines')


@dataclasses.dataclass(frozen=True, slots=True)
class StartEnded:
    """A start or a wake ended (every ``StartBegan`` is followed by one): ``duration_s`` from
    its beginning (the deployer's monotonic clock), ``at`` the wall clock at its end. Published
    before the step's ``DeploymentChanged``; one that ends with no change (ondemand shutting
    down while the row stays ``starting``) alone."""
    dep_id: int
    name: str
    kind: StartKind
    level: int | None
    duration_s: float
    result: StartResult
    at: float
    taken_back: bool
    start: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Slept:
    """An engine was put to sleep at ``level`` (1 or 2): by the reaper (``idle``), make-room
    (``make_room``) or an administrator (``admin``). Published after its change to asleep, when
    its engine call has ended: ``took_s`` from the mark to that end (what a request that came in
    between waited before its wake could begin)."""
    dep_id: int
    name: str
    level: int
    reason: StopCause
    took_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class Woken:
    """A wake ended: ``ready`` (the wake check matched), ``failed`` (an engine call failed or
    timed out) or ``mismatch`` (the wake check's answer differed); a failed one is followed by
    a cold start. ``seconds``: from the wake's first call to its end."""
    dep_id: int
    name: str
    result: str
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class StartPhase:
    """A cold start entered ``phase`` (container, process, weights, compile or serving)."""
    dep_id: int
    name: str
    phase: str


@dataclasses.dataclass(frozen=True, slots=True)
class StartTimed:
    """A cold start ended ready: how long each of its phases took, and the error of the ETA
    given at its beginning (|estimate - actual| / actual; None when none was given)."""
    dep_id: int
    name: str
    phases: dict[str, float]
    eta_error: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class CountersChanged:
    """The controller's in-flight or queued counts of a deployment changed (already throttled)."""
    dep_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class KeyRotated:
    """The on-demand key changed, appeared or went away."""


@dataclasses.dataclass(frozen=True, slots=True)
class ViewPublished:
    """A deployment view (or ``{"id", "removed": true}``) for the admin API's stream."""
    view: dict[str, Any]


E = TypeVar("E")
Handler = Callable[[Any], None]


class Resync:
    """In a stream's queue: events were dropped here; read the whole state again."""

    def __repr__(self) -> str:
        return "RESYNC"


RESYNC = Resync()


class EventBus:
    def __init__(self, queue_size: int = 256) -> None:
        self._queue_size = queue_size
        self._handlers: dict[type, list[Handler]] = {}
        self._queues: dict[type, set[asyncio.Queue[Any]]] = {}

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> Callable[[], None]:
        """Call ``handler(event)`` for every published event of ``kind``; returns the unsubscribe."""
        handlers = self._handlers.setdefault(kind, [])
        handlers.append(handler)
        return lambda: handlers.remove(handler)

    def publish(self, event: object) -> None:
        kind = type(event)
        for queue in self._queues.get(kind, ()):
            if queue.full():  # the reader fell behind: what it missed is replaced by one resync
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(RESYNC)
            else:
                queue.put_nowait(event)
        for handler in list(self._handlers.get(kind, ())):
            try:
                handler(event)
            except Exception:  # one broken handler must not stop the others
                log.exception("handler %r of %s failed", handler, kind.__name__)

    @contextlib.contextmanager
    def stream(self, kind: type[E]) -> Iterator[asyncio.Queue[E | Resync]]:
        """A bounded queue of the events of ``kind`` (or :data:`RESYNC`) while the ``with`` block lasts."""
        queue: asyncio.Queue[E | Resync] = asyncio.Queue(self._queue_size)
        queues = self._queues.setdefault(kind, set())
        queues.add(queue)
        try:
            yield queue
        finally:
            queues.discard(queue)

    def readers(self, kind: type) -> int:
        return len(self._queues.get(kind, ()))
