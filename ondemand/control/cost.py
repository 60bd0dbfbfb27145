"""Make-room by cost (``scheduler = "cost"``): the take rule that lets make-room put away a
deployment idle for less than its timeout when that pays. Pure: no clock, no I/O; what it reads of
the core comes through ``CoreView``.

The seed rule waits for a victim's whole idle timeout, so a model that needs whole GPUs waits out
its queue timeout behind models idle with nothing in flight; Ollama's rule (any model with nothing
in flight) ends those waits but puts a hot model away in every lull, and its next requests then
wait for its GPUs. Neither weighs what a choice costs. This one does, per victim V:

- **the requester's wait without V**, ``W``, in request-seconds: each of its waiting requests waits
  V's idle timeout left if V stays idle that long (the seed rule would take it then), else the
  queue's timeout (V's learned gaps say how likely it is to idle out; with fewer than
  ``LEARN_AFTER``, it is taken to); no other way the memory could come is counted;
- **V's expected loss**, in request-seconds past ``slo_s``: ``E[max(0, max(0, R - t) + c -
  slo_s)]`` for its next request, ``t`` V's next arrival from now, drawn from its learned idle gaps
  longer than the idle time it has had (the gaps kept for every on-demand deployment, as adaptive
  warmth keeps them); ``R`` the earliest moment the requester could give the memory back (its own
  start or wake, then ``min_idle_timeout_s``); ``c`` what V's next request then waits for (a wake
  from the tier V is put into, or a cold start); plus the burst behind it, the requests that follow
  at one per mean gap until V is back. With fewer than ``LEARN_AFTER`` gaps, V is taken to be asked
  again at once (``t`` = 0), and only that request counts.

V is taken when ``W`` exceeds its expected loss, or when it is idle for its whole timeout (the
seed's rule, whatever the cost). The rest is the seed scheduler's: the core never offers a victim
with a slot in flight, with waiters, with engine metrics that show work, of higher priority than
the request, or always on (``Slots.quiet_for``, ``Scheduler.may_take``). Why this shape, and where
it differs from Belady's rule and the papers: design.md, "The cost scheduler".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..model import Deployment
from .rhythm import LEARN_AFTER

# Why make-room took a victim (``TakeRule.reason``, ``ondemand_make_room_total{rule}``): idle for its
# whole timeout, whatever the rule; or before it, because this rule found that it pays.
IDLE_TIMEOUT = "idle_timeout"
COST = "cost"
# The shortest mean gap the burst behind a victim's next request is counted at (a model asked
# without pause would otherwise count as an endless burst).
MIN_GAP_S = 0.05


class CoreView(Protocol):
    """What the cost rule reads of the decision core."""

    min_idle_timeout_s: float
    queue_timeout_s: float

    def gaps(self, dep_id: int) -> Sequence[float]:
        """Its learned idle gaps (seconds; none learned: empty)."""

    def start_s(self, dep: Deployment) -> float:
        """How long its start (stopped) or wake (asleep) takes now."""

    def waiting(self, dep_id: int) -> int:
        """Its requests waiting for a slot, a start or memory."""

    def put_away_s(self, dep: Deployment) -> float:
        """What its next request waits for once make-room puts it away now: the wake from the tier
        it is put into, or a cold start."""

    def sleep_s(self, dep: Deployment) -> float:
        """How long its memory stays held once it is put to sleep (0: unknown, or it stops)."""

    def arrival_gap_s(self, dep_id: int) -> float | None:
        """Its mean time between requests lately, idle or busy (None: too few seen)."""

    def queue_room(self) -> int:
        """How many more requests may wait before the queue is full (``max_queued``)."""


def expected_loss(gaps: Sequence[float], idle_for_s: float, hold_s: float, come_back_s: float,
                  slo_s: float) -> float:
    """V's requests' expected wait past the SLO, in request-seconds, when V is put away now: its
    next arrival ``t`` waits ``max(0, hold_s - t) + come_back_s``, and the requests that follow it
    until V is back, at one per mean gap, wait the rest of that time (the burst behind the first).
    ``t`` is drawn from the learned gaps longer than ``idle_for_s``, less it; with fewer than
    ``LEARN_AFTER`` gaps, or none that long, ``t`` = 0 and only that first request counts (nothing
    says how many follow)."""
    over = hold_s + come_back_s - slo_s  # an arrival before this moment waits past the SLO
    if len(gaps) < LEARN_AFTER:
        return max(0.0, over)
    later = [g - idle_for_s for g in gaps if g > idle_for_s]
    if not later:
        return max(0.0, over)
    mean_gap = max(sum(gaps) / len(gaps), MIN_GAP_S)
    total = 0.0
    for t in later:
        first = max(0.0, max(0.0, hold_s - t) + come_back_s - slo_s)
        behind = max(0.0, over - t)
        total += first + behind * behind / (2 * mean_gap)
    return total / len(later)


def refused(away_s: float, arrival_gap_s: float | None, queue_room: int) -> float:
    """How many of V's requests the queue would refuse while V is away ``away_s``: those that come
    at one per ``arrival_gap_s`` past the room left in the queue (0 with no rate known). The
    learned idle gaps cannot say it: a hot model is rarely idle, and its gaps are the lulls."""
    if arrival_gap_s is None:
        return 0.0
    return max(0.0, away_s / max(arrival_gap_s, MIN_GAP_S) - queue_room)


def reach_timeout(gaps: Sequence[float], idle_for_s: float, idle_after_s: float) -> float:
    """The chance that V, idle for ``idle_for_s``, stays idle until ``idle_after_s`` (its gaps
    longer than that, of those longer than ``idle_for_s``); 1 with fewer than ``LEARN_AFTER``
    gaps, or none that long (nothing says it comes back sooner)."""
    if len(gaps) < LEARN_AFTER:
        return 1.0
    longer = [g for g in gaps if g > idle_for_s]
    if not longer:
        return 1.0
    return sum(1 for g in longer if g >= idle_after_s) / len(longer)


class ByCost:
    """The cost scheduler's take rule (module doc); told the core it serves by ``bind``."""

    def __init__(self, slo_s: float):
        self.slo_s = slo_s
        self.core: CoreView | None = None

    def bind(self, core: CoreView) -> None:
        self.core = core

    def __call__(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        """May ``victim``, in a lull of ``idle_for_s`` of its ``idle_after_s``, be taken early?"""
        figures = self.figures(requester, victim, idle_for_s, idle_after_s)
        return bool(figures) and figures["wait_s"] > figures["loss_s"]

    def figures(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
                ) -> dict[str, float]:
        """What ``__call__`` weighs for a victim in a lull (empty before ``bind``): the requester's
        waiting requests' wait without it, in request-seconds (``wait_s``: each waits the victim's
        timeout out if it stays idle that long, else until the queue gives it up), against its
        expected loss (``loss_s``, ``expected_loss``), with the requester's hold (``hold_s``) and
        the victim's way back (``come_back_s``)."""
        core = self.core
        if core is None:
            return {}
        gaps = core.gaps(victim.id)
        left = idle_after_s - idle_for_s
        reach = reach_timeout(gaps, idle_for_s, idle_after_s)
        wait_s = (reach * left + (1 - reach) * max(left, core.queue_timeout_s)) * max(1, core.waiting(requester.id))
        hold_s = core.start_s(requester) + core.min_idle_timeout_s
        come_back_s = core.put_away_s(victim)
        loss = expected_loss(gaps, idle_for_s, hold_s, come_back_s, self.slo_s)
        # A request the full queue refuses fails outright: counted as one that waited out the queue.
        overflow = refused(hold_s + come_back_s, core.arrival_gap_s(victim.id), core.queue_room())
        loss += overflow * core.queue_timeout_s
        return {"wait_s": wait_s, "loss_s": loss, "hold_s": hold_s, "come_back_s": come_back_s, "slo_s": self.slo_s,
                "refused": overflow}

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        """``scheduler.TakeRule.reason``: the cost's figures."""
        return {"rule": COST, **{k: round(v, 1) for k, v in
                                 self.figures(requester, victim, idle_for_s, idle_after_s).items()}}
