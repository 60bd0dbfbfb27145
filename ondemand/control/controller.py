"""The controller: the decision core's coordinator. Every call from outside the core comes here
(a request's admission and wait, the effects' reports, the deployer's changes, the reaper's step,
an administrator's mode switch, drain and shutdown) and goes on to the parts that decide it, in
order:

- the slots part (``Slots``, ``slots.py``): each deployment's record, its slots, waiters, drains,
  start backoff, idle gaps, the idle rule and the live counters;
- each deployment's warmth policy (``WarmthPolicy``, ``warmth_policy.py``: ``Fixed``, or
  ``Adaptive`` in ``keepwarm.py``, by its ``keep_warm``): how long idle is idle in an idle period,
  what the reaper does then, the pre-warm;
- the scheduler (``Scheduler``, ``scheduler.py``, chosen by the box's ``scheduler`` key): the
  memory queue's order and holds, make-room's victims and their placement;
- the start side (``Attempts``, ``attempts.py``): each deployment's attempt to start for its
  waiters, one effect out at a time, make-room for the queue's head, and the queue's clock.

Every method is a plain ``def``: no await, no I/O, so on one event loop each is atomic and the
core needs no lock. What it decides is done through ``Effects`` (``protocol.py``), whose real
implementation (``effects.py``) runs each effect as a named task and reports back through the
``on_*`` methods; the tests drive the same methods with a fake clock and a recording fake of
``Effects``. The invariants, and the one line that holds each: design.md, "Invariants".
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..engines import tiers
from ..errors import InsufficientMemory
from ..model import Deployment, State
from . import modes, verdicts
from .attempts import Attempts
from .keepwarm import Adaptive
from .modes import ModePlan
from .protocol import Effects, Timer
from .queue import WaitQueue
from .record import Phase, Record, Waiter, idled_out
from .rhythm import Rhythm
from .scheduler import Scheduler, SeedScheduler
from .slots import BACKOFF_FIRST_S, BACKOFF_MAX_S, Slots
from .ticket import Ticket, Waits, Want
from .warmth_policy import Fixed, WarmthPolicy

__all__ = ["ACTOR", "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Controller", "Effects", "ModePlan", "Phase", "Slot",
           "Timer", "Waiter"]

Slot = Ticket  # a granted slot is the ticket that holds it (``release()``)

ACTOR = "ondemand"


class Controller:
    """The decision core's coordinator (module doc). Its parts: ``slots``, ``scheduler``,
    ``start_side``, and the warmth policies ``fixed`` and ``adaptive_warmth``."""

    def __init__(self, effects: Effects, *, clock: Callable[[], float], wall: Callable[[], float],
                 queue_timeout_s: float = 900, max_queued: int = 256, idle_timeout_s: int = 600,
                 min_idle_timeout_s: int = 60, make_room_wait_s: float = 20.0, recent_stop_s: float = 20.0,
                 max_tick_s: float = 15.0, publish_interval_s: float = 1.0, sleep_timeout_s: float | None = None,
                 asleep_residue_gib: float = 2.0, scheduler: Scheduler | None = None):
        self.effects = effects
        self.clock = clock
        self.wall = wall
        self.scheduler: Scheduler = SeedScheduler() if scheduler is None else scheduler
        self.slots = Slots(effects, clock=clock, wall=wall, warmth=self._warmth, queue_timeout_s=queue_timeout_s,
                           max_queued=max_queued, idle_timeout_s=idle_timeout_s,
                           min_idle_timeout_s=min_idle_timeout_s, publish_interval_s=publish_interval_s,
                           sleep_timeout_s=sleep_timeout_s)
        self.fixed: WarmthPolicy = Fixed(self.slots.idle_timeout)
        self.adaptive_warmth = Adaptive(self.slots, self.scheduler.queue)
        self.start_side = Attempts(effects, self.slots, self.scheduler, on_queue=self.adaptive_warmth.queue_changed,
                                   make_room_wait_s=make_room_wait_s, recent_stop_s=recent_stop_s,
                                   max_tick_s=max_tick_s, asleep_residue_gib=asleep_residue_gib)
        self.min_idle_timeout_s: float = min_idle_timeout_s
        self._holds: dict[int, str] = {}  # each held_for the reaper's step last saw (its view shows it)
        self.scheduler.bind(self)  # a cost rule reads the gaps and tiers below (cost.CoreView)
        self.fixed = self.scheduler.warmth(self.fixed)  # cost: warmth by value over the timeouts

    @property
    def queue(self) -> WaitQueue:
        """The scheduler's memory queue."""
        return self.scheduler.queue

    @property
    def queue_timeout_s(self) -> float:
        return self.slots.queue_timeout_s

    @queue_timeout_s.setter
    def queue_timeout_s(self, seconds: float) -> None:
        self.slots.queue_timeout_s = seconds

    @property
    def asleep_residue_gib(self) -> float:
        """What make-room counts an asleep engine to free, per GPU, when nothing was read of it."""
        return self.start_side.asleep_residue_gib

    @asleep_residue_gib.setter
    def asleep_residue_gib(self, gib: float) -> None:
        self.start_side.asleep_residue_gib = gib

    def _warmth(self, dep: Deployment | None, rec: Record | None) -> WarmthPolicy:
        """``dep``'s warmth policy: adaptive's while it holds it, else fixed."""
        return self.adaptive_warmth if self.adaptive_warmth.holds(dep, rec) else self.fixed

    # --- a request ------------------------------------------------------------------

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
        raises ``ondemand_busy`` past its ``max_inflight``. No edge of the product asks this (the
        gateway's and the replay's ask ``admit``, then ``join`` and ``take``): the core's tests and
        an administrator's drain tests take a ready slot with it."""
        dep = self.effects.deployment(dep_id)
        if dep is not None and dep.state is State.READY:
            return self._take_ready(dep)
        return None

    def _take_ready(self, dep: Deployment) -> Ticket | None:
        """A ready deployment's slot, or None while an administrator's sleep drains it."""
        return Ticket(dep, slot=self) if self.slots.take_ready(dep) else None

    def release(self, dep_id: int) -> None:
        """A ticket gives its slot back; the last one's idle timeout now runs, and a queued
        request may find a victim sooner."""
        if self.slots.release(dep_id):
            self.start_side.schedule_tick()

    def join(self, dep_id: int, *, arrival: float, notify: Callable[[], None],
             on_queued: Callable[[], None] | None = None) -> Waiter:
        """A request that found no ready engine starts waiting; raises the refusals
        that need no wait (unknown, shutting down, planned, backoff, queue full)."""
        dep = self.effects.deployment(dep_id)
        if dep is None:
            raise verdicts.unknown(dep_id)
        if self.slots.closing:
            raise verdicts.shutting_down()
        waiter = self.slots.join(dep, arrival=arrival, notify=notify, on_queued=on_queued,
                                 queued=dep_id in self.queue)
        self.start_side.advance(dep_id)
        return waiter

    def take(self, waiter: Waiter) -> Ticket | None:
        """The waiter's turn: its ticket (with its slot) when ready, its verdict raised, or None (wait on).
        Raises ``ondemand_queue_timeout`` once its deadline has passed."""
        dep = self.slots.take(waiter)
        return None if dep is None else Ticket(dep, slot=self)

    def leave(self, waiter: Waiter) -> None:
        """A waiter is done (slot taken, verdict, timeout or hang-up); a deployment nobody
        waits for any more gives up its place in the queue, and its hold."""
        nobody = self.slots.leave(waiter)
        if nobody is None:
            return
        if nobody and self.queue.remove(waiter.dep_id):
            self.start_side.queue_changed()
            self.start_side.advance_all()
        self.slots.counters_changed(waiter.dep_id)

    def next_wake(self, waiter: Waiter) -> float:
        """Seconds the waiter may sleep before it looks again (its deadline)."""
        return self.slots.next_wake(waiter)

    def drain(self, dep_id: int, drained: Callable[[], None]) -> None:
        """An administrator's sleep drains first (``Slots.drain``)."""
        self.slots.drain(dep_id, drained)

    def undrain(self, dep_id: int, drained: Callable[[], None]) -> None:
        """The drain is over (it slept, or its deadline passed): slots again, and its waiters
        move on: served when it is still ready, else they wake it."""
        if self.slots.undrain(dep_id, drained):
            self.start_side.advance(dep_id)

    # --- reads ------------------------------------------------------------------------

    def record(self, dep_id: int) -> Record | None:
        return self.slots.record(dep_id)

    def attempts(self) -> list[int]:
        return self.slots.attempts()

    def attempt_phase(self, dep_id: int) -> Phase | None:
        return self.slots.attempt_phase(dep_id)

    def inflight(self, dep_id: int) -> int:
        return self.slots.inflight(dep_id)

    def waiting(self, dep_id: int | None = None) -> int:
        return self.slots.waiting(dep_id)

    def draining(self, dep_id: int) -> bool:
        return self.slots.draining(dep_id)

    def busy_total(self, dep_id: int) -> int:
        return self.slots.busy_total(dep_id)

    def backoff_left(self, dep_id: int) -> float:
        return self.slots.backoff_left(dep_id)

    def is_idle(self, dep: Deployment, now: float | None = None) -> bool:
        """May this deployment be stopped as idle by the reaper? Its stops' precheck."""
        return self.slots.is_idle(dep, now)

    def precheck(self, for_dep: int | None) -> Callable[[Deployment], bool]:
        """The precheck of a stop or sleep the core asked for: the reaper's (``for_dep`` None),
        ``is_idle``; make-room's for ``for_dep``, the rule it chose the victim by (the scheduler's),
        asked again in the deployer's step that marks it."""
        if for_dep is None:
            return self.is_idle

        def still(dep: Deployment) -> bool:
            if dep.id == for_dep:  # a relocation (Attempts._relocates): its own waiters wait for its start
                return dep.state is State.ASLEEP
            requester = self.effects.deployment(for_dep)
            return requester is not None and self.start_side.may_put_away(dep, requester)
        return still

    def queue_place(self, dep_id: int) -> tuple[int, int] | None:
        """(its place in the memory queue, from 1; the queue's length), or None."""
        return self.queue.place(dep_id)

    def status(self, dep_id: int) -> dict[str, Any]:
        """The ``ondemand`` field of a deployment view: the slots part's, with ``held_for`` and
        ``put_away_early`` (its last put-away, when make-room took it before its idle timeout)."""
        out = self.slots.status(dep_id, self.queue.place(dep_id))
        rec = self.slots.record(dep_id)
        out["held_for"] = self.held_for(dep_id)
        out["put_away_early"] = None if rec is None or rec.early is None else dict(rec.early)
        return out

    def held_for(self, dep_id: int) -> str | None:
        """Why its warmth policy keeps an idle ``dep_id`` awake past where the seed's rule would
        rest it (``WarmthPolicy.held_for``: ``slo``), or None."""
        dep = self.effects.deployment(dep_id)
        if dep is None:
            return None
        rec = self.slots.record(dep_id)
        return self._warmth(dep, rec).held_for(dep, rec, self.clock())

    def make_rooms(self) -> dict[str, int]:
        """The victims make-room put away so far, by the rule that allowed each
        (``ondemand_make_room_total``): ``idle_timeout`` (idle for its whole timeout), ``cost``
        (before it); a rule that took none is not there."""
        return dict(self.start_side.make_rooms)

    def learn(self, gaps: Mapping[int, Iterable[float]]) -> None:
        """The idle gaps kept in the state file (after a restart): what was learned stays."""
        self.slots.learn(gaps)

    def rhythm(self, dep_id: int) -> Rhythm | None:
        return self.slots.rhythm(dep_id)

    # --- what a scheduler that weighs costs reads (cost.CoreView) -------------------------

    def gaps(self, dep_id: int) -> Sequence[float]:
        r = self.slots.rhythm(dep_id)
        return r.gaps if r is not None else ()

    def start_s(self, dep: Deployment) -> float:
        """Its start, or its wake from the level it sleeps at, as the tiers price them (a level the
        effects leave out of where it may rest now, the host reserve say, still wakes: its default)."""
        if dep.state is State.ASLEEP and dep.sleep_level:
            tier = tiers.asleep(dep.sleep_level)
            return self.effects.tiers(dep).get(tier.name, tier.default_s)
        return self._back_s(dep, None)

    def put_away_s(self, dep: Deployment) -> float:
        """What its next request waits for once make-room puts it away: an awake engine that sleeps
        when idle wakes from that level; any other (stopped, or asleep and stopped) starts cold."""
        return self._back_s(dep, self.effects.idle_level(dep) if dep.state is State.READY else None)

    def sleep_s(self, dep: Deployment) -> float:
        """How long its memory stays held once it is put to sleep when idle (the effects' measure)."""
        return self.effects.sleep_s(dep)

    def arrival_gap_s(self, dep_id: int) -> float | None:
        """Its mean time between requests lately (``Slots.arrival_gap_s``; None: too few seen)."""
        return self.slots.arrival_gap_s(dep_id)

    def queue_room(self) -> int:
        """How many more requests may wait before the queue is full (``max_queued``)."""
        return max(0, self.slots.max_queued - self.slots.waiting())

    def _back_s(self, dep: Deployment, level: int | None) -> float:
        """What coming back from the tier of sleep ``level`` (0 or None: stopped) costs ``dep``, as
        the effects price the tiers it may rest in now; one they leave out costs a cold start."""
        costs = self.effects.tiers(dep)
        tier = tiers.asleep(level) if level else tiers.STOPPED
        return costs.get(tier.name, costs.get(tiers.STOPPED.name, tiers.STOPPED.default_s))

    # --- what the effects ask and report (the start side's) ------------------------------

    def wanted(self, dep_id: int) -> bool:
        """Does anyone still wait for ``dep_id``? (The deployer asks it as it marks starting.)"""
        return self.start_side.wanted(dep_id)

    def settle_target(self, dep_id: int) -> int:
        """Whose fit a make-room's settle waits for: ``dep_id``, or the head of higher
        priority that took its place (and what it freed)."""
        return self.scheduler.settle_target(dep_id)

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        """GiB per GPU the queue holds for entries other than ``dep_id`` (for the head, what
        was freed for it): not free for ``dep_id``. The deployer asks it in the step of its fit
        check, so a hold made while the check's reading was out still counts."""
        return self.scheduler.held_for_others(dep_id)

    def on_admitted(self, dep_id: int, started: bool) -> None:
        self.start_side.on_admitted(dep_id, started)

    def on_refused(self, dep_id: int, exc: InsufficientMemory) -> None:
        self.start_side.on_refused(dep_id, exc)

    def on_budget_error(self, dep_id: int, reason: str) -> None:
        self.start_side.on_budget_error(dep_id, reason)

    def on_start_error(self, dep_id: int, reason: str) -> None:
        self.start_side.on_start_error(dep_id, reason)

    def on_stopped(self, dep_id: int, approved: bool, for_dep: int | None) -> None:
        self.start_side.on_stopped(dep_id, approved, for_dep)

    def on_slept(self, dep_id: int) -> None:
        """A sleep's engine call ended (the deployer's ``Slept``): its memory is free now. A
        make-room's victim reports through ``on_stopped``; after any other sleep (the reaper's, an
        administrator's, adaptive warmth's) the queue looks again now, not at its next tick."""
        if not self.start_side.put_away_now(dep_id):
            self.start_side.offer()

    def on_settled(self, dep_id: int) -> None:
        self.start_side.on_settled(dep_id)

    def tick(self) -> None:
        """The queue's clock (``Attempts.tick``)."""
        self.start_side.tick()

    # --- what the deployer reports ------------------------------------------------------

    def on_deployment(self, dep_id: int, dep: Deployment | None, old: Deployment | None) -> None:
        """Every creation, change, transition and removal of a deployment."""
        now = self.clock()
        if dep is None:
            self._holds.pop(dep_id, None)
            self.start_side.removed(dep_id)
            return
        rec = self.slots.record_for(dep_id)
        if old is None:
            rec.last_activity = now  # a new deployment
        else:
            if old.config() != dep.config():
                rec.backoff = None  # a changed model or configuration
            if not old.on_demand and dep.on_demand:
                rec.last_activity = now  # switched to on demand
            if old.priority is not dep.priority and dep_id in self.queue:
                self.queue.rerank(dep_id, dep.priority.rank)  # an edit while it waits
                self.start_side.queue_changed()
        if dep.state is State.READY and (old is None or old.state is not State.READY):
            rec.last_activity = now
            rec.backoff = None
            rec.early = None  # awake again: its early put-away is over
        if dep.state is State.ASLEEP:
            if old is None or old.state is not State.ASLEEP:
                rec.asleep_since = now
        else:
            rec.asleep_since = None
        self._warmth(dep, rec).changed(dep, rec)
        if old is not None and old.state is State.STARTING and dep.state is not State.STARTING:
            self.start_side.start_ended(dep)
        if old is not None and dep.measured_since(old):  # memory may read free now: no victim for it
            self.start_side.offer()
        else:
            self.start_side.advance_all()

    # --- the reaper's step ----------------------------------------------------------------

    def reap(self) -> list[int]:
        """Ask to stop every on-demand deployment idle by the rules; returns their ids."""
        if self.slots.closing:
            return []
        now = self.clock()
        asked = []
        claimed = self.slots.claimed()
        for dep in self.effects.deployments():
            self._show_hold(dep)
            span = None if dep.id in claimed else self.slots.quiet_for(dep, now)  # Slots.is_idle's reading
            if span is None or not idled_out(*span) or self._held_awake(dep, now):
                continue
            # How long its rule had it wait: its timeout, or its warmth policy's (warmth by value
            # rests a model cheap to wake at min_idle_timeout_s, or holds a dear one longer).
            minutes = round(span[1] / 60, 2)  # "0.33", "10", "1.5"
            if dep.state is State.ASLEEP:
                # Asleep it stays, until a request wakes it, make-room needs its memory, or
                # it has slept sleep_timeout_s.
                rec = self.slots.record(dep.id)
                slept = 0.0 if rec is None or rec.asleep_since is None else now - rec.asleep_since
                if self.slots.sleep_timeout_s is None or slept < self.slots.sleep_timeout_s:
                    continue
                self.effects.stop(dep.id, text=f"Stopped after {round(slept / 60, 2):g} min asleep "
                                               "(sleep_timeout_s)", for_dep=None)
            elif self._rests(dep, now):
                pass  # its warmth policy chose its tier (adaptive warmth's plan)
            elif self.effects.idle_level(dep) > 0:
                self.effects.sleep(dep.id, text=f"Put to sleep after {minutes:g} min idle", for_dep=None)
            else:
                self.effects.stop(dep.id, text=f"Put to sleep after {minutes:g} min idle", for_dep=None)
            asked.append(dep.id)
        return asked

    def _show_hold(self, dep: Deployment) -> None:
        """Its view is published again when its ``held_for`` changed since the reaper's last step:
        a hold begins as time passes (where the seed's rule would rest it), not with an event."""
        held = self.held_for(dep.id)
        if self._holds.get(dep.id) != held:
            if held is None:
                del self._holds[dep.id]
            else:
                self._holds[dep.id] = held
            self.slots.counters_changed(dep.id)

    def _held_awake(self, dep: Deployment, now: float) -> bool:
        """Its warmth policy holds it awake though idle (adaptive: a pre-warmed engine waits for
        its request until ``awake_until_s``); the reaper leaves it be, make-room does not."""
        rec = self.slots.record(dep.id)
        until = self._warmth(dep, rec).held_until(dep, rec, now)
        return until is not None and now < until

    def _rests(self, dep: Deployment, now: float) -> bool:
        """Its warmth policy put it away in a tier of its own (adaptive: the plan's)."""
        rec = self.slots.record(dep.id)
        return self._warmth(dep, rec).rest(dep, rec, now)

    # --- adaptive warmth's reads and reports ----------------------------------------------

    def adaptive(self, dep_id: int) -> dict[str, Any] | None:
        """The view's ``adaptive`` object (``Adaptive.view``)."""
        return self.adaptive_warmth.view(dep_id)

    def prewarms(self, dep_id: int) -> dict[str, int]:
        """Its pre-warms' results so far: ``hit`` and ``miss``."""
        return self.adaptive_warmth.prewarms(dep_id)

    def prewarm_wanted(self, dep_id: int) -> bool:
        """Is the pre-warm out for ``dep_id`` still wanted? (Its effect asks, as it marks starting.)"""
        return self.adaptive_warmth.prewarm_wanted(dep_id)

    def on_prewarmed(self, dep_id: int, started: bool) -> None:
        """The pre-warm's report (``Effects.prewarm``)."""
        self.adaptive_warmth.on_prewarmed(dep_id, started)

    # --- mode switch ------------------------------------------------------------------------

    def plan_mode(self, dep_id: int, mode: str, *, idle_timeout_s: int | None = None,
                  set_idle_timeout: bool = False) -> ModePlan:
        """Decide a switch (BEHAVIOUR.md, "Switch to always on"); resets the start backoff."""
        modes.check(mode, idle_timeout_s, set_idle_timeout, self.slots.min_idle_timeout_s)
        dep = self.effects.deployment(dep_id)
        if dep is None:
            raise verdicts.unknown(dep_id)
        plan = modes.plan(dep, mode, idle_timeout_s, set_idle_timeout)
        self.slots.reset_backoff(dep_id)  # set_mode resets the start backoff
        return plan

    def mode_switched(self, dep_id: int) -> None:
        """The switch is stored: waiters look again (a start may be theirs to wait for now)."""
        self.start_side.advance(dep_id)

    def shutdown(self) -> None:
        """Shutdown began: from now on nothing is started or stopped for a waiter (no
        make-room, no reaper), and every waiter, queued or waiting for a start, gets
        ``ondemand_shutting_down`` at once instead of holding the shutdown up."""
        self.slots.closing = True
        err = verdicts.shutting_down()
        for dep_id in self.slots.attempts():
            self.slots.give_verdict(dep_id, err)
        for dep_id in self.queue.ids():
            self.queue.remove(dep_id)
        self.start_side.stop_ticking()

    def close(self) -> None:
        """No timer of the core's is left: the pre-warms', the publishes', the tick."""
        self.adaptive_warmth.close()
        self.slots.close()
        self.start_side.stop_ticking()

