"""The replay: a trace's requests through ondemand's own decisions under each policy, in
virtual time.

A policy is ondemand configured to behave like it, not a scheduler of its own (``configure``):

- ``current``: the deployments as given;
- ``always-on``: every deployment always on, placed and ready when the trace begins (those that
  do not fit beside the others fail: their requests are refused);
- ``ttl=S``: ``idle_timeout_s`` S and ``idle_action`` stop for the on-demand ones: stopped S
  seconds after their last request ended, never put to sleep (llama-swap's ``ttl``, Ollama's
  ``keep_alive``);
- ``sleep-ttl=S``: the same, put to sleep at level 1 instead (llama-swap with a vLLM sleep
  wrapper);
- ``lru=S``, ``sleep-lru=S``: as ``ttl=S`` and ``sleep-ttl=S``, and make-room takes any model with
  nothing in flight, least recently used first, however short its lull (Ollama's rule: the seed
  scheduler with ``any_quiet`` as its take rule);
- ``seed``, ``cost``: the deployments as given, under that scheduler whatever the box's
  ``scheduler`` (``cost`` aims at the replay's ``--slo-s``);
- ``fixed=S``: ondemand's tiered warmth with ``idle_timeout_s`` S for all;
- ``adaptive``: ``keep_warm`` adaptive for the on-demand ones (their idle timeouts as given):
  each learns its idle gaps as the trace goes, from those the state file kept (``Replayed.gaps``)
  or from none, and behaves as ``fixed`` until its 20th;
- ``clairvoyant``: a reference, not a product policy: it knows every arrival in advance, rests an
  idle deployment at once when its next request is far enough, wakes or starts it just in time
  when memory is free or can be freed from deployments needed later, and takes victims furthest
  next arrival first (``clairvoyant.py``, its parts plugged into the same core). It is the one
  policy that reads the trace ahead: ``replay`` then holds the trace's requests in memory.
  ``clairvoyant=S`` is the same reference whose own rests wait until a deployment has been idle S
  seconds (the floor the product keeps, ``min_idle_timeout_s``; its make-room may take one
  sooner, as the product's may): the least memory a policy with that floor holds.

One ``Run`` per policy: its own virtual clock, world (``world.py``), controller and requests'
edge (``flights.py``), and the reaper's step every ``reap_interval_s`` (at k × the period:
a period that is no whole number of seconds does not drift). ``replay`` reads the trace once
and hands each request to every run in turn (each runs its clock up to the arrival first), so
nothing of the trace is held, and memory does not grow with the policies (but under
``clairvoyant``, whose run is given the whole list first). Each tally sketches its TTFTs and
waits (``sketch.py``), and keeps the page's timelines only when asked (``timelines``): a run's
memory then does not grow with the trace's length either.

**Idle spans are skipped, not stepped through** (a week of quiet, a gap of 10^8 s, a request
that decodes for days: millions of steps that each decide nothing). A step is skipped when it
can change nothing, which the run knows without asking the reaper's rule again: nothing has
happened since the last step that ran (no timer fired, no request arrived), that step asked
nothing and no request waited (so it also made every plan adaptive warmth makes when first
asked, and the state the next steps read is the same), and the step falls before the earliest
``idle_until`` of the deployments (the controller's own word for when the reaper may take each
one; none: never until something happens). The next step that runs is then the first of the
grid at or after that moment, the next timer or the next arrival, whichever comes first; it is
pushed in the same order among the timers as a stepping reaper's would be (nothing else is
pushed in between), so the results are those of stepping, to the byte (``step_idle=True``
steps, for the tests that hold this).

``measure_from_s`` (``--warmup-s``): the trace's first seconds are replayed but not counted.
Every run goes on from the state its own decisions left at that moment (what runs, what sleeps,
what was learned), and counts only what happens from then on: the requests that arrive, the
starts, wakes, sleeps, stops and pre-warms, and the memory held. A pre-warm still out then is
counted as one of the window's, so that its hit is not counted alone.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

from ..control.controller import Controller
from ..control.scheduler import Scheduler, SeedScheduler, any_quiet, scheduler
from ..model import IdleAction, KeepWarm, Mode, Role, State
from . import clairvoyant
from .clock import VirtualClock
from .flights import Flights
from .types import LRU_KINDS, TIMED_KINDS, Box, Policy, PolicyResult, Replayed, Request, Tally
from .world import World

# idle_until is rounded to the ms: a skip stops this much before it (a step that runs early
# and decides nothing changes nothing).
QUIET_MARGIN_S = 0.01


def check_policy(policy: Policy, box: Box) -> None:
    """Raises ValueError, naming the policy, for one the replay cannot run on this box."""
    if policy.kind in TIMED_KINDS and (policy.seconds or 0) < box.min_idle_timeout_s:
        raise ValueError(f"policy {policy.name!r}: {policy.seconds} s is below the box's min_idle_timeout_s "
                         f"({box.min_idle_timeout_s} s), the shortest idle timeout a deployment may have")


def configure(replayed: Sequence[Replayed], policy: Policy, box: Box) -> list[Replayed]:
    """The deployments as ``policy`` sets them (module doc)."""
    check_policy(policy, box)
    if policy.kind == clairvoyant.CLAIRVOYANT:
        return clairvoyant.configure(replayed)
    out = []
    for r in replayed:
        dep = r.deployment
        if dep.role is Role.MODEL and dep.state is not State.PLANNED:
            if policy.kind == "always-on":
                dep = dep.replace(mode=Mode.ALWAYS_ON)
            elif dep.on_demand and policy.kind in TIMED_KINDS:
                dep = dep.replace(idle_timeout_s=policy.seconds, keep_warm=KeepWarm.FIXED)
                if policy.kind in ("ttl", "lru"):
                    dep = dep.replace(idle_action=IdleAction.STOP)
                elif policy.kind in ("sleep-ttl", "sleep-lru"):
                    dep = dep.replace(idle_action=IdleAction.SLEEP)
            elif dep.on_demand and policy.kind == "adaptive":
                dep = dep.replace(keep_warm=KeepWarm.ADAPTIVE)
        out.append(dataclasses.replace(r, deployment=dep))
    return out


def scheduler_of(policy: Policy, box: Box, slo_s: float) -> Scheduler:
    """The scheduler a policy runs: the box's (its ``scheduler`` key), but for ``seed`` and
    ``cost`` (that scheduler, whatever the box says; cost aims at the replay's ``slo_s``) and the
    peers whose make-room takes any model with nothing in flight (``lru``, ``sleep-lru``: Ollama's
    rule, the seed scheduler's queue and placement)."""
    if policy.kind in LRU_KINDS:
        return SeedScheduler(any_quiet)
    return scheduler(policy.kind if policy.kind in ("seed", "cost") else box.scheduler, slo_s)


class Run:
    """One policy's replay (module doc)."""

    def __init__(self, policy: Policy, replayed: Sequence[Replayed], box: Box, slo_s: float,
                 measure_from_s: float = 0.0, *, step_idle: bool = False, trace: Sequence[Request] | None = None,
                 keep: bool = False, timelines: bool = True):
        self.policy = policy
        self.box = box
        self.clock = clock = VirtualClock()
        self.tallies = {r.deployment.name: Tally.keeping(keep) for r in replayed}
        self.total = Tally.keeping(keep)
        self.world = World(replayed, box, clock, self.tallies, self.total, timelines)
        self.refused = self.world.place_always_on()
        # The clairvoyant reference's parts, given every request ahead (``trace``).
        self.foresight: clairvoyant.Clairvoyant | None = None
        sched: Scheduler
        if policy.kind == clairvoyant.CLAIRVOYANT:
            if trace is None:
                raise ValueError("the clairvoyant policy is given the trace's requests in advance")
            self.foresight = clairvoyant.Clairvoyant(trace, replayed, self.world, clock, float(policy.seconds or 0))
            # The waiters early starts join count in the core's limit of waiters: raised by the
            # most of them out at once (one a deployment), no request is refused for them.
            sched, max_queued = self.foresight.scheduler, box.max_queued + len(replayed)
        else:
            sched, max_queued = scheduler_of(policy, box, slo_s), box.max_queued
        self.controller = Controller(
            self.world, clock=clock, wall=clock, queue_timeout_s=box.queue_timeout_s, max_queued=max_queued,
            idle_timeout_s=box.idle_timeout_s, min_idle_timeout_s=box.min_idle_timeout_s,
            sleep_timeout_s=box.sleep_timeout_s, asleep_residue_gib=box.asleep_residue_gib,
            scheduler=sched)
        self.world.bind(self.controller)
        if self.foresight is not None:
            self.foresight.bind(self.controller)
        self.controller.learn({r.deployment.id: r.gaps for r in replayed if r.gaps})
        self.flights = Flights(self.world, self.controller, clock, self.tallies, self.total, slo_s, timelines)
        self.measure_from_s = measure_from_s
        self._hits_before: dict[str, int] = {}  # pre-warm hits before the measured window
        if measure_from_s > 0:
            self.flights.measure_from_s = measure_from_s
            clock.call_later(measure_from_s, self._measure)
        self.step_idle = step_idle
        self.reap_steps = 0  # the reaper's steps that ran
        self._step = 0  # the index on the grid (k x reap_interval_s) of the reaper's next step
        self._quiet_mark = -1  # clock.fired after the last step, while nothing else has happened since
        self._quiet_until = -math.inf  # no step before this can change anything (module doc)
        self._next_step(1)

    def _measure(self) -> None:
        """The measured window begins (module doc): the memory held so far is booked, then every
        count starts again from nothing, but for the pre-warms still out."""
        self.world.ledger.book()
        for name, tally in self.tallies.items():
            hits, misses = self._prewarm_results(name)
            out = tally.prewarms - hits - misses
            tally.reset()
            tally.prewarms = out
            self._hits_before[name] = hits
        self.total.reset()

    def _prewarm_results(self, name: str) -> tuple[int, int]:
        """The controller's count of ``name``'s pre-warms that were hits and misses so far."""
        results = self.controller.prewarms(self.flights.ids[name])
        return results["hit"], results["miss"]

    def _reap(self) -> None:
        """The reaper's step (control/reaper.py), unless it can change nothing (module doc)."""
        clock = self.clock
        if not self.step_idle and self._quiet_mark == clock.fired - 1 and clock.now < self._quiet_until:
            self._quiet_mark = clock.fired  # skipped: still nothing happened
            self._skip_to(min(self._quiet_until, clock.next_due(), clock.horizon))
            return
        self.reap_steps += 1
        asked = self.controller.reap()
        self._quiet_mark = clock.fired
        self._quiet_until = -math.inf if asked or self.controller.attempts() else self._reapable_from()
        self._next_step(self._step + 1)

    def _reapable_from(self) -> float:
        """The earliest moment the reaper may take a deployment (``idle_until``; the controller
        runs on the virtual clock for wall time too), less a margin for its rounding to the ms;
        inf: none until something happens."""
        until = [self.controller.status(dep.id)["idle_until"] for dep in self.world.deployments()]
        return min((u for u in until if u is not None), default=math.inf) - QUIET_MARGIN_S

    def _skip_to(self, moment: float) -> None:
        """The reaper's next step: the first of the grid after now and at or after ``moment``."""
        period = self.box.reap_interval_s
        if moment == math.inf:  # nothing due at all: step on (a run that ends asks no more)
            self._next_step(self._step + 1)
            return
        k = max(self._step + 1, math.ceil(moment / period))
        # The quotient is rounded: set k by the products the steps are scheduled at.
        while k > self._step + 1 and (k - 1) * period >= moment:
            k -= 1
        while k * period < moment:
            k += 1
        self._next_step(k)

    def _next_step(self, k: int) -> None:
        self._step = k
        self.clock.call_at(k * self.box.reap_interval_s, self._reap)

    def arrive(self, req: Request) -> None:
        self.clock.run_until(req.at_s)
        self._quiet_mark = -1  # something happened: the reaper's next step runs
        if self.foresight is None:
            self.flights.arrive(req)
        else:
            self.foresight.arrive(req, self.flights)

    def finish(self) -> PolicyResult:
        """Run on until the last request has ended; what is awake then stays (no stop)."""
        self.clock.run_while(lambda: self.flights.open > 0)
        if self.clock.now < self.measure_from_s:  # the trace ended before its measured window
            self.clock.run_until(self.measure_from_s)
        self.world.ledger.close()
        for name, tally in self.tallies.items():
            tally.prewarm_hits = self._prewarm_results(name)[0] - self._hits_before.get(name, 0)
        for key in ("cold_starts", "wakes", "sleeps", "stops", "prewarms", "prewarm_hits"):
            setattr(self.total, key, sum(getattr(t, key) for t in self.tallies.values()))
        return PolicyResult(self.policy, self.total, self.tallies, end_s=self.clock.now,
                            memory=self.world.ledger.timeline, queue=self.flights.timeline)


def replay(requests: Iterable[Request], replayed: Sequence[Replayed], box: Box, policies: Sequence[Policy], *,
           slo_s: float = 5.0, measure_from_s: float = 0.0, step_idle: bool = False,
           progress: Callable[[int], None] | None = None, keep: bool = False, timelines: bool = True
           ) -> list[PolicyResult]:
    """Each policy's result, in the order given, counted from ``measure_from_s`` (module doc);
    ``progress(n)`` after every 256th request. A ``clairvoyant`` policy reads the requests ahead:
    they are then held in a list (the one case where the trace is in memory). ``keep``: the
    tallies keep each request's TTFT and wait besides their sketches (memory then grows with the
    trace: for tests and small traces). ``timelines``: the page's timelines of memory and of the
    queue are kept (they grow with the changes, so with the trace; without, the results' are
    empty)."""
    trace: Sequence[Request] | None = None
    if any(p.kind == clairvoyant.CLAIRVOYANT for p in policies):
        requests = trace = requests if isinstance(requests, Sequence) else list(requests)
    runs = [Run(p, configure(replayed, p, box), box, slo_s, measure_from_s, step_idle=step_idle,
                trace=trace if p.kind == clairvoyant.CLAIRVOYANT else None, keep=keep, timelines=timelines)
            for p in policies]
    n = 0
    for n, req in enumerate(requests, 1):
        for run in runs:
            run.arrive(req)
        if progress is not None and n % 256 == 0:
            progress(n)
    if progress is not None:
        progress(n)
    return [run.finish() for run in runs]
