"""What ondemand does around each cold start besides starting it: the compile cache, the weights
read ahead, and the start's phases watched in its engine's log.

The deployer calls ``before`` (past the start-up gates, with the launch it is about to start)
and ``after`` (the backend's start returned) of its ``start_hooks``, and the adaptive pre-warm
``expected`` (a start is expected now: the weights are read ahead, whether or not it starts);
``StartHooks`` does nothing, for a deployer without the app. ``StartWatch`` hears the deployer's changes from the
bus (``on_change``): a move to ``starting`` begins a start's timeline (phase ``container``),
leaving it ends the timeline, and a start that ended ready records its phases' durations
(``StartTimed``: the metrics) for the next start's ETA. Between the two, a task follows the
engine's log (``logs``) through a ``PhaseReader``; each phase entered is published
(``StartPhase``: the view is published again). Wakes have no phases: their ETA is their own.

Holds in memory only: the phase history starts empty at every start of ondemand (until a start
has shown a logged phase, a deployment keeps the single ETA, counted down).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from ..config import Config
from ..events import StartPhase, StartTimed
from ..model import Deployment, State
from ..tasks import TaskGroup
from . import compile_cache
from .backends import Backend, Engine
from .backends.logs import RUN_MARKER
from .phases import PhaseHistory, PhaseReader, Timeline
from .readahead import ReadAhead
from .recipes import Launch

log = logging.getLogger("ondemand.engines.startwatch")

PRUNE_EVERY_S = 3600.0  # the compile cache's unused keys are looked for at most this often
# What the queued notice says of each phase.
SAYS = {"container": "creating its engine", "process": "starting its engine", "weights": "loading weights",
        "compile": "compiling", "serving": "starting its server"}


# The lines of the engine's log read back when its start's phases begin to be followed: a process
# engine's first lines may be written before the follower is added (the run marker sorts them).
LOG_TAIL = 200


class Estimates(Protocol):
    """The start history's estimates (control/starts.py): the single ETA, and the notice's."""

    def eta_s(self, dep_id: int) -> float | None: ...

    def notice_eta_s(self, dep_id: int) -> float | None: ...


class StartHooks:
    """Told of each cold start by the deployer; this one does nothing."""

    def before(self, dep: Deployment, how: Launch) -> None:
        """Past the start-up gates, before the backend's start (no await: never delays it)."""

    def after(self, dep: Deployment, engine: Engine) -> None:
        """The backend's start returned: the engine's process is up (no await)."""

    def expected(self, dep: Deployment) -> None:
        """A start is expected soon (an adaptive pre-warm's moment), whether or not one follows."""


