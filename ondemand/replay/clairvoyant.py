"""The replay's ``clairvoyant`` policy: a reference that knows every arrival in advance, to show
how far each policy is from what knowing the future gives. It is no product policy and is not
proven optimal: a policy that beats it shows that the reference can be improved.

Its rules:

- every deployment is stopped at the first arrival (on demand, whatever its mode);
- it never puts away a deployment with a request in flight;
- arrived requests are served in arrival order (whatever their priority), and idle victims are
  taken furthest next arrival first, on the GPU set the product's placement picks;
- an idle deployment rests at once (asleep at level 1, else stopped) when its next arrival is at
  least ``sleep_s`` + ``wake_s`` away (``cold_start_s`` when it would stop: a stop takes no time
  here); ``clairvoyant=S`` rests it no sooner than S seconds idle, then by the same rule: the least
  memory a policy that keeps the product's floor (``min_idle_timeout_s``) could hold, to tell a
  target of memory that no such policy can reach from one a policy misses;
- it wakes or starts at its next arrival less its wake or start time when memory is free then, or
  can be freed from idle deployments whose next arrival is later, without delaying a request that
  has arrived;
- ties by name.

It runs on ondemand's decision core as every policy does (design.md, "The replay"), with parts
plugged into it:

- ``Future``: each deployment's arrival times, read from the trace before the run (this one
  policy holds the trace in memory: ``run.replay`` lists it when it is asked for), and which came;
- ``ClairvoyantScheduler`` (the core's ``Scheduler``): the seed scheduler's queue and holds, over
  an ``ArrivalQueue``; make-room takes any quiet deployment for an arrived request, and for an
  early start only those whose next arrival is later; victims furthest next arrival first, through
  ``eviction.pick_victims`` (placement's best fit);
- ``Foresight`` (``foresight.py``, the ``WarmthPolicy`` of every deployment): idle at once when a
  rest is due (under ``clairvoyant=S`` no sooner than S seconds idle), never before its next
  arrival otherwise, and the reaper's step asked for at that moment (the run's own
  steps every ``reap_interval_s`` would rest it up to a period late), and the queue's look when an
  engine goes quiet (the core's clock looks every ``max_tick_s``);
- ``EarlyStarts``: at each start's moment, a waiter that stands for the request to come joins
  through the core's edge (``Controller.join``, as ``flights.py`` joins a request), not counted
  and never served: it leaves once its engine is ready, or when its request arrives. Its queue
  entry ranks below every arrived request (``ArrivalQueue``), which overtakes it and takes over
  what was freed for it, as a higher priority does in the seed queue; and it asks for no start
  while an arrived request waits for one (``ClairvoyantScheduler.asks_first``), so it never takes
  memory from an arrived request.

Three readings of the rules, where the core alone would break them:

- a sleeper wakes only on its own GPUs, so the memory it will take back is not free for an early
  start needed after it (nor is it a victim for one: it is needed first), though placement, which
  only prefers to leave a sleeper its room, would take it when nothing else fits
  (``ClairvoyantScheduler.held_for_others``);
- a victim being put away for an arrived request is not woken by its own request, which came
  later, before that one is served (a wake during the sleep would take back what is being freed);
- the queue's clock is moved on when an engine goes quiet or a rest's sleep ends: a victim (or
  the memory) is there at once, where the core's own clock waits up to ``max_tick_s``.

Ties by name: the run numbers the deployments in name order (``configure``), so the core's own
ties (the queue's, placement's) fall by name too.
"""
from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..control.controller import Controller, Waiter
from ..control.cost import IDLE_TIMEOUT, CoreView
from ..control.eviction import Candidate, pick_victims
from ..control.placement import Fit, asleep_held, holdings
from ..control.queue import WaitQueue
from ..control.record import idled_out
from ..control.scheduler import SeedScheduler
from ..control.warmth_policy import WarmthPolicy
from ..engines import tiers
from ..errors import OndemandError
from ..model import REQUEST_STARTABLE, Deployment, IdleAction, KeepWarm, Mode, Role, State
from .clock import Timer, VirtualClock
from .flights import Flights
from .foresight import Foresight
from .types import Replayed, Request, fits_engine
from .world import World

CLAIRVOYANT = "clairvoyant"
# The memory queue's ranks (``WaitQueue``'s priority ranks): an entry an arrived request waits
# in, and one only an early start waits in.
ARRIVED, AHEAD = 1, 0
RESTING = (State.ASLEEP, State.STOPPED)


