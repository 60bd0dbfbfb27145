"""What ondemand does around each cold start besides starting it: the compile cache, the weights
read ahead, and the start's phases watched in its engine's log.

A unit calls ``before`` (past the start-up gates, with the launch it is about to start) and
``after`` (the backend's start returned) of its deployer's ``start_hooks`` (``start.StartHooks``,
which does nothing, for a deployer without the app), and the adaptive pre-warm ``expected`` (a
start is expected now: the weights are read ahead, whether or not it starts). ``StartWatch``
hears the starts from the bus: a cold start's ``StartBegan`` begins its timeline (phase
``container``) on its ``Start``, and its ``StartEnded`` ends it; one that ended ready records
its phases' durations (``StartTimed``: the metrics) for the next start's ETA. Between the two, a
task follows the engine's log (``logs``) through a ``PhaseReader``; each phase entered is
published (``StartPhase``: the view is published again). Wakes have no phases: their ETA is
their own; nor has a start taken back after ondemand's restart (its beginning was not seen).

What a start shows is on its ``Start`` (``unit.start``), what its caches showed on its unit
(``launched``, ``read_ahead``): the watch finds them by id (``units``) and keeps nothing of a
start's. It holds in memory only the phase history, empty at every start of ondemand (until a
start has shown a logged phase, a deployment keeps the single ETA, counted down).
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
from ..events import StartBegan, StartEnded, StartPhase, StartTimed
from ..model import Deployment, State
from ..tasks import TaskGroup
from . import compile_cache
from .backends import Backend, Engine
from .backends.logs import RUN_MARKER
from .phases import PhaseHistory, PhaseReader, Timeline
from .readahead import Outcome, ReadAhead
from .recipes import Launch
from .start import Start, StartHooks
from .unit import Unit

log = logging.getLogger("ondemand.engines.startwatch")

PRUNE_EVERY_S = 3600.0  # the compile cache's unused keys are looked for at most this often
# What the queued notice says of each phase.
SAYS = {"container": "creating its engine", "process": "starting its engine", "weights": "loading weights",
        "compile": "compiling", "serving": "starting its server"}


# The lines of the engine's log read back when its start's phases begin to be followed: a process
# engine's first lines may be written before the follower is added (the run marker sorts them).
LOG_TAIL = 200


class Estimates(Protocol):
    """The start history's estimates (control/starts.py): the single ETA, and the wakes'."""

    def eta_s(self, dep_id: int) -> float | None: ...

    def wake_eta_s(self, dep_id: int, level: int | None = None) -> float | None: ...


class StartWatch(StartHooks):
    def __init__(self, logs: Callable[[Deployment], AsyncIterator[bytes]], *, publish: Callable[[object], None],
                 estimates: Estimates, units: Callable[[int], Unit | None], compile_root: Path | None = None,
                 readahead: ReadAhead | None = None, retention_days: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        """``units``: the deployer's unit of an id (its start, its caches); ``clock``: the
        deployer's (a start's phases are timed on it)."""
        self.logs = logs
        self.publish = publish
        self.estimates = estimates
        self.single_eta = estimates.eta_s
        self.units = units
        self.compile_root = compile_root
        self.readahead = readahead
        self.retention_days = retention_days
        self.clock = clock
        self.history = PhaseHistory()
        self.tasks = TaskGroup("start watch")
        self._pruned_at = -float("inf")

    @classmethod
    def of(cls, cfg: Config, backend: Backend, available_gib: Callable[[], float | None], *,
           publish: Callable[[object], None], estimates: Estimates, units: Callable[[int], Unit | None]) -> StartWatch:
        """The app's: its backend's logs, the configured compile cache and read-ahead."""
        ahead = ReadAhead(model_cache=cfg.deployer.model_cache, available_gib=available_gib,
                          reserve_gib=cfg.budget.host_reserve_gib)
        return cls(lambda dep: backend.logs(dep, tail=LOG_TAIL, follow=True), publish=publish, estimates=estimates,
                   units=units, compile_root=cfg.deployer.compile_cache, readahead=ahead,
                   retention_days=cfg.retention_days)

    # --- the unit's hooks --------------------------------------------------------------

    def before(self, start: Start, dep: Deployment, how: Launch) -> None:
        if start.timeline is None:
            # The start task may run before its StartBegan is published (the registry writes the
            # row first): the timeline begins here then, and that event keeps it.
            self._begin(start)
        if how.compile_key is not None and self.compile_root is not None:
            warm: bool | None = None
            try:
                warm = compile_cache.prepare(self.compile_root, how.compile_key)  # a mkdir and a listing
            except OSError as exc:
                log.warning("%s: compile cache %s: %s", dep.name, self.compile_root, exc)
            start.compile_key, start.compile_warm = how.compile_key, warm
            self._prune_now_and_then()
        if self.readahead is not None and dep.model is not None:
            start.read_ahead = self._read_ahead(self.readahead, dep)

    def after(self, start: Start, dep: Deployment, engine: Engine) -> None:
        if start.timeline is None or start.result is not None:
            return  # ended meanwhile (a stop during the backend's start)
        self._enter(start, "process")
        start.follower = self.tasks.spawn(self._follow(dep, start), f"phases of {dep.name}")

    def expected(self, dep: Deployment) -> None:
        # Its weights read ahead as for a start, even when the pre-warm finds no memory free and
        # starts nothing: the request expected then starts it from the page cache.
        if self.readahead is not None and dep.model is not None:
            self._read_ahead(self.readahead, dep)

    def _read_ahead(self, readahead: ReadAhead, dep: Deployment) -> Outcome:
        """Read its weights ahead (one read at a time: its unit keeps the last, for the view)."""
        unit = self.units(dep.id)
        outcome = readahead.warm(dep, unit.read_ahead if unit is not None else None)
        if unit is not None:
            unit.read_ahead = outcome
        return outcome

    # --- the bus ---------------------------------------------------------------------

    def on_start_began(self, e: StartBegan) -> None:
        """A cold start's timeline begins (a wake has none; one taken back was not seen beginning)."""
        start: Start = e.start
        if start.kind == "cold" and not start.taken_back and start.timeline is None:  # None: ``before`` began it
            self._begin(start)

    def on_start_ended(self, e: StartEnded) -> None:
        """Its log's follow ends; a cold start that ended ready records its phases."""
        start: Start = e.start
        if start.follower is not None:
            start.follower.cancel("the start ended")
        if e.result == "ready" and start.timeline is not None:
            self._timed(start, start.timeline)

    def forget(self, dep_id: int) -> None:
        """A removed deployment's phase history goes with it."""
        self.history.forget(dep_id)

    def _begin(self, start: Start) -> None:
        now = self.clock()
        estimate = self.history.eta_s(start.dep_id, None, now)
        if estimate is None:
            estimate = self.single_eta(start.dep_id)
        start.timeline = Timeline(now, estimate)
        self.publish(StartPhase(start.dep_id, start.name, "container"))

    def _timed(self, start: Start, timeline: Timeline) -> None:
        now = self.clock()
        durations = timeline.durations(now)
        self.history.record(start.dep_id, durations)
        actual = now - timeline.began
        error = abs(timeline.estimate_s - actual) / actual if timeline.estimate_s is not None and actual > 0 else None
        log.info("%s started in %.1f s: %s", start.name, actual,
                 ", ".join(f"{p} {s:.1f} s" for p, s in durations.items()))
        self.publish(StartTimed(start.dep_id, start.name, durations, error))

    def _enter(self, start: Start, phase: str) -> None:
        if start.timeline is not None and start.timeline.enter(phase, self.clock()):
            self.publish(StartPhase(start.dep_id, start.name, phase))

    async def _follow(self, dep: Deployment, start: Start) -> None:
        """Read the starting engine's log into its phases, until the start ends (cancelled then)."""
        reader = PhaseReader(reset_on=RUN_MARKER)
        try:
            async with contextlib.aclosing(self.logs(dep)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    for phase in reader.feed(chunk):
                        self._enter(start, phase)
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

    def _timeline(self, dep_id: int) -> Timeline | None:
        """The phases of its cold start under way, if it shows them."""
        unit = self.units(dep_id)
        start = unit.start if unit is not None else None
        return start.timeline if start is not None else None

    def phase(self, dep_id: int) -> str | None:
        timeline = self._timeline(dep_id)
        return timeline.phase if timeline is not None else None

    def eta_s(self, dep_id: int) -> float | None:
        """What is left of its start: by phase when its starts showed phases, else its single
        ETA counted down; not starting, the whole start's."""
        timeline = self._timeline(dep_id)
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
        history's: a wake's estimate for an asleep (or waking) deployment, else a cold start's."""
        if self._timeline(dep_id) is not None:
            return self.eta_s(dep_id)
        unit = self.units(dep_id)
        asleep = unit is not None and (unit.dep.state is State.ASLEEP or
                                       (unit.start is not None and unit.start.kind == "wake"))
        return self.estimates.wake_eta_s(dep_id) if asleep else self.estimates.eta_s(dep_id)

    def notice_phase(self, dep_id: int) -> str | None:
        """The phase of a cold start under way, in the notice's words."""
        timeline = self._timeline(dep_id)
        return SAYS.get(timeline.phase) if timeline is not None else None

    def fields(self, dep_id: int, compile_key: str | None) -> dict[str, Any]:
        """The view's: ``start_phase``, ``start_phases`` (a bar per phase), ``compile_cache``
        ({key, warm}: its configuration's key, and whether its last start with that key found
        the directory warm; null when not known) and ``read_ahead``; while starting, ``start_eta_s``."""
        unit = self.units(dep_id)
        timeline = self._timeline(dep_id)
        last = unit.launched if unit is not None else None
        warm = last.compile_warm if last is not None and last.compile_key == compile_key else None
        ahead = unit.read_ahead if unit is not None else None
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
        if self.readahead is not None:
            await self.readahead.close()
        await self.tasks.close()  # the logs' follows with it


async def _prune(root: Path, days: float) -> None:
    try:
        await asyncio.to_thread(compile_cache.prune, root, days)
    except OSError as exc:
        log.warning("compile cache %s: cannot prune: %s", root, exc)
