"""What the controller holds of each deployment (one ``Record``), of each attempt to start
one for its waiters (``Attempt``) and of each waiting request (``Waiter``); a granted slot is
a request's ``ticket.Ticket``. Plain state: the decisions are the controller's."""
from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

from ..errors import OndemandError
from .protocol import Timer
from .rhythm import Plan, Rhythm


class Phase(enum.Enum):
    IDLE = "idle"
    ADMITTING = "admitting"
    STOPPING = "stopping victims"
    SETTLING = "settling"


class Waiter:
    """One request waiting for a slot. ``notify`` wakes its task (set by whoever waits)."""
    __slots__ = ("dep_id", "arrival", "deadline", "on_queued", "notify", "notified", "verdict")

    def __init__(self, dep_id: int, arrival: float, deadline: float,
                 on_queued: Callable[[], None] | None, notify: Callable[[], None]):
        self.dep_id = dep_id
        self.arrival = arrival
        self.deadline = deadline
        self.on_queued = on_queued
        self.notify = notify
        self.notified = False  # the queued notice went out
        self.verdict: OndemandError | None = None


@dataclasses.dataclass
class Attempt:
    """A deployment's waiters and the one effect out for them (its phase)."""
    waiters: list[Waiter] = dataclasses.field(default_factory=list)
    phase: Phase = Phase.IDLE
    starting_for_request: bool = False
    stopped_victim: bool = False  # this attempt stopped a victim: no does_not_fit now
    # Its waiters were told they are queued (make-room's victims do not free enough, or it waits
    # behind the head): a request that joins it while queued is told at once.
    told: bool = False
    victims: set[int] = dataclasses.field(default_factory=set)  # stops out for this attempt
    # What each victim frees on the GPU set chosen for this attempt: held for it once stopped.
    frees: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    freed: float = 0.0
    # Asked when a sleep's call ended (``Attempts.offer``): a refusal then takes no victim; make-room
    # waits for the queue's look.
    offer_only: bool = False


@dataclasses.dataclass
class Backoff:
    until: float
    delay: float
    reason: str


class Record:
    """What the controller holds of one deployment: its slots, its activity, its attempt,
    its start backoff, its drains and its publishing. Made when first needed; a field at its
    default is what "nothing held" was before (no activity seen, no attempt, no backoff)."""
    __slots__ = ("inflight", "last_activity", "last_request_at", "asleep_since", "attempt", "backoff", "busy",
                 "published_at", "publish_timer", "drains", "drained", "idle_since", "rhythm", "learned", "adaptive",
                 "early", "arrivals")

    def __init__(self) -> None:
        self.inflight = 0  # granted slots
        self.last_activity: float | None = None  # monotonic; None: none seen (removed, or never)
        self.last_request_at: float | None = None  # wall time of the last slot
        self.asleep_since: float | None = None  # for sleep_timeout_s (after a restart: from then)
        self.attempt: Attempt | None = None  # while it has waiters or an effect of theirs is out
        self.backoff: Backoff | None = None
        self.busy = 0  # 429s for max_inflight (a counter)
        self.published_at = -math.inf
        self.publish_timer: Timer | None = None
        # A sleep drains first: no new slot while one is out; each callback once its in-flight ended.
        self.drains = 0
        self.drained: list[Callable[[], None]] = []
        # Adaptive warmth: since when it has had no slot (None: a request came since, or none
        # ended yet), and the idle gaps learned (on-demand deployments only), with their count
        # (a plan is made again after one: the rhythm keeps the newest, so its length stops).
        self.idle_since: float | None = None
        self.rhythm: Rhythm | None = None
        self.learned = 0
        self.adaptive: AdaptiveState | None = None  # keep_warm adaptive: its idle period, its pre-warms
        # Its last put-away, when make-room took it before its idle timeout (the rule's reason, for
        # whom, when): the view's ``put_away_early``, until it is ready again.
        self.early: dict[str, Any] | None = None
        # When its last requests came (slots and waiters alike; the newest ARRIVALS_KEPT): its rate.
        self.arrivals: collections.deque[float] | None = None

    def waiters(self) -> int:
        return len(self.attempt.waiters) if self.attempt is not None else 0

    def forget(self) -> None:
        """The deployment is gone: all but its attempt and its drains (they end on their own)."""
        self.inflight = 0
        self.last_activity = self.last_request_at = self.asleep_since = self.idle_since = None
        self.rhythm = None
        self.learned = 0
        if self.adaptive is not None:
            self.adaptive.end()
            self.adaptive = None
        self.backoff = None
        self.busy = 0
        self.early = None
        self.published_at = -math.inf
        if self.publish_timer is not None:
            self.publish_timer.cancel()
            self.publish_timer = None

    def unused(self) -> bool:
        return self.attempt is None and not self.drains and not self.drained


class Prewarm(enum.Enum):
    NONE = "none"  # not asked (yet), or it found no free memory
    OUT = "out"  # the effect is out
    STARTED = "started"  # it woke or started the engine: a request's arrival is a hit, its rest a miss


@dataclasses.dataclass(eq=False)
class Period:
    """One idle period of an adaptive deployment: from its last slot's release to the next
    arrival. Its plan is made once, when first asked (``keepwarm``), not on the request's path."""
    began: float  # monotonic: the release of its last slot
    planned: bool = False
    plan: Plan | None = None  # None (once planned): it behaves as fixed
    cost_s: float = 0.0  # its rest tier's cost to come back (ready at prewarm_in_s + cost_s)
    prewarm: Prewarm = Prewarm.NONE
    timer: Timer | None = None  # the pre-warm's


@dataclasses.dataclass(eq=False)
class AdaptiveState:
    """What adaptive warmth holds of one deployment: its idle period, the results of its
    pre-warms (``ondemand_prewarms_total``) and the view's plan, made again only when what it
    was made of changes."""
    period: Period | None = None
    hits: int = 0
    misses: int = 0
    shown: tuple[object, Plan | None] | None = None  # (what the view's plan was made of, the plan)

    def end(self) -> None:
        """The idle period is over (an arrival, a new one, a removal): its pre-warm's timer goes."""
        if self.period is not None and self.period.timer is not None:
            self.period.timer.cancel()
        self.period = None


def idled_out(idle_for_s: float, idle_after_s: float) -> bool:
    """Idle for its whole timeout (its warmth policy's idle rule): the reaper may take it, and
    make-room may whatever its scheduler's take rule (``Slots.quiet_for`` gives the two figures)."""
    return idle_for_s >= idle_after_s


NOTHING = Record()  # what is read of a deployment the controller holds nothing of (never written)
