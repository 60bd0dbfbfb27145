"""Adaptive warmth in the decision core: what a deployment with ``keep_warm = "adaptive"`` does
with the rhythm learned of its idle gaps (``rhythm.py``).

Each idle period (from the release of its last slot to the next arrival: a ``Period``) gets one
``Plan``, made when first asked (by the reaper's step, make-room or a view; never on a request's
path): how long the engine stays awake idle (``awake_for_s``, the idle rule's timeout for this
period in place of ``idle_timeout_s``), the tier the reaper then puts it in (``rest``: asleep at
level 1 or 2, or stopped, of the tiers the effects say it may rest in now, with their measured
costs), and when a pre-warm wakes or starts it again (``prewarm_in_s``). A plan of None (before
its 20th gap, or gaps with no pattern) behaves as ``fixed``. While anything waits in the memory
queue a plan stays awake its whole ``idle_timeout_s`` (a box with no memory to spare is no place
for an early rest's bet), then rests in the plan's tier.

A pre-warm takes only memory free at that moment: none while anything waits in the queue, the
queue's holds kept out of its fit check, and no make-room (``Effects.prewarm``). A pre-warmed
engine that no request has used yields at once: make-room may take it as soon as it is ready,
while the reaper leaves it awake until ``awake_until_s`` and then puts it away as ``fixed`` does
(its idle action's tier). Each pre-warm that started ends as a hit (a request arrived before the
engine went away again) or a miss (``ondemand_prewarms_total``).

``Adaptive`` is the ``WarmthPolicy`` (``warmth_policy.py``) of such a deployment, a part the
``Controller`` owns beside ``Fixed``: it reads the deployments' records (the slots part's) and
the length of the memory queue (the scheduler's), and acts through the core's ``Effects``. Plain
``def``s, no await, no I/O, as the whole core.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from typing import Any

from ..engines import tiers, warmth
from ..model import Deployment, KeepWarm, State
from .record import AdaptiveState, Period, Prewarm, Record
from .rhythm import LEARN_AFTER, Plan
from .slots import MIN_GAP_S, Slots

HISTOGRAM_BINS = 12
AWAKE = (State.STARTING, State.READY)


def tier_costs(levels: Iterable[int], wake_s: Callable[[int], float | None], start_s: float | None
               ) -> dict[str, float]:
    """The tiers an engine may rest in (``tiers.TIERS``' names, shallow to deep: asleep at each
    of ``levels``, and stopped), each with its cost to come back as the start history that prices
    it measured it (``Tier.start``: a wake, ``wake_s(level)``, its wakes' median from that level;
    a cold start, ``start_s``, its cold starts'; None: nothing measured), else the tier's default."""
    out = {}
    for tier in tiers.TIERS:
        if tier.level is not None and tier.level not in levels:
            continue  # a sleep its engine, its idle action or the host reserve rules out now
        measured = wake_s(tier.level) if tier.start == "wake" and tier.level is not None else start_s
        out[tier.name] = tier.default_s if measured is None else measured
    return out


def rest_levels(dep: Deployment, per_gpu: bool, host_available_gib: float | None, host_reserve_gib: float
                ) -> list[int]:
    """The sleep levels an idle ``dep`` may rest at now, as the deployer's sleep takes them: its
    idle action sleeps, at its level or deeper, as deep as its engine was started able to; level
    1 only when the host reserve allows it (``warmth.host_level``; None: nothing is read here)."""
    idle = warmth.idle_level(dep, per_gpu)
    deepest = warmth.deepest_level(dep, per_gpu)
    return [level for level in tiers.LEVELS if idle and idle <= level <= deepest
            and warmth.host_level(dep, level, host_available_gib, host_reserve_gib, per_gpu) == level]


def histogram(gaps: Sequence[float], bins: int = HISTOGRAM_BINS) -> dict[str, list[Any]]:
    """The gaps in ``bins`` bins spaced evenly on a log scale, from MIN_GAP_S to the longest (a
    burst's seconds and a job's hours both show): ``edges_s`` (bins + 1) and ``counts``."""
    lo = MIN_GAP_S
    hi = max(max(gaps, default=lo), 2 * lo)
    span = math.log(hi / lo)
    counts = [0] * bins
    for gap in gaps:
        at = int(math.log(max(gap, lo) / lo) / span * bins)
        counts[min(at, bins - 1)] += 1
    return {"edges_s": [round(lo * (hi / lo) ** (i / bins), 1) for i in range(bins + 1)], "counts": counts}


def adaptive(dep: Deployment) -> bool:
    """Does ``dep`` follow its rhythm? (On demand and ``keep_warm`` adaptive.)"""
    return dep.on_demand and dep.keep_warm is KeepWarm.ADAPTIVE


class Adaptive:
    """Adaptive warmth's decisions (a ``WarmthPolicy``): each idle period's plan, the idle rule and
    the rest it gives, the pre-warm and its result. It holds no state of its own: each
    deployment's is in its record (``Record.adaptive``)."""

    def __init__(self, slots: Slots, queue: Sized):
        self.slots = slots  # the records, the idle timeouts, the backoff, the live counters
        self.queue = queue  # the memory queue: nothing rests early, and no pre-warm, while it holds anyone
        self.effects = slots.effects
        self.clock = slots.clock
        self.wall = slots.wall

    def holds(self, dep: Deployment | None, rec: Record | None) -> bool:
        """Is ``dep``'s warmth this policy's: adaptive, or in an idle period begun while it was
        (a switch to fixed ends the period when its change arrives, ``changed``)?"""
        if dep is not None and adaptive(dep):
            return True
        return rec is not None and rec.adaptive is not None and rec.adaptive.period is not None

    # --- the idle period ----------------------------------------------------------------

    def idle_began(self, dep: Deployment | None, rec: Record) -> None:
        """Its last slot was released: an idle period begins (its plan is made when first asked)."""
        a = rec.adaptive
        if a is not None:
            a.end()
        if dep is not None and adaptive(dep):
            if a is None:
                a = rec.adaptive = AdaptiveState()
            a.period = Period(self.clock())

    def idle_ended(self, dep: Deployment, rec: Record) -> None:
        """A request arrived: the idle period is over, and a pre-warm that started is a hit."""
        a = rec.adaptive
        if a is None:
            return
        period = a.period
        if period is not None and (period.prewarm is Prewarm.STARTED
                                   or (period.prewarm is Prewarm.OUT and dep.state in AWAKE)):
            a.hits += 1
        a.end()

    def idle_after(self, dep: Deployment, rec: Record) -> float:
        """How long it must have been idle to count as idle (the reaper, make-room): its idle
        timeout; in an adaptive idle period, its plan's ``awake_for_s``, but only while nothing
        waits for memory (an early rest then hands its memory to the queue at once, and when the
        bet on a far next request fails, that request waits for the newcomer's whole idle timeout
        instead of a wake: the replay showed it failing the code trace's flagship). Make-room asks
        once its own request is queued, so for make-room it is always the idle timeout. A
        pre-warmed engine no request has used: no time at all (it yields its memory to any
        request)."""
        period = self._period(dep, rec)
        if period is None:
            return self.slots.idle_timeout(dep)
        if period.prewarm is Prewarm.STARTED:
            return 0.0
        plan = self._planned(dep, rec, period)
        if plan is None or len(self.queue):
            return self.slots.idle_timeout(dep)
        return plan.awake_for_s

    def queue_changed(self) -> None:
        """The memory queue may just have filled or emptied (one entry or none: each change adds
        or removes one): every adaptive idle deployment's view is published again, since its idle
        rule follows the queue (``idle_after``), and its ``idle_until`` with it."""
        if len(self.queue) <= 1:
            for dep_id, rec in self.slots.items():
                if rec.adaptive is not None and rec.adaptive.period is not None:
                    self.slots.counters_changed(dep_id, rec)

    def changed(self, dep: Deployment, rec: Record) -> None:
        """A change of the deployment: a pre-warmed engine that goes away unused is a miss; a
        switch to fixed (or always on) ends its idle period's plan."""
        a = rec.adaptive
        if a is None or a.period is None:
            return
        if not adaptive(dep):
            a.end()
        elif a.period.prewarm is Prewarm.STARTED and dep.state not in AWAKE:
            a.misses += 1
            a.end()

    def close(self) -> None:
        """The core is closing: every idle period's pre-warm timer goes."""
        for _, rec in self.slots.items():
            if rec.adaptive is not None:
                rec.adaptive.end()

    # --- the plan ----------------------------------------------------------------------

    def _period(self, dep: Deployment, rec: Record | None) -> Period | None:
        a = rec.adaptive if rec is not None else None
        return a.period if a is not None and adaptive(dep) else None

    def _planned(self, dep: Deployment, rec: Record, period: Period) -> Plan | None:
        """The period's plan, made the first time it is asked, with its pre-warm's timer."""
        if period.planned:
            return period.plan
        period.planned = True
        tiers = self.effects.tiers(dep)
        plan = period.plan = self._plan(dep, rec, tiers)
        if plan is not None and plan.rest is not None:
            period.cost_s = tiers[plan.rest]
        if plan is not None and plan.prewarm_in_s is not None:
            dep_id = dep.id
            delay = max(0.0, period.began + plan.prewarm_in_s - self.clock())
            period.timer = self.effects.call_later(delay, lambda: self._prewarm_due(dep_id, period))
        return plan

    def _plan(self, dep: Deployment, rec: Record, tiers: Mapping[str, float]) -> Plan | None:
        """The plan its rhythm gives for an idle period beginning now (None: as fixed); made
        again only when the gaps, the bounds or the tiers' costs have changed."""
        a = rec.adaptive
        if rec.rhythm is None or a is None:
            return None
        timeout = self.slots.idle_timeout(dep)
        floor = self.slots.min_idle_timeout_s
        made_of = (rec.rhythm, len(rec.rhythm), rec.learned, timeout, floor, tuple(sorted(tiers.items())))
        if a.shown is not None and a.shown[0] == made_of:
            return a.shown[1]
        plan = rec.rhythm.plan(idle_timeout_s=timeout, min_idle_timeout_s=floor, tiers=tiers)
        a.shown = (made_of, plan)
        return plan

    # --- the reaper's step ---------------------------------------------------------------

    def held_until(self, dep: Deployment, rec: Record | None, now: float) -> float | None:
        """When the reaper's hold of a ready adaptive engine ends (monotonic): it leaves it be
        from its pre-warm's moment until ``awake_until_s`` (the next request is expected then;
        make-room does not wait). None before the pre-warm's moment, or with no such plan."""
        period = self._period(dep, rec)
        if rec is None or period is None or dep.state is not State.READY:
            return None
        plan = self._planned(dep, rec, period)
        if plan is None or plan.prewarm_in_s is None or plan.awake_until_s is None \
                or now < period.began + plan.prewarm_in_s:
            return None
        return period.began + plan.awake_until_s

    def held_for(self, dep: Deployment, rec: Record | None, now: float) -> str | None:
        """None: nothing is held for the SLO here (its hold, ``held_until``, keeps a pre-warmed
        engine for the request it was woken for)."""
        return None

    def rest(self, dep: Deployment, rec: Record | None, now: float) -> bool:
        """Put an idle adaptive engine away in its plan's tier (asked by the reaper before the
        pre-warm's moment); False: the reaper puts it away as fixed does."""
        period = self._period(dep, rec)
        if rec is None or period is None or period.prewarm is not Prewarm.NONE:
            return False
        plan = self._planned(dep, rec, period)
        if plan is None or plan.rest is None or plan.prewarm_in_s is None \
                or now >= period.began + plan.prewarm_in_s:
            return False
        idle = round((now - period.began) / 60, 2)
        back = round((period.began + plan.prewarm_in_s + period.cost_s - now) / 60, 1)
        why = f"after {idle:g} min idle (adaptive warmth: its next request is expected in about {back:g} min)"
        level = tiers.BY_NAME[plan.rest].level
        if level is not None:
            self.effects.sleep(dep.id, text=f"Put to sleep at level {level} {why}", for_dep=None, level=level)
        else:
            self.effects.stop(dep.id, text=f"Stopped {why}", for_dep=None)
        return True

    # --- the pre-warm ---------------------------------------------------------------------

    def _prewarm_due(self, dep_id: int, period: Period) -> None:
        """The pre-warm's moment: wake or start it, if it rests and nothing else wants memory."""
        rec = self.slots.record(dep_id)
        if rec is None or rec.adaptive is None or rec.adaptive.period is not period:
            return  # the period ended (an arrival, a removal) and its timer fired anyway
        period.timer = None
        dep = self.effects.deployment(dep_id)
        if dep is None or not self._may_prewarm(dep, rec):
            return
        period.prewarm = Prewarm.OUT
        plan = period.plan
        expected = 0.0 if plan is None or plan.prewarm_in_s is None else \
            period.began + plan.prewarm_in_s + period.cost_s - self.clock()
        verb = "Woken" if dep.state is State.ASLEEP else "Started"
        self.effects.prewarm(dep_id, text=f"{verb} ahead of its next request (adaptive warmth: expected in "
                                          f"about {max(0.0, expected):.0f} s)")

    def _may_prewarm(self, dep: Deployment, rec: Record) -> bool:
        """Resting (asleep or stopped), nobody waiting for it or for memory, no start backoff."""
        return (not self.slots.closing and adaptive(dep) and dep.state in (State.ASLEEP, State.STOPPED)
                and dep.pending_mode is None and rec.attempt is None and not rec.inflight
                and not len(self.queue) and self.slots.backoff_left(dep.id) <= 0)

    def prewarm_wanted(self, dep_id: int) -> bool:
        """Is the pre-warm out for ``dep_id`` still wanted? The effect asks it in the step that
        would mark it starting: a request or a queue entry that came meanwhile has it do nothing."""
        rec = self.slots.record(dep_id)
        dep = self.effects.deployment(dep_id)
        period = rec.adaptive.period if rec is not None and rec.adaptive is not None else None
        return (dep is not None and rec is not None and period is not None and period.prewarm is Prewarm.OUT
                and self._may_prewarm(dep, rec))

    def on_prewarmed(self, dep_id: int, started: bool) -> None:
        """The pre-warm's report: ``started`` False (it did not fit, or was not wanted any
        more): nothing was done, and nothing more is done this period."""
        rec = self.slots.record(dep_id)
        period = rec.adaptive.period if rec is not None and rec.adaptive is not None else None
        if period is None or period.prewarm is not Prewarm.OUT:
            return  # an arrival ended the period meanwhile (and counted the hit)
        period.prewarm = Prewarm.STARTED if started else Prewarm.NONE

    # --- reads ---------------------------------------------------------------------------

    def view(self, dep_id: int) -> dict[str, Any] | None:
        """The view's ``adaptive`` object, from its ``LEARN_AFTER``-th gap on: the gaps it learned
        from and the plan of its idle period (or, when it is not idle, of one beginning now), with
        when the next request is expected; the plan's fields null while it makes none (no pattern:
        it behaves as fixed, and an admin sees that it learned and found no rhythm worth acting
        on). None before then, and when it is not adaptive."""
        dep = self.effects.deployment(dep_id)
        rec = self.slots.record(dep_id)
        if dep is None or rec is None or rec.rhythm is None or not adaptive(dep) \
                or len(rec.rhythm) < LEARN_AFTER:
            return None
        if rec.adaptive is None:
            rec.adaptive = AdaptiveState()
        period = rec.adaptive.period
        plan = self._planned(dep, rec, period) if period is not None else self._plan(dep, rec, self.effects.tiers(dep))
        expected = None
        if period is not None and plan is not None and plan.prewarm_in_s is not None:
            expected = round(self.wall() + period.began + plan.prewarm_in_s + period.cost_s - self.clock(), 3)
        return {"gaps": len(rec.rhythm),
                "awake_for_s": None if plan is None else round(plan.awake_for_s, 1),
                "prewarm_in_s": None if plan is None or plan.prewarm_in_s is None else round(plan.prewarm_in_s, 1),
                "rest": None if plan is None else plan.rest, "expected_at": expected,
                "histogram": histogram(rec.rhythm.gaps)}

    def prewarms(self, dep_id: int) -> dict[str, int]:
        """Its pre-warms' results so far: ``hit`` and ``miss`` (``ondemand_prewarms_total``)."""
        rec = self.slots.record(dep_id)
        a = rec.adaptive if rec is not None else None
        return {"hit": a.hits if a else 0, "miss": a.misses if a else 0}
