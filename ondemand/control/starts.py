"""Start history: how long each deployment's successful starts took, for its view
(``last_start_s``, ``start_eta_s``; an asleep one's ``wake_eta_s``), the queued notice and
``ondemand status``.

Durations come from the bus: a start's ``StartEnded`` says how long it took, from the step that
marked it ``starting`` (a failed wake's cold start: from the step its wake ended; a start that
began before ondemand restarted: from its stored row's stamp) to its end, and whether it
ended ``ready``; only those are kept. A wake is kept apart: it says nothing of how long a cold
start takes, and its own history gives ``wake_eta_s``. A sleep's call (the bus's ``Slept``) is kept
too, by level, for ``sleep_eta_s``: how long a sleeper's memory stays held once it is put to
sleep, which warmth by value weighs (a request that comes meanwhile waits for the call, then the
wake), timed on the deployer's clock.

The views read memory only (no await); each new start, wake and sleep is written to the state
file (``starts``, the last ``KEEP`` per deployment of each kind and level; a wake with the level
it woke from, a sleep with its level) by a named task, and read back at start-up.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable

from ..engines.tiers import LEVELS
from ..errors import log_unwritten
from ..events import Slept, StartEnded
from ..state.store import Store
from ..tasks import TaskGroup

log = logging.getLogger("ondemand.control.starts")

KEEP = 20  # starts kept per deployment in the state file
ETA_OF = 5  # the ETA is the median of this many last starts (or wakes)
WRITE_GRACE_S = 2.0  # at shutdown, how long the rows still being written may take (``close``)


def wake_median(level: int, from_level: dict[int, list[float]], every: list[float]) -> float | None:
    """The cost of a wake from ``level``: the median of its wakes from that level; None (the
    caller's default) when only the other level's are known; while no wake's level is known (a
    state file's wakes from before schema 9), the median of ``every`` wake. The live box and a
    replay of its state file price a wake by this one rule."""
    own = from_level.get(level)
    if own:
        return statistics.median(own)
    if any(from_level.get(other) for other in LEVELS):
        return None
    return statistics.median(every) if every else None


def newest(rows: Iterable[tuple[str, float, int | None]]) -> dict[str | tuple[str, int], list[float]]:
    """One deployment's recorded rows (kind, duration_s, level), oldest first, as the box prices
    them: the newest ``ETA_OF`` of each kind (key ``kind``) and of each kind at a known level (key
    ``(kind, level)``). The box at start-up and a replay of its state file both read them so."""
    out: dict[str | tuple[str, int], list[float]] = {}
    for kind, duration, level in rows:
        out.setdefault(kind, []).append(duration)
        if level in LEVELS:
            out.setdefault((kind, level), []).append(duration)
    for durations in out.values():
        del durations[:-ETA_OF]
    return out


class StartHistory:
    def __init__(self, store: Store, *, keep: int = KEEP, wall: Callable[[], float] = time.time):
        self.store = store
        self.keep = keep
        self.wall = wall  # a sleep's row's stamp (a start's comes with its StartEnded)
        self.tasks = TaskGroup("starts")
        self._durations: dict[int, list[float]] = {}  # cold starts, oldest first, at most ETA_OF
        self._wakes: dict[int, list[float]] = {}  # wakes, the same way
        # Wakes by the level they woke from (the state file keeps it since schema 9).
        self._wakes_from: dict[tuple[int, int], list[float]] = {}
        self._sleeps: dict[tuple[int, int], list[float]] = {}  # sleep calls by level, the same way

    async def load(self) -> None:
        for dep_id, rows in (await self.store.starts(self.keep)).items():
            kept = newest(rows)
            for kind, into in (("start", self._durations), ("wake", self._wakes)):
                if kind in kept:
                    into[dep_id] = kept[kind]
            for level in LEVELS:
                for kind, by_level in (("wake", self._wakes_from), ("sleep", self._sleeps)):
                    if (kind, level) in kept:
                        by_level[(dep_id, level)] = kept[(kind, level)]

    async def close(self) -> None:
        """The rows still being written are written (a start or a sleep that ended as ondemand
        shuts down is kept): each is one insert, so they get ``WRITE_GRACE_S``, then are cancelled."""
        await self.tasks.finish(WRITE_GRACE_S)

    # --- the bus -------------------------------------------------------------------

    def on_start_ended(self, e: StartEnded) -> None:
        """A start ended: one that ended ready is recorded (no await)."""
        if e.result != "ready":
            return  # failed, stopped, ...: not a successful start
        if e.duration_s < 0:  # only a start taken back, timed from its row's wall-clock stamp
            log.warning("%s: ignoring a start that took %.1f s (the clock went back)", e.name, e.duration_s)
            return
        self.record(e.dep_id, e.duration_s, "wake" if e.kind == "wake" else "start", at=e.at, level=e.level)

    def on_slept(self, e: Slept) -> None:
        """A sleep's call ended: how long it took is kept, and written (no await)."""
        took = max(0.0, e.took_s)
        sleeps = self._sleeps.setdefault((e.dep_id, e.level), [])
        sleeps.append(took)
        del sleeps[:-ETA_OF]
        self.tasks.spawn(self._write(e.dep_id, took, "sleep", self.wall(), e.level), f"write sleep {e.dep_id}")

    def forget(self, dep_id: int) -> None:
        """A removed deployment's history (its stored rows go with retention's next pass)."""
        self._durations.pop(dep_id, None)
        self._wakes.pop(dep_id, None)
        for level in LEVELS:
            self._wakes_from.pop((dep_id, level), None)
            self._sleeps.pop((dep_id, level), None)

    def record(self, dep_id: int, duration_s: float, kind: str = "start", *, at: float,
               level: int | None = None) -> None:
        """One successful start; a wake (``kind`` "wake") with the sleep ``level`` it woke from."""
        durations = (self._durations if kind == "start" else self._wakes).setdefault(dep_id, [])
        durations.append(duration_s)
        del durations[:-ETA_OF]
        level = level if kind == "wake" else None  # a cold start has none (a sleep: ``on_slept``)
        if level is not None:
            from_level = self._wakes_from.setdefault((dep_id, level), [])
            from_level.append(duration_s)
            del from_level[:-ETA_OF]
        self.tasks.spawn(self._write(dep_id, duration_s, kind, at, level), f"write start {dep_id}")

    async def _write(self, dep_id: int, duration_s: float, kind: str, at: float, level: int | None) -> None:
        try:
            await self.store.write_start(dep_id, at=at, duration_s=duration_s, kind=kind, keep=self.keep,
                                         level=level)
        except Exception as exc:  # the history is a courtesy: a failed write costs one entry
            log_unwritten(log, exc, "cannot record the %s of deployment %d", kind, dep_id)

    # --- reads (no await) --------------------------------------------------------------

    def last_start_s(self, dep_id: int) -> float | None:
        """How long its last successful start took, or None."""
        durations = self._durations.get(dep_id)
        return round(durations[-1], 1) if durations else None

    def eta_s(self, dep_id: int) -> float | None:
        """The median of its last ETA_OF successful starts, or None."""
        durations = self._durations.get(dep_id)
        return round(statistics.median(durations), 1) if durations else None

    def wake_eta_s(self, dep_id: int, level: int | None = None) -> float | None:
        """The median of its last ETA_OF successful wakes, or None. With ``level``: of its wakes
        from that level (None when only the other level's are known); of all of them while no
        wake's level is known (the wakes of a state file from before schema 9)."""
        if level is not None:
            from_level = {lv: self._wakes_from.get((dep_id, lv), []) for lv in LEVELS}
            median = wake_median(level, from_level, self._wakes.get(dep_id, []))
            return None if median is None else round(median, 1)
        durations = self._wakes.get(dep_id)
        return round(statistics.median(durations), 1) if durations else None

    def sleep_eta_s(self, dep_id: int, level: int) -> float | None:
        """The median of its last ETA_OF sleeps at ``level`` (the state file's too), or None."""
        sleeps = self._sleeps.get((dep_id, level))
        return statistics.median(sleeps) if sleeps else None

    def fields(self, dep_id: int, asleep: bool = False) -> dict[str, float | None]:
        """The view's fields; an asleep deployment's (``asleep``) adds ``wake_eta_s``."""
        out = {"last_start_s": self.last_start_s(dep_id), "start_eta_s": self.eta_s(dep_id)}
        if asleep:
            out["wake_eta_s"] = self.wake_eta_s(dep_id)
        return out
