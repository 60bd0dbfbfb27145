"""The slots part of the decision core: what it holds of each deployment (its ``Record``) and the
rules that read only that: a slot's grant and release (``max_inflight`` read in the step that
grants), the waiters (their refusals, deadlines and verdicts), an administrator's drain, the start
backoff, the idle gaps learned, the idle rule (``is_idle``: how long idle is idle this period is
the deployment's warmth policy's answer) and the live counters' publishing.

It asks nothing of the rest of the core: the ``Controller`` calls it and does what follows (a
waiter that joins moves its attempt on; a queue entry nobody waits for goes; a slot's release
may let a queued request look sooner). Plain ``def``s, no await, no I/O, as the whole core.
"""
from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import OndemandError
from ..model import REQUEST_STARTABLE, SLEEPING, STOPPABLE_WHEN_IDLE, Deployment, State
from . import verdicts
from .protocol import Effects
from .record import NOTHING, Attempt, Backoff, Phase, Record, Waiter, idled_out
from .rhythm import Rhythm
from .warmth_policy import WarmthPolicy

ARRIVALS_KEPT = 64  # the newest arrivals a deployment's rate is read from
ARRIVALS_KNOWN = 8  # fewer: its rate is not known

log = logging.getLogger("ondemand.control.controller")  # the core's one logger

# An idle gap shorter than this is a busy model between two requests: not learned, not stored.
MIN_GAP_S = 1.0
BACKOFF_FIRST_S = 60.0
BACKOFF_MAX_S = 900.0


