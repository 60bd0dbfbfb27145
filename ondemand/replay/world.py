"""The world a replay's controller lives in, simulated on a virtual clock: the box (its GPUs as
a ``static`` budget, its host memory), the deployer behind ``Effects``, and the engines.

The decisions are ondemand's own, unchanged: the ``Controller`` (slots, queue, make-room, the
reaper's rule, priorities, limits) decides, and this world does what the real effects
(``control/effects.py``) and deployer (``engines/deployer.py``) do with what it asks, and reports
back through the same ``on_*`` calls, each in its own event as their tasks do. The deployer's
decisions are its own functions (``engines/rules.py``), called here as the deployer calls them;
this world keeps only the simulated engines, their timings and the box:

- ``admit``: ``rules.admit`` (may it start, ``wanted``, the queue's holds, the real fit check:
  ``Budget.check_fit``) picks the GPUs; the deployment is marked ``starting`` and its engine
  starts behind the start-up gates of its GPUs (``rules.gate_keys``; one start at a time per
  GPU), taking what coming back from its tier costs (``Costs.back_s``: ``cold_start_s``, or a
  wake's ``wake_s`` from level 1, ``wake2_s`` from level 2), after its sleep's own call has ended;
- ``sleep``: with the core's precheck (``Controller.precheck``), marked ``asleep`` at the level ``rules`` gives
  (asked, then the host reserve: a level 1 may become a level 2, or a stop), ``sleep_s`` for the
  engine's call; a level-1 sleep reserves its predicted host memory while its call is out (as
  the deployer's ``host_reserved``) and holds it from the call's end (the box's available host
  memory, as ``MemAvailable`` would show it) until it wakes or stops. After the call it keeps
  ``asleep_residue_gib`` per GPU (the ``static`` budget's rule: nothing is measured); until the
  call ends the fit checks count its whole footprint (``_as_read``: a real budget reads the
  memory still used), so nothing takes it mid-sleep; its end is the deployer's ``Slept``
  (``Controller.on_slept``: the queue is offered the memory);
- ``stop``: approved by ``rules.may_stop`` with the same precheck, ``stopping`` then ``stopped``
  (an engine's exit costs no time here);
- ``prewarm`` (adaptive warmth): ``admit`` without make-room, ``prewarm_wanted`` asked in the
  same step as the fit check; a pre-warm that starts is counted (its hit is the controller's);
  ``tiers``: the rest tiers at the deployment's own costs;
- ``settle``: the fit check polled every ``SETTLE_POLL_S`` until it passes or the wait runs out.

Every transition changes the fields ``rules.marked`` says and reaches the controller as the bus
brings it (``on_deployment``), and each is counted (cold starts, wakes, sleeps, stops) and its
memory booked in the ``Ledger``: what each engine holds on each GPU over time (starting, awake,
asleep: its residue once the sleep's call has freed the rest), for GPU-hours, GiB-hours and the
page's timeline.

The engines batch as vLLM's do (``engine.py``: a KV cache, prefill shared by the engine, decode
per request bounded per engine).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..control import placement
from ..control.budget import Budget, Reading
from ..control.controller import Controller
from ..control.keepwarm import rest_levels, tier_costs
from ..engines import rules, tiers, warmth
from ..errors import DeployerError, InsufficientMemory
from ..model import HOLDING, Deployment, Mode, Role, State
from .clock import Timer, VirtualClock
from .engine import Engine
from .types import Box, Costs, Replayed, Tally

SETTLE_POLL_S = 0.05  # as the real effects' settle
READING = Reading(None)  # a static budget measures nothing: the deployments' bookings are the reading


class Ledger:
    """What each engine holds on each GPU over virtual time: per deployment its GPU-seconds (the
    GPUs it holds memory on, times the time) and GiB-seconds, for the box the seconds each GPU
    had some engine's memory on it, and the timeline (t, GPU, deployment, GiB from then on), kept
    only when ``drawn`` (a page will draw it: it grows with the changes, so with the trace)."""

    def __init__(self, gpus: int, clock: VirtualClock, tallies: Mapping[str, Tally], box: Tally, drawn: bool = True):
        self.clock = clock
        self.tallies = tallies
        self.box = box
        self.drawn = drawn
        self.timeline: list[tuple[float, int, str, float]] = []
        self._held: dict[str, dict[int, float]] = {}
        self._since: dict[str, float] = {}
        self._total = [0.0] * gpus
        self._total_since = [0.0] * gpus

    def hold(self, name: str, holdings: Mapping[int, float]) -> None:
        now = self.clock.now
        old = self._held.get(name, {})
        self._accrue(name, now)
        for gpu in sorted(set(old) | set(holdings)):
            before, after = old.get(gpu, 0.0), holdings.get(gpu, 0.0)
            if abs(before - after) > 1e-9:
                self._accrue_gpu(gpu, now)
                self._total[gpu] += after - before
                if self.drawn:
                    self.timeline.append((now, gpu, name, round(after, 3)))
        self._held[name] = dict(holdings)

    def _accrue(self, name: str, now: float) -> None:
        held, since = self._held.get(name), self._since.get(name, now)
        self._since[name] = now
        if held:
            t = self.tallies[name]
            t.gpu_seconds += (now - since) * sum(1 for g in held.values() if g > 1e-9)
            t.gpu_gib_seconds += (now - since) * sum(held.values())

    def _accrue_gpu(self, gpu: int, now: float) -> None:
        if self._total[gpu] > 1e-9:
            self.box.gpu_seconds += now - self._total_since[gpu]
        self._total_since[gpu] = now

    def book(self) -> None:
        """Book everything held up to now (a measured window begins, or the replay ends)."""
        now = self.clock.now
        for name in self._held:
            self._accrue(name, now)
        for gpu in range(len(self._total)):
            self._accrue_gpu(gpu, now)

    def close(self) -> None:
        """Book everything held up to now (the replay's end), and the box's GiB-seconds."""
        self.book()
        self.box.gpu_gib_seconds = sum(self.tallies[n].gpu_gib_seconds for n in self._held)


class _Gate:
    __slots__ = ("held", "waiters")

    def __init__(self) -> None:
        self.held = False
        self.waiters: collections.deque[Callable[[], None]] = collections.deque()


class World:
    """The box, the deployer and the engines (module doc); the controller's ``Effects``."""

    def __init__(self, replayed: Sequence[Replayed], box: Box, clock: VirtualClock, tallies: Mapping[str, Tally],
                 total: Tally, drawn: bool = True):
        self.clock = clock
        self.box = box
        self.tallies = tallies
        self.budget = Budget("static", None if box.per_gpu else box.gpus[0],
                             gpu_capacity_gib=box.gpus if box.per_gpu else None, reserve_gib=box.reserve_gib,
                             host_reserve_gib=box.host_reserve_gib, asleep_residue_gib=box.asleep_residue_gib)
        self.pools = len(box.gpus)
        self.ledger = Ledger(self.pools, clock, tallies, total, drawn)
        self._deps = {r.deployment.id: r.deployment for r in replayed}
        self._costs = {r.deployment.id: r.costs for r in replayed}
        self.engines: dict[int, Engine] = {}
        self.ready_kind: dict[int, str] = {}  # how it last became ready: "cold" or "wake"
        self._gates: dict[int | None, _Gate] = {}
        self._sleep_ends: dict[int, float] = {}  # a sleep's engine call is out until then
        self._reserved: dict[int, float] = {}  # host GiB a level-1 sleep under way will take (its call is out)
        self._host: dict[int, float] = {}  # host GiB each level-1 sleeper holds (its call ended)
        self._controller: Controller | None = None

    def bind(self, controller: Controller) -> None:
        self._controller = controller

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("the world is not bound to a controller")
        return self._controller

    def place_always_on(self) -> list[str]:
        """Before the trace: every always-on deployment (and the system's) ready, placed in the
        file's order by the fit check; those that do not fit beside the others fail (their
        requests are refused). Returns the names of those."""
        refused = []
        for dep in list(self._deps.values()):
            if dep.state is State.PLANNED or (dep.mode is not Mode.ALWAYS_ON and dep.role is Role.MODEL):
                continue
            try:
                gpus = self.budget.check_fit(dep, self._as_read(), READING)
            except InsufficientMemory as exc:
                self._mark(dep.id, State.FAILED, f"does not fit beside the others: {exc}")
                refused.append(dep.name)
                continue
            self.engines[dep.id] = Engine(self._costs[dep.id], self.clock)
            self.ready_kind[dep.id] = "ready"
            self._mark(dep.id, State.READY, gpus=gpus)
        return refused

    # --- reads (Effects) ------------------------------------------------------------------

    def costs(self, dep_id: int) -> Costs:
        """What its engine costs (the edge reads its ``max_model_len``)."""
        return self._costs[dep_id]

    def deployment(self, dep_id: int) -> Deployment | None:
        return self._deps.get(dep_id)

    def deployments(self) -> list[Deployment]:
        return list(self._deps.values())

    def _as_read(self) -> list[Deployment]:
        """The deployments as the budget would read the box (``rules.as_read``: one whose sleep
        call is still out holds its whole footprint until the call ends), so no start takes it
        mid-sleep and the start it was freed for waits for it, as make-room's settle does."""
        return rules.as_read(self._deps.values(), self._sleep_ends.__contains__)

    def sleeping(self, dep_id: int) -> bool:
        """Is its sleep's engine call still out (its memory not yet freed)?"""
        return dep_id in self._sleep_ends

    def engine_idle(self, dep_id: int) -> bool:
        engine = self.engines.get(dep_id)
        return engine is None or engine.idle()

    def idle_level(self, dep: Deployment) -> int:
        return warmth.idle_level(dep, self.budget.per_gpu)

    def tiers(self, dep: Deployment) -> Mapping[str, float]:
        """Adaptive warmth's rest tiers (``DeployerEffects.tiers``' rule), at this one's costs."""
        costs = self._costs[dep.id]
        levels = rest_levels(dep, self.budget.per_gpu, self.host_available_gib(), self.box.host_reserve_gib)
        return tier_costs(levels, lambda level: costs.back_s(tiers.asleep(level)), costs.back_s(tiers.STOPPED))

    def sleep_s(self, dep: Deployment) -> float:
        """Its sleep's cost (``DeployerEffects.sleep_s``' rule, known here rather than measured)."""
        return self._costs[dep.id].sleep_s if self.idle_level(dep) else 0.0

    def host_available_gib(self) -> float:
        """The host memory available (``Budget.host_available_gib``, ``MemAvailable``): the box's
        less what the level-1 sleepers whose call ended hold; not yet those under way."""
        return self.box.host_gib - sum(self._host.values())

    # --- actions (Effects): each runs as its own event, as the real ones run as tasks ------

    def admit(self, dep_id: int, *, text: str) -> None:
        self.clock.call_later(0, lambda: self._admit(dep_id))

    def stop(self, dep_id: int, *, text: str, for_dep: int | None) -> None:
        self.clock.call_later(0, lambda: self._stop(dep_id, for_dep))

    def sleep(self, dep_id: int, *, text: str, for_dep: int | None, level: int | None = None) -> None:
        self.clock.call_later(0, lambda: self._sleep(dep_id, for_dep, level))

    def prewarm(self, dep_id: int, *, text: str) -> None:
        self.clock.call_later(0, lambda: self._prewarm(dep_id))

    def settle(self, dep_id: int, within_s: float) -> None:
        deadline = self.clock.now + within_s
        self.clock.call_later(0, lambda: self._settle(dep_id, deadline))

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        pass  # the replay's record is its tallies

    def counters_changed(self, dep_id: int) -> None:
        pass

    def idle_gap(self, dep_id: int, gap_s: float) -> None:
        pass  # learned by the controller itself (Record.rhythm); nothing is kept in a file

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.clock.call_later(delay, callback)

    # --- the deployer -----------------------------------------------------------------------

    def _mark(self, dep_id: int, state: State, reason: str | None = None, gpus: tuple[int, ...] | None = None,
              extra: Mapping[str, Any] | None = None) -> Deployment:
        """A transition as the real registry's ``mark`` makes it (``rules.marked``), booked and
        told (the bus)."""
        old = self._deps[dep_id]
        new = self._deps[dep_id] = old.replace(**rules.marked(old, state, reason, None, gpus, extra))
        self._hold(new)
        if self._controller is not None:
            self._controller.on_deployment(dep_id, new, old)
        return new

    def _hold(self, dep: Deployment) -> None:
        if dep.state is State.ASLEEP and dep.id not in self._sleep_ends:
            gib = placement.asleep_held(dep, self.box.asleep_residue_gib, self.pools, self.budget.per_gpu)
        else:
            gib = dep.footprint_gib if dep.state in HOLDING else 0.0
        held = placement.holdings(gib, dep.gpu_count, dep.gpus, self.pools, self.budget.per_gpu) if gib else {}
        self.ledger.hold(dep.name, held)

    def _admit(self, dep_id: int) -> None:
        """``Deployer.admit_start`` and the effect's report (``DeployerEffects._admit``)."""
        ctl = self.controller
        try:
            started = self._admit_start(dep_id, lambda: ctl.wanted(dep_id))
        except InsufficientMemory as exc:
            ctl.on_refused(dep_id, exc)
        except DeployerError as exc:
            ctl.on_start_error(dep_id, str(exc))
        else:
            ctl.on_admitted(dep_id, started)

    def _prewarm(self, dep_id: int) -> None:
        """``Deployer.admit_start`` as the pre-warm calls it (``prewarm_wanted`` asked, the fit
        check, no make-room), and the effect's report."""
        ctl = self.controller
        try:
            started = self._admit_start(dep_id, lambda: ctl.prewarm_wanted(dep_id))
        except (InsufficientMemory, DeployerError):
            started = False  # only memory free now, or a state that cannot start: it does nothing
        if started:
            self.tallies[self._deps[dep_id].name].prewarms += 1
        ctl.on_prewarmed(dep_id, started)

    def _admit_start(self, dep_id: int, wanted: Callable[[], bool]) -> bool:
        """``Deployer.admit_start``'s step (``rules.admit``, the fit check on the box as booked),
        then the start; whether it started. Raises DeployerError or InsufficientMemory."""
        dep = self._deps.get(dep_id)
        if dep is None:
            raise DeployerError(f"deployment {dep_id} does not exist")
        gpus = rules.admit(dep, False, wanted, lambda: self.controller.held_for_others(dep_id),
                           lambda d, held: self.budget.check_fit(d, self._as_read(), READING, held))
        if gpus is not None:
            self._start(dep, gpus)
        return gpus is not None

    def _start(self, dep: Deployment, gpus: tuple[int, ...]) -> None:
        waking = dep.state is State.ASLEEP
        costs = self._costs[dep.id]
        if waking:
            self.tallies[dep.name].wakes += 1
            took = costs.back_s(tiers.asleep(dep.sleep_level or tiers.LEVELS[0]))
        else:
            self.tallies[dep.name].cold_starts += 1
            took = costs.back_s(tiers.STOPPED)
        dep = self._mark(dep.id, State.STARTING, gpus=gpus)
        keys = rules.gate_keys(dep.gpus, self.budget.per_gpu)
        self._through_gates(keys, lambda release: self._run_start(dep.id, took, waking, release))

    def _through_gates(self, keys: Sequence[int | None], then: Callable[[Callable[[], None]], None]) -> None:
        """The start-up gates of ``keys``, taken one after the other in order (asyncio's locks:
        first come, first served), then ``then(release)``."""
        def take(i: int) -> None:
            if i == len(keys):
                then(lambda: self._release(keys))
                return
            gate = self._gates.setdefault(keys[i], _Gate())
            if gate.held:
                gate.waiters.append(lambda: take(i + 1))
            else:
                gate.held = True
                take(i + 1)
        take(0)

    def _release(self, keys: Sequence[int | None]) -> None:
        for key in keys:
            gate = self._gates[key]
            if gate.waiters:  # handed on: its next holder runs as the lock's waiter would, later
                self.clock.call_later(0, gate.waiters.popleft())
            else:
                gate.held = False

    def _run_start(self, dep_id: int, took: float, waking: bool, release: Callable[[], None]) -> None:
        dep = self._deps.get(dep_id)
        if dep is None or dep.state is not State.STARTING:
            release()
            return
        now = self.clock.now
        begin = max(now, self._sleep_ends.get(dep_id, now))  # a wake waits for its sleep's own call to end
        self.clock.call_later(begin - now + took, lambda: self._started(dep_id, waking, release))

    def _started(self, dep_id: int, waking: bool, release: Callable[[], None]) -> None:
        dep = self._deps.get(dep_id)
        if dep is not None and dep.state is State.STARTING:
            self._host.pop(dep_id, None)  # awake: its weights are back on the GPUs
            if dep_id not in self.engines:
                self.engines[dep_id] = Engine(self._costs[dep_id], self.clock)
            self.ready_kind[dep_id] = "wake" if waking else "cold"
            self._mark(dep_id, State.READY)
        release()

    def _stop(self, dep_id: int, for_dep: int | None) -> None:
        """``Deployer.stop`` with the core's precheck, and the effect's report."""
        dep = self._deps.get(dep_id)
        if dep is None or not rules.may_stop(dep, self.controller.precheck(for_dep), False, dep_id in self.engines):
            self.controller.on_stopped(dep_id, False, for_dep)
            return
        self._mark(dep_id, State.STOPPING)
        self.clock.call_later(0, lambda: self._stopped(dep_id, for_dep))

    def _stopped(self, dep_id: int, for_dep: int | None) -> None:
        dep = self._deps.get(dep_id)
        if dep is not None and dep.state is State.STOPPING:
            self.tallies[dep.name].stops += 1
            self._reserved.pop(dep_id, None)
            self._host.pop(dep_id, None)
            self.engines.pop(dep_id, None)
            self._mark(dep_id, State.STOPPED)
        self.controller.on_stopped(dep_id, True, for_dep)

    def _sleep(self, dep_id: int, for_dep: int | None, level: int | None = None) -> None:
        """``Deployer.sleep`` (at ``level``, else its idle level; ``or_stop``) with the core's precheck as
        its precheck."""
        ctl = self.controller
        dep = self._deps.get(dep_id)
        per_gpu = self.budget.per_gpu
        try:
            want = rules.asked_level(dep, level, per_gpu) if dep is not None else 0
        except DeployerError:
            want = 0  # its engine cannot sleep so: the real effect logs it, and nothing happens
        if dep is None or not want or not rules.may_sleep(dep, dep_id in self.engines, False, ctl.precheck(for_dep)):
            ctl.on_stopped(dep_id, False, for_dep)
            return
        got = rules.sleep_level(dep, want, self.host_available_gib(),
                                (gib for other, gib in self._reserved.items() if other != dep_id),
                                self.box.host_reserve_gib, per_gpu)
        if got == 0:
            self._stop(dep_id, for_dep)  # the host reserve leaves no level it can sleep at
            return
        took = self._costs[dep_id].sleep_s
        self._sleep_ends[dep_id] = self.clock.now + took
        if tiers.asleep(got).host:  # a level 1: its weights go to host memory
            self._reserved[dep_id] = warmth.predicted_host_gib(dep)  # until its call ends
        self.tallies[dep.name].sleeps += 1
        self._mark(dep_id, State.ASLEEP, extra={"sleep_level": got})
        self.clock.call_later(took, lambda: self._slept(dep_id, for_dep))

    def _slept(self, dep_id: int, for_dep: int | None) -> None:
        self._sleep_ends.pop(dep_id, None)
        host = self._reserved.pop(dep_id, None)
        if host is not None:  # the call moved its weights to host memory: held until it wakes or stops
            self._host[dep_id] = host
        dep = self._deps.get(dep_id)
        if dep is not None and dep.state is State.ASLEEP:
            self._hold(dep)  # the call freed all but what it keeps
        self.controller.on_slept(dep_id)  # the deployer's Slept, published before the effect reports
        self.controller.on_stopped(dep_id, True, for_dep)

    def _settle(self, dep_id: int, deadline: float) -> None:
        """The real settle's loop: until the deployment (or the head that took its place) fits."""
        ctl = self.controller
        target = ctl.settle_target(dep_id)
        dep = self._deps.get(target)
        if dep is not None and self.clock.now < deadline:
            try:
                self.budget.check_fit(dep, self._as_read(), READING, ctl.held_for_others(target))
            except InsufficientMemory:
                self.clock.call_later(SETTLE_POLL_S, lambda: self._settle(dep_id, deadline))
                return
        ctl.on_settled(dep_id)