class StartWatch(StartHooks):
    def __init__(self, logs: Callable[[Deployment], AsyncIterator[bytes]], *, publish: Callable[[object], None],
                 estimates: Estimates, compile_root: Path | None = None,
                 readahead: ReadAhead | None = None, retention_days: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logs = logs
        self.publish = publish
        self.estimates = estimates
        self.single_eta = estimates.eta_s
        self.compile_root = compile_root
        self.readahead = readahead
        self.retention_days = retention_days
        self.clock = clock
        self.history = PhaseHistory()
        self.tasks = TaskGroup("start watch")
        self._timelines: dict[int, Timeline] = {}
        self._names: dict[int, str] = {}
        self._followers: dict[int, asyncio.Task[None]] = {}  # the task following each start's log
        self._caches: dict[int, tuple[str, bool | None]] = {}  # the last start's key, and whether it was warm
        self._pruned_at = -float("inf")

    @classmethod
    def of(cls, cfg: Config, backend: Backend, available_gib: Callable[[], float | None], *,
           publish: Callable[[object], None], estimates: Estimates) -> StartWatch:
        """The app's: its backend's logs, the configured compile cache and read-ahead."""
        ahead = ReadAhead(model_cache=cfg.deployer.model_cache, available_gib=available_gib,
                          reserve_gib=cfg.budget.host_reserve_gib)
        return cls(lambda dep: backend.logs(dep, tail=LOG_TAIL, follow=True), publish=publish, estimates=estimates,
                   compile_root=cfg.deployer.compile_cache, readahead=ahead, retention_days=cfg.retention_days)

    # --- the deployer's hooks --------------------------------------------------------

    def before(self, dep: Deployment, how: Launch) -> None:
        if dep.id not in self._timelines and dep.sleep_level is None:
            # The start task may run before the change to starting is published (the deployer
            # writes the row first): the timeline begins here then, and that change keeps it.
            self._begin(dep)
        if how.compile_key is not None and self.compile_root is not None:
            warm: bool | None = None
            try:
                warm = compile_cache.prepare(self.compile_root, how.compile_key)  # a mkdir and a listing
            except OSError as exc:
                log.warning("%s: compile cache %s: %s", dep.name, self.compile_root, exc)
            self._caches[dep.id] = (how.compile_key, warm)
            self._prune_now_and_then()
        if self.readahead is not None and dep.model is not None:
            self.readahead.warm(dep)

    def after(self, dep: Deployment, engine: Engine) -> None:
        timeline = self._timelines.get(dep.id)
        if timeline is None:
            return  # a start this watch did not see begin (none: it listens from the app's start)
        self._enter(dep.id, timeline, "process")
        self._followers[dep.id] = self.tasks.spawn(self._follow(dep, timeline), f"phases of {dep.name}")

    def expected(self, dep: Deployment) -> None:
        # Its weights read ahead as for a start, even when the pre-warm finds no memory free and
        # starts nothing: the request expected then starts it from the page cache.
        if self.readahead is not None and dep.model is not None:
            self.readahead.warm(dep)

    # --- the bus ---------------------------------------------------------------------

    def on_change(self, dep_id: int, dep: Deployment | None, old: Deployment | None) -> None:
        """A DeploymentChanged (no await): a cold start begins or ends."""
        if dep is None:
            self._end(dep_id)
            self.history.forget(dep_id)
            self._caches.pop(dep_id, None)
            if self.readahead is not None:
                self.readahead.forget(dep_id)
            return
        cold = dep.state is State.STARTING and dep.sleep_level is None
        if cold and (old is None or old.state is not State.STARTING or old.sleep_level is not None):
            if dep_id not in self._timelines:  # begun by ``before`` already: the same start
                self._begin(dep)  # a start, or a failed wake's cold start in the same ``starting``
        elif dep.state is not State.STARTING and dep_id in self._timelines:
            timeline = self._end(dep_id)
            if dep.state is State.READY and timeline is not None:
                self._timed(dep, timeline)

    def _begin(self, dep: Deployment) -> None:
        now = self.clock()
        estimate = self.history.eta_s(dep.id, None, now)
        if estimate is None:
            estimate = self.single_eta(dep.id)
        self._timelines[dep.id] = Timeline(now, estimate)
        self._names[dep.id] = dep.name
        self.publish(StartPhase(dep.id, dep.name, "container"))

    def _end(self, dep_id: int) -> Timeline | None:
        follower = self._followers.pop(dep_id, None)
        if follower is not None:
            follower.cancel("the start ended")
        return self._timelines.pop(dep_id, None)

    def _timed(self, dep: Deployment, timeline: Timeline) -> None:
        now = self.clock()
        durations = timeline.durations(now)
        self.history.record(dep.id, durations)
        actual = now - timeline.began
        error = abs(timeline.estimate_s - actual) / actual if timeline.estimate_s is not None and actual > 0 else None
        log.info("%s started in %.1f s: %s", dep.name, actual,
                 ", ".join(f"{p} {s:.1f} s" for p, s in durations.items()))
        self.publish(StartTimed(dep.id, dep.name, durations, error))

    def _enter(self, dep_id: int, timeline: Timeline, phase: str) -> None:
        if timeline.enter(phase, self.clock()):
            self.publish(StartPhase(dep_id, self._names.get(dep_id, str(dep_id)), phase))

    async def _follow(self, dep: Deployment, timeline: Timeline) -> None:
        """Read the starting engine's log into its phases, until the start ends (cancelled then)."""
        reader = PhaseReader(reset_on=RUN_MARKER)
        try:
            async with contextlib.aclosing(self.logs(dep)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    for phase in reader.feed(chunk):
                        self._enter(dep.id, timeline, phase)
        except Exception as exc:  # the phases are a courtesy: a log that cannot be read leaves the ETA single
            log.info("%s: cannot follow the engine's log for its start phases: %s", dep.name, exc)

    def _prune_now_and_then(self) -> None:
        now = self.clock()
        if self.compile_root is None or now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        root, days = self.compile_root, self.retention_days
        self.tasks.spawn(_prune(root, days), "prune the compile cache")

    # --- reads (no await) --------------------------------------------------------------

    def phase(self, dep_id: int) -> str | None:
        timeline = self._timelines.get(dep_id)
        return timeline.phase if timeline is not None else None

    def eta_s(self, dep_id: int) -> float | None:
        """What is left of its start: by phase when its starts showed phases, else its single
        ETA counted down; not starting, the whole start's."""
        timeline = self._timelines.get(dep_id)
        now = self.clock()
        eta = self.history.eta_s(dep_id, timeline, now)
        if eta is None:
            single = self.single_eta(dep_id)
            if single is None or timeline is None:
                return single
            eta = max(0.0, single - (now - timeline.began))
        return round(eta, 1)

    def notice_eta_s(self, dep_id: int) -> float | None:
        """What the queued notice expects: what is left of a cold start under way, else the
        history's (a wake's estimate for an asleep deployment)."""
        if dep_id in self._timelines:
            return self.eta_s(dep_id)
        return self.estimates.notice_eta_s(dep_id)

    def notice_phase(self, dep_id: int) -> str | None:
        """The phase of a cold start under way, in the notice's words."""
        timeline = self._timelines.get(dep_id)
        return SAYS.get(timeline.phase) if timeline is not None else None

    def fields(self, dep_id: int, compile_key: str | None) -> dict[str, Any]:
        """The view's: ``start_phase``, ``start_phases`` (a bar per phase), ``compile_cache``
        ({key, warm}: its configuration's key, and whether its last start with that key found
        the directory warm; null when not known) and ``read_ahead``; while starting, ``start_eta_s``."""
        timeline = self._timelines.get(dep_id)
        last = self._caches.get(dep_id)
        warm = last[1] if last is not None and last[0] == compile_key else None
        ahead = self.readahead.outcome(dep_id) if self.readahead is not None else None
        out: dict[str, Any] = {
            "start_phase": timeline.phase if timeline is not None else None,
            "start_phases": self.history.bars(dep_id, timeline, self.clock()) if timeline is not None else [],
            "compile_cache": {"key": compile_key, "warm": warm} if compile_key is not None else None,
            "read_ahead": ahead.as_dict() if ahead is not None else None,
        }
        if timeline is not None:
            out["start_eta_s"] = self.eta_s(dep_id)
        return out

    async def close(self) -> None:
        for dep_id in list(self._timelines):
            self._end(dep_id)
        if self.readahead is not None:
            await self.readahead.close()
        await self.tasks.close()


async def _prune(root: Path, days: float) -> None:
    try:
        await asyncio.to_thread(compile_cache.prune, root, days)
    except OSError as exc:
        log.warning("compile cache %s: cannot prune: %s", root, exc)