def configure(replayed: Sequence[Replayed]) -> list[Replayed]:
    """The deployments as the reference runs them: every model on demand (stopped when the trace
    begins), its warmth this module's (``keep_warm`` fixed: the core asks ``Controller.fixed``),
    put to sleep when it can sleep (else stopped), numbered in name order."""
    ids = {name: i for i, name in enumerate(sorted(r.deployment.name for r in replayed), 1)}
    out = []
    for r in replayed:
        dep = r.deployment.replace(id=ids[r.deployment.name])
        if dep.role is Role.MODEL and dep.state is not State.PLANNED:
            dep = dep.replace(mode=Mode.ON_DEMAND, keep_warm=KeepWarm.FIXED, idle_action=IdleAction.SLEEP)
        out.append(dataclasses.replace(r, deployment=dep))
    return out


class Future:
    """Each deployment's arrivals, in time order, and how many of them came. A request longer
    than its engine's ``max_model_len`` is none: rejected at its arrival, it starts nothing."""

    def __init__(self, requests: Iterable[Request], replayed: Sequence[Replayed]):
        self.ids = {r.deployment.name: r.deployment.id for r in replayed}
        self.names = {r.deployment.id: r.deployment.name for r in replayed}
        self._costs = {r.deployment.id: r.costs for r in replayed}
        self._times = {dep_id: array("d") for dep_id in self.names}  # 8 bytes an arrival
        for req in requests:
            if self.counts(req):
                self._times[self.ids[req.model]].append(req.at_s)
        self._came = dict.fromkeys(self.names, 0)

    def counts(self, req: Request) -> bool:
        """Is ``req`` an arrival at all (not rejected at once as too long for its engine)?"""
        return fits_engine(req, self._costs[self.ids[req.model]])

    def came(self, req: Request) -> None:
        """``req`` arrives: its deployment's next arrival is the one after it."""
        if self.counts(req):
            self._came[self.ids[req.model]] += 1

    def next_at(self, dep_id: int) -> float:
        """When its next request arrives (inf: none will)."""
        times, came = self._times[dep_id], self._came[dep_id]
        return times[came] if came < len(times) else math.inf

    def key(self, dep_id: int) -> tuple[float, str]:
        """Its next arrival, ties by name: the order of need."""
        return self.next_at(dep_id), self.names[dep_id]


