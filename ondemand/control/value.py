"""Warmth by value (``scheduler = "cost"``): how long an idle engine stays awake, weighed against
``slo_s`` instead of one timeout for all. The ``WarmthPolicy`` the cost scheduler gives the
deployments whose ``keep_warm`` is ``fixed``. Pure: no clock, no I/O; it reads the core through
``ValueView``.

What a rest costs is what the next request waits for when it comes back: the wake from the tier
the engine rests in, or a cold start (``CoreView.put_away_s``). Two kinds of engine:

- **Cheap to bring back** (that wait at most ``CHEAP`` of ``slo_s``: a 0.25 s wake of a 0.6B, a
  3 s wake of a 30B MoE): a rest costs its next request nothing against the SLO, and staying
  awake costs the whole footprint, so it rests once idle for ``min_idle_timeout_s``, never sooner.
  Unless its sleep is slow: a request that comes while the sleep's call is out waits for its end
  and then the wake (a 30B MoE's level-1 sleep takes 21 s). When the sleep (``sleep_s``, measured)
  and the wake leave a *window* after the rest begins in which the next request would miss, it
  rests at the idle time that makes least of the memory held awake and the misses of requests
  that come in the window, at the same price (``rest_at``): past a cluster of gaps that ends
  just after ``min_idle_timeout_s``, say.
- **Dear to bring back** (its wake or start passes that: a 5.4 s wake of a 235B over four GPUs,
  any cold start): every rest costs its next request the SLO, and every second awake costs its
  whole footprint. It stays awake while that pays at ``PRICE_GIB_S`` a miss: at idle time ``a``,
  held until its next request or its idle timeout more, it would hold ``footprint x E[min(t,
  timeout)]`` GiB-seconds (``t`` over its learned gaps longer than ``a``, less ``a``) to save the
  miss of a request that comes within that time (the share of those gaps that end within it). So it
  may rest before its timeout (its gaps say nothing comes back soon) or stay awake past it
  (``held_for`` ``slo``: they say something will). With fewer than ``HOLD_AFTER`` (10) gaps it
  keeps its timeout.

An asleep engine keeps its timeout's rule (the reaper's stop after ``sleep_timeout_s`` reads no
idle time of ours), and make-room weighs an idle engine by cost whatever this says.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol

from ..model import Deployment, State
from .record import Record
from .warmth_policy import WarmthPolicy

# An engine whose next request waits at most CHEAP x slo_s to bring it back rests early.
CHEAP = 0.6
# A dear engine stays awake while the memory it holds for each miss it saves costs at most this
# (GiB-seconds a miss: 3 GiB-hours, the trade the replay's tables set; design.md).
PRICE_GIB_S = 3 * 3600.0
# A dear engine's rule reads its gaps from the HOLD_AFTER-th on; before, it keeps its timeout. Fewer
# than make-room's (rhythm.LEARN_AFTER, 20): a wrong guess here holds or rests one engine, where make-room's would
# take a model in use from its users (on the replay's Azure traces a 235B seen 31 times an hour
# learns its rhythm in time only so).
HOLD_AFTER = 10
HELD_FOR_SLO = "slo"


class ValueView(Protocol):
    """What warmth by value reads of the decision core (a part of ``cost.CoreView``)."""

    min_idle_timeout_s: float

    def gaps(self, dep_id: int) -> Sequence[float]:
        """Its learned idle gaps (seconds; none learned: empty)."""

    def put_away_s(self, dep: Deployment) -> float:
        """What its next request waits for once it is put away now."""

    def sleep_s(self, dep: Deployment) -> float:
        """How long its memory stays held once it is put to sleep (0: unknown, or it stops)."""


def hold_until(ordered: Sequence[float], floor: float, horizon: float, gib: float, price_gib_s: float) -> float:
    """The earliest idle time ``a`` >= ``floor`` (``floor`` or just after a gap) at which holding
    ``gib`` awake no longer pays: the GiB-seconds it would hold until its next request or
    ``horizon`` more, ``gib`` x E[min(t, horizon)], exceed ``price_gib_s`` times the chance that
    the request comes within ``horizon`` (a miss it saves). ``t`` ranges over the gaps longer than
    ``a``, less ``a``; ``ordered`` sorted. Past the longest gap nothing says a request comes back:
    it rests there at the latest."""
    n = len(ordered)
    prefix = [0.0]
    for g in ordered:
        prefix.append(prefix[-1] + g)
    for a in [floor] + [g for g in ordered if g > floor]:
        first = bisect.bisect_right(ordered, a)
        longer = n - first
        if longer == 0:
            return a
        end = bisect.bisect_right(ordered, a + horizon)
        soon = end - first
        held = (prefix[end] - prefix[first] - soon * a) + (n - end) * horizon  # sum of min(t, horizon)
        if gib * held / longer > price_gib_s * soon / longer:
            return a
    return floor


def rest_at(ordered: Sequence[float], floor: float, window: float, gib: float, price_gib_s: float) -> float:
    """When an engine cheap to wake, whose sleep holds its next request past the SLO for
    ``window`` seconds after the rest begins, should rest: the idle time ``a`` >= ``floor`` that
    makes least of ``gib`` x E[min(t, a) - floor] (the GiB-seconds held awake) + ``price_gib_s``
    x P(a < t < a + ``window``) (a miss: its next request comes during the sleep), ``t`` over the
    learned gaps longer than ``floor``; ``ordered`` sorted. Only ``floor`` and the gaps themselves
    can be best (the held memory grows with ``a``, and a gap leaves the window only once ``a``
    passes it); ties go to the earlier."""
    longer = list(ordered[bisect.bisect_right(ordered, floor):])
    n = len(longer)
    if not n:
        return floor  # no gap lasts past the floor: nothing says a request comes back
    prefix = [0.0]
    for g in longer:
        prefix.append(prefix[-1] + g)
    best, best_cost = floor, float("inf")
    for a in [floor] + longer:
        done = bisect.bisect_right(longer, a)  # gaps ended by a: held for all of them
        held = prefix[done] - done * floor + (n - done) * (a - floor)
        missed = max(0, bisect.bisect_left(longer, a + window) - done)  # gaps that end in the window
        cost = (gib * held + price_gib_s * missed) / n
        if cost < best_cost - 1e-9:
            best, best_cost = a, cost
    return best


class ByValue:
    """Warmth by value (module doc), over ``fixed`` (its timeouts) and the core's ``view``."""

    def __init__(self, fixed: WarmthPolicy, view: ValueView, slo_s: float):
        self.fixed = fixed
        self.view = view
        self.slo_s = slo_s
        self._memo: dict[int, tuple[tuple[int, float, float, float, float], float]] = {}

    def cheap(self, dep: Deployment) -> bool:
        """Does bringing it back from its rest cost its next request at most ``CHEAP`` of the SLO?"""
        return self.view.put_away_s(dep) <= CHEAP * self.slo_s

    def idle_after(self, dep: Deployment, rec: Record) -> float:
        timeout = self.fixed.idle_after(dep, rec)
        if dep.state is not State.READY:
            return timeout
        floor = min(float(self.view.min_idle_timeout_s), timeout)
        cheap = self.cheap(dep)
        window = 0.0
        if cheap:
            # A request that comes during the sleep's call waits for its end, then the wake.
            window = self.view.sleep_s(dep) + self.view.put_away_s(dep) - self.slo_s
            if window <= 0:
                return floor
        gaps = self.view.gaps(dep.id)
        if len(gaps) < HOLD_AFTER:
            return floor if cheap else timeout
        key = (len(gaps), gaps[-1], floor, timeout, window)  # a sleep measured anew moves the window
        memo = self._memo.get(dep.id)
        if memo is None or memo[0] != key:
            if cheap:
                at = rest_at(sorted(gaps), floor, window, dep.footprint_gib, PRICE_GIB_S)
            else:
                at = hold_until(sorted(gaps), floor, timeout, dep.footprint_gib, PRICE_GIB_S)
            memo = (key, at)
            self._memo[dep.id] = memo
        return memo[1]

    def held_for(self, dep: Deployment, rec: Record | None, now: float) -> str | None:
        """``slo`` while it is kept awake past its timeout because its wake would miss the SLO and
        its next request is likely soon; else None."""
        if rec is None or rec.last_activity is None or rec.inflight or dep.state is not State.READY:
            return None
        idle_for = now - rec.last_activity
        timeout = self.fixed.idle_after(dep, rec)
        return HELD_FOR_SLO if timeout <= idle_for < self.idle_after(dep, rec) else None

    def idle_began(self, dep: Deployment | None, rec: Record) -> None:
        self.fixed.idle_began(dep, rec)

    def idle_ended(self, dep: Deployment, rec: Record) -> None:
        self.fixed.idle_ended(dep, rec)

    def held_until(self, dep: Deployment, rec: Record | None, now: float) -> float | None:
        return self.fixed.held_until(dep, rec, now)

    def rest(self, dep: Deployment, rec: Record | None, now: float) -> bool:
        return self.fixed.rest(dep, rec, now)

    def changed(self, dep: Deployment, rec: Record) -> None:
        self._memo.pop(dep.id, None)
        self.fixed.changed(dep, rec)
