"""One deployment on this box: a :class:`Unit`, its row as last changed, its engine and the work
under way on it.

After llama-swap's ``internal/process`` (one ``Process`` per model, owned by its router): the
deployer (``registry.py``, ``deployer.py``) holds one unit per deployment, and a unit runs its
own lifecycle:

    take_back() ─┐                        ┌─▶ ready ──(exit, or probe() unanswered)──▶ failed
                 ├─▶ starting: begin() ───┤
    admitted ────┘   (the gates, then the └─▶ failed (exited, timed out, serves another name)
                      backend's start and readiness; a wake: its calls and check, else cold)
    asleep: sleep_call_out() while the sleep's call is out
    stopping: halt() (the start or wake under way ends, then the engine stops)

A unit decides nothing the registry has not marked and writes nothing itself: every change of
its deployment goes through its owner (``Owner.transition``, ``update``, ``owe_start``), which
changes the row in memory, writes it with its event (and audit) in one transaction, and
publishes it. Between two awaits a unit's fields and its deployment's state agree, so a
decision that reads them (the stop's precheck, the fit check) needs no lock.

What it holds (before issue 30, parallel dicts of the deployer keyed by the deployment's id):
its deployment (``dep``), its engine and that engine's exit (``engine``, ``exited``), the start
or wake under way (``start``: start.py, its ``task``) and whether it is past its start-up gates
(``gated``) or in a wake's engine calls (``waking``), its caches (``launched``, ``read_ahead``),
the sleep call under way (``sleeping``) with the host memory it reserves (``host_reserved``)
and each GPU's use across it (``gpu_drop``), whether a start is owed after ondemand's restart
(``owed``), being removed (``removing``) or gone (``removed``), the watchdog's misses in a row
(``misses``), the booking last read (``booked``), the futures of its next change and the start
events to publish before it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from ..events import StartResult, StopCause, Woken
from ..model import HOLDING, Booking, Deployment, Mode, State
from ..tasks import TaskGroup
from . import warmth
from .backends import Backend, BackendError, Engine
from .client import EngineClient
from .readahead import Outcome
from .recipes import FieldError, Launch
from .sleeper import Sleeper, WakeFailed
from .start import Start, StartHooks

log = logging.getLogger("ondemand.engines.unit")

# The booking read for a deployment (``recipes.booking``, in a thread), with what it was derived from.
Booked = tuple[tuple[Any, ...], Booking | None]


def ready_poll_s(elapsed: float) -> float:
    """How long to wait before asking a starting engine again whether it is ready. The
    waiting clients feel every poll interval in full, and a probe of a local engine that
    is not up yet costs next to nothing (a refused connection, or a 503): 20 ms for the
    first 2 s (a warm model, a wake), then 50 ms, so readiness is seen within about 25 ms
    on average (ondemand's benchmark measures it)."""
    return 0.02 if elapsed < 2.0 else 0.05


def owed_a_start(dep: Deployment) -> bool:
    """Whether a deployment whose engine is gone when ondemand starts is started again: always
    on (or switching to it) and ready or starting when the old ondemand ended, or marked owed
    by it (always on with ``pending_mode`` always_on: a debt not yet paid, or the process
    backend's shutdown). A row an administrator stopped is neither: it stays stopped."""
    always_on = Mode.ALWAYS_ON in (dep.mode, dep.pending_mode)
    marked = dep.mode is Mode.ALWAYS_ON and dep.pending_mode is Mode.ALWAYS_ON
    return (always_on and dep.state in (State.READY, State.STARTING)) or marked


def checks_name(dep: Deployment) -> bool:
    """Whether readiness asks that /v1/models list the served name: for every recipe, and
    for vLLM and SGLang rows (they answer 404 for another name). A llama.cpp or custom row
    without a model runs as given, as before recipes (llama.cpp serves any name)."""
    return dep.model is not None or dep.engine in ("vllm", "sglang")


class Owner(Protocol):
    """What a unit needs of the deployer that owns it: how engines run and are reached, the
    start-up gates, and the registry's writes (the only writer of deployment rows)."""
    backend: Backend
    client: EngineClient
    sleeper: Sleeper
    tasks: TaskGroup
    start_hooks: StartHooks
    clock: Callable[[], float]
    publish: Callable[[object], None]
    start_timeout_s: float
    stop_timeout_s: float
    watch_failures: int

    @property
    def per_gpu(self) -> bool: ...
    def launch(self, dep: Deployment, *, secrets: bool = False) -> Launch: ...
    def gate(self, unit: Unit) -> AbstractAsyncContextManager[None]: ...
    def amend(self, dep_id: int, **changes: Any) -> tuple[Deployment, Deployment]: ...
    async def transition(self, dep_id: int, state: State, *, reason: str | None = None,
                         log_tail: str | None = None, text: str | None = None, actor: str = "deployer",
                         cause: StopCause | None = None, extra: Mapping[str, Any] | None = None) -> None: ...
    async def owe_start(self, dep_id: int, *, reason: str, text: str, cause: StopCause | None = None) -> None: ...
    async def update(self, dep_id: int, *, actor: str = "admin", text: str | None = None,
                     **fields: Any) -> Deployment: ...
    async def note(self, dep_id: int, text: str, detail: dict[str, Any], *, audit: str) -> None: ...


class Unit:
    """One deployment and its engine; see the module's docstring."""

    def __init__(self, owner: Owner, dep: Deployment, booked: Booked | None = None):
        self.owner = owner
        self.dep = dep
        self.booked = booked
        self.engine: Engine | None = None
        self.exited: asyncio.Future[int | None] | None = None  # the exit of ``engine``, when it is attached
        self.start: Start | None = None  # the start or the wake under way
        self.task: asyncio.Task[None] | None = None  # its task
        self.launched: Start | None = None  # its last cold start past its gates: its compile cache's state
        self.read_ahead: Outcome | None = None  # the last read of its weights ahead, a start's or a pre-warm's
        self.gated = False  # a start past its gates: busy with the backend (a stop waits for it)
        self.waking = False  # a wake's engine calls are out: a stop may cancel them
        self.sleep_call: asyncio.Future[None] | None = None  # a sleep's engine call is out: done when it ends
        self.host_reserved: float | None = None  # host memory its level-1 sleep under way will take (predicted)
        # Each GPU's used memory before and after its sleep call, for a sleeper nvidia-smi lists no
        # process of (the drop across the call is what the sleep freed).
        self.gpu_drop: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self.owed = False  # owed a start after ondemand's restart, not yet admitted
        self.removing = False  # stopped for removal: nothing starts it again
        self.removed = False  # no longer in the registry: its tasks end
        self.misses = 0  # the watchdog's checks in a row that its engine did not answer
        self._changes: list[asyncio.Future[None]] = []
        self._announced: list[object] = []  # its start's events, published before the next change

    @property
    def id(self) -> int:
        return self.dep.id

    @property
    def sleeping(self) -> bool:
        """A sleep's engine call is out (a wake waits for it to end)."""
        return self.sleep_call is not None

    def is_(self, *states: State) -> bool:
        """Still in the registry, and in one of ``states``."""
        return not self.removed and self.dep.state in states

    # --- its changes ----------------------------------------------------------------

    def changed(self) -> asyncio.Future[None]:
        """A future resolved at the next change or removal of the deployment."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changes.append(fut)
        return fut

    @property
    def listeners(self) -> int:
        """How many futures wait for its next change."""
        return len(self._changes)

    def settle(self) -> None:
        """It changed (or is removed): the futures waiting for that are resolved."""
        changes, self._changes = self._changes, []
        for fut in changes:
            if not fut.done():
                fut.set_result(None)

    def announced(self) -> list[object]:
        """Its start events not published yet: the registry publishes them before its next change."""
        events, self._announced = self._announced, []
        return events

    # --- its start ------------------------------------------------------------------

    def _began(self, start: Start) -> None:
        self.start = start
        self._announced.append(start.began_event())

    def end_start(self, result: StartResult, at: float | None = None) -> None:
        """The start under way (if any) ends with ``result`` (``at``: the wall clock at its end)."""
        start, self.start = self.start, None
        if start is not None:
            self._announced.append(start.end(result, now=self.owner.clock(), at=at))

    # --- its engine -----------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """Hold ``engine`` and watch for its exit."""
        self.engine = engine
        exited: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self.exited = exited
        self.owner.tasks.spawn(self._watch_exit(engine, exited), f"exit {engine.name}")

    async def _watch_exit(self, engine: Engine, exited: asyncio.Future[int | None]) -> None:
        owner = self.owner
        try:
            code = await owner.backend.wait_exit(engine)
        except BackendError as exc:
            log.warning("lost track of %s: %s", engine.name, exc)
            code = None
        if not exited.done():
            exited.set_result(code)
        if self.engine is engine:
            self.engine = None
        if self.is_(State.READY, State.ASLEEP):
            # Watchdog: an engine that exits while serving is failed, not stopped.
            await owner.transition(self.id, State.FAILED, reason=f"engine exited with code {code}",
                                   log_tail=await self.tail(engine), actor="watchdog", cause=StopCause.FAILED)

    async def tail(self, engine: Engine | None) -> str:
        try:
            return await self.owner.backend.log_tail(engine, self.dep)
        except Exception as exc:  # the tail is a courtesy; never fail a transition over it
            return f"(log tail unavailable: {exc})"

    async def stop_engine(self, engine: Engine, why: str = "") -> None:
        """Stop the engine (SIGTERM, a kill after ``stop_timeout_s``) and wait for its exit to be
        seen, so that what it held is free when this returns."""
        owner = self.owner
        try:
            await owner.backend.stop(engine, owner.stop_timeout_s)
        except BackendError as exc:
            log.error("stopping %s%s: %s", self.dep.name, f" {why}" if why else "", exc)
        exited = self.exited
        if exited is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), owner.stop_timeout_s + 5)

    async def probe(self) -> None:
        """The watchdog's check of a ready engine: one that stops answering ``/health``
        (``watch_failures`` checks in a row) becomes failed, and is killed at once: it no longer
        answers, so a SIGTERM would go unheard (a hung or SIGSTOPped engine) and its in-flight
        requests would hang through the whole stop timeout."""
        owner, engine = self.owner, self.engine
        if engine is None:
            return
        if await owner.client.answers(engine, "/health"):
            self.misses = 0
            return
        self.misses += 1
        if self.misses < owner.watch_failures or not self.is_(State.READY):
            return
        self.misses = 0
        reason = f"engine stopped answering /health ({owner.watch_failures} checks): killed"
        log.error("%s: its engine stopped answering /health (%d checks in a row): killing it now; "
                  "its in-flight requests end with it", self.dep.name, owner.watch_failures)
        await owner.transition(self.id, State.FAILED, actor="watchdog", reason=reason,
                               log_tail=await self.tail(engine), cause=StopCause.FAILED)
        await owner.backend.stop(engine, 0)  # no grace: it cannot act on a SIGTERM

    async def halt(self) -> None:
        """The engine's half of a stop the registry marked: the start or wake under way ends,
        then the engine stops."""
        start = self.task
        if start is not None and not start.done():
            if self.gated and not self.waking:
                # Let the start notice the stop; never cancel a backend call half-way.
                await asyncio.shield(start)
            else:
                # At the gate it holds nothing yet; a wake's engine calls are only HTTP to an
                # engine about to be stopped (a hung wake would hold the stop up to wake_timeout_s).
                start.cancel("stopped while waiting at the start-up gate or waking")
                with contextlib.suppress(asyncio.CancelledError):
                    await start
        if self.engine is not None:
            await self.stop_engine(self.engine)

    # --- after ondemand's restart -----------------------------------------------------

    async def take_back(self) -> None:
        """At ondemand's start: adopt the engine that outlived the old ondemand (a start or
        wake under way goes on), stop one that should not run, or settle the row: stopped, or
        owed a start (``owed_a_start``)."""
        owner, dep = self.owner, self.dep
        try:
            how: Launch | None = owner.launch(dep)
        except (FieldError, OSError, ValueError):
            how = None  # cannot be derived now: any engine of this deployment's is its own
        try:
            engine = await owner.backend.adopt(dep, how, compare=how is not None)
        except BackendError as exc:
            log.warning("cannot look for the engine of %s: %s", dep.name, exc)
            engine = None
        if engine is not None and dep.state in (State.READY, State.ASLEEP, State.STARTING):
            log.info("adopted the running engine of %s (%s)", dep.name, engine.base_url)
            self.attach(engine)
            if dep.state is State.STARTING:  # its start goes on here: announced now (no change goes with it)
                self.start = Start.taken_back_from(dep, now=owner.clock())
                owner.publish(self.start.began_event())
                # Ended mid-wake, the engine may still sleep (its /health answers anyway): woken again.
                wake = dep.sleep_level is not None
                self.task = owner.tasks.spawn(self._wake() if wake else self._wait_ready(engine),
                                              f"{'wake' if wake else 'start'} {dep.name}")
        elif engine is not None:
            await owner.backend.stop(engine, owner.stop_timeout_s)
            if dep.state is State.STOPPING:
                await owner.transition(self.id, State.STOPPED, text="stopped after ondemand restarted")
        elif owed_a_start(dep):
            await owner.owe_start(self.id, reason="engine gone after ondemand restarted: it is started again",
                                  text="engine gone after ondemand restarted; it will be started again")
        elif dep.state in HOLDING:
            await owner.transition(self.id, State.STOPPED, reason="engine gone after ondemand restarted",
                                   text="engine gone after ondemand restarted")
        await self._cut_short_switch()

    async def _cut_short_switch(self) -> None:
        now = self.dep
        if not self.owed and now.pending_mode is not None and now.state is not State.STARTING:
            # A switch whose start was never admitted (ondemand died between its two writes):
            # nothing would start it, and requests would wait for it. Cleared, as a refused start.
            log.warning("%s: the switch to %s was cut short by a restart before its start: it stays %s",
                        now.name, now.pending_mode, now.mode)
            await self.owner.update(self.id, actor="deployer", pending_mode=None,
                                    text=f"switch to {now.pending_mode} cut short by a restart; still {now.mode}")

    # --- start and wake ----------------------------------------------------------------

    def begin(self, waking: bool) -> None:
        """Marked starting by the registry: the start (or the wake) begins (announced with the
        mark's change), and runs in the background, behind the start-up gates."""
        self._began(Start(self.dep, "wake" if waking else "cold", began=self.owner.clock()))
        coro = self._wake() if waking else self._start()
        self.task = self.owner.tasks.spawn(coro, f"start {self.dep.name}")

    @contextlib.asynccontextmanager
    async def _through_gate(self) -> AsyncIterator[None]:
        self.gated = True
        try:
            yield
        finally:
            self.gated = False

    async def _start(self) -> None:
        async with self.owner.gate(self), self._through_gate():
            await self._cold_start()

    async def _cold_start(self) -> None:
        """Create the engine and wait until it is ready; the caller holds its gates."""
        owner, dep = self.owner, self.dep
        if not self.is_(State.STARTING):
            return  # stopped or removed while it waited at the gate
        try:
            how = owner.launch(dep, secrets=True)
        except (FieldError, OSError, ValueError) as exc:
            what = f"deployer.hf_token_file: {exc}" if not isinstance(exc, FieldError) else str(exc)
            await owner.transition(self.id, State.FAILED, reason=f"cannot make its command line: {what}")
            return
        start = self.launched = self.start
        assert start is not None, "marked starting: begun"
        owner.start_hooks.before(start, dep, how)
        try:
            engine = await owner.backend.start(dep, how)
        except Exception as exc:  # a BackendError, or a defect: the start failed, it is not stuck
            if not isinstance(exc, BackendError):
                log.exception("starting %s failed", dep.name)
            tail = await self.tail(None)
            await owner.transition(self.id, State.FAILED, reason=str(exc) or repr(exc), log_tail=tail)
            return
        self.attach(engine)
        owner.start_hooks.after(start, dep, engine)
        await self._wait_ready(engine)

    async def _wait_ready(self, engine: Engine) -> None:
        """Ask the engine until it is ready (``/health``, then ``/v1/models``), it exits or
        ``start_timeout_s`` passes (failed). A stop ends it; the stop stops the engine."""
        owner, dep = self.owner, self.dep
        began = owner.clock()
        deadline = began + owner.start_timeout_s
        exited = self.exited
        assert exited is not None, "attached"
        changed = self.changed()
        while True:
            if not self.is_(State.STARTING):
                return  # a stop took over; it stops the engine
            if exited.done():
                await owner.transition(self.id, State.FAILED,
                                       reason=f"engine exited with code {exited.result()} before it was ready",
                                       log_tail=await self.tail(engine))
                return
            if owner.clock() >= deadline:
                await owner.transition(self.id, State.FAILED,
                                       reason=f"engine did not answer /health within {owner.start_timeout_s:g} s",
                                       log_tail=await self.tail(engine))
                await owner.backend.stop(engine, owner.stop_timeout_s)
                return
            if await owner.client.answers(engine, "/health") and await self._serves(engine, dep):
                return
            if changed.done():
                changed = self.changed()  # one future at a time, however long the start
            waits: list[asyncio.Future[Any]] = [exited, changed]
            await asyncio.wait(waits, timeout=ready_poll_s(owner.clock() - began), return_when=asyncio.FIRST_COMPLETED)

    async def _serves(self, engine: Engine, dep: Deployment) -> bool:
        """Whether the engine's /v1/models answered: then ready if it lists the served name,
        else failed (requests for the name would get the engine's 404)."""
        owner = self.owner
        served = await owner.client.served_names(engine, checks_name(dep))
        if served is None:
            return False
        if not self.is_(State.STARTING):
            return True
        if dep.served_name in served or not checks_name(dep):
            await self._ready(engine, dep)
            return True
        names = ", ".join(served) or "no model"
        await owner.transition(
            self.id, State.FAILED, log_tail=await self.tail(engine),
            reason=f"the engine serves {names}, not {dep.served_name} (served_name): requests "
                   "for it would get the engine's 404; fix served_name or the engine's "
                   "--served-model-name/--alias")
        await owner.backend.stop(engine, owner.stop_timeout_s)
        return True

    async def _ready(self, engine: Engine, dep: Deployment) -> None:
        extra = {}
        if warmth.idle_level(dep, self.owner.per_gpu) > 0:
            # What every wake of this engine must answer again (torch_memory_saver #71).
            extra["wake_check"] = await self.owner.sleeper.record_check(engine, dep)
            if not self.is_(State.STARTING):
                return  # a stop took over; it stops the engine
        await self.owner.transition(self.id, State.READY, text="ready", extra=extra)

    async def _wake(self) -> None:
        """Wake an asleep engine (``starting`` since the admit), behind its gates: the engine
        calls of its level, then the wake check. A wake that fails, times out or answers
        otherwise than the check recorded stops the engine and starts it cold, audited
        ``ondemand_wake_failed``; only a failed cold start is a failed start (the backoff)."""
        owner = self.owner
        async with owner.gate(self), self._through_gate():
            if self.sleep_call is not None:
                await asyncio.shield(self.sleep_call)  # the sleep's own call ends first: a wake never overtakes it
            dep, engine = self.dep, self.engine
            if not self.is_(State.STARTING):
                return
            level = dep.sleep_level or 1
            if engine is None:
                await self._wake_failed(None, level, WakeFailed("failed", "no engine to wake"))
                return
            began = owner.clock()
            failure = await self._wake_calls(engine, dep, level)
            seconds = owner.clock() - began
            if not self.is_(State.STARTING):
                return  # a stop took over; it stops the engine
            owner.publish(Woken(self.id, dep.name, failure.result if failure else "ready", seconds))
            if failure is not None:
                await self._wake_failed(engine, level, failure)
                return
            await owner.transition(self.id, State.READY, text=f"woken from sleep level {level} in {seconds:.2f} s")

    async def _wake_calls(self, engine: Engine, dep: Deployment, level: int) -> WakeFailed | None:
        """The wake's engine calls and check, bounded by ``wake_timeout_s``; what failed, or None."""
        timeout = self.owner.sleeper.wake_timeout_s
        self.waking = True
        try:
            await asyncio.wait_for(self.owner.sleeper.wake(engine, dep, level), timeout)
        except asyncio.TimeoutError:
            return WakeFailed("failed", f"the engine did not wake within {timeout:g} s (deployer.wake_timeout_s)")
        except WakeFailed as exc:
            return exc
        finally:
            self.waking = False
        return None

    async def _wake_failed(self, engine: Engine | None, level: int, failure: WakeFailed) -> None:
        """Audit the failed wake, stop the engine and start it cold (its gates are held)."""
        text = f"wake from sleep level {level} failed ({failure}): stopped and started cold"
        log.warning("%s: %s", self.dep.name, text)
        detail = {"reason": str(failure), "result": failure.result, "level": level}
        await self.owner.note(self.id, text, detail, audit="ondemand_wake_failed")
        if engine is not None:
            await self.stop_engine(engine, "after its failed wake")
        if not self.is_(State.STARTING):
            return
        # A cold start from here, stored and published (starting to starting, without the sleep
        # level), its wake ended first: the start history times it from here, not from the
        # wake's beginning, and a restart of ondemand during it takes back a cold start.
        self.end_start("mismatch" if failure.result == "mismatch" else "failed")
        self._began(Start(self.dep, "cold", began=self.owner.clock()))
        await self.owner.transition(self.id, State.STARTING, text=f"starting cold after the failed wake from "
                                    f"sleep level {level}",
                                    extra={"sleep_level": None, "host_gib": None, "wake_check": None})
        await self._cold_start()

    # --- sleep ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def sleep_call_out(self) -> AsyncIterator[None]:
        """While its sleep's engine call is out (``sleeping``): a wake waits for it to end. At
        its end the host memory reserved for it is no longer (the call moved the weights)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleep_call = done
        try:
            yield
        finally:
            self.sleep_call = None
            self.host_reserved = None
            done.set_result(None)