class Slots:
    """The slots part (module doc); ``warmth(dep, rec)`` gives a deployment's warmth policy."""

    def __init__(self, effects: Effects, *, clock: Callable[[], float], wall: Callable[[], float],
                 warmth: Callable[[Deployment | None, Record | None], WarmthPolicy],
                 queue_timeout_s: float = 900, max_queued: int = 256, idle_timeout_s: int = 600,
                 min_idle_timeout_s: int = 60, publish_interval_s: float = 1.0,
                 sleep_timeout_s: float | None = None):
        self.effects = effects
        self.clock = clock
        self.wall = wall
        self.warmth = warmth  # a deployment's warmth policy (the controller's choice)
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.idle_timeout_s = idle_timeout_s
        self.min_idle_timeout_s = min_idle_timeout_s
        self.publish_interval_s = publish_interval_s
        self.sleep_timeout_s = sleep_timeout_s
        # One record per deployment. A record moves to the end as an attempt begins, so the
        # attempts are looked at in the order they began (``attempts``).
        self._records: dict[int, Record] = {}
        self._waiting = 0
        self.closing = False  # shutdown began: no waiter joins, nothing starts or stops for one
        now = clock()
        for dep in effects.deployments():  # first seen after a restart: a full idle timeout
            rec = self.record_for(dep.id)
            rec.last_activity = now
            if dep.state is State.ASLEEP:
                rec.asleep_since = now

    # --- records ----------------------------------------------------------------

    def record(self, dep_id: int) -> Record | None:
        """What the controller holds of ``dep_id`` (None: nothing yet)."""
        return self._records.get(dep_id)

    def record_for(self, dep_id: int) -> Record:
        """``dep_id``'s record, made when first needed."""
        rec = self._records.get(dep_id)
        if rec is None:
            rec = self._records[dep_id] = Record()
        return rec

    def items(self) -> list[tuple[int, Record]]:
        """Every record with its deployment's id, the attempts in the order they began."""
        return list(self._records.items())

    def attempt(self, dep_id: int) -> Attempt | None:
        rec = self._records.get(dep_id)
        return rec.attempt if rec is not None else None

    def attempts(self) -> list[int]:
        """The deployments with an attempt (waiters, or an effect of theirs out), in the
        order their attempts began."""
        return [dep_id for dep_id, rec in self._records.items() if rec.attempt is not None]

    def claimed(self) -> set[int]:
        """The victims some attempt is stopping."""
        return {v for rec in self._records.values() if rec.attempt is not None for v in rec.attempt.victims}

    def forget_if_unused(self, dep_id: int) -> None:
        """An attempt with no waiter, no effect out and no start of its own running ends."""
        rec = self._records.get(dep_id)
        dw = rec.attempt if rec is not None else None
        if rec is not None and dw is not None and not dw.waiters and dw.phase is Phase.IDLE \
                and not dw.starting_for_request:
            rec.attempt = None

    def removed(self, dep_id: int) -> None:
        """The deployment is gone: its record goes, but for an attempt or a drain still ending."""
        rec = self._records.get(dep_id)
        if rec is not None:
            rec.forget()
            if rec.unused():
                del self._records[dep_id]

    # --- reads ----------------------------------------------------------------

    def inflight(self, dep_id: int) -> int:
        rec = self._records.get(dep_id)
        return rec.inflight if rec is not None else 0

    def waiting(self, dep_id: int | None = None) -> int:
        if dep_id is None:
            return self._waiting
        dw = self.attempt(dep_id)
        return len(dw.waiters) if dw else 0

    def draining(self, dep_id: int) -> bool:
        """An administrator's sleep drains it: no new slot until it ends."""
        rec = self._records.get(dep_id)
        return rec is not None and rec.drains > 0

    def busy_total(self, dep_id: int) -> int:
        """Requests refused 429 ``ondemand_busy`` (over ``max_inflight``) so far."""
        rec = self._records.get(dep_id)
        return rec.busy if rec is not None else 0

    def attempt_phase(self, dep_id: int) -> Phase | None:
        dw = self.attempt(dep_id)
        return dw.phase if dw else None

    def idle_timeout(self, dep: Deployment) -> int:
        return dep.idle_timeout_s or self.idle_timeout_s

    def last_active(self, dep_id: int, now: float) -> float:
        rec = self._records.get(dep_id)
        return now if rec is None or rec.last_activity is None else rec.last_activity

    def status(self, dep_id: int, place: tuple[int, int] | None) -> dict[str, Any]:
        """The ``ondemand`` field of a deployment view; ``place``: its place in the memory queue."""
        dep = self.effects.deployment(dep_id)
        rec = self._records.get(dep_id) or NOTHING
        dw = rec.attempt
        inflight = rec.inflight
        starting = dep is not None and dep.state is State.STARTING
        if place is not None and not starting:
            phase = "queued"
        elif starting and dw is not None and dw.starting_for_request:
            phase = "starting_for_request"
        elif inflight:
            phase = "serving"
        elif dep is None or dep.state is State.FAILED:
            phase = "failed"
        elif dep.state in SLEEPING:
            phase = "sleeping"
        else:
            phase = "idle"
        return {"inflight": inflight, "queued": len(dw.waiters) if dw else 0,
                "queue_position": place[0] if place else None,
                "last_request_at": rec.last_request_at, "phase": phase,
                "idle_until": self._idle_until(dep, rec), "backoff_until": self._backoff_until(dep_id)}

    def _idle_until(self, dep: Deployment | None, rec: Record) -> float | None:
        """Wall time at which the reaper may take it (its idle rule's time runs out, or its
        warmth policy's hold ends), or None."""
        if dep is None or not dep.on_demand or dep.state not in STOPPABLE_WHEN_IDLE or rec.inflight \
                or (rec.attempt is not None and rec.attempt.waiters) or rec.last_activity is None:
            return None
        if dep.state is State.ASLEEP:  # the reaper stops it only after sleep_timeout_s asleep, if set
            if self.sleep_timeout_s is None or rec.asleep_since is None:
                return None
            left = rec.asleep_since + self.sleep_timeout_s - self.clock()
            return round(self.wall() + left, 3)
        left = rec.last_activity + self.idle_after(dep, rec) - self.clock()
        until = round(self.wall() + left, 3)
        held = self.warmth(dep, rec).held_until(dep, rec, self.clock())
        return until if held is None else max(until, round(self.wall() + held - self.clock(), 3))

    # --- the idle rule ----------------------------------------------------------------

    def is_idle(self, dep: Deployment, now: float | None = None) -> bool:
        """May the reaper stop this deployment as idle? Quiet, and for as long as its warmth policy
        asks (make-room asks the scheduler's rule over ``quiet_for`` instead). The reaper's precheck."""
        span = self.quiet_for(dep, now)
        return span is not None and idled_out(*span)

    def quiet_for(self, dep: Deployment, now: float | None = None) -> tuple[float, float] | None:
        """(how long it has been idle, how long its warmth policy asks before the reaper may take
        it) when it is quiet: on demand, ready or asleep, no switch of mode under way, not drained,
        no slot in flight, nobody waiting for it, its engine's metrics quiet. None when it is not:
        nothing may put it away then, whatever a scheduler weighs."""
        now = self.clock() if now is None else now
        rec = self._records.get(dep.id)
        if rec is None:
            rec = NOTHING
        if not (dep.on_demand
                and dep.state in STOPPABLE_WHEN_IDLE
                and dep.pending_mode is None
                and not rec.drains  # an administrator's sleep drains it
                and not rec.inflight
                and not (rec.attempt is not None and rec.attempt.waiters)
                and self.effects.engine_idle(dep.id)):
            return None
        return now - (now if rec.last_activity is None else rec.last_activity), self.idle_after(dep, rec)

    def idle_after(self, dep: Deployment, rec: Record) -> float:
        """How long it must have been idle to count as idle: its warmth policy's answer."""
        return self.warmth(dep, rec).idle_after(dep, rec)

    def next_idle_expiry(self, now: float) -> float:
        """Seconds until the next idle deployment's idle rule lets it be taken (inf: none)."""
        soonest = math.inf
        for dep in self.effects.deployments():
            if dep.on_demand and dep.state in STOPPABLE_WHEN_IDLE and not self.inflight(dep.id):
                rec = self._records.get(dep.id) or NOTHING
                left = self.last_active(dep.id, now) + self.idle_after(dep, rec) - now
                if left > 0:
                    soonest = min(soonest, left + 0.05)
        return soonest

    # --- the idle gaps ----------------------------------------------------------------

    def arrived(self, dep: Deployment, rec: Record) -> None:
        """The first request since it became idle ends the gap: learned when it is on demand and
        was idle for at least MIN_GAP_S (shorter is a busy model's breath), whatever its
        ``keep_warm`` (a switch to adaptive finds its rhythm). Every slot follows an arrival, so
        none is out while ``idle_since`` is set. The idle period ends with it."""
        gap = self.clock() - rec.idle_since if rec.idle_since is not None else 0.0
        rec.idle_since = None
        if gap >= MIN_GAP_S and dep.on_demand:
            if rec.rhythm is None:
                rec.rhythm = Rhythm()
            rec.rhythm.add(gap)
            rec.learned += 1
            self.effects.idle_gap(dep.id, gap)
        self.warmth(dep, rec).idle_ended(dep, rec)

    def learn(self, gaps: Mapping[int, Iterable[float]]) -> None:
        """The idle gaps kept in the state file (after a restart): what was learned stays."""
        for dep_id, kept in gaps.items():
            if self.effects.deployment(dep_id) is not None:
                self.record_for(dep_id).rhythm = Rhythm(kept)

    def rhythm(self, dep_id: int) -> Rhythm | None:
        """The idle gaps learned of ``dep_id`` (None: none yet)."""
        rec = self._records.get(dep_id)
        return rec.rhythm if rec is not None else None

    # --- slots ------------------------------------------------------------------

    def take_ready(self, dep: Deployment) -> bool:
        """A ready deployment's slot, counted; False while an administrator's sleep drains it.
        Raises ``ondemand_busy`` past its ``max_inflight``."""
        rec = self.record_for(dep.id)
        if rec.idle_since is not None:
            self.arrived(dep, rec)
        if rec.drains:
            return False  # it waits (``join``), and is counted there
        self._count_arrival(rec)
        self._check_limit(dep, rec)
        self._grant(dep, rec)
        return True

    def _count_arrival(self, rec: Record) -> None:
        if rec.arrivals is None:
            rec.arrivals = collections.deque(maxlen=ARRIVALS_KEPT)
        rec.arrivals.append(self.clock())

    def arrival_gap_s(self, dep_id: int) -> float | None:
        """Its mean time between requests over its newest ``ARRIVALS_KEPT`` (the silence since the
        last counted), or None before ``ARRIVALS_KNOWN``."""
        rec = self._records.get(dep_id)
        if rec is None or rec.arrivals is None or len(rec.arrivals) < ARRIVALS_KNOWN:
            return None
        return (self.clock() - rec.arrivals[0]) / len(rec.arrivals)

    def _check_limit(self, dep: Deployment, rec: Record) -> None:
        """Read in the step that grants: never two past the limit. Only granted slots
        count (not health checks, not waiters); a refusal is no failed start."""
        if dep.max_inflight is not None and rec.inflight >= dep.max_inflight:
            rec.busy += 1
            raise verdicts.busy(dep)

    def _grant(self, dep: Deployment, rec: Record) -> None:
        rec.inflight += 1
        rec.last_activity = self.clock()
        rec.last_request_at = self.wall()
        self.counters_changed(dep.id, rec)

    def release(self, dep_id: int) -> bool:
        """A slot given back; True when it was the last: an idle period begins."""
        rec = self.record_for(dep_id)
        n = rec.inflight - 1
        rec.inflight = n if n > 0 else 0
        if rec.last_activity is not None:
            rec.last_activity = self.clock()
        self.counters_changed(dep_id, rec)
        if n > 0:
            return False
        rec.idle_since = self.clock()  # an idle gap begins (adaptive warmth learns them)
        dep = self.effects.deployment(dep_id)
        self.warmth(dep, rec).idle_began(dep, rec)
        if rec.drained:
            drained, rec.drained = rec.drained, []
            for callback in drained:
                callback()
        return True

    def drain(self, dep_id: int, drained: Callable[[], None]) -> None:
        """A sleep drains first: from now until ``undrain`` no new slot is given to ``dep_id``
        (a request waits, and is served or wakes it afterwards); ``drained()`` is called once its
        requests in flight have ended (at once when none is)."""
        rec = self.record_for(dep_id)
        rec.drains += 1
        if rec.inflight:
            rec.drained.append(drained)
        else:
            drained()

    def undrain(self, dep_id: int, drained: Callable[[], None]) -> bool:
        """One drain is over; True when none is left (slots again)."""
        rec = self.record_for(dep_id)
        if drained in rec.drained:
            rec.drained.remove(drained)
        n = rec.drains - 1
        rec.drains = n if n > 0 else 0
        return n <= 0

    # --- waiters ------------------------------------------------------------------

    def join(self, dep: Deployment, *, arrival: float, notify: Callable[[], None],
             on_queued: Callable[[], None] | None, queued: bool) -> Waiter:
        """A request that found no ready engine starts waiting (its attempt made, last in the
        order of attempts when new); raises the refusals that need no wait (planned, backoff,
        queue full). ``queued``: its deployment is in the memory queue (a waiter that joins an
        attempt told so is told at once)."""
        if dep.state is State.PLANNED:
            raise verdicts.planned(dep)
        if dep.state in REQUEST_STARTABLE:  # a start by hand is waited for, backoff or not
            self._check_backoff(dep)
        rec = self.record_for(dep.id)
        self._count_arrival(rec)  # refused for a full queue or not: it was asked
        if self._waiting >= self.max_queued:
            raise verdicts.queue_full(self._waiting)
        waiter = Waiter(dep.id, arrival, arrival + self.queue_timeout_s, on_queued, notify)
        if rec.idle_since is not None:
            self.arrived(dep, rec)
        dw = rec.attempt
        if dw is None:
            dw = rec.attempt = Attempt()
            del self._records[dep.id]  # to the end: the attempts in the order they began
            self._records[dep.id] = rec
        dw.waiters.append(waiter)
        self._waiting += 1
        self.counters_changed(dep.id, rec)
        if queued and dw.told:
            self.notify_queued(waiter)
        return waiter

    def take(self, waiter: Waiter) -> Deployment | None:
        """The waiter's turn: its deployment, its slot counted, when ready; its verdict raised;
        or None (wait on). Raises ``ondemand_queue_timeout`` once its deadline has passed."""
        if waiter.verdict is not None:
            raise waiter.verdict
        dep = self.effects.deployment(waiter.dep_id)
        if dep is None:
            raise verdicts.removed(waiter.dep_id)
        if dep.state is State.READY:
            rec = self.record_for(waiter.dep_id)
            if not rec.drains:
                self._check_limit(dep, rec)  # it waited for a start, not for a slot: over the limit, 429 too
                self._grant(dep, rec)
                return dep
        now = self.clock()
        if now >= waiter.deadline:
            waited = now - waiter.arrival
            self.effects.audit("ondemand_queue_timeout", dep.id,
                               f"a request for {dep.name} gave up after waiting {waited:.0f} s "
                               "(ondemand_queue_timeout_s)",
                               {"waited_s": round(waited, 1), "state": dep.state.value})
            raise verdicts.queue_timeout(dep, self.queue_timeout_s)
        return None

    def leave(self, waiter: Waiter) -> bool | None:
        """A waiter is done (slot taken, verdict, timeout or hang-up). True when nobody waits for
        its deployment any more; None when it had left already."""
        rec = self._records.get(waiter.dep_id)
        dw = rec.attempt if rec is not None else None
        if rec is None or dw is None or waiter not in dw.waiters:
            return None
        dw.waiters.remove(waiter)
        self._waiting -= 1
        if dw.waiters:
            return False
        if dw.phase is Phase.IDLE and not dw.starting_for_request:
            rec.attempt = None
        return True

    def next_wake(self, waiter: Waiter) -> float:
        """Seconds the waiter may sleep before it looks again (its deadline)."""
        return max(0.0, waiter.deadline - self.clock())

    def notify_queued(self, waiter: Waiter) -> None:
        if not waiter.notified:
            waiter.notified = True
            if waiter.on_queued is not None:
                try:
                    waiter.on_queued()
                except Exception:
                    log.exception("on_queued callback failed")

    def wake_waiters(self, dep_id: int) -> None:
        dw = self.attempt(dep_id)
        for waiter in list(dw.waiters if dw else ()):
            waiter.notify()

    def give_verdict(self, dep_id: int, err: OndemandError) -> None:
        dw = self.attempt(dep_id)
        for waiter in list(dw.waiters if dw else ()):
            if waiter.verdict is None:
                waiter.verdict = err
                waiter.notify()

    # --- start failures -------------------------------------------------------

    def _check_backoff(self, dep: Deployment) -> None:
        b = self.backoff(dep.id)
        if b is not None and self.clock() < b.until:
            raise self.start_failed(dep, b)

    def start_failed(self, dep: Deployment, b: Backoff) -> OndemandError:
        left = max(1, int(b.until - self.clock()))
        return verdicts.start_failed(dep, b.reason, left)

    def record_failure(self, dep_id: int, reason: str) -> Backoff:
        rec = self.record_for(dep_id)
        prev = rec.backoff
        delay = BACKOFF_FIRST_S if prev is None else min(prev.delay * 2, BACKOFF_MAX_S)
        b = rec.backoff = Backoff(self.clock() + delay, delay, reason)
        return b

    def backoff(self, dep_id: int) -> Backoff | None:
        rec = self._records.get(dep_id)
        return rec.backoff if rec is not None else None

    def reset_backoff(self, dep_id: int) -> None:
        rec = self._records.get(dep_id)
        if rec is not None:
            rec.backoff = None

    def backoff_left(self, dep_id: int) -> float:
        b = self.backoff(dep_id)
        return max(0.0, b.until - self.clock()) if b else 0.0

    def _backoff_until(self, dep_id: int) -> float | None:
        """Wall time at which the start backoff ends, or None."""
        left = self.backoff_left(dep_id)
        return round(self.wall() + left, 3) if left > 0 else None

    # --- live counters ----------------------------------------------------------------------

    def counters_changed(self, dep_id: int, rec: Record | None = None) -> None:
        """At most one publish a second per deployment: the first at once, later ones folded."""
        if rec is None:
            rec = self.record_for(dep_id)
        if rec.publish_timer is not None:
            return
        now = self.clock()
        due = rec.published_at + self.publish_interval_s
        if now >= due:
            self._publish(dep_id)
        else:
            rec.publish_timer = self.effects.call_later(due - now, lambda: self._publish(dep_id))

    def _publish(self, dep_id: int) -> None:
        rec = self.record_for(dep_id)
        rec.publish_timer = None
        rec.published_at = self.clock()
        if self.effects.deployment(dep_id) is not None:
            self.effects.counters_changed(dep_id)

    def close(self) -> None:
        """The core is closing: no publish is left pending."""
        for rec in self._records.values():
            if rec.publish_timer is not None:
                rec.publish_timer.cancel()
                rec.publish_timer = None