class EarlyStarts:
    """Each deployment's start or wake ahead of its next request (module doc): its moment's
    timer, and the waiter that stands for the request while the start is out."""

    def __init__(self, future: Future, world: World, clock: VirtualClock):
        self.future = future
        self.world = world
        self.clock = clock
        self.waiters: dict[int, Waiter] = {}  # dep id -> the waiter standing for its next request
        self.joined: set[int] = set()  # the same deployments, from just before their join
        self.left: Callable[[Deployment], None] = lambda dep: None  # told when a waiter leaves
        self._moments: dict[int, tuple[float, Timer]] = {}
        self._gave_up: dict[int, float] = {}  # the arrival whose early start a verdict ended
        self._controller: Controller | None = None

    def bind(self, controller: Controller) -> None:
        self._controller = controller
        for dep in self.world.deployments():
            self.plan(dep.id)

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("the early starts are bound to no controller")
        return self._controller

    # --- what the scheduler asks ------------------------------------------------------

    def arrived_waiting(self, dep_id: int) -> int:
        """The arrived requests that wait for ``dep_id`` (its waiters but the early start's)."""
        return self.controller.waiting(dep_id) - (dep_id in self.joined)

    def arrived_wait_for_a_start(self) -> bool:
        """Does an arrived request wait for a start that has not begun (for memory, or for its
        admit)? An early start asks for none meanwhile."""
        ctl = self.controller
        for dep_id in ctl.attempts():
            dep = self.world.deployment(dep_id)
            if dep is not None and dep.state in REQUEST_STARTABLE and self.arrived_waiting(dep_id) > 0:
                return True
        return False

    def claimed_for_an_arrival(self, dep_id: int) -> bool:
        """Is ``dep_id`` a victim that make-room is putting away for an arrived request? Its own
        request, which came later, waits until that one is served (a wake in the middle of the
        sleep would take back what is being freed for it)."""
        ctl = self.controller
        for other in ctl.attempts():
            attempt = ctl.slots.attempt(other)
            if attempt is not None and dep_id in attempt.victims and self.arrived_waiting(other) > 0:
                return True
        return False

    def kept_for_sleepers(self, dep_id: int) -> dict[int, float]:
        """GiB per GPU that the deployments asleep and needed before ``dep_id`` will take back
        when they wake (a sleeper wakes only on its own GPUs; a sleep whose call is out holds it
        all anyway). An arrived request is needed before any of them: none."""
        if self.arrived_waiting(dep_id) > 0:
            return {}
        world = self.world
        need = self.future.key(dep_id)
        kept: dict[int, float] = {}
        for dep in world.deployments():
            if dep.id == dep_id or dep.state is not State.ASLEEP or world.sleeping(dep.id) \
                    or self.future.key(dep.id) >= need:
                continue
            gib = dep.footprint_gib - asleep_held(dep, world.box.asleep_residue_gib, world.pools, world.budget.per_gpu)
            for gpu, share in holdings(gib, dep.gpu_count, dep.gpus, world.pools, world.budget.per_gpu).items():
                kept[gpu] = kept.get(gpu, 0.0) + share
        return kept

    # --- the moments ------------------------------------------------------------------

    def plan(self, dep_id: int) -> None:
        """Set (again) the moment of ``dep_id``'s early start: its next arrival less what its
        start or wake takes from the state it rests in (now, when that has passed)."""
        old = self._moments.pop(dep_id, None)
        if old is not None:
            old[1].cancel()
        dep = self.world.deployment(dep_id)
        if dep is None or dep.state not in RESTING or not dep.on_demand or dep_id in self.joined:
            return
        at = self.future.next_at(dep_id)
        if at == math.inf or self._gave_up.get(dep_id) == at:
            return
        costs = self.world.costs(dep_id)
        took = costs.back_s(tiers.STOPPED if dep.state is State.STOPPED else tiers.asleep(dep.sleep_level or 1))
        moment = max(self.clock.now, at - took)
        self._moments[dep_id] = (moment, self.clock.call_at(moment, self._due))

    def _due(self) -> None:
        """Every early start whose moment has come joins, the first needed first, ties by name."""
        now = self.clock.now
        due = sorted((d for d, (moment, _) in self._moments.items() if moment <= now), key=self.future.key)
        for dep_id in due:
            self._moments.pop(dep_id)[1].cancel()
            self._join(dep_id)

    def _join(self, dep_id: int) -> None:
        ctl = self.controller
        dep = self.world.deployment(dep_id)
        if dep is None or dep.state not in RESTING or ctl.waiting(dep_id):
            return  # arrived requests wait for it: their start is its start
        self.joined.add(dep_id)  # before the join, whose steps ask the scheduler
        try:
            waiter = ctl.join(dep_id, arrival=self.future.next_at(dep_id), notify=lambda: self._poke(dep_id))
        except OndemandError:  # a start's backoff: the request will hear it
            self.joined.discard(dep_id)
            return
        self.waiters[dep_id] = waiter

    def _poke(self, dep_id: int) -> None:
        """The core's ``notify``: looked at one event later, as a waiting task wakes."""
        self.clock.call_later(0, lambda: self._look(dep_id))

    def _look(self, dep_id: int) -> None:
        waiter = self.waiters.get(dep_id)
        dep = self.world.deployment(dep_id)
        if waiter is None or dep is None:
            return
        if waiter.verdict is not None:  # does_not_fit, a failed start: no second try before it arrives
            self._gave_up[dep_id] = waiter.arrival
            self.leave(dep_id)
        elif dep.state is State.READY:
            self.leave(dep_id)

    def leave(self, dep_id: int) -> None:
        """The early start's waiter leaves (its engine is ready, or its request came)."""
        waiter = self.waiters.pop(dep_id, None)
        self.joined.discard(dep_id)
        if waiter is None:
            return
        self.controller.leave(waiter)
        dep = self.world.deployment(dep_id)
        if dep is not None:
            self.left(dep)

    def arrived(self, dep_id: int) -> None:
        """A request of ``dep_id`` arrived (and was served, refused, or waits): the waiter that
        stood for it leaves, and a queue entry it waits in ranks as arrived from now on."""
        self.leave(dep_id)
        ctl = self.controller
        if dep_id in ctl.queue and self.arrived_waiting(dep_id) > 0:
            ctl.queue.rerank(dep_id, ARRIVED)
        self.plan(dep_id)


class ArrivalQueue(WaitQueue):
    """The memory queue by first arrival, whatever the deployments' priorities: an entry ranks
    ``ARRIVED`` while an arrived request waits in it, else ``AHEAD`` (an early start's), below
    every arrived one. The rank is the one thing the seed queue takes from elsewhere (the
    deployment's priority, handed in by the start side): the rest is the seed queue's."""

    def __init__(self, rank: Callable[[int], int]):
        super().__init__()
        self.rank = rank

    def add(self, dep_id: int, first_arrival: float, rank: int = ARRIVED) -> bool:
        return super().add(dep_id, first_arrival, self.rank(dep_id))


