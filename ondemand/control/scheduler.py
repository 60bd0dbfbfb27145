"""The scheduler, a part of the decision core: who waits for memory in which order (the wait
queue, ``queue.py``), what is held for whom (the head's reservation), which idle models make
room for the head (``eviction.py``) and which GPUs a model gets there (``placement.py``).

The ``Controller`` owns one, chosen by the box's ``scheduler`` key, and acts on what it says: the
scheduler asks for no effect, reads no clock and logs nothing. ``Scheduler`` is what the
controller asks of it; ``SeedScheduler`` is ondemand's rule from the start (priority, then first
arrival; the lowest priority, then awake before asleep, then least recently used, as victims; best
fit). A second scheduler is one new class beside it, named in ``SCHEDULERS``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..model import Deployment
from .cost import IDLE_TIMEOUT, ByCost, CoreView
from .eviction import Candidate, pick_victims
from .placement import Fit
from .queue import WaitQueue
from .record import idled_out
from .value import ByValue
from .warmth_policy import WarmthPolicy


class Scheduler(Protocol):
    """What the controller asks of its scheduler (plain defs, no effects)."""

    queue: WaitQueue  # the deployments waiting for memory, in order, and what is held for each
    relocates: bool  # may a sleeper that cannot wake where it is start cold elsewhere (relocation.py)?

    def behind(self, dep_id: int, head: int) -> bool:
        """Does ``dep_id``'s entry wait behind ``head``, a head of higher priority that took its
        place (what is freed for ``dep_id`` is held for ``head``)?"""

    def asks_first(self, dep_id: int, admitting: Callable[[int], bool]) -> bool:
        """Must ``dep_id`` wait for the head's admit (``admitting(head)``) before asking its own?"""

    def settle_target(self, dep_id: int) -> int:
        """Whose fit a make-room's settle for ``dep_id`` waits for."""

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        """GiB per GPU held for entries other than ``dep_id``: not free for it."""

    def room_coming(self, head: int, making_room: Iterable[int]) -> bool:
        """Is memory on its way to ``head`` from the make-rooms of ``making_room`` (the attempts
        stopping victims or waiting for their memory), so that it must not stop more?"""

    def bind(self, core: CoreView) -> None:
        """Told the core it serves (a rule that weighs costs reads its learned gaps and tiers)."""

    def warmth(self, fixed: WarmthPolicy) -> WarmthPolicy:
        """The warmth policy of the deployments whose ``keep_warm`` is ``fixed``: ``fixed`` itself,
        or one of the scheduler's own over it (cost: ``value.ByValue``). Asked once, after ``bind``."""

    def may_take(self, requester: Deployment, victim: Deployment) -> bool:
        """May make-room put ``victim`` away for ``requester`` (if it is idle)?"""

    def takes(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        """May make-room put ``victim`` away for ``requester`` now? It is quiet (no slot in
        flight, nobody waiting for it, its engine idle), has been idle ``idle_for_s``, and its
        warmth policy asks ``idle_after_s`` before the reaper may take it."""

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        """Why ``takes`` allowed ``victim`` (``TakeRule.reason``): make-room's audit and count."""

    def victims(self, candidates: list[Candidate], fit: Fit) -> tuple[list[Candidate], tuple[int, ...]]:
        """Of the idle ``candidates``, the ones to put away and the GPUs the model then gets;
        ([], ()) when putting them all away would not make it fit."""


class TakeRule(Protocol):
    """Which quiet deployments make-room may put away before their whole idle timeout (the
    scheduler's one varying rule; one idle for its whole timeout is taken whatever the rule, and
    the scheduler says so, ``SeedScheduler.takes``)."""

    def __call__(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool: ...

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        """Why an early take it allowed was allowed, asked once make-room chose the victim: ``{"rule":
        <the rule's name>, ...}`` with the figures it weighed (``ondemand_make_room``'s detail,
        ``ondemand_make_room_total``'s label)."""

    def bind(self, core: CoreView) -> None:
        """Told the core it serves (a rule that weighs costs reads its gaps and tiers)."""


class AfterIdleTimeout:
    """ondemand's rule from the start (the design document's): only a victim idle for its whole
    timeout, as the reaper would take it: never one earlier."""

    def __call__(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        return False

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        return {"rule": IDLE_TIMEOUT}  # never asked: it takes nothing early

    def bind(self, core: CoreView) -> None:
        pass


class AnyQuiet:
    """Ollama's rule: any model with no request in flight, however short its lull (the replay's
    ``lru=S`` and ``sleep-lru=S``, a peer to compare with; no box is configured so)."""

    def __call__(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        return True

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        return {"rule": "any_quiet"}

    def bind(self, core: CoreView) -> None:
        pass


after_idle_timeout = AfterIdleTimeout()
any_quiet = AnyQuiet()


class SeedScheduler:
    """Priority, then first arrival, in the queue; only the head makes room, and what is freed
    for it is held for it (or for a head of higher priority that takes its place); victims of the
    requester's priority or lower that ``take`` allows (idle for their whole timeout), picked by
    ``eviction.pick_victims`` on placement's best fit."""

    def __init__(self, take: TakeRule = after_idle_timeout, by_value_slo_s: float | None = None,
                 relocates: bool = False) -> None:
        self.queue = WaitQueue()
        self.take = take
        self.by_value_slo_s = by_value_slo_s  # warmth by value against this SLO; None: fixed's
        self.relocates = relocates
        self.core: CoreView | None = None

    def bind(self, core: CoreView) -> None:
        self.core = core
        self.take.bind(core)

    def warmth(self, fixed: WarmthPolicy) -> WarmthPolicy:
        if self.by_value_slo_s is None or self.core is None:
            return fixed
        return ByValue(fixed, self.core, self.by_value_slo_s)

    def behind(self, dep_id: int, head: int) -> bool:
        return dep_id != head and self.queue.overtaken_by(dep_id) == head

    def asks_first(self, dep_id: int, admitting: Callable[[int], bool]) -> bool:
        """A queued entry of lower priority than the head waits while the head's own admit is
        out, so that memory freed by a stop nobody made for the head (the reaper, an
        administrator) goes to the higher request first."""
        head = self.queue.head()
        return head is not None and self.behind(dep_id, head) and admitting(head)

    def settle_target(self, dep_id: int) -> int:
        """``dep_id``, or the head of higher priority that took its place (and what it freed)."""
        taker = self.queue.overtaken_by(dep_id)
        return dep_id if taker is None else taker

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        """For the head, what was freed for it is its own; everything else held is not."""
        return self.queue.reserved_for_others(dep_id)

    def room_coming(self, head: int, making_room: Iterable[int]) -> bool:
        """Entries this head overtook still stop victims or wait for their memory to show: all
        of it is held for the head."""
        return any(self.behind(d, head) for d in making_room)

    def may_take(self, requester: Deployment, victim: Deployment) -> bool:
        """Of the requester's priority or lower: a higher one is never put to sleep for it (the
        request waits instead)."""
        return victim.priority.rank <= requester.priority.rank

    def takes(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        return idled_out(idle_for_s, idle_after_s) or self.take(requester, victim, idle_for_s, idle_after_s)

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        if idled_out(idle_for_s, idle_after_s):
            return {"rule": IDLE_TIMEOUT}
        return self.take.reason(requester, victim, idle_for_s, idle_after_s)

    def victims(self, candidates: list[Candidate], fit: Fit) -> tuple[list[Candidate], tuple[int, ...]]:
        return pick_victims(candidates, fit.free, fit.choose)


def cost(slo_s: float) -> Scheduler:
    """``scheduler = "cost"``: the seed scheduler's queue and placement, make-room by cost
    (``cost.ByCost``: a victim idle for less than its timeout when that pays, against ``slo_s``)."""
    return SeedScheduler(ByCost(slo_s), by_value_slo_s=slo_s, relocates=True)


# The box's ``scheduler`` key (config's check names the same ones): each a new scheduler, given the
# box's ``slo_s``.
SCHEDULERS: dict[str, Callable[[float], Scheduler]] = {"seed": lambda slo_s: SeedScheduler(), "cost": cost}


def scheduler(name: str, slo_s: float = 5.0) -> Scheduler:
    """A new scheduler of the kind ``name`` (a value of the ``scheduler`` key)."""
    try:
        return SCHEDULERS[name](slo_s)
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}: one of {', '.join(SCHEDULERS)}") from None
