"""The controller's decision core: slots, waiters, the wait queue, make-room,
start failures, mode switches, the idle rule and the live counters.

Every method here is a plain ``def``: no await, no I/O. On one event loop a
method without an await is atomic, so the core needs no lock: each decision
reads the in-memory state and acts on it in one step. What it decides is
done through ``Effects`` (start, stop, wait for memory, audit, publish,
timers), one narrow interface: the real one (``effects.py``) runs each
effect as a named task and reports the result back by calling one of the
``on_*`` methods below, which decide the next step. Tests drive the same
methods with a fake clock and a recording fake of ``Effects``.

Per deployment with waiters, one *attempt* moves through phases:

    idle ──admit──▶ admitting ──refused, head, victims──▶ stopping victims
      ▲                 │ started                              │ freed
      │                 ▼                                      ▼
      └──────────── (the start runs; ready / failed      settling (memory
                     / stopped arrive as changes)         to show as free)

At most one effect of an attempt is out at a time, so a burst of first
requests starts the model once, and a waiter that hangs up never cancels an
effect half-way (its task is not the waiter's).

Invariants (each has a test that races it):
- a slot is counted only when a waiter takes it, for state ``ready``, in the
  same step as the read (``take``);
- a stop by the controller goes through the deployer with ``is_idle`` as its
  precheck, run in the same step as marking ``stopping``: a slot and a stop
  never interleave;
- a start is asked for only while someone waits, and the deployer asks again
  (``wanted``) in the step that marks ``starting``;
- only the head of the queue makes room; memory freed for it is held for it
  until it starts or gives up (or for a head of higher priority that took
  its place);
- a victim is never of higher priority than the request it is stopped for;
- a slot beyond ``max_inflight`` is refused (429) in the same step as the
  count is read, so no two requests can both take the last one;
- every waiter leaves through ``leave``: counts never drift, and the queue
  entry of a deployment nobody waits for goes at once, its hold with it.
Nothing is persisted: after a restart every deployment waits a full idle
timeout.
"""
from __future__ import annotations

import logging

from ..errors import InsufficientMemory
from ..model import REQUEST_STARTABLE, Deployment, State
from . import modes, verdicts
from .eviction import Candidate
from .keepwarm import AdaptiveWarmth
from .modes import ModePlan
from .placement import Fit, asleep_held, holdings
from .protocol import Effects, Timer
from .record import Attempt, Phase, Waiter
from .slots import BACKOFF_FIRST_S, BACKOFF_MAX_S
from .ticket import Ticket

__all__ = ["ACTOR", "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Controller", "Effects", "ModePlan", "Phase", "Slot",
           "Timer", "Waiter"]

Slot = Ticket  # a granted slot is the ticket that holds it (``release()``)

log = logging.getLogger("ondemand.control.controller")

ACTOR = "ondemand"


