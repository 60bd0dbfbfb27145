"""How long an on-demand deployment's idle engine stays warm: the ``WarmthPolicy`` the decision
core asks, one per deployment, chosen by its ``keep_warm``. ``Fixed`` (here): idle after its idle
timeout, then the reaper puts it away in its idle action's tier. ``Adaptive`` (``keepwarm.py``):
each idle period planned from the rhythm of its idle gaps, with a pre-warm.

The ``Controller`` owns one of each and asks the deployment's (``Adaptive.holds``) at each step of
an idle period: it begins (the last slot's release), it ends (an arrival), how long idle is idle
in it (the idle rule's time, which the slots part, the reaper and make-room read), what the reaper
does with it, and what a change of the deployment means to it. Plain ``def``s, no await, no I/O.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..model import Deployment
from .record import Record


class WarmthPolicy(Protocol):
    """One deployment's idle periods, as a policy of warmth sees them."""

    def idle_began(self, dep: Deployment | None, rec: Record) -> None:
        """Its last slot was released: an idle period begins (``dep`` None: it is gone)."""

    def idle_ended(self, dep: Deployment, rec: Record) -> None:
        """A request arrived: the idle period is over (the gap was learned before)."""

    def idle_after(self, dep: Deployment, rec: Record) -> float:
        """How long it must have been idle, in this period, to count as idle."""

    def held_until(self, dep: Deployment, rec: Record | None, now: float) -> float | None:
        """Until when (monotonic) the reaper leaves it awake though idle, or None."""

    def held_for(self, dep: Deployment, rec: Record | None, now: float) -> str | None:
        """Why it keeps an idle ``dep`` awake past where the seed's rule (its idle timeout, then
        its idle action's tier) would rest it now: ``"slo"`` (its wake or start would keep its
        next request past ``slo_s``), or None (the view's ``ondemand.held_for``)."""

    def rest(self, dep: Deployment, rec: Record | None, now: float) -> bool:
        """Asked by the reaper for an idle engine: put it away in a tier of the policy's own
        (True), or leave it to the reaper's rule, its idle action's tier (False)."""

    def changed(self, dep: Deployment, rec: Record) -> None:
        """The deployment changed (a transition, an edit, a mode switch)."""


class Fixed:
    """``keep_warm = "fixed"`` (and every always-on deployment): idle after its idle timeout,
    whatever its rhythm; nothing held awake, no rest of its own, nothing to end."""

    def __init__(self, idle_timeout: Callable[[Deployment], float]):
        self.idle_timeout = idle_timeout  # its own idle_timeout_s, or the box's

    def idle_began(self, dep: Deployment | None, rec: Record) -> None:
        pass

    def idle_ended(self, dep: Deployment, rec: Record) -> None:
        pass

    def idle_after(self, dep: Deployment, rec: Record) -> float:
        return self.idle_timeout(dep)

    def held_until(self, dep: Deployment, rec: Record | None, now: float) -> float | None:
        return None

    def held_for(self, dep: Deployment, rec: Record | None, now: float) -> str | None:
        return None

    def rest(self, dep: Deployment, rec: Record | None, now: float) -> bool:
        return False

    def changed(self, dep: Deployment, rec: Record) -> None:
        pass
