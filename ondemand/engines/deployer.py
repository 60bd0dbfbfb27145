"""The deployer: the registry of every deployment (``registry.py``: one :class:`~.unit.Unit`
each, the one writer of their rows) and the operations on them: a start admitted, a stop, a
sleep, what is taken back after ondemand's restart, and the watchdog.

No lock orders the decisions: each one reads the state and changes it in memory with no await
in between, which on one event loop is atomic. That holds for the two that matter:

- ``stop(precheck=...)`` runs the precheck and marks ``stopping`` in one step, so handing out
  a slot (the controller, no await either) and approving a stop can never interleave ("never
  stop a busy model");
- ``admit_start`` reads the memory budget first (the one await), then checks the fit and marks
  ``starting`` in one step; the budget's reading counts every engine that was starting at the
  reading or is starting now by what it declared, so a reading that aged during the await is
  never optimistic.

The decisions themselves (may it start, approve a stop, which sleep level, how a mark changes
the row, the gates' order) are ``rules.py``'s, pure functions the replay's world calls too. The
fit check is the control side's (``control/budget.py``), given by ``app.py`` as the budget
(``memory.Memory``): the deployer reads it and checks it, in that step, and imports nothing of
``control/``.

``_gates`` are the start-up gates, one per GPU: engines that share a GPU start one at a time,
from create to ready, so two cold starts do not fight over memory that neither shows as used
yet (vLLM sizes its cache from the free memory it measures as it loads). Engines on other GPUs
start meanwhile; on a one-pool budget (nothing tells GPUs apart) there is one gate for all, and
an engine with no GPU passes none. They are the one lock held across slow work, on purpose;
nothing that must answer quickly waits for them (a stop cancels a start still waiting there).

Waking a vLLM engine from sleep mode goes through ``starting`` too: it takes memory back, may
fail, and its waiters wait like a start's. The engine calls of a sleep and a wake, and the wake
check, are the sleeper's (``sleeper.py``); what a sleeper still holds is read here, from the
budget's nvidia-smi readings and the backend (``memory.py``'s arithmetic).

After a restart of ondemand (a reboot, a removed container, a child process that died with the
old ondemand), an always-on deployment that was ready or starting and has lost its engine is
*owed a start* (issue 21, "After a reboot"): ``Unit.take_back`` marks it stopped with
``pending_mode`` always_on, the mark a switch to always on uses, and ``restart_lost`` admits
it, once the app is up, through ``admit_start`` (the fit check, then the start-up gates),
retrying a refusal. The mark is in the row, so a debt survives another restart; the LiteLLM
sync and the gateway treat it as a switch (the gateway entry, the requests wait) until ready.
A stop cancels the debt; one an administrator stopped was never owed.

Every call to an engine (readiness, the watchdog's probe, the sleep API, the wake check) goes
through the engine client (``client.py``), on the pools the gateway forwards on.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ..errors import BudgetError, DeployerError, InsufficientMemory, StateFileError
from ..events import Slept, StopCause
from ..http.pool import Upstreams
from ..model import HOLDING, Deployment, Mode, State
from ..state.store import Store
from ..tasks import TaskGroup
from . import rules, tiers, warmth
from .backends import Backend, BackendError, Engine
from .client import EngineClient
from .memory import Memory, apps_gib, residue_after_drop
from .recipes import Box
from .registry import Registry
from .rules import Precheck
from .sleeper import Sleeper
from .start import StartHooks
from .unit import Unit, owed_a_start

__all__ = ["Deployer", "StartFailed", "StartInterrupted"]

log = logging.getLogger("ondemand.engines.deployer")

# A refused start after ondemand's restart is tried again after this long, doubled each time up to the most.
RESTART_RETRY_S = 10.0
RESTART_RETRY_MAX_S = 300.0
# A sleep for make-room is measured this long after it (once the request it was for has its memory).
MEASURE_AFTER_MAKE_ROOM_S = 1.0


class StartFailed(Exception):
    """The engine did not become ready; the deployment is failed."""


class StartInterrupted(Exception):
    """The deployment was stopped or removed while it was starting."""

    def __init__(self, state: str):
        super().__init__(f"deployment was {state} while it was starting")
        self.state = state


class Deployer(Registry):
    start_hooks = StartHooks()  # the app's: the compile cache, the read-ahead, the start's phases
    budget: Memory

    def __init__(self, store: Store, backend: Backend, budget: Memory, *,
                 publish: Callable[[object], None] = lambda event: None,
                 start_timeout_s: float = 1800.0, stop_timeout_s: float = 30.0,
                 watch_interval_s: float = 5.0, watch_failures: int = 3, probe_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, box: Box | None = None,
                 restart_retry_s: float = RESTART_RETRY_S, wake_timeout_s: float = 300.0,
                 upstreams: Upstreams | None = None):
        """``budget``: the control side's (``control/budget.Budget``), given by ``app.py``.
        ``upstreams``: the engines' pools the gateway forwards on (the app's); without them,
        the deployer's own (closed with it)."""
        super().__init__(store, budget, box or Box(backend=backend.kind), publish,
                         lambda dep, booked: Unit(self, dep, booked))
        self.backend = backend
        self.budget = budget
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.watch_interval_s = watch_interval_s
        self.watch_failures = watch_failures
        self.clock = clock
        self.restart_retry_s = restart_retry_s
        self._own_pools = upstreams is None
        self.client = EngineClient(upstreams or Upstreams(), probe_timeout_s)
        self.sleeper = Sleeper(self.client, wake_timeout_s)
        self._gates: dict[int | None, asyncio.Lock] = {}  # per GPU index (None: the one pool)
        self.tasks = TaskGroup("deployer")

    @property
    def per_gpu(self) -> bool:
        return self.budget.per_gpu

    # --- life of the deployer -------------------------------------------------

    async def load(self) -> None:
        """Read the rows and take back what survived our restart."""
        try:
            await self.budget.box_sizes()  # the recipes' memory shares need each GPU's size
        except BudgetError as exc:
            log.warning("cannot read the GPUs' sizes yet (%s): running engines are taken back as they are", exc)
        await self._load_rows()
        for unit in self.units():
            await unit.take_back()
        self.tasks.spawn(self._watchdog(), "watchdog")

    async def close(self, stop_engines: bool) -> None:
        """Stop background work; with ``stop_engines`` also the engines (process backend)."""
        await self.tasks.close()
        if stop_engines:
            engines = [(unit, unit.engine) for unit in self.units() if unit.engine is not None]
            await asyncio.gather(*(self.backend.stop(e, self.stop_timeout_s) for _, e in engines),
                                 return_exceptions=True)
            for unit, _ in engines:  # the rows say what is true for the next start
                if unit.is_(*HOLDING):
                    with contextlib.suppress(Exception):
                        if owed_a_start(unit.dep):  # always on: the next ondemand starts it again
                            await self.owe_start(unit.id, reason="stopped at shutdown: started again when "
                                                 "ondemand starts", text="stopped at shutdown; ondemand's next "
                                                 "start starts it again", cause=StopCause.SHUTDOWN)
                        else:
                            await self.transition(unit.id, State.STOPPED, text="stopped at shutdown",
                                                  cause=StopCause.SHUTDOWN)
        for unit in self.units():  # a start left to the next ondemand (its row stays starting) ends here
            unit.end_start("interrupted")
            self._announce(unit)
        if self._own_pools:
            await self.client.upstreams.close()
        await self.backend.close()

    async def remove(self, dep_id: int, *, actor: str = "admin", user: str | None = None) -> None:
        unit = self._unit_of(dep_id)
        dep = unit.dep
        unit.removing = True
        try:
            await self.stop(dep_id, actor=actor, user=user, text="stopped for removal")
            with contextlib.suppress(BackendError):
                await self.backend.remove(dep)
            await self._forget(unit, actor=actor, user=user)
        finally:
            unit.removing = False

    # --- start and wake -------------------------------------------------------

    async def admit_start(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                          text: str | None = None, audit: str | None = None,
                          held_for_others: Callable[[], Mapping[int, float]] | None = None,
                          wanted: Callable[[], bool] | None = None, reading: object | None = None) -> bool:
        """The fit check and the move to ``starting``; the engine then starts in the
        background behind the start-up gate. Returns False when it is starting or
        ready already (nothing to do: wait for it). Raises InsufficientMemory,
        BudgetError (the budget could not be read: nothing was tried), or
        DeployerError for a state that cannot start. The fit check picks the GPUs,
        kept in ``gpus`` while the engine holds them. ``held_for_others``: GiB per GPU
        the wait queue keeps for its head, asked in the same step as the fit check.
        ``wanted``: asked in that step too; False means nobody needs the start any more,
        and nothing starts. ``reading``: make-room's own reading for this start, taken after
        the request and the attempt began (the only one a fit check may reuse); else the GPUs
        are read now."""
        unit = self._unit_of(dep_id)
        if not rules.may_start(unit.dep, unit.removing):
            return False
        if reading is None:
            reading = await self.budget.read(self.all())
        await self._read_missing()  # the GPUs' sizes are known now (nothing to read, mostly)
        # From here to the mark, no await: the check and the move are one step.
        self._book_missing()
        unit = self._unit_of(dep_id)
        gpus = rules.admit(unit.dep, unit.removing, wanted, held_for_others,
                           lambda dep, held: self.budget.check_fit(dep, self.as_read(), reading, held))
        if gpus is None:
            return False
        waking = unit.dep.state is State.ASLEEP
        old, new = self.mark(dep_id, State.STARTING, gpus=gpus)
        unit.begin(waking)
        await self.persist(old, new, actor=actor, user=user, audit=audit,
                           text=text or ("waking" if waking else "starting"))
        return True

    async def wait_started(self, dep_id: int) -> None:
        """Wait until a start ends: returns when ready; raises StartFailed or StartInterrupted."""
        while True:
            unit = self.unit(dep_id)
            if unit is None:
                raise StartInterrupted("removed")
            dep = unit.dep
            if dep.state is State.READY:
                return
            if dep.state is State.FAILED:
                raise StartFailed(dep.state_reason or "start failed")
            if dep.state is not State.STARTING:
                raise StartInterrupted(dep.state.value)
            await unit.changed()

    async def restart(self, dep_id: int, **kw: Any) -> None:
        """Start a stopped, failed or planned deployment (or wake an asleep one) and wait until it is ready."""
        await self.admit_start(dep_id, **kw)
        await self.wait_started(dep_id)

    @contextlib.asynccontextmanager
    async def gate(self, unit: Unit) -> AsyncIterator[None]:
        """The gates of the GPUs this start was given, taken in index order (two starts that
        share GPUs never hold one each and wait for the other's)."""
        # Removed meanwhile: its start ends at once, through no gate.
        keys = [] if unit.removed else rules.gate_keys(unit.dep.gpus, self.budget.per_gpu)
        async with contextlib.AsyncExitStack() as held:
            for key in keys:
                await held.enter_async_context(self._gates.setdefault(key, asyncio.Lock()))
            yield

    # --- starts owed after ondemand's restart ----------------------------------

    def restart_lost(self, held_for_others: Callable[[int], Mapping[int, float]] | None = None
                     ) -> list[asyncio.Task[None]]:
        """Start again, in the background, the always-on deployments ``Unit.take_back`` found
        without their engine; returns the tasks. Called by the app once everything that hears
        of a start listens (the controller, the LiteLLM sync); ``held_for_others``: the wait
        queue's holds, kept out of the fit check as for any start."""
        owed = sorted((unit for unit in self.units() if unit.owed), key=lambda unit: unit.id)
        return [self.tasks.spawn(self._pay_start(unit, held_for_others), f"restart {unit.dep.name}")
                for unit in owed]

    def _owes_start(self, unit: Unit) -> bool:
        """Still owed and still wanted always on (a switch to on demand since cancels it)."""
        return unit.owed and not unit.removed and Mode.ALWAYS_ON in (unit.dep.mode, unit.dep.pending_mode)

    async def _pay_start(self, unit: Unit, held_for_others: Callable[[int], Mapping[int, float]] | None) -> None:
        """Admit the owed start, as any start (the fit check, the start-up gates). A refusal
        (too little memory, the budget unreadable) is noted in the reason and tried again,
        10 s, then twice as long each time, up to 5 min: memory may free up, nvidia-smi come
        back. Ends once admitted, or once the debt is settled otherwise: an administrator's
        start or stop, a switch to on demand, a removal. (A request starts nothing meanwhile:
        the pending mode makes it wait for this start.)"""
        delay, dep_id = self.restart_retry_s, unit.id
        held = (lambda: held_for_others(dep_id)) if held_for_others is not None else None
        while self._owes_start(unit):
            try:
                # wanted: asked in the step that marks starting, so a stop during the fit
                # check's reading is never followed by this start.
                await self.admit_start(dep_id, actor="ondemand", text="starting again after ondemand restarted",
                                       held_for_others=held, wanted=lambda: self._owes_start(unit))
                break
            except (InsufficientMemory, BudgetError) as exc:
                if not self._owes_start(unit):
                    break
                reason = (f"engine gone after ondemand restarted; its start was refused ({exc}): "
                          f"tried again in {delay:g} s")
                log.warning("%s: %s", unit.dep.name, reason)
                old, new = self.amend(dep_id, state_reason=reason)
                await self.persist(old, new, actor="ondemand", text=reason)
            except DeployerError:
                break  # removed, or being stopped: nothing is owed any more
            await asyncio.sleep(delay)
            delay = min(delay * 2, max(RESTART_RETRY_MAX_S, self.restart_retry_s))
        unit.owed = False

    # --- the watchdog -----------------------------------------------------------

    async def _watchdog(self) -> None:
        """Every ``watch_interval_s``, each ready engine is asked ``/health`` (``Unit.probe``),
        all together, so one that hangs does not delay the others' checks."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            await asyncio.gather(*(unit.probe() for unit in self.units()
                                   if unit.engine is not None and unit.dep.state is State.READY))

    # --- stop and sleep -------------------------------------------------------

    def _approve_stop(self, dep_id: int, precheck: Precheck | None
                      ) -> tuple[Unit, Deployment, Deployment] | None:
        """The stop decision, with no await: the precheck and the mark are one step."""
        unit = self.unit(dep_id)
        if unit is None or not rules.may_stop(unit.dep, precheck, unit.owed, unit.engine is not None):
            return None
        return (unit, *self.mark(dep_id, State.STOPPING))

    async def stop(self, dep_id: int, precheck: Precheck | None = None, *,
                   actor: str = "admin", user: str | None = None, text: str | None = None,
                   audit: str | None = None, cause: StopCause = StopCause.ADMIN) -> bool:
        """Stop the engine. With ``precheck``, only if it approves. Returns whether
        this call stopped it (False: refused, or nothing to stop). The approved stop
        is the one recorded (and audited when asked), with its ``cause``."""
        approved = self._approve_stop(dep_id, precheck)
        if approved is None:
            return False
        unit, old, new = approved
        await self.persist(old, new, actor=actor, user=user, text=text, audit=audit, cause=cause)
        await unit.halt()
        if unit.is_(State.STOPPING):
            await self.transition(dep_id, State.STOPPED, actor=actor, user=user)
        return True

    async def sleep(self, dep_id: int, level: int | None = None, precheck: Precheck | None = None, *,
                    actor: str = "admin", user: str | None = None, text: str | None = None,
                    audit: str | None = None, cause: StopCause = StopCause.ADMIN, or_stop: bool = False,
                    on_marked: Callable[[], None] | None = None) -> int | None:
        """Put the engine to sleep at ``level`` (None: its ``idle_action``'s, else 1). A level-1
        sleep that would leave less than ``budget.host_reserve_gib`` of host memory sleeps at
        level 2, or, with ``or_stop`` (the reaper, make-room), is a stop. Returns the level it
        sleeps at, 0 when it was stopped instead, None when ``precheck`` or its state refused.
        Raises DeployerError for an engine that cannot sleep so (an administrator's ask).

        The precheck and the mark to ``asleep`` are one step, as for a stop: from then on no
        slot is given (a request waits for the wake), and a wake waits for this sleep's engine
        call to end. A failed sleep call stops the engine (its state is not known). ``on_marked``
        is called in the step of the mark (an administrator's drain ends there: its waiters wake it).
        """
        unit = self._unit_of(dep_id)
        dep = unit.dep
        want = rules.asked_level(dep, level, self.budget.per_gpu)
        # From here to the mark, no await: the checks and the move are one step.
        engine = unit.engine
        if not rules.may_sleep(dep, engine is not None, unit.removing, precheck) or engine is None:
            if precheck is None:
                raise DeployerError(f"{dep.name} is {dep.state}, not ready")
            return None
        # The level-1 sleeps under way have not moved their weights yet: reserved.
        got = rules.sleep_level(dep, want, self.budget.host_available_gib(),
                                (other.host_reserved or 0.0 for other in self.units() if other is not unit),
                                self.budget.host_reserve_gib, self.budget.per_gpu)
        text = text or "put to sleep by an administrator"
        reserve = f"host memory: a level-1 sleep would leave less than {self.budget.host_reserve_gib:g} GiB available"
        if got == 0:
            if not or_stop:
                raise DeployerError(f"{dep.name} cannot sleep now ({reserve}, and it cannot sleep at level 2): "
                                    "stop it instead")
            stopped = await self.stop(dep_id, precheck, actor=actor, user=user, audit=audit, cause=cause,
                                      text=f"{text}; stopped instead ({reserve})")
            return 0 if stopped else None
        why = f" (level {got}: {reserve})" if got != want else ""
        marked = self.mark(dep_id, State.ASLEEP, extra={"sleep_level": got})
        if tiers.asleep(got).host:  # a level 1: its weights go to host memory
            unit.host_reserved = warmth.predicted_host_gib(dep)  # until its call ends
        if on_marked is not None:
            on_marked()
        persist = {"actor": actor, "user": user, "audit": audit, "text": f"{text} (sleep level {got}){why}"}
        return await self._asleep(unit, engine, got, marked, cause, persist)

    async def _asleep(self, unit: Unit, engine: Engine, level: int, marked: tuple[Deployment, Deployment],
                      cause: StopCause, persist: dict[str, Any]) -> int | None:
        """The sleep marked: its call, then a stop if it failed, else what it still holds measured."""
        dep = marked[0]
        began = self.clock()
        failure, before = await self._sleep_call(unit, engine, level, marked, persist)
        if failure is not None:
            if unit.is_(State.ASLEEP):  # not woken or stopped meanwhile
                await self.stop(unit.id, actor=persist["actor"], user=persist["user"], cause=cause,
                                text=f"the engine's sleep failed ({failure}): stopped")
                return 0
            return None
        # It slept, even if a wake came meanwhile.
        self.publish(Slept(unit.id, dep.name, level, cause, self.clock() - began))
        if not unit.is_(State.ASLEEP):
            return level  # a wake or a stop came during the call: it carries on from here
        if cause is StopCause.MAKE_ROOM:
            # A request waits for what this sleep frees: its settle and admit read the GPUs now,
            # and a measurement (nvidia-smi, /proc) at the same time only slows them down.
            self.tasks.spawn(self._measure_later(unit, engine, level, before), f"measure {dep.name}")
        else:
            await self._measure_sleeper(unit, engine, level, before)
        return level

    def check_sleep(self, dep_id: int, level: int | None) -> None:
        """Raises DeployerError when ``sleep(dep_id, level)`` by an administrator would be refused
        now (not ready, no sleep API, a level its engine cannot take): asked before a drain."""
        unit = self._unit_of(dep_id)
        dep = unit.dep
        rules.asked_level(dep, level, self.budget.per_gpu)
        if not rules.may_sleep(dep, unit.engine is not None, unit.removing, None):
            raise DeployerError(f"{dep.name} is {dep.state}, not ready")

    async def _sleep_call(self, unit: Unit, engine: Engine, level: int, marked: tuple[Deployment, Deployment],
                          persist: dict[str, Any]) -> tuple[str | None, float | None]:
        """Write the mark to asleep, then call the engine's sleep; (why it failed or None, the
        host memory before it, for a level 1). A wake meanwhile waits for the call to end."""
        dep = marked[0]
        async with unit.sleep_call_out():
            # Marked in memory: written before anything else is awaited, so a stop that comes
            # during the measurement below is written after it (the row never says asleep
            # for a stopped deployment).
            await self.persist(*marked, cause=None, detail={"level": level}, **persist)
            before = await self._host_gib(engine) if tiers.asleep(level).host else None
            gpus_before = await self._gpus_used(dep)
            failure = await self.sleeper.sleep(engine, dep, level)
            if failure is not None:
                return failure, before
            gpus_after = await self._gpus_used(dep) if gpus_before is not None else None
            if gpus_before is not None and gpus_after is not None:
                unit.gpu_drop = (gpus_before, gpus_after)
            return None, before

    # --- what a sleeper still holds (read from the budget and the backend) ----------

    async def _measure_later(self, unit: Unit, engine: Engine, level: int, before: float | None) -> None:
        await asyncio.sleep(MEASURE_AFTER_MAKE_ROOM_S)
        await self._measure_sleeper(unit, engine, level, before)

    async def _gpus_used(self, dep: Deployment) -> tuple[float, ...] | None:
        """Each GPU's used memory now, for the drop across a sleep call: only for a deployment
        nvidia-smi never listed a process of (measured, its residue is read per process)."""
        if self.budget.source != "nvidia-smi" or dep.measured_gib is not None:
            return None
        try:
            return tuple(g.used for g in await self.budget.measure() or ())
        except BudgetError as exc:
            log.debug("cannot read the GPUs across the sleep of %s: %s", dep.name, exc)
            return None

    async def _host_gib(self, engine: Engine) -> float | None:
        try:
            return await self.backend.host_memory(engine)
        except Exception as exc:  # a measurement is a courtesy: never fail a sleep over one
            log.debug("cannot measure the host memory of %s: %s", engine.name, exc)
            return None

    async def _measure_sleeper(self, unit: Unit, engine: Engine, level: int, before: float | None) -> None:
        """What the sleeper still holds: on its GPUs (nvidia-smi, its processes; none listed
        once it was measured awake means none), and in host memory (its process tree's, or its
        container's). A level-1 sleep's growth of host memory is the next one's prediction."""
        residue: float | None = None
        if self.budget.source == "nvidia-smi":
            with contextlib.suppress(BudgetError):
                apps = await self.budget.compute_apps()
                pids = await self.backend.pids(engine)
                residue = apps_gib(apps, pids) if pids else None
                if residue is None and pids and not unit.removed and unit.dep.measured_gib is not None:
                    residue = 0.0  # its processes were listed awake: asleep they hold nothing
        drop, unit.gpu_drop = unit.gpu_drop, None
        if residue is None and drop is not None and not unit.removed:
            # No per-process rows (a container that cannot see the others' processes): what it
            # held before (measured, else booked) less what the sleep call freed on its GPUs.
            gpus = list(unit.dep.gpus) or list(range(len(drop[0])))
            residue = residue_after_drop(unit.dep.footprint_gib, gpus, *drop)
        host = await self._host_gib(engine)
        if not unit.is_(State.ASLEEP):
            return
        fields: dict[str, Any] = {"host_gib": None if host is None else round(host, 3)}
        if residue is not None:
            fields["asleep_gib"] = round(residue, 3)
        if tiers.asleep(level).host and host is not None and before is not None:
            fields["sleep_host_gib"] = round(max(0.0, host - before), 3)
        with contextlib.suppress(StateFileError, DeployerError):
            await self.update(unit.id, actor="ondemand", **fields)