class Controller(AdaptiveWarmth):
    """The decision core: the request side (``Slots``: records, slots, waiters, backoff,
    counters), adaptive warmth (``AdaptiveWarmth``: each idle period's plan, the pre-warm) and,
    here, the start side: each deployment's attempt, make-room, what the
    deployer reports, the reaper's step, the mode switch and the shutdown."""

    # --- the attempt ----------------------------------------------------------------

    def _advance(self, dep_id: int) -> None:
        """Decide the next step of ``dep_id``'s attempt."""
        dw = self._attempt(dep_id)
        if dw is None or not dw.waiters:
            return
        dep = self.effects.deployment(dep_id)
        if dep is None or self._closing:
            return
        if dep.state is State.READY:
            if not self.draining(dep_id):  # a drain's waiters wait for its end
                self._wake_waiters(dep_id)
            return
        if dw.phase is not Phase.IDLE:
            return  # an effect of this attempt is out; its report decides
        if dep.state not in REQUEST_STARTABLE or dep.pending_mode is not None:
            return  # starting (by hand or for us), stopping, or set_mode starts it: wait
        if not dep.on_demand:
            if dep.state is not State.ASLEEP:
                self._give_verdict(dep_id, verdicts.switched_to_always_on(dep))
            return
        b = self._backoff(dep_id)
        if b is not None and self.clock() < b.until:
            self._give_verdict(dep_id, self._start_failed(dep, b))
            return
        if self._head_asks_first(dep_id):
            return  # the head's answer comes first; its report moves this one on
        dw.phase = Phase.ADMITTING
        # Set before the move to starting, whose view is published as the start is admitted.
        dw.starting_for_request = True
        waking = dep.state is State.ASLEEP
        self.effects.admit(dep_id, text=("Woken" if waking else "Started") + " for a request")

    def _head_asks_first(self, dep_id: int) -> bool:
        """A queued entry behind a head of higher priority waits while the head's admit is out."""
        return self.scheduler.asks_first(dep_id, lambda head: self.attempt_phase(head) is Phase.ADMITTING)

    def _release_held(self, head: int) -> None:
        """The head's admit has reported: the entries that let it ask first ask now."""
        for dep_id in self.queue.ids():
            if self.scheduler.behind(dep_id, head):
                self._advance(dep_id)

    def settle_target(self, dep_id: int) -> int:
        """Whose fit a make-room's settle waits for: ``dep_id``, or the head of higher
        priority that took its place (and what it freed)."""
        return self.scheduler.settle_target(dep_id)

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        """GiB per GPU the queue holds for entries other than ``dep_id`` (for the head, what
        was freed for it): not free for ``dep_id``. The deployer asks it in the step of its fit
        check, so a hold made while the check's reading was out still counts."""
        return self.scheduler.held_for_others(dep_id)

    def wanted(self, dep_id: int) -> bool:
        """Does anyone still wait for ``dep_id``? (The deployer asks it as it marks starting.)
        Not once shutdown began: an admit already out starts nothing."""
        return not self._closing and self.waiting(dep_id) > 0

    def on_admitted(self, dep_id: int, started: bool) -> None:
        """The admit effect's report: ``started`` False when it was starting or ready
        already, or nobody wanted it any more."""
        dw = self._attempt(dep_id)
        if dw is None:
            return
        dw.phase = Phase.IDLE
        if not started:
            # Starting or ready already, being removed, or nobody waits: the change that
            # follows (or none is needed) moves it on. Never ask again from here: a loop.
            dw.starting_for_request = False
            self._forget_if_unused(dep_id)
            self._release_held(dep_id)
            return
        if self.queue.remove(dep_id):
            self._queue_changed()
            self._advance_all()

    def _admit_ended(self, dep_id: int) -> Attempt | None:
        """An admit that started nothing reported: the attempt is idle again."""
        dw = self._attempt(dep_id)
        if dw is not None:
            dw.phase = Phase.IDLE
            dw.starting_for_request = False
        return dw

    def on_refused(self, dep_id: int, exc: InsufficientMemory) -> None:
        """The fit check said no: does_not_fit, or queue, and the head makes room."""
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        if not dw.waiters or dep is None:
            self._forget_if_unused(dep_id)
            return
        fit: Fit = exc.fit or Fit(exc.need, (exc.free,), (exc.capacity,), 1, None, False)
        recent_stop = self.clock() - self._last_ondemand_stop < self.recent_stop_s
        if fit.never_fits() and not dw.stopped_victim and not recent_stop:
            self._give_verdict(dep_id, verdicts.does_not_fit(dep, fit, exc.capacity))
            return
        if self._closing:
            return  # its waiters heard it already
        self._enqueue(dep_id, dw, dep)
        if not self.queue.is_head_or_empty(dep_id):
            self._tell_queued(dw)
            return  # only the head makes room
        try:
            if self._room_coming(dep_id):
                self._schedule_tick()
                return  # what the entries it overtook are freeing is held for it: wait for that
            victims, chosen = self._pick_victims(dep, fit)
            if not victims:
                self._tell_queued(dw)
                self._schedule_tick()
                return  # queued until something changes
        finally:
            self._release_held(dep_id)
        dw.phase = Phase.STOPPING
        dw.victims = {v.id for v in victims}
        dw.frees = {v.id: {g: gib for g, gib in v.holds.items() if g in chosen} for v in victims}
        dw.freed = 0.0
        for v in victims:
            if v.tier == 0 and self._sleeps(v.id):
                self.effects.sleep(v.id, text=f"Put to sleep to make room for {dep.served_name}", for_dep=dep_id)
            elif v.tier == 0:
                self.effects.stop(v.id, text=f"Put to sleep to make room for {dep.served_name}", for_dep=dep_id)
            else:
                self.effects.stop(v.id, text=f"Stopped (asleep) to make room for {dep.served_name}", for_dep=dep_id)

    def on_budget_error(self, dep_id: int, reason: str) -> None:
        """The budget could not be read: nothing was tried, so no backoff; the waiters hear why."""
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        name = dep.served_name if dep else f"deployment {dep_id}"
        self._give_verdict(dep_id, verdicts.budget_unavailable(name, reason))
        self._forget_if_unused(dep_id)
        self._release_held(dep_id)

    def on_start_error(self, dep_id: int, reason: str) -> None:
        """The deployer refused the start (a state it cannot start from): a start failure."""
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        if dep is not None and dep.state in REQUEST_STARTABLE:
            self._give_verdict(dep_id, self._start_failed(dep, self._record_failure(dep_id, reason)))
        self._forget_if_unused(dep_id)
        self._release_held(dep_id)

    def on_stopped(self, dep_id: int, approved: bool, for_dep: int | None) -> None:
        """A stop effect's report (reaper or make-room)."""
        if approved:
            self._last_ondemand_stop = self.clock()
        if for_dep is None:
            return
        dw = self._attempt(for_dep)
        if dw is None or dw.phase is not Phase.STOPPING or dep_id not in dw.victims:
            return
        dw.victims.discard(dep_id)
        frees = dw.frees.pop(dep_id, {})
        if approved:
            dw.freed += sum(frees.values())
            self.queue.reserve(for_dep, frees)  # held at once, per GPU: nobody else may take it meanwhile
        if dw.victims:
            return  # the others are still stopping
        if not dw.waiters:
            dw.phase = Phase.IDLE
            self._forget_if_unused(for_dep)
            return
        if dw.freed <= 0:
            dw.phase = Phase.IDLE  # they became busy: wait for the next change
            self._schedule_tick()
            return
        names = self.effects.deployment(for_dep)
        log.info("stopped idle models to make room for %s (%.1f GiB)", names.name if names else for_dep, dw.freed)
        dw.stopped_victim = True
        dw.phase = Phase.SETTLING
        self.effects.settle(for_dep, self.make_room_wait_s)

    def on_settled(self, dep_id: int) -> None:
        """Freed memory shows (or the wait ran out): try again, and so does the head of
        higher priority that took the freed memory over."""
        taker = self.queue.overtaken_by(dep_id)
        dw = self._attempt(dep_id)
        if dw is not None:
            dw.phase = Phase.IDLE
            self._forget_if_unused(dep_id)
        if taker is not None:
            self._advance(taker)  # first: this one then waits for the head's answer
        self._advance(dep_id)

    def _room_coming(self, head: int) -> bool:
        """Entries this head overtook still stop victims or wait for their memory to show:
        all of it is held for the head, which must not stop more meanwhile."""
        making_room = [d for d, rec in self._records.items()
                       if rec.attempt is not None and rec.attempt.phase in (Phase.STOPPING, Phase.SETTLING)]
        return self.scheduler.room_coming(head, making_room)

    def _forget_if_unused(self, dep_id: int) -> None:
        rec = self._records.get(dep_id)
        dw = rec.attempt if rec is not None else None
        if rec is not None and dw is not None and not dw.waiters and dw.phase is Phase.IDLE \
                and not dw.starting_for_request:
            rec.attempt = None

    def _enqueue(self, dep_id: int, dw: Attempt, dep: Deployment) -> None:
        first = min((w.arrival for w in dw.waiters), default=self.clock())
        if self.queue.add(dep_id, first, dep.priority.rank):
            log.info("deployment %d queued for memory (%s priority)", dep_id, dep.priority)
            self._queue_changed()
        self._counters_changed(dep_id)
        self._schedule_tick()

    def _tell_queued(self, dw: Attempt) -> None:
        """The queued notice, only for the queue: its waiters wait because the idle models
        make-room may take do not free enough (or behind the head). A make-room that found its
        victims, and a start or a wake, tell nothing: the answer is exactly the engine's."""
        dw.told = True
        for waiter in dw.waiters:
            self._notify_queued(waiter)

    def _pick_victims(self, requester: Deployment, fit: Fit) -> tuple[list[Candidate], tuple[int, ...]]:
        """The idle deployments the scheduler may take for ``requester``, and its choice of them."""
        now = self.clock()
        claimed = self._claimed()
        pools = len(fit.free)
        per_gpu = fit.per_gpu
        candidates = [Candidate(d.id, holdings(self._frees(d, pools, per_gpu), d.gpu_count, d.gpus, pools, per_gpu),
                                self._last_active(d.id, now), d.priority.rank,
                                0 if d.state is State.READY else 1)
                      for d in self.effects.deployments()
                      if d.id != requester.id and d.id not in claimed and self.scheduler.may_take(requester, d)
                      and self.is_idle(d, now)]
        return self.scheduler.victims(candidates, fit)

    def _sleeps(self, dep_id: int) -> bool:
        """Is an idle ``dep_id`` put to sleep (not stopped)?"""
        dep = self.effects.deployment(dep_id)
        return dep is not None and self.effects.idle_level(dep) > 0

    def _frees(self, dep: Deployment, pools: int, per_gpu: bool) -> float:
        """GiB on its GPUs that putting ``dep`` away frees: awake and put to sleep, all but what
        it kept asleep last time (as measured; nothing known, all); awake and stopped, all;
        asleep and stopped, what it keeps (as found after its sleep, else
        ``asleep_residue_gib`` per GPU: never nothing, so an asleep engine is always a victim
        when its GPU is needed)."""
        if dep.state is State.ASLEEP:
            return asleep_held(dep, self.asleep_residue_gib, pools, per_gpu)
        if self.effects.idle_level(dep) > 0:
            return dep.footprint_gib - dep.residue_gib
        return dep.footprint_gib

    # --- what the deployer reports ------------------------------------------------------

    def on_deployment(self, dep_id: int, dep: Deployment | None, old: Deployment | None) -> None:
        """Every creation, change, transition and removal of a deployment."""
        now = self.clock()
        if dep is None:
            self._removed(dep_id)
            return
        rec = self._record(dep_id)
        if old is None:
            rec.last_activity = now  # a new deployment
        else:
            if old.config() != dep.config():
                rec.backoff = None  # a changed model or configuration
            if not old.on_demand and dep.on_demand:
                rec.last_activity = now  # switched to on demand
            if old.priority is not dep.priority and dep_id in self.queue:
                self.queue.rerank(dep_id, dep.priority.rank)  # an edit while it waits
                self._queue_changed()
        if dep.state is State.READY and (old is None or old.state is not State.READY):
            rec.last_activity = now
            rec.backoff = None
        if dep.state is State.ASLEEP:
            if old is None or old.state is not State.ASLEEP:
                rec.asleep_since = now
        else:
            rec.asleep_since = None
        self._warmth_changed(dep, rec)
        if old is not None and old.state is State.STARTING and dep.state is not State.STARTING:
            self._start_ended(dep)
        self._advance_all()

    def _start_ended(self, dep: Deployment) -> None:
        dw = self._attempt(dep.id)
        if dw is None:
            return
        for_request, dw.starting_for_request = dw.starting_for_request, False
        if dep.state is State.FAILED:
            if for_request or dw.waiters:  # waiters hear it, and new starts wait for the backoff
                b = self._record_failure(dep.id, dep.state_reason or "start failed")
                self._give_verdict(dep.id, self._start_failed(dep, b))
        elif dep.state is not State.READY and for_request:
            self._give_verdict(dep.id, verdicts.stopped(dep.served_name))
        self._forget_if_unused(dep.id)

    def _removed(self, dep_id: int) -> None:
        dw = self._attempt(dep_id)
        if dw is not None:
            started_for_them = dw.starting_for_request and dw.phase is Phase.IDLE
            err = verdicts.stopped(f"deployment {dep_id}") if started_for_them else verdicts.removed(dep_id)
            self._give_verdict(dep_id, err)
            dw.phase = Phase.IDLE
            dw.starting_for_request = False
            self._forget_if_unused(dep_id)
        if self.queue.remove(dep_id):
            self._queue_changed()
            self._advance_all()
        rec = self._records.get(dep_id)
        if rec is not None:
            rec.forget()
            if rec.unused():
                del self._records[dep_id]

    # --- the reaper's step ----------------------------------------------------------------

    def reap(self) -> list[int]:
        """Ask to stop every on-demand deployment idle by the rules; returns their ids."""
        if self._closing:
            return []
        now = self.clock()
        asked = []
        claimed = self._claimed()
        for dep in self.effects.deployments():
            if dep.id in claimed or not self.is_idle(dep, now) or self._held_awake(dep, now):
                continue
            minutes = round(self.idle_timeout(dep) / 60, 2)  # "0.33", "10", "1.5"
            if dep.state is State.ASLEEP:
                # Asleep it stays, until a request wakes it, make-room needs its memory, or
                # it has slept sleep_timeout_s.
                rec = self._records.get(dep.id)
                slept = 0.0 if rec is None or rec.asleep_since is None else now - rec.asleep_since
                if self.sleep_timeout_s is None or slept < self.sleep_timeout_s:
                    continue
                self.effects.stop(dep.id, text=f"Stopped after {round(slept / 60, 2):g} min asleep "
                                               "(sleep_timeout_s)", for_dep=None)
            elif self._rest_by_plan(dep, now):
                pass  # adaptive warmth's plan chose its tier (keepwarm.py)
            elif self.effects.idle_level(dep) > 0:
                self.effects.sleep(dep.id, text=f"Put to sleep after {minutes:g} min idle", for_dep=None)
            else:
                self.effects.stop(dep.id, text=f"Put to sleep after {minutes:g} min idle", for_dep=None)
            asked.append(dep.id)
        return asked

    # --- mode switch ------------------------------------------------------------------------

    def plan_mode(self, dep_id: int, mode: str, *, idle_timeout_s: int | None = None,
                  set_idle_timeout: bool = False) -> ModePlan:
        """Decide a switch (BEHAVIOUR.md, "Switch to always on"); resets the start backoff."""
        modes.check(mode, idle_timeout_s, set_idle_timeout, self.min_idle_timeout_s)
        dep = self.effects.deployment(dep_id)
        if dep is None:
            raise verdicts.unknown(dep_id)
        plan = modes.plan(dep, mode, idle_timeout_s, set_idle_timeout)
        self._reset_backoff(dep_id)  # set_mode resets the start backoff
        return plan

    def mode_switched(self, dep_id: int) -> None:
        """The switch is stored: waiters look again (a start may be theirs to wait for now)."""
        self._advance(dep_id)

    def shutdown(self) -> None:
        """Shutdown began: from now on nothing is started or stopped for a waiter (no
        make-room, no reaper), and every waiter, queued or waiting for a start, gets
        ``ondemand_shutting_down`` at once instead of holding the shutdown up."""
        self._closing = True
        err = verdicts.shutting_down()
        for dep_id in self.attempts():
            self._give_verdict(dep_id, err)
        for dep_id in self.queue.ids():
            self.queue.remove(dep_id)
        if self._tick_timer is not None:
            self._tick_timer.cancel()
            self._tick_timer = None

    def close(self) -> None:
        for rec in self._records.values():
            if rec.adaptive is not None:
                rec.adaptive.end()  # its pre-warm's timer
            if rec.publish_timer is not None:
                rec.publish_timer.cancel()
                rec.publish_timer = None
        if self._tick_timer is not None:
            self._tick_timer.cancel()
            self._tick_timer = None
