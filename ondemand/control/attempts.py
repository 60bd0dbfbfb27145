"""The start side of the decision core: each deployment's attempt to start (or wake) its engine
for the requests that wait for it, and make-room for the head of the memory queue.

Per deployment with waiters, one attempt, and at most one effect of it out at a time (its
``Phase``): the admit (the deployer's fit check and start), the victims' stops or sleeps, the
settle (freed memory to show as free); each effect's report (``on_*``, through the
``Controller``) decides the next step, and so does each change of a deployment that ends a start.
A refused admit queues the deployment for memory; the scheduler says who is the head, what is
held for it, and which idle models it may put away. While something is queued, the queue's clock
(``tick``) looks again. Each victim put away is counted by the rule that allowed it (the scheduler's
``reason``), and one taken before its idle timeout is audited ``ondemand_make_room``.

A part the ``Controller`` owns: it reads and writes the slots part's records and waiters and the
scheduler's queue, and acts through ``Effects``. Plain ``def``s, no await, no I/O.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..errors import InsufficientMemory
from ..model import REQUEST_STARTABLE, Deployment, State
from . import relocation, verdicts
from .eviction import Candidate
from .placement import Fit, asleep_held, holdings
from .protocol import Effects, Timer
from .record import Attempt, Phase, idled_out
from .scheduler import Scheduler
from .slots import Slots

log = logging.getLogger("ondemand.control.controller")  # the core's one logger


class Attempts:
    """Each deployment's attempt (module doc)."""

    def __init__(self, effects: Effects, slots: Slots, scheduler: Scheduler, *, on_queue: Callable[[], None],
                 make_room_wait_s: float, recent_stop_s: float, max_tick_s: float, asleep_residue_gib: float):
        self.effects = effects
        self.slots = slots
        self.scheduler = scheduler
        self.queue = scheduler.queue
        self.clock = slots.clock
        self.on_queue = on_queue  # told after every change of the queue (adaptive warmth's idle rule follows it)
        self.make_room_wait_s = make_room_wait_s
        self.recent_stop_s = recent_stop_s
        self.max_tick_s = max_tick_s
        self.asleep_residue_gib = asleep_residue_gib  # budget.asleep_residue_gib: a sleeper nothing was read of
        self._last_ondemand_stop = -math.inf
        self._tick_timer: Timer | None = None
        self._tick_due = math.inf
        # Each victim whose stop is out for a make-room: (the requester, taken before its idle
        # timeout, why the scheduler's rule allowed it), until the stop reports (``on_stopped``: one
        # report per stop, whatever happens).
        self._taking: dict[int, tuple[int, bool, dict[str, Any]]] = {}
        # The victims make-room put away, by the rule that allowed each (``TakeRule.reason``'s
        # ``rule``; ``ondemand_make_room_total``).
        self.make_rooms: dict[str, int] = {}

    # --- the attempt ----------------------------------------------------------------

    def advance(self, dep_id: int) -> None:
        """Decide the next step of ``dep_id``'s attempt."""
        dw = self.slots.attempt(dep_id)
        if dw is None or not dw.waiters:
            return
        dep = self.effects.deployment(dep_id)
        if dep is None or self.slots.closing:
            return
        if dep.state is State.READY:
            if not self.slots.draining(dep_id):  # a drain's waiters wait for its end
                self.slots.wake_waiters(dep_id)
            return
        if dw.phase is not Phase.IDLE:
            return  # an effect of this attempt is out; its report decides
        if dep.state not in REQUEST_STARTABLE or dep.pending_mode is not None:
            return  # starting (by hand or for us), stopping, or set_mode starts it: wait
        if not dep.on_demand:
            if dep.state is not State.ASLEEP:
                self.slots.give_verdict(dep_id, verdicts.switched_to_always_on(dep))
            return
        b = self.slots.backoff(dep_id)
        if b is not None and self.clock() < b.until:
            self.slots.give_verdict(dep_id, self.slots.start_failed(dep, b))
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
        return self.scheduler.asks_first(dep_id, lambda head: self.slots.attempt_phase(head) is Phase.ADMITTING)

    def _release_held(self, head: int) -> None:
        """The head's admit has reported: the entries that let it ask first ask now."""
        for dep_id in self.queue.ids():
            if self.scheduler.behind(dep_id, head):
                self.advance(dep_id)

    def wanted(self, dep_id: int) -> bool:
        """Does anyone still wait for ``dep_id``? (The deployer asks it as it marks starting.)
        Not once shutdown began: an admit already out starts nothing."""
        return not self.slots.closing and self.slots.waiting(dep_id) > 0

    def on_admitted(self, dep_id: int, started: bool) -> None:
        """The admit effect's report: ``started`` False when it was starting or ready
        already, or nobody wanted it any more."""
        dw = self.slots.attempt(dep_id)
        if dw is None:
            return
        dw.phase = Phase.IDLE
        dw.offer_only = False
        if not started:
            # Starting or ready already, being removed, or nobody waits: the change that
            # follows (or none is needed) moves it on. Never ask again from here: a loop.
            dw.starting_for_request = False
            self.slots.forget_if_unused(dep_id)
            self._release_held(dep_id)
            return
        if self.queue.remove(dep_id):
            self.queue_changed()
            self.advance_all()

    def _admit_ended(self, dep_id: int) -> Attempt | None:
        """An admit that started nothing reported: the attempt is idle again."""
        dw = self.slots.attempt(dep_id)
        if dw is not None:
            dw.phase = Phase.IDLE
            dw.starting_for_request = False
            dw.offer_only = False
        return dw

    def on_refused(self, dep_id: int, exc: InsufficientMemory) -> None:
        """The fit check said no: does_not_fit, or queue, and the head makes room."""
        dw = self.slots.attempt(dep_id)
        offered = dw is not None and dw.offer_only  # read before _admit_ended clears it
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        if not dw.waiters or dep is None:
            self.slots.forget_if_unused(dep_id)
            return
        fit: Fit = exc.fit or Fit(exc.need, (exc.free,), (exc.capacity,), 1, None, False)
        recent_stop = self.clock() - self._last_ondemand_stop < self.recent_stop_s
        if fit.never_fits() and not dw.stopped_victim and not recent_stop:
            self.slots.give_verdict(dep_id, verdicts.does_not_fit(dep, fit, exc.capacity))
            return
        if self.slots.closing:
            return  # its waiters heard it already
        self._enqueue(dep_id, dw, dep)
        if not self.queue.is_head_or_empty(dep_id) or offered:
            self._tell_queued(dw)
            if offered:  # asked on an offer of freed memory: make-room waits for the queue's look
                self.schedule_tick()
                self._release_held(dep_id)
            return  # only the head makes room
        try:
            if self._room_coming(dep_id):
                self.schedule_tick()
                return  # what the entries it overtook are freeing is held for it: wait for that
            quiet = self._quiet(dep)
            victims, chosen = self._pick_victims(quiet, fit)
            if not victims and self._sleep_ending(dep_id):
                self._tell_queued(dw)
                self.schedule_tick()
                return  # memory is on its way from a sleep: wait for its call's end, then look again
            if not victims and self._relocates(dep, dw, fit):
                return  # stopped where it sleeps, to start cold where it fits (relocation.py)
            if not victims and any(self._sleeps_now(d) for d in quiet):
                victims, chosen = self._pick_victims(quiet, fit, escalate=True)
            if not victims:
                self._tell_queued(dw)
                self.schedule_tick()
                return  # queued until something changes
        finally:
            self._release_held(dep_id)
        dw.phase = Phase.STOPPING
        dw.victims = {v.id for v in victims}
        dw.frees = {v.id: {g: gib for g, gib in v.holds.items() if g in chosen} for v in victims}
        dw.freed = 0.0
        self._note_reasons(dep, victims)
        for v in victims:
            victim = self.effects.deployment(v.id)
            if v.tier == 0 and not v.stop and victim is not None and self._sleeps_now(victim):
                self.effects.sleep(v.id, text=f"Put to sleep to make room for {dep.served_name}", for_dep=dep_id)
            elif v.tier == 0:
                self.effects.stop(v.id, text=f"Put to sleep to make room for {dep.served_name}", for_dep=dep_id)
            else:
                self.effects.stop(v.id, text=f"Stopped (asleep) to make room for {dep.served_name}", for_dep=dep_id)

    def _relocates(self, dep: Deployment, dw: Attempt, fit: Fit) -> bool:
        """A sleeper that cannot wake on its own GPUs, with no victim there, when the scheduler
        relocates and a cold start fits elsewhere now: stopped (its own stop: the precheck asks
        only that it still sleeps), then its attempt starts it cold."""
        if not (self.scheduler.relocates and relocation.may_relocate(dep, fit)) or self.put_away_now(dep.id):
            return False
        if relocation.elsewhere(fit) is None:
            return False
        pools = len(fit.free)
        dw.phase = Phase.STOPPING
        dw.victims = {dep.id}
        dw.frees = {dep.id: holdings(self._frees(dep, pools, fit.per_gpu), dep.gpu_count, dep.gpus, pools, fit.per_gpu)}
        dw.freed = 0.0
        log.info("%s cannot wake on GPUs %s: stopped, to start where it fits", dep.name, dep.gpus)
        self.effects.stop(dep.id, text="Stopped (asleep) to start on other GPUs: its own are taken", for_dep=dep.id)
        return True

    def put_away_now(self, dep_id: int) -> bool:
        """Is ``dep_id`` a victim of a make-room under way (its sleep or stop not yet reported)?"""
        return any(rec.attempt is not None and dep_id in rec.attempt.victims for _, rec in self.slots.items())

    def on_budget_error(self, dep_id: int, reason: str) -> None:
        """The budget could not be read: nothing was tried, so no backoff; the waiters hear why."""
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        name = dep.served_name if dep else f"deployment {dep_id}"
        self.slots.give_verdict(dep_id, verdicts.budget_unavailable(name, reason))
        self.slots.forget_if_unused(dep_id)
        self._release_held(dep_id)

    def on_start_error(self, dep_id: int, reason: str) -> None:
        """The deployer refused the start (a state it cannot start from): a start failure."""
        dw = self._admit_ended(dep_id)
        if dw is None:
            return
        dep = self.effects.deployment(dep_id)
        if dep is not None and dep.state in REQUEST_STARTABLE:
            self.slots.give_verdict(dep_id, self.slots.start_failed(dep, self.slots.record_failure(dep_id, reason)))
        self.slots.forget_if_unused(dep_id)
        self._release_held(dep_id)

    def on_stopped(self, dep_id: int, approved: bool, for_dep: int | None) -> None:
        """A stop effect's report (reaper or make-room)."""
        if approved:
            self._last_ondemand_stop = self.clock()
        if for_dep is None:
            return
        taking = self._taking.get(dep_id)
        if taking is not None and taking[0] == for_dep:
            del self._taking[dep_id]
            if approved:  # counted and audited once it is done: a victim the precheck kept was not taken
                self._took(dep_id, for_dep, *taking[1:])
        dw = self.slots.attempt(for_dep)
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
            self.slots.forget_if_unused(for_dep)
            return
        if dw.freed <= 0:
            dw.phase = Phase.IDLE  # they became busy: wait for the next change
            self.schedule_tick()
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
        dw = self.slots.attempt(dep_id)
        if dw is not None:
            dw.phase = Phase.IDLE
            self.slots.forget_if_unused(dep_id)
        if taker is not None:
            self.advance(taker)  # first: this one then waits for the head's answer
        self.advance(dep_id)

    def _room_coming(self, head: int) -> bool:
        """Entries this head overtook still stop victims or wait for their memory to show:
        all of it is held for the head, which must not stop more meanwhile."""
        making_room = [d for d, rec in self.slots.items()
                       if rec.attempt is not None and rec.attempt.phase in (Phase.STOPPING, Phase.SETTLING)]
        return self.scheduler.room_coming(head, making_room)

    def _enqueue(self, dep_id: int, dw: Attempt, dep: Deployment) -> None:
        first = min((w.arrival for w in dw.waiters), default=self.clock())
        if self.queue.add(dep_id, first, dep.priority.rank):
            log.info("deployment %d queued for memory (%s priority)", dep_id, dep.priority)
            self.queue_changed()
        self.slots.counters_changed(dep_id)
        self.schedule_tick()

    def _tell_queued(self, dw: Attempt) -> None:
        """The queued notice, only for the queue: its waiters wait because the idle models
        make-room may take do not free enough (or behind the head). A make-room that found its
        victims, and a start or a wake, tell nothing: the answer is exactly the engine's."""
        dw.told = True
        for waiter in dw.waiters:
            self.slots.notify_queued(waiter)

    def _quiet(self, requester: Deployment) -> list[Deployment]:
        """The deployments make-room may put away for ``requester`` now (``may_put_away``), but the
        victims some attempt is putting away already."""
        now = self.clock()
        claimed = self.slots.claimed()
        return [d for d in self.effects.deployments() if d.id != requester.id and d.id not in claimed
                and not self.effects.sleeping(d.id) and self.may_put_away(d, requester, now)]

    def _sleep_ending(self, but: int) -> bool:
        """Is a sleep's call out (but ``but``'s)? Its memory is on its way: counted as held until
        the call ends (``rules.as_read``), never taken mid-call, and looked at again then
        (``Controller.on_slept``)."""
        return any(self.effects.sleeping(d.id) for d in self.effects.deployments() if d.id != but)

    def _pick_victims(self, quiet: list[Deployment], fit: Fit, escalate: bool = False
                      ) -> tuple[list[Candidate], tuple[int, ...]]:
        """The scheduler's choice of the ``quiet`` deployments, put to sleep where they sleep when
        idle. ``escalate``, when that cannot make it fit (what they would keep asleep stands in the
        way; asked after relocation, which costs only the requester): the awake ones are stopped
        instead, all of those the choice takes, so the GPU a model needs nearly whole is cleared of
        what would stand in its way again."""
        now = self.clock()
        pools = len(fit.free)
        per_gpu = fit.per_gpu
        return self.scheduler.victims(
            [Candidate(d.id, holdings(self._frees(d, pools, per_gpu, escalate), d.gpu_count, d.gpus, pools, per_gpu),
                       self.slots.last_active(d.id, now), d.priority.rank,
                       0 if d.state is State.READY else 1, escalate and self._sleeps_now(d))
             for d in quiet], fit)

    def _sleeps_now(self, dep: Deployment) -> bool:
        """Is ``dep`` awake and put to sleep (not stopped) when make-room takes it?"""
        return dep.state is State.READY and self.effects.idle_level(dep) > 0

    def may_put_away(self, victim: Deployment, requester: Deployment, now: float | None = None) -> bool:
        """May make-room put ``victim`` away for ``requester``: quiet, and taken by the scheduler's
        rule (of its priority, idle long enough). Make-room's choice and its stop's precheck."""
        if not self.scheduler.may_take(requester, victim):
            return False
        span = self.slots.quiet_for(victim, now)
        return span is not None and self.scheduler.takes(requester, victim, *span)

    def _note_reasons(self, requester: Deployment, victims: list[Candidate]) -> None:
        """Why the scheduler's rule allowed each victim, asked in the step that chose it (the
        figures it weighed then), kept until its stop reports."""
        now = self.clock()
        for v in victims:
            victim = self.effects.deployment(v.id)
            span = self.slots.quiet_for(victim, now) if victim is not None else None
            if victim is None or span is None:
                continue  # not so: chosen in this step as quiet
            why = self.scheduler.reason(requester, victim, *span)
            self._taking[v.id] = (requester.id, not idled_out(*span), {**why, "idle_for_s": round(span[0], 1),
                                                                    "idle_after_s": round(span[1], 1)})

    def _took(self, victim_id: int, for_dep: int, early: bool, why: dict[str, Any]) -> None:
        """A victim's stop was done for ``for_dep``: counted by its rule; taken before its idle
        timeout (``early``), audited ``ondemand_make_room`` (the requester's row) and shown on its
        view."""
        rule = why["rule"]
        self.make_rooms[rule] = self.make_rooms.get(rule, 0) + 1
        rec = self.slots.record(victim_id)
        if rec is not None:
            rec.early = None
        if not early:
            return  # as the reaper would have: its ondemand_sleep row says it all
        victim, requester = self.effects.deployment(victim_id), self.effects.deployment(for_dep)
        vname = victim.name if victim is not None else f"deployment {victim_id}"
        rname = requester.name if requester is not None else f"deployment {for_dep}"
        done = f"Put {vname} to sleep" if victim is not None and victim.state is State.ASLEEP else f"Stopped {vname}"
        how = (f"{rule}: wait {why['wait_s']:g} s > expected loss {why['loss_s']:g} s"
               if "wait_s" in why and "loss_s" in why else rule)
        text = (done + f" for {rname} after {why['idle_for_s']:.0f} s idle of its "
                f"{why['idle_after_s']:.0f} s idle timeout ({how})")
        log.info("%s", text)
        self.effects.audit("ondemand_make_room", for_dep, text,
                           {"victim_id": victim_id, "victim": vname, "for": rname, "reason": why})
        if rec is not None:
            rec.early = {"for": rname, "for_id": for_dep, "at": round(self.slots.wall(), 3), **why}
            self.slots.counters_changed(victim_id)  # its view says so

    def _frees(self, dep: Deployment, pools: int, per_gpu: bool, stop: bool = False) -> float:
        """GiB on its GPUs that putting ``dep`` away frees: awake and put to sleep, all but what it
        keeps asleep (``placement.asleep_held``, as the budget counts it: measured after its last
        sleep, else ``asleep_residue_gib`` per GPU); awake and stopped (``stop``, or it stops when
        idle), all; asleep and stopped, what it keeps (never nothing, so an asleep engine is always
        a victim when its GPU is needed)."""
        if dep.state is State.ASLEEP:
            return asleep_held(dep, self.asleep_residue_gib, pools, per_gpu)
        if not stop and self.effects.idle_level(dep) > 0:
            return dep.footprint_gib - asleep_held(dep, self.asleep_residue_gib, pools, per_gpu)
        return dep.footprint_gib

    # --- what the deployer reports ------------------------------------------------------

    def start_ended(self, dep: Deployment) -> None:
        dw = self.slots.attempt(dep.id)
        if dw is None:
            return
        for_request, dw.starting_for_request = dw.starting_for_request, False
        if dep.state is State.FAILED:
            if for_request or dw.waiters:  # waiters hear it, and new starts wait for the backoff
                b = self.slots.record_failure(dep.id, dep.state_reason or "start failed")
                self.slots.give_verdict(dep.id, self.slots.start_failed(dep, b))
        elif dep.state is not State.READY and for_request:
            self.slots.give_verdict(dep.id, verdicts.stopped(dep.served_name))
        self.slots.forget_if_unused(dep.id)

    def removed(self, dep_id: int) -> None:
        dw = self.slots.attempt(dep_id)
        if dw is not None:
            started_for_them = dw.starting_for_request and dw.phase is Phase.IDLE
            err = verdicts.stopped(f"deployment {dep_id}") if started_for_them else verdicts.removed(dep_id)
            self.slots.give_verdict(dep_id, err)
            dw.phase = Phase.IDLE
            dw.starting_for_request = False
            self.slots.forget_if_unused(dep_id)
        if self.queue.remove(dep_id):
            self.queue_changed()
            self.advance_all()
        self.slots.removed(dep_id)

    # --- the queue's clock ---------------------------------------------------------------

    def offer(self) -> None:
        """Memory was freed outside any make-room (a sleep's call ended): each attempt that waits
        asks now whether it fits, but one that does not takes no victim here; make-room stays with
        the queue's look (``tick``), as when a deployment becomes idle (design.md)."""
        for dep_id in [*self.queue.ids(), *(d for d in self.slots.attempts() if d not in self.queue)]:
            dw = self.slots.attempt(dep_id)
            if dw is not None and dw.phase is Phase.IDLE:
                dw.offer_only = True
                self.advance(dep_id)
                if self.slots.attempt_phase(dep_id) is not Phase.ADMITTING:
                    dw.offer_only = False  # it asked nothing (ready, backoff, behind the head)

    def advance_all(self) -> None:
        # The queue's order first: when memory frees, the head asks before the others.
        queued = self.queue.ids()
        for dep_id in [*queued, *(d for d in self.slots.attempts() if d not in self.queue)]:
            self.advance(dep_id)

    def queue_changed(self) -> None:
        """Every queued entry's place may have moved: their views say so; and adaptive warmth's
        idle rule follows the queue."""
        for dep_id in self.queue.ids():
            self.slots.counters_changed(dep_id)
        self.on_queue()

    def schedule_tick(self) -> None:
        """While something is queued, look again at most every ``max_tick_s``, and just
        after the next idle timeout runs out (a victim may appear then); a timer already
        set for later is brought forward."""
        if not len(self.queue):
            return
        now = self.clock()
        due = now + max(min(self.max_tick_s, self.slots.next_idle_expiry(now)), 0.01)
        if self._tick_timer is not None:
            if due >= self._tick_due - 1e-3:
                return
            self._tick_timer.cancel()
        self._tick_due = due
        self._tick_timer = self.effects.call_later(due - now, self.tick)

    def tick(self) -> None:
        if self._tick_timer is not None:  # called before its timer (Controller.tick): it takes its place
            self._tick_timer.cancel()
        self._tick_timer = None
        self._tick_due = math.inf
        self.advance_all()
        self.schedule_tick()

    def stop_ticking(self) -> None:
        """Shutdown or close: the queue's clock stops."""
        if self._tick_timer is not None:
            self._tick_timer.cancel()
            self._tick_timer = None