class ClairvoyantScheduler:
    """The core's ``Scheduler`` for the reference (module doc): the seed scheduler's queue,
    holds and settle over an ``ArrivalQueue``, its own take rule and victims."""

    def __init__(self, future: Future, early: EarlyStarts):
        self.future = future
        self.early = early
        self.queue: WaitQueue = ArrivalQueue(lambda d: ARRIVED if early.arrived_waiting(d) > 0 else AHEAD)
        self.seed = SeedScheduler()
        self.seed.queue = self.queue  # the seed's rules, read over this queue
        self.relocates = False

    def bind(self, core: CoreView) -> None:
        self.seed.bind(core)

    def warmth(self, fixed: WarmthPolicy) -> WarmthPolicy:
        return fixed  # its rests are its own (Foresight), not a warmth policy's

    def behind(self, dep_id: int, head: int) -> bool:
        return self.seed.behind(dep_id, head)

    def asks_first(self, dep_id: int, admitting: Callable[[int], bool]) -> bool:
        """The seed's rule; a victim being put away for an arrived request waits until that one
        is served (arrival order); and an early start waits while an arrived request waits for
        a start: the memory free now may be what that one needs."""
        if self.seed.asks_first(dep_id, admitting) or self.early.claimed_for_an_arrival(dep_id):
            return True
        return self.early.arrived_waiting(dep_id) == 0 and self.early.arrived_wait_for_a_start()

    def settle_target(self, dep_id: int) -> int:
        return self.seed.settle_target(dep_id)

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        """The seed's holds, and for an early start what the sleepers needed before it will take
        back when they wake: free now, but theirs first (placement only prefers to leave a
        sleeper its room, and takes it when nothing else fits)."""
        held = self.seed.held_for_others(dep_id)
        for gpu, gib in self.early.kept_for_sleepers(dep_id).items():
            held[gpu] = held.get(gpu, 0.0) + gib
        return held

    def room_coming(self, head: int, making_room: Iterable[int]) -> bool:
        return self.seed.room_coming(head, making_room)

    def may_take(self, requester: Deployment, victim: Deployment) -> bool:
        return True  # arrival order, whatever the priorities

    def takes(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float) -> bool:
        """Any quiet deployment for an arrived request; for an early start, one needed later."""
        if self.early.arrived_waiting(requester.id) > 0:
            return True
        return self.future.key(victim.id) > self.future.key(requester.id)

    def reason(self, requester: Deployment, victim: Deployment, idle_for_s: float, idle_after_s: float
               ) -> dict[str, Any]:
        return {"rule": IDLE_TIMEOUT if idled_out(idle_for_s, idle_after_s) else CLAIRVOYANT}

    def victims(self, candidates: list[Candidate], fit: Fit) -> tuple[list[Candidate], tuple[int, ...]]:
        """Furthest next arrival first, ties by name: ``pick_victims`` (the shortest prefix that
        makes the model fit on placement's best fit, and of it those on the chosen GPUs) given
        that order as each candidate's last use."""
        order = sorted(candidates, key=lambda c: (-self.future.next_at(c.id), self.future.names[c.id]))
        ranked = [dataclasses.replace(c, rank=0, tier=0, last_used=float(i)) for i, c in enumerate(order)]
        picked, gpus = pick_victims(ranked, fit.free, fit.choose)
        by_id = {c.id: c for c in candidates}  # each with its own tier: awake ones are put to sleep, asleep stopped
        return [by_id[c.id] for c in picked], gpus


class Clairvoyant:
    """The reference's parts for one run (module doc): the ``scheduler`` its controller is made
    with, then ``bind`` plugs the rest in; ``arrive`` hands each request on to the edge."""

    def __init__(self, requests: Iterable[Request], replayed: Sequence[Replayed], world: World,
                 clock: VirtualClock, floor_s: float = 0.0):
        self.world = world
        self.future = Future(requests, replayed)
        self.early = EarlyStarts(self.future, world, clock)
        self.scheduler = ClairvoyantScheduler(self.future, self.early)
        self.warmth = Foresight(self.future.next_at, world, clock, self.early.plan, floor_s)
        self.early.left = self.warmth.check

    def bind(self, controller: Controller) -> None:
        # Every deployment is fixed (``configure``), and the core asks a fixed one's warmth here.
        controller.fixed = self.warmth
        self.warmth.bind(controller)
        self.early.bind(controller)

    def arrive(self, req: Request, flights: Flights) -> None:
        self.future.came(req)
        flights.arrive(req)
        if not self.future.counts(req):
            return  # rejected at once: no arrival, so the early start standing for the next one stays
        dep_id = flights.ids[req.model]
        self.early.arrived(dep_id)
        dep = self.world.deployment(dep_id)
        if dep is not None:
            self.warmth.check(dep)  # refused, it is idle still, and its next arrival is further
