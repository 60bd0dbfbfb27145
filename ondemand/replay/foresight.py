"""The clairvoyant reference's warmth (``clairvoyant.py``, the module doc): ``Foresight``, the
``WarmthPolicy`` of every deployment under ``clairvoyant``, which rests an idle engine when its
next arrival is far enough (at once, or under ``clairvoyant=S`` once it has been idle S seconds)
and asks the core's steps for what happens at once."""
from __future__ import annotations

import math
from collections.abc import Callable

from ..control.controller import Controller
from ..engines import tiers
from ..engines.tiers import Tier
from ..model import Deployment, State
from .clock import Timer, VirtualClock
from .world import World


class Foresight:
    """The ``WarmthPolicy`` of every deployment (module doc): an awake engine is idle at once when
    its rest is due, and never before its next arrival otherwise; asleep, it stays asleep. What
    happens at once is asked of the core at once, one event later (the step under way ends
    first, as the engine's and the edge's do): the reaper's step when a rest is due, and the
    queue's look when an engine went quiet or a rest's sleep freed its memory (the core's own
    clock looks every ``max_tick_s``, when an idle timeout may make a victim). ``next_at`` says
    when a deployment's next request arrives (``clairvoyant.Future``), ``plan`` sets its early
    start's moment again (``clairvoyant.EarlyStarts``)."""

    def __init__(self, next_at: Callable[[int], float], world: World, clock: VirtualClock,
                 plan: Callable[[int], None], floor_s: float = 0.0):
        self.next_at = next_at
        self.world = world
        self.clock = clock
        self.plan = plan
        self.floor_s = floor_s  # no rest before this long idle (``clairvoyant=S``)
        self._controller: Controller | None = None
        self._out = False  # a step of the core's is asked for, one event later
        self._reap = self._tick = False
        self._floors: dict[int, Timer] = {}  # dep id -> the look when its floor has passed

    def bind(self, controller: Controller) -> None:
        self._controller = controller

    def due(self, dep: Deployment) -> Tier | None:
        """The tier an awake ``dep`` rests in now (asleep at level 1, else stopped), or None: its
        next arrival is too near."""
        if dep.state is not State.READY or not dep.on_demand or self._floor_at(dep) > self.clock.now:
            return None
        costs = self.world.costs(dep.id)
        sleep_and_wake = costs.sleep_s + costs.back_s(tiers.ASLEEP_1)
        gap = self.next_at(dep.id) - self.clock.now
        if gap < min(sleep_and_wake, costs.back_s(tiers.STOPPED)):
            return None
        if tiers.ASLEEP_1.name in self.world.tiers(dep):
            return tiers.ASLEEP_1 if gap >= sleep_and_wake else None
        return tiers.STOPPED if gap >= costs.back_s(tiers.STOPPED) else None

    def _floor_at(self, dep: Deployment) -> float:
        """When ``dep`` will have been idle ``floor_s`` (its last activity, as the reaper reads it)."""
        if not self.floor_s or self._controller is None:
            return -math.inf
        return self._controller.slots.last_active(dep.id, self.clock.now) + self.floor_s

    def check(self, dep: Deployment) -> None:
        """A rest due now is taken now; one held back by the floor is looked at again when the
        floor has passed (a request before then moves the last activity, and the look finds no
        rest due)."""
        if self.due(dep) is not None:
            self._soon(reap=True)
        elif self.floor_s and dep.state is State.READY and dep.on_demand:
            at = self._floor_at(dep)
            old = self._floors.get(dep.id)
            if at > self.clock.now and (old is None or old.cancelled or old.when != at):
                if old is not None:
                    old.cancel()
                self._floors[dep.id] = self.clock.call_at(at, lambda: self._floor_passed(dep.id))

    def _floor_passed(self, dep_id: int) -> None:
        self._floors.pop(dep_id, None)
        dep = self.world.deployment(dep_id)
        if dep is not None:
            self.check(dep)

    def look_again(self) -> None:
        """Memory may be free, or a victim quiet: the queue looks now."""
        if self._controller is not None and len(self._controller.queue):
            self._soon(tick=True)

    def _soon(self, *, reap: bool = False, tick: bool = False) -> None:
        self._reap |= reap
        self._tick |= tick
        if not self._out and self._controller is not None:
            self._out = True
            self.clock.call_later(0, self._step)

    def _step(self) -> None:
        self._out = False
        reap, tick, self._reap, self._tick = self._reap, self._tick, False, False
        ctl = self._controller
        if ctl is None:
            return
        if reap:  # first: a rest's stop frees memory the queue may take at once
            ctl.reap()
        if tick and len(ctl.queue):
            ctl.tick()

    # --- the WarmthPolicy ---------------------------------------------------------------

    def idle_began(self, dep: Deployment | None, rec: object) -> None:
        if dep is not None:
            self.check(dep)
        self.look_again()

    def idle_ended(self, dep: Deployment, rec: object) -> None:
        pass

    def idle_after(self, dep: Deployment, rec: object) -> float:
        return 0.0 if self.due(dep) is not None else math.inf

    def held_until(self, dep: Deployment, rec: object, now: float) -> float | None:
        return None

    def held_for(self, dep: Deployment, rec: object, now: float) -> str | None:
        return None

    def rest(self, dep: Deployment, rec: object, now: float) -> bool:
        """Asked by the reaper once ``idle_after`` said idle: asleep at level 1, or stopped."""
        tier = self.due(dep)
        why = f"(clairvoyant: its next request is in {self.next_at(dep.id) - now:.0f} s)"
        if tier is tiers.ASLEEP_1:
            self.world.sleep(dep.id, text=f"Put to sleep at level 1 at once {why}", for_dep=None, level=1)
            # The sleep's memory is free when its call ends: the queue looks then, after the
            # world's own report (set one event later, so it comes after the world's timer).
            took = self.world.costs(dep.id).sleep_s
            self.clock.call_later(0, lambda: self._look_after(took))
        elif tier is tiers.STOPPED:
            self.world.stop(dep.id, text=f"Stopped at once {why}", for_dep=None)
        return True  # its own tier, or awake until its next arrival: never the reaper's rule

    def _look_after(self, seconds: float) -> None:
        self.clock.call_later(seconds, self.look_again)

    def changed(self, dep: Deployment, rec: object) -> None:
        """A transition: a deployment that now rests gets its early start's moment, one that
        became ready with nothing to do may rest."""
        self.plan(dep.id)
        if dep.state is State.READY:
            self.check(dep)
