"""The request side of the controller's decision core: a request's verdict (``admit``: a
refusal, or its ``Ticket``), what it holds of each deployment (its ``Record``), the slots,
the waiters, the start backoff, the idle rule, the live counters and the clock of the queue.
``Controller`` (``controller.py``) adds the start side: each deployment's attempt, make-room,
the deployer's reports, the reaper's step.

Plain ``def`` methods, no await, no I/O, as the whole core (``controller.py``, at the top).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..errors import OndemandError
from ..model import REQUEST_STARTABLE, SLEEPING, STOPPABLE_WHEN_IDLE, Deployment, State
from . import verdicts
from .protocol import Effects, Timer
from .record import NOTHING, Attempt, Backoff, Phase, Record, Waiter
from .scheduler import Scheduler, SeedScheduler
from .ticket import Ticket, Waits, Want

log = logging.getLogger("ondemand.control.controller")  # the core's one logger

# An idle gap shorter than this is a busy model between two requests: not learned, not stored.
MIN_GAP_S = 1.0
BACKOFF_FIRST_S = 60.0
BACKOFF_MAX_S = 900.0


class Slots:
    def __init__(self, effects: Effects, *, clock: Callable[[], float], wall: Callable[[], float],
                 queue_timeout_s: float = 900, max_queued: int = 256, idle_timeout_s: int = 600,
                 min_idle_timeout_s: int = 60, make_room_wait_s: float = 20.0, recent_stop_s: float = 20.0,
                 max_tick_s: float = 15.0, publish_interval_s: float = 1.0, sleep_timeout_s: float | None = None,
                 asleep_residue_gib: float = 2.0, scheduler: Scheduler | None = None):
        self.effects = effects
        self.clock = clock
        self.wall = wall
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.idle_timeout_s = idle_timeout_s
        self.min_idle_timeout_s = min_idle_timeout_s
        self.make_room_wait_s = make_room_wait_s
        self.recent_stop_s = recent_stop_s
        self.max_tick_s = max_tick_s
        self.publish_interval_s = publish_interval_s
        self.sleep_timeout_s = sleep_timeout_s
        self.asleep_residue_gib = asleep_residue_gib  # budget.asleep_residue_gib: a sleeper nothing was read of
        self.scheduler: Scheduler = SeedScheduler() if scheduler is None else scheduler
        self.queue = self.scheduler.queue
        # One record per deployment. A record moves to the end as an attempt begins, so the
        # attempts are looked at in the order they began (``attempts``).
        self._records: dict[int, Record] = {}
        self._waiting = 0
        self._last_ondemand_stop = -math.inf
        self._tick_timer: Timer | None = None
        self._tick_due = math.inf
        self._closing = False  # shutdown began: nothing starts or stops for waiters any more
        now = clock()
        for dep in effects.deployments():  # first seen after a restart: a full idle timeout
            rec = self._record(dep.id)
            rec.last_activity = now
            if dep.state is State.ASLEEP:
                rec.asleep_since = now

    def _record(self, dep_id: int) -> Record:
        rec = self._records.get(dep_id)
        if rec is None:
            rec = self._records[dep_id] = Record()
        return rec

    def _attempt(self, dep_id: int) -> Attempt | None:
        rec = self._records.get(dep_id)
        return rec.attempt if rec is not None else None

    def _claimed(self) -> set[int]:
        """The victims some attempt is stopping."""
        return {v for rec in self._records.values() if rec.attempt is not None for v in rec.attempt.victims}

    # --- reads ----------------------------------------------------------------

    def record(self, dep_id: int) -> Record | None:
        """What the controller holds of ``dep_id`` (None: nothing yet)."""
        return self._records.get(dep_id)

    def attempts(self) -> list[int]:
        """The deployments with an attempt (waiters, or an effect of theirs out), in the
        order their attempts began."""
        return [dep_id for dep_id, rec in self._records.items() if rec.attempt is not None]

    def inflight(self, dep_id: int) -> int:
        rec = self._records.get(dep_id)
        return rec.inflight if rec is not None else 0

    def waiting(self, dep_id: int | None = None) -> int:
        if dep_id is None:
            return self._waiting
        dw = self._attempt(dep_id)
        return len(dw.waiters) if dw else 0

    def draining(self, dep_id: int) -> bool:
        """An administrator's sleep drains it: no new slot until it ends."""
        rec = self._records.get(dep_id)
        return rec is not None and rec.drains > 0

    def busy_total(self, dep_id: int) -> int:
        """Requests refused 429 ``ondemand_busy`` (over ``max_inflight``) so far."""
        rec = self._records.get(dep_id)
        return rec.busy if rec is not None else 0

    def queue_place(self, dep_id: int) -> tuple[int, int] | None:
        """(its place in the memory queue, from 1; the queue's length), or None."""
        return self.queue.place(dep_id)

    def idle_timeout(self, dep: Deployment) -> int:
        return dep.idle_timeout_s or self.idle_timeout_s

    def is_idle(self, dep: Deployment, now: float | None = None) -> bool:
        """May this deployment be stopped as idle (reaper, make-room)? The stop's precheck."""
        now = self.clock() if now is None else now
        rec = self._records.get(dep.id)
        if rec is None:
            rec = NOTHING
        return (dep.on_demand
                and dep.state in STOPPABLE_WHEN_IDLE
                and dep.pending_mode is None
                and not rec.drains  # an administrator's sleep drains it
                and not rec.inflight
                and not (rec.attempt is not None and rec.attempt.waiters)
                and now - (now if rec.last_activity is None else rec.last_activity) >= self._idle_after(dep, rec)
                and self.effects.engine_idle(dep.id))

    def status(self, dep_id: int) -> dict[str, Any]:
        """The ``ondemand`` field of a deployment view."""
        dep = self.effects.deployment(dep_id)
        rec = self._records.get(dep_id) or NOTHING
        dw = rec.attempt
        inflight = rec.inflight
        starting = dep is not None and dep.state is State.STARTING
        if dep_id in self.queue and not starting:
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
        place = self.queue.place(dep_id)
        return {"inflight": inflight, "queued": len(dw.waiters) if dw else 0,
                "queue_position": place[0] if place else None,
                "last_request_at": rec.last_request_at, "phase": phase,
                "idle_until": self._idle_until(dep, rec), "backoff_until": self._backoff_until(dep_id)}

    def _idle_until(self, dep: Deployment | None, rec: Record) -> float | None:
        """Wall time at which the reaper may take it (its idle timeout runs), or None."""
        if dep is None or not dep.on_demand or dep.state not in STOPPABLE_WHEN_IDLE or rec.inflight \
                or (rec.attempt is not None and rec.attempt.waiters) or rec.last_activity is None:
            return None
        if dep.state is State.ASLEEP:  # the reaper stops it only after sleep_timeout_s asleep, if set
            if self.sleep_timeout_s is None or rec.asleep_since is None:
                return None
            left = rec.asleep_since + self.sleep_timeout_s - self.clock()
            return round(self.wall() + left, 3)
        left = rec.last_activity + self._idle_after(dep, rec) - self.clock()
        return round(self.wall() + left, 3)

    def _backoff_until(self, dep_id: int) -> float | None:
        """Wall time at which the start backoff ends, or None."""
        left = self.backoff_left(dep_id)
        return round(self.wall() + left, 3) if left > 0 else None

    def attempt_phase(self, dep_id: int) -> Phase | None:
        dw = self._attempt(dep_id)
        return dw.phase if dw else None

    # --- slots ------------------------------------------------------------------

    def screen(self, dep_id: int, want: Want) -> Deployment:
        """The refusals that need no wait (``verdicts.screen``) on the deployment as read now."""
        return verdicts.screen(self.effects.deployment(dep_id), want)

    def admit(self, dep_id: int, want: Want) -> Ticket:
        """A request's verdict, in one step: the deployment read once, refused (the refusals that
        need no wait, ``verdicts.screen``, and ``ondemand_busy`` past its ``max_inflight``) or let
        in: a ticket with the deployment as read, holding a slot when it is on demand and ready.
        A ticket whose ``waits`` is set holds nothing: the request waits (``join``) for a start, a
        wake, or the end of a drain. (The edge gives a ticket that goes on its engine's address.)"""
        dep = verdicts.screen(self.effects.deployment(dep_id), want)
        if want is Want.TRAFFIC and (dep.on_demand or dep.pending_mode is not None):
            if dep.state is not State.READY:
                return Ticket(dep, waits=Waits.START)
            return self._take_ready(dep) or Ticket(dep, waits=Waits.DRAIN)
        return Ticket(dep)  # always on and ready, a model's route, the list, a health check: no slot

    def try_take(self, dep_id: int) -> Ticket | None:
        """A slot at once when the deployment is ready, whatever its mode (no waiter), else None;
        raises ``ondemand_busy`` past its ``max_inflight``. The replay's edge asks this; the
        gateway's asks ``admit``."""
        dep = self.effects.deployment(dep_id)
        if dep is not None and dep.state is State.READY:
            return self._take_ready(dep)
        return None

    def _take_ready(self, dep: Deployment) -> Ticket | None:
        """A ready deployment's slot, or None while an administrator's sleep drains it."""
        rec = self._record(dep.id)
        if rec.idle_since is not None:
            self._arrived(dep, rec)
        if rec.drains:
            return None
        self._check_limit(dep, rec)
        return self._grant(dep, rec)

    def _check_limit(self, dep: Deployment, rec: Record) -> None:
        """Read in the step that grants: never two past the limit. Only granted slots
        count (not health checks, not waiters); a refusal is no failed start."""
        if dep.max_inflight is not None and rec.inflight >= dep.max_inflight:
            rec.busy += 1
            raise verdicts.busy(dep)

    def _grant(self, dep: Deployment, rec: Record) -> Ticket:
        rec.inflight += 1
        rec.last_activity = self.clock()
        rec.last_request_at = self.wall()
        self._counters_changed(dep.id, rec)
        return Ticket(dep, slot=self)

    def release(self, dep_id: int) -> None:
        rec = self._record(dep_id)
        n = rec.inflight - 1
        rec.inflight = n if n > 0 else 0
        if rec.last_activity is not None:
            rec.last_activity = self.clock()
        self._counters_changed(dep_id, rec)
        if n <= 0:
            rec.idle_since = self.clock()  # an idle gap begins (adaptive warmth learns them)
            self._idle_began(dep_id, rec)
            if rec.drained:
                drained, rec.drained = rec.drained, []
                for callback in drained:
                    callback()
            self._schedule_tick()  # its idle timeout now runs: a queued request may look sooner

    # --- adaptive warmth's hooks (keepwarm.AdaptiveWarmth) ---------------------------------

    def _arrived(self, dep: Deployment, rec: Record) -> None:
        """The first request since its last slot's release: the idle gap ends."""
        raise NotImplementedError

    def _idle_began(self, dep_id: int, rec: Record) -> None:
        """Its last slot was released: an idle period begins."""
        raise NotImplementedError

    def _idle_after(self, dep: Deployment, rec: Record) -> float:
        """How long it must have been idle to count as idle: its idle timeout, or its plan's."""
        raise NotImplementedError

    def drain(self, dep_id: int, drained: Callable[[], None]) -> None:
        """A sleep drains first: from now until ``undrain`` no new slot is given to ``dep_id``
        (a request waits, and is served or wakes it afterwards); ``drained()`` is called once its
        requests in flight have ended (at once when none is)."""
        rec = self._record(dep_id)
        rec.drains += 1
        if rec.inflight:
            rec.drained.append(drained)
        else:
            drained()

    def undrain(self, dep_id: int, drained: Callable[[], None]) -> None:
        """The drain is over (it slept, or its deadline passed): slots again, and its waiters
        move on: served when it is still ready, else they wake it."""
        rec = self._record(dep_id)
        if drained in rec.drained:
            rec.drained.remove(drained)
        n = rec.drains - 1
        rec.drains = n if n > 0 else 0
        if n > 0:
            return
        self._advance(dep_id)

    # --- waiters ------------------------------------------------------------------

    def join(self, dep_id: int, *, arrival: float, notify: Callable[[], None],
             on_queued: Callable[[], None] | None = None) -> Waiter:
        """A request that found no ready engine starts waiting; raises the refusals
        that need no wait (unknown, planned, backoff, queue full)."""
        dep = self.effects.deployment(dep_id)
        if dep is None:
            raise verdicts.unknown(dep_id)
        if self._closing:
            raise verdicts.shutting_down()
        if dep.state is State.PLANNED:
            raise verdicts.planned(dep)
        if dep.state in REQUEST_STARTABLE:  # a start by hand is waited for, backoff or not
            self._check_backoff(dep)
        if self._waiting >= self.max_queued:
            raise verdicts.queue_full(self._waiting)
        waiter = Waiter(dep_id, arrival, arrival + self.queue_timeout_s, on_queued, notify)
        rec = self._record(dep_id)
        if rec.idle_since is not None:
            self._arrived(dep, rec)
        dw = rec.attempt
        if dw is None:
            dw = rec.attempt = Attempt()
            del self._records[dep_id]  # to the end: the attempts in the order they began
            self._records[dep_id] = rec
        dw.waiters.append(waiter)
        self._waiting += 1
        self._counters_changed(dep_id, rec)
        if dep_id in self.queue and dw.told:
            self._notify_queued(waiter)
        self._advance(dep_id)
        return waiter

    def take(self, waiter: Waiter) -> Ticket | None:
        """The waiter's turn: its ticket (with its slot) when ready, its verdict raised, or None (wait on).
        Raises ``ondemand_queue_timeout`` once its deadline has passed."""
        if waiter.verdict is not None:
            raise waiter.verdict
        dep = self.effects.deployment(waiter.dep_id)
        if dep is None:
            raise verdicts.removed(waiter.dep_id)
        if dep.state is State.READY:
            rec = self._record(waiter.dep_id)
            if not rec.drains:
                self._check_limit(dep, rec)  # it waited for a start, not for a slot: over the limit, 429 too
                return self._grant(dep, rec)
        now = self.clock()
        if now >= waiter.deadline:
            waited = now - waiter.arrival
            self.effects.audit("ondemand_queue_timeout", dep.id,
                               f"a request for {dep.name} gave up after waiting {waited:.0f} s "
                               "(ondemand_queue_timeout_s)",
                               {"waited_s": round(waited, 1), "state": dep.state.value})
            raise verdicts.queue_timeout(dep, self.queue_timeout_s)
        return None

    def leave(self, waiter: Waiter) -> None:
        """A waiter is done (slot taken, verdict, timeout or hang-up)."""
        dep_id = waiter.dep_id
        rec = self._records.get(dep_id)
        dw = rec.attempt if rec is not None else None
        if rec is None or dw is None or waiter not in dw.waiters:
            return
        dw.waiters.remove(waiter)
        self._waiting -= 1
        if not dw.waiters:
            if dw.phase is Phase.IDLE and not dw.starting_for_request:
                rec.attempt = None
            if self.queue.remove(dep_id):  # nobody waits: it gives up its place and its hold
                self._queue_changed()
                self._advance_all()
        self._counters_changed(dep_id)

    def next_wake(self, waiter: Waiter) -> float:
        """Seconds the waiter may sleep before it looks again (its deadline)."""
        return max(0.0, waiter.deadline - self.clock())

    def _notify_queued(self, waiter: Waiter) -> None:
        if not waiter.notified:
            waiter.notified = True
            if waiter.on_queued is not None:
                try:
                    waiter.on_queued()
                except Exception:
                    log.exception("on_queued callback failed")

    def _wake_waiters(self, dep_id: int) -> None:
        dw = self._attempt(dep_id)
        for waiter in list(dw.waiters if dw else ()):
            waiter.notify()

    def _give_verdict(self, dep_id: int, err: OndemandError) -> None:
        dw = self._attempt(dep_id)
        for waiter in list(dw.waiters if dw else ()):
            if waiter.verdict is None:
                waiter.verdict = err
                waiter.notify()

    # --- start failures -------------------------------------------------------

    def _check_backoff(self, dep: Deployment) -> None:
        b = self._backoff(dep.id)
        if b is not None and self.clock() < b.until:
            raise self._start_failed(dep, b)

    def _start_failed(self, dep: Deployment, b: Backoff) -> OndemandError:
        left = max(1, int(b.until - self.clock()))
        return verdicts.start_failed(dep, b.reason, left)

    def _record_failure(self, dep_id: int, reason: str) -> Backoff:
        rec = self._record(dep_id)
        prev = rec.backoff
        delay = BACKOFF_FIRST_S if prev is None else min(prev.delay * 2, BACKOFF_MAX_S)
        b = rec.backoff = Backoff(self.clock() + delay, delay, reason)
        return b

    def _backoff(self, dep_id: int) -> Backoff | None:
        rec = self._records.get(dep_id)
        return rec.backoff if rec is not None else None

    def _reset_backoff(self, dep_id: int) -> None:
        rec = self._records.get(dep_id)
        if rec is not None:
            rec.backoff = None

    def backoff_left(self, dep_id: int) -> float:
        b = self._backoff(dep_id)
        return max(0.0, b.until - self.clock()) if b else 0.0


    def _advance_all(self) -> None:
        # The queue's order first: when memory frees, the head asks before the others.
        queued = self.queue.ids()
        for dep_id in [*queued, *(d for d in self.attempts() if d not in self.queue)]:
            self._advance(dep_id)

    def _queue_changed(self) -> None:
        """Every queued entry's place may have moved: their views say so."""
        for dep_id in self.queue.ids():
            self._counters_changed(dep_id)

    def _last_active(self, dep_id: int, now: float) -> float:
        rec = self._records.get(dep_id)
        return now if rec is None or rec.last_activity is None else rec.last_activity

    # --- time -------------------------------------------------------------------------

    def _schedule_tick(self) -> None:
        """While something is queued, look again at most every ``max_tick_s``, and just
        after the next idle timeout runs out (a victim may appear then); a timer already
        set for later is brought forward."""
        if not len(self.queue):
            return
        now = self.clock()
        due = now + max(min(self.max_tick_s, self._next_idle_expiry(now)), 0.01)
        if self._tick_timer is not None:
            if due >= self._tick_due - 1e-3:
                return
            self._tick_timer.cancel()
        self._tick_due = due
        self._tick_timer = self.effects.call_later(due - now, self.tick)

    def tick(self) -> None:
        self._tick_timer = None
        self._tick_due = math.inf
        self._advance_all()
        self._schedule_tick()

    def _next_idle_expiry(self, now: float) -> float:
        soonest = math.inf
        for dep in self.effects.deployments():
            if dep.on_demand and dep.state in STOPPABLE_WHEN_IDLE and not self.inflight(dep.id):
                rec = self._records.get(dep.id) or NOTHING
                left = self._last_active(dep.id, now) + self._idle_after(dep, rec) - now
                if left > 0:
                    soonest = min(soonest, left + 0.05)
        return soonest

    # --- live counters ----------------------------------------------------------------------

    def _counters_changed(self, dep_id: int, rec: Record | None = None) -> None:
        """At most one publish a second per deployment: the first at once, later ones folded."""
        if rec is None:
            rec = self._record(dep_id)
        if rec.publish_timer is not None:
            return
        now = self.clock()
        due = rec.published_at + self.publish_interval_s
        if now >= due:
            self._publish(dep_id)
        else:
            rec.publish_timer = self.effects.call_later(due - now, lambda: self._publish(dep_id))

    def _publish(self, dep_id: int) -> None:
        rec = self._record(dep_id)
        rec.publish_timer = None
        rec.published_at = self.clock()
        if self.effects.deployment(dep_id) is not None:
            self.effects.counters_changed(dep_id)


    def _advance(self, dep_id: int) -> None:
        """Decide the next step of ``dep_id``'s attempt: the start side's (``Controller``)."""
        raise NotImplementedError
