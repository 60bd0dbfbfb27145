"""The deployer: owner of every deployment's state and of its engine.

States (``model.State``): planned, starting, ready, asleep, stopping,
stopped, failed, and removal. Only the deployer changes a deployment. Each
change replaces the frozen ``Deployment`` in memory at once (readers on the
event loop see it without an await), then writes the row, its event and any
audit row in one transaction, then publishes ``DeploymentChanged`` on the
bus (the controller decides, the app publishes the view, the LiteLLM sync
is triggered).

No lock orders the decisions: each one reads the state and changes it in
memory with no await in between, which on one event loop is atomic. That
holds for the two that matter:

- ``stop(precheck=...)`` runs the precheck and marks ``stopping`` in one
  step, so handing out a slot (the controller, no await either) and approving
  a stop can never interleave ("never stop a busy model");
- ``admit_start`` reads the memory budget first (the one await), then checks
  the fit and marks ``starting`` in one step; the budget's reading counts
  every engine that was starting at the reading or is starting now by what
  it declared, so a reading that aged during the await is never optimistic.

``_gates`` are the start-up gates, one per GPU: engines that share a GPU start
one at a time, from create to ready, so two cold starts do not fight over memory
that neither shows as used yet (vLLM sizes its cache from the free memory it
measures as it loads). Engines on other GPUs start meanwhile; on a one-pool
budget (nothing tells GPUs apart) there is one gate for all, and an engine with
no GPU passes none. They are the one lock held across slow work, on purpose;
nothing that must answer quickly waits for them (a stop cancels a start still
waiting there).

Waking a vLLM engine from sleep mode goes through ``starting`` too: it takes
memory back, may fail, and its waiters wait like a start's.

After a restart of ondemand (a reboot, a removed container, a child process
that died with the old ondemand), an always-on deployment that was ready or
starting and has lost its engine is *owed a start* (issue 21, "After a
reboot"): ``_take_back`` marks it stopped with ``pending_mode`` always_on, the
mark a switch to always on uses, and ``restart_lost`` admits it, once the app
is up, through ``admit_start`` (the fit check, then the start-up gates),
retrying a refusal. The mark is in the row, so a debt survives another restart;
the LiteLLM sync and the gateway treat it as a switch (the gateway entry, the
requests wait) until ready. A stop cancels the debt; one an administrator
stopped was never owed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from ..control.budget import Budget, apps_gib, residue_after_drop
from ..errors import BudgetError, DeployerError, DeploymentBusy, InsufficientMemory, NameTaken, StateFileError
from ..events import DeploymentChanged, Slept, StopCause, Woken
from ..model import ADMIN_STARTABLE, EDITABLE, HOLDING, Booking, Deployment, Mode, State, plain
from ..state.store import Store
from ..tasks import TaskGroup
from . import warmth
from .backends import Backend, BackendError, Engine
from .recipes import Box, FieldError, Launch, booking, is_secret, launch, may_sleep
from .startwatch import StartHooks

log = logging.getLogger("ondemand.engines.deployer")

Precheck = Callable[[Deployment], bool]

# An edit of these makes another engine: what the old one was measured to use no longer holds.
_REMEASURE = frozenset({"engine", "model", "image", "args", "command", "memory_gib", "gpu_count", "gpu_ids"})
# What a booking without memory_gib is derived from (recipes.booking).
_REBOOK = frozenset({"engine", "model", "args", "memory_gib", "gpu_count", "gpu_ids"})

# A refused start after ondemand's restart is tried again after this long, doubled each time up to the most.
RESTART_RETRY_S = 10.0
RESTART_RETRY_MAX_S = 300.0
# A sleep for make-room is measured this long after it (once the request it was for has its memory).
MEASURE_AFTER_MAKE_ROOM_S = 1.0
# Read by the gateway and the controller only, never by an engine: editable in any state, so
# a limit or a priority changes without a restart.
LIVE_FIELDS = frozenset({"priority", "max_inflight", "keep_warm"})


def ready_poll_s(elapsed: float) -> float:
    """How long to wait before asking a starting engine again whether it is ready. The
    waiting clients feel every poll interval in full, and a probe of a local engine that
    is not up yet costs next to nothing (a refused connection, or a 503): 20 ms for the
    first 2 s (a warm model, a wake), then 50 ms, so readiness is seen within about 25 ms
    on average (ondemand's benchmark measures it)."""
    return 0.02 if elapsed < 2.0 else 0.05


class WakeFailed(Exception):
    """An engine call of the sleep API failed (``_engine_call``: a sleep's, read as its reason),
    or a wake did not bring the engine back: a call failed or timed out (``failed``), or the
    wake check's answer differed (``mismatch``)."""

    def __init__(self, result: str, reason: str):
        super().__init__(reason)
        self.result = result


class StartFailed(Exception):
    """The engine did not become ready; the deployment is failed."""


class StartInterrupted(Exception):
    """The deployment was stopped or removed while it was starting."""

    def __init__(self, state: str):
        super().__init__(f"deployment was {state} while it was starting")
        self.state = state


def _shown(field: str, value: Any) -> Any:
    """A field's value as an audit row keeps it: a secret's value in ``env`` masked."""
    out = plain(value, field)
    if field == "env":
        out = {k: "***" if is_secret(k) else v for k, v in out.items()}
    return out


def _owed_a_start(dep: Deployment) -> bool:
    """Whether a deployment whose engine is gone when ondemand starts is started again: always
    on (or switching to it) and ready or starting when the old ondemand ended, or marked owed
    by it (always on with ``pending_mode`` always_on: a debt not yet paid, or the process
    backend's shutdown). A row an administrator stopped is neither: it stays stopped."""
    always_on = Mode.ALWAYS_ON in (dep.mode, dep.pending_mode)
    marked = dep.mode is Mode.ALWAYS_ON and dep.pending_mode is Mode.ALWAYS_ON
    return (always_on and dep.state in (State.READY, State.STARTING)) or marked


def _checks_name(dep: Deployment) -> bool:
    """Whether readiness asks that /v1/models list the served name: for every recipe, and
    for vLLM and SGLang rows (they answer 404 for another name). A llama.cpp or custom row
    without a model runs as given, as before recipes (llama.cpp serves any name)."""
    return dep.model is not None or dep.engine in ("vllm", "sglang")


class Deployer:
    start_hooks = StartHooks()  # the app's: the compile cache, the read-ahead, the start's phases
    def __init__(self, store: Store, backend: Backend, budget: Budget, *,
                 publish: Callable[[object], None] = lambda event: None,
                 start_timeout_s: float = 1800.0, stop_timeout_s: float = 30.0,
                 watch_interval_s: float = 5.0, watch_failures: int = 3, probe_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, box: Box | None = None,
                 restart_retry_s: float = RESTART_RETRY_S, wake_timeout_s: float = 300.0):
        self.store = store
        self.backend = backend
        self.budget = budget
        self.box = box or Box(backend=backend.kind)
        self.publish = publish
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.watch_interval_s = watch_interval_s
        self.watch_failures = watch_failures
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self.restart_retry_s = restart_retry_s
        self.wake_timeout_s = wake_timeout_s
        self._deps: dict[int, Deployment] = {}
        self._engines: dict[int, Engine] = {}
        self._starts: dict[int, asyncio.Task[None]] = {}
        self._gated: set[int] = set()  # starts past the gate: busy with the backend
        self._removing: set[int] = set()  # stopped for removal: nothing starts them again
        self._owed: set[int] = set()  # owed a start after ondemand's restart, not yet admitted
        self._sleeping: dict[int, asyncio.Future[None]] = {}  # a sleep's engine call is out: done when it ends
        # Host memory the level-1 sleeps under way will take (predicted): reserved against the next.
        self._host_reserved: dict[int, float] = {}
        # Each GPU's used memory before and after a sleep call, for a sleeper nvidia-smi lists no
        # process of (the drop across the call is what the sleep freed).
        self._gpu_drop: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
        self._waking: set[int] = set()  # a wake's engine calls are out: a stop may cancel them
        self._exits: dict[int, asyncio.Future[int | None]] = {}
        self._changes: dict[int, list[asyncio.Future[None]]] = {}
        self._gates: dict[int | None, asyncio.Lock] = {}  # per GPU index (None: the one pool)
        # The booking each deployment's checkpoint gave when ``book`` last read it (in a thread),
        # with what it was derived from: ``with_booking`` takes it when those are the same.
        self._booked: dict[int, tuple[tuple[Any, ...], Booking | None]] = {}
        self._http: aiohttp.ClientSession | None = None
        self.tasks = TaskGroup("deployer")

    # --- reads (no await: safe to combine with a decision) ------------------

    def get(self, dep_id: int) -> Deployment | None:
        return self._deps.get(dep_id)

    def all(self) -> list[Deployment]:
        return list(self._deps.values())

    def engine(self, dep_id: int) -> Engine | None:
        return self._engines.get(dep_id)

    def base_url(self, dep_id: int) -> str | None:
        engine = self._engines.get(dep_id)
        return engine.base_url if engine else None

    def launch(self, dep: Deployment, *, secrets: bool = False) -> Launch:
        """How ``dep``'s engine runs on this box (``recipes.launch``). The memory share is of
        the GPUs it holds (a start's), else of the smallest; with ``secrets`` the token is read
        (a start only). Raises FieldError or OSError (``secrets``)."""
        sizes = self.budget.sizes() or ()
        held = [sizes[g] for g in dep.gpus if g < len(sizes)] if self.budget.per_gpu else []
        size = min(held or sizes) if sizes else None
        return launch(dep, self.box, gpu_size_gib=size, box_gpus=len(sizes) if self.budget.per_gpu else 1,
                      per_gpu=self.budget.per_gpu, secrets=secrets)

    def with_booking(self, dep: Deployment) -> Deployment:
        """``dep`` with the booking a recipe without ``memory_gib`` gets on this box
        (``recipes.booking``). No await: the booking ``book`` read for the same fields and GPUs,
        else derived here (reading the checkpoint's headers on the event loop)."""
        inputs = self._booking_inputs(dep)
        read = self._booked.get(dep.id)
        if read is not None and read[0] == inputs:
            found = read[1]
        else:
            found = booking(dep, self.box, self.budget.sizes(), self.budget.per_gpu)
        return dep if found == dep.booking else dep.replace(booking=found)

    async def book(self, dep: Deployment) -> Deployment:
        """``with_booking``, the checkpoint read in a thread: its headers and config on slow
        storage would hold up the event loop (every request). The async callers (load, create,
        edit, a start's missing bookings, a dry run) call it before their step without an await,
        whose ``with_booking`` then takes what was read."""
        if dep.memory_gib > 0 or dep.model is None:
            return self.with_booking(dep)  # nothing to read
        inputs, sizes = self._booking_inputs(dep), self.budget.sizes()
        found = await asyncio.to_thread(booking, dep, self.box, sizes, self.budget.per_gpu)
        if dep.id:  # not a dry run's
            self._booked[dep.id] = (inputs, found)
        return dep if found == dep.booking else dep.replace(booking=found)

    def _booking_inputs(self, dep: Deployment) -> tuple[Any, ...]:
        """What ``recipes.booking`` derives a booking from, besides the box and the checkpoint."""
        return (dep.engine, dep.model, dep.args, dep.memory_gib, dep.gpu_count, dep.gpu_ids,
                tuple(self.budget.sizes() or ()))

    def _unbooked(self) -> list[Deployment]:
        return [dep for dep in self._deps.values() if dep.booking is None and dep.memory_gib <= 0
                and dep.model is not None]

    async def _read_missing(self) -> None:
        """Read the checkpoints ``_book_missing`` will book from, each once for its GPUs' sizes."""
        for dep in self._unbooked():
            read = self._booked.get(dep.id)
            if read is None or read[0] != self._booking_inputs(dep):
                await self.book(dep)

    def _book_missing(self) -> None:
        """Derive the bookings not derived yet (the GPUs' sizes were not known). No await."""
        for dep in self._unbooked():
            self._deps[dep.id] = self.with_booking(dep)

    def ready_engines(self) -> list[tuple[int, str]]:
        return self.engines_in((State.READY,))

    def engines_in(self, states: tuple[State, ...]) -> list[tuple[int, str]]:
        """(id, base URL) of the engines whose deployment is in one of ``states``."""
        out = []
        for i, e in self._engines.items():
            dep = self._deps.get(i)
            if dep is not None and dep.state in states:
                out.append((i, e.base_url))
        return out

    def changed(self, dep_id: int) -> asyncio.Future[None]:
        """A future resolved at the next change or removal of ``dep_id``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changes.setdefault(dep_id, []).append(fut)
        return fut

    def _get(self, dep_id: int) -> Deployment:
        dep = self._deps.get(dep_id)
        if dep is None:
            raise DeployerError(f"deployment {dep_id} does not exist")
        return dep

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("the deployer is not loaded")
        return self._http

    # --- life of the deployer -------------------------------------------------

    async def load(self) -> None:
        """Read the rows and take back what survived our restart."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, connect=5))
        try:
            await self.budget.box_sizes()  # the recipes' memory shares need each GPU's size
        except BudgetError as exc:
            log.warning("cannot read the GPUs' sizes yet (%s): running engines are taken back as they are", exc)
        for row in await self.store.deployments():
            dep = await self.book(Deployment.from_row(row))
            self._deps[dep.id] = dep
        for dep in list(self._deps.values()):
            await self._take_back(dep)
        self.tasks.spawn(self._watchdog(), "watchdog")

    async def _take_back(self, dep: Deployment) -> None:
        try:
            how: Launch | None = self.launch(dep)
        except (FieldError, OSError, ValueError):
            how = None  # cannot be derived now: any engine of this deployment's is its own
        try:
            engine = await self.backend.adopt(dep, how, compare=how is not None)
        except BackendError as exc:
            log.warning("cannot look for the engine of %s: %s", dep.name, exc)
            engine = None
        if engine is not None and dep.state in (State.READY, State.ASLEEP, State.STARTING):
            log.info("adopted the running engine of %s (%s)", dep.name, engine.base_url)
            self._attach(engine)
            if dep.state is State.STARTING and dep.sleep_level is not None:
                # ondemand ended during a wake: the engine may still sleep (its /health answers
                # all the same), so the wake is done again, and checked.
                self._starts[dep.id] = self.tasks.spawn(self._wake(dep.id), f"wake {dep.name}")
            elif dep.state is State.STARTING:
                self._starts[dep.id] = self.tasks.spawn(self._finish_start(dep.id, engine), f"start {dep.name}")
        elif engine is not None:
            await self.backend.stop(engine, self.stop_timeout_s)
            if dep.state is State.STOPPING:
                await self._transition(dep.id, State.STOPPED, text="stopped after ondemand restarted")
        elif _owed_a_start(dep):
            await self._owe_start(dep.id, reason="engine gone after ondemand restarted: it is started again",
                                  text="engine gone after ondemand restarted; it will be started again")
        elif dep.state in HOLDING:
            await self._transition(dep.id, State.STOPPED, reason="engine gone after ondemand restarted",
                                   text="engine gone after ondemand restarted")
        now = self._deps[dep.id]
        if dep.id not in self._owed and now.pending_mode is not None and now.state is not State.STARTING:
            # A switch whose start was never admitted (ondemand died between its two writes):
            # nothing would start it, and requests would wait for it. Cleared, as a refused start.
            log.warning("%s: the switch to %s was cut short by a restart before its start: it stays %s",
                        dep.name, now.pending_mode, now.mode)
            await self.update(dep.id, actor="deployer", pending_mode=None,
                              text=f"switch to {now.pending_mode} cut short by a restart; still {now.mode}")

    async def close(self, stop_engines: bool) -> None:
        """Stop background work; with ``stop_engines`` also the engines (process backend)."""
        await self.tasks.close()
        if stop_engines:
            engines = list(self._engines.values())
            await asyncio.gather(*(self.backend.stop(e, self.stop_timeout_s) for e in engines),
                                 return_exceptions=True)
            for e in engines:  # the rows say what is true for the next start
                dep = self._deps.get(e.deployment_id)
                if dep is not None and dep.state in HOLDING:
                    with contextlib.suppress(Exception):
                        if _owed_a_start(dep):  # always on: the next ondemand starts it again
                            await self._owe_start(dep.id, reason="stopped at shutdown: started again when "
                                                  "ondemand starts", text="stopped at shutdown; ondemand's next "
                                                  "start starts it again", cause=StopCause.SHUTDOWN)
                        else:
                            await self._transition(dep.id, State.STOPPED, text="stopped at shutdown",
                                                   cause=StopCause.SHUTDOWN)
        if self._http is not None:
            await self._http.close()
        await self.backend.close()

    # --- changes ----------------------------------------------------------------

    def _replace(self, dep_id: int, **changes: Any) -> tuple[Deployment, Deployment]:
        """Replace the live deployment (no await); returns (old, new)."""
        old = self._deps[dep_id]
        new = old.replace(updated_at=time.time(), **changes)
        if set(changes) & _REBOOK:
            new = self.with_booking(new)
        self._deps[dep_id] = new
        return old, new

    def _mark(self, dep_id: int, state: State, reason: str | None = None,
              log_tail: str | None = None, gpus: tuple[int, ...] | None = None,
              extra: Mapping[str, Any] | None = None) -> tuple[Deployment, Deployment]:
        """The in-memory half of a transition (no await). ``gpus``: the GPUs a start
        was given; an engine that holds nothing any more holds no GPU either. A sleep's
        level stays through its wake (``starting``: a restart mid-wake wakes it again)."""
        dep = self._deps[dep_id]
        changes: dict[str, Any] = {"state": state, "state_reason": reason}
        if state not in (State.ASLEEP, State.STARTING):
            changes["sleep_level"] = changes["host_gib"] = None
        if state not in HOLDING:
            changes["wake_check"] = None  # it belongs to the engine: the next one records its own
        changes.update(extra or {})
        if gpus is not None:
            changes["gpus"] = gpus
        elif state not in HOLDING:
            changes["gpus"] = ()
        if log_tail is not None or state in (State.STARTING, State.READY):
            changes["log_tail"] = log_tail
        if state in (State.READY, State.FAILED, State.STOPPED) and dep.pending_mode is not None:
            # A switch to always on is applied in the same transaction as the state change.
            changes["mode"], changes["pending_mode"] = dep.pending_mode, None
        self._owed.discard(dep_id)  # any transition settles a start owed: admitted, or stopped
        return self._replace(dep_id, **changes)

    async def _owe_start(self, dep_id: int, *, reason: str, text: str, cause: StopCause | None = None) -> None:
        """Mark it stopped and owed a start to always on, with ``pending_mode`` always_on in the
        same transaction. That is a switch's mark, so nothing else needs telling: LiteLLM keeps
        (or gets) the gateway entry and the gateway holds its requests for the start, until
        ready (then the direct entry), and make-room never picks it. In the row, the debt
        outlives another restart of ondemand (``_owed_a_start``)."""
        old, _ = self._mark(dep_id, State.STOPPED, reason)  # a switch under way is applied: always on now
        _, new = self._replace(dep_id, pending_mode=Mode.ALWAYS_ON)
        self._owed.add(dep_id)
        await self._persist(old, new, text=text, cause=cause)

    async def _transition(self, dep_id: int, state: State, *, reason: str | None = None,
                          log_tail: str | None = None, text: str | None = None, actor: str = "deployer",
                          user: str | None = None, audit: str | None = None,
                          detail: dict[str, Any] | None = None, cause: StopCause | None = None,
                          extra: Mapping[str, Any] | None = None) -> None:
        old, new = self._mark(dep_id, state, reason, log_tail, extra=extra)
        await self._persist(old, new, text=text, actor=actor, user=user, audit=audit, detail=detail, cause=cause)

    async def _persist(self, old: Deployment, new: Deployment, *, text: str | None = None, actor: str = "deployer",
                       user: str | None = None, audit: str | None = None,
                       detail: dict[str, Any] | None = None, cause: StopCause | None = None) -> None:
        """The stored half of a transition marked with ``_mark``: the row, its event and
        its audit row in one transaction; then the change is published (with ``cause``
        when it records a stop)."""
        text = text or f"{old.state} → {new.state}" + (f": {new.state_reason}" if new.state_reason else "")
        detail = {"from": old.state.value, "to": new.state.value, **(detail or {})}
        try:
            async with self.store.transaction():
                await self.store.update_deployment(
                    new.id, state=new.state, state_reason=new.state_reason, log_tail=new.log_tail,
                    mode=new.mode, pending_mode=new.pending_mode, gpus=new.gpus, updated_at=new.updated_at,
                    sleep_level=new.sleep_level, host_gib=new.host_gib, asleep_gib=new.asleep_gib,
                    sleep_host_gib=new.sleep_host_gib, wake_check=new.wake_check)
                await self.store.write_event(actor=actor, user=user, deployment_id=new.id, text=text, detail=detail)
                if audit:
                    await self.store.write_audit(action=audit, actor=actor, user=user, deployment_id=new.id,
                                                 text=text, detail=detail)
        except StateFileError as exc:
            # The engine did what it did: memory keeps the truth and the next transition writes
            # the whole state again (a restart takes back what runs). Only this event is lost.
            log.error("%s: %s (%s)", new.name, exc, text)
        finally:
            log.info("%s: %s", new.name, text)
            self._notify(new.id, self._deps.get(new.id), old, cause)

    def _notify(self, dep_id: int, dep: Deployment | None, old: Deployment | None,
                cause: StopCause | None = None) -> None:
        for fut in self._changes.pop(dep_id, ()):
            if not fut.done():
                fut.set_result(None)
        self.publish(DeploymentChanged(dep_id, dep, old, cause))

    # --- create, change, remove ----------------------------------------------

    async def create(self, fields: dict[str, Any], *, actor: str = "admin", user: str | None = None) -> Deployment:
        row = await self.store.insert_deployment(fields)
        dep = await self.book(Deployment.from_row(row))
        async with self.store.transaction():
            await self.store.write_event(actor=actor, user=user, deployment_id=dep.id, text=f"created ({dep.mode})")
        self._deps[dep.id] = dep
        self._notify(dep.id, dep, None)
        return dep

    async def update(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                     text: str | None = None, audit: str | None = None, detail: dict[str, Any] | None = None,
                     **fields: Any) -> Deployment:
        """Change stored fields (not the state) in one transaction with its event.
        The in-memory change is made before the first await."""
        bad = set(fields) & {"id", "state", "state_reason"}
        if bad:
            raise DeployerError(f"not changeable through update: {', '.join(sorted(bad))}")
        self._get(dep_id)
        old, new = self._replace(dep_id, **fields)
        try:
            async with self.store.transaction():
                await self.store.update_deployment(dep_id, **{k: getattr(new, k) for k in fields},
                                                   updated_at=new.updated_at)
                if text:
                    await self.store.write_event(actor=actor, user=user, deployment_id=dep_id, text=text,
                                                 detail=detail or {})
                if audit:
                    await self.store.write_audit(action=audit, actor=actor, user=user, deployment_id=dep_id,
                                                 text=text or audit, detail=detail or {})
        except StateFileError:
            if self._deps.get(dep_id) is new:  # an administrator's change that was not stored: undone
                self._deps[dep_id] = old
            raise
        self._notify(dep_id, self._deps.get(dep_id), old)
        return new

    async def record_footprint(self, dep_id: int, gib: float) -> None:
        """What a ready engine was measured to use (``footprint``): kept when it moved by
        more than 1 % (or 50 MiB); one beyond 10 % over its declared size is logged and
        recorded as an event the first time."""
        dep = self._deps.get(dep_id)
        if dep is None or dep.state is not State.READY:
            return
        old = dep.measured_gib
        if old is not None and abs(old - gib) < max(0.05, 0.01 * gib):
            return
        new = dep.replace(measured_gib=round(gib, 3))
        text = None
        if new.over_declared and not dep.over_declared:
            how = "declared" if dep.memory_gib > 0 else "was booked"
            text = (f"uses {gib:.1f} GiB of GPU memory, more than the {dep.booked_gib:g} GiB it {how}: "
                    "fit checks count the measured size; raise memory_gib")
            log.warning("%s %s", dep.name, text)
        await self.update(dep_id, actor="ondemand", text=text, measured_gib=new.measured_gib)

    async def edit(self, dep_id: int, changes: dict[str, Any], *, actor: str = "admin",
                   user: str | None = None) -> Deployment:
        """Edit fields of a deployment with no engine (stopped, failed, planned) in place:
        same id, audited ``deployment_update`` with the old and new values of the fields
        that differ. The checks and the in-memory change are one step (no await).
        Raises DeploymentBusy in another state or while its engine still runs (unless only
        ``LIVE_FIELDS`` change), NameTaken for another deployment's name."""
        if set(changes) & _REBOOK:  # read before the step: ``update`` books from what was read
            await self.book(self._get(dep_id).replace(**changes))
        dep = self._get(dep_id)
        if (dep.state not in EDITABLE or dep_id in self._engines) and not (changes and set(changes) <= LIVE_FIELDS):
            running = " and its engine still runs" if dep.state in EDITABLE else ""
            raise DeploymentBusy(f"{dep.name} is {dep.state}{running}: only a stopped, failed or planned "
                                 "deployment can be edited; stop it first")
        edited = dep.replace(**changes)
        changed = {k: getattr(edited, k) for k in changes if getattr(edited, k) != getattr(dep, k)}
        if not changed:
            return dep
        name = changed.get("name")
        if name is not None and any(d.name == name for d in self._deps.values() if d.id != dep_id):
            raise NameTaken(f"name: a deployment named {name!r} exists")
        old = {k: _shown(k, getattr(dep, k)) for k in changed}
        new = {k: _shown(k, v) for k, v in changed.items()}
        # Another engine: what the old one was measured to use, keep asleep and add to host memory
        # asleep no longer holds (a stale small reading would let a big model's sleep swap).
        extra = {k: None for k in ("measured_gib", "asleep_gib", "sleep_host_gib")
                 if getattr(dep, k) is not None} if set(changed) & _REMEASURE else {}
        return await self.update(dep_id, actor=actor, user=user, audit="deployment_update",
                                 text=f"edited {', '.join(sorted(changed))}",
                                 detail={"old": old, "new": new}, **changed, **extra)

    async def remove(self, dep_id: int, *, actor: str = "admin", user: str | None = None) -> None:
        dep = self._get(dep_id)
        self._removing.add(dep_id)
        try:
            await self.stop(dep_id, actor=actor, user=user, text="stopped for removal")
            with contextlib.suppress(BackendError):
                await self.backend.remove(dep)
            async with self.store.transaction():
                await self.store.delete_deployment(dep_id)
                await self.store.write_event(actor=actor, user=user, deployment_id=dep_id,
                                             text=f"removed {dep.name}")
        finally:
            self._removing.discard(dep_id)
        old = self._deps.pop(dep_id, dep)
        self._booked.pop(dep_id, None)
        self._notify(dep_id, None, old)

    # --- start and wake -------------------------------------------------------

    async def admit_start(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                          text: str | None = None, audit: str | None = None,
                          held_for_others: Callable[[], Mapping[int, float]] | None = None,
                          wanted: Callable[[], bool] | None = None, reading_age_s: float = 0.0) -> bool:
        """The fit check and the move to ``starting``; the engine then starts in the
        background behind the start-up gate. Returns False when it is starting or
        ready already (nothing to do: wait for it). Raises InsufficientMemory,
        BudgetError (the budget could not be read: nothing was tried), or
        DeployerError for a state that cannot start. The fit check picks the GPUs,
        kept in ``gpus`` while the engine holds them. ``held_for_others``: GiB per GPU
        the wait queue keeps for its head, asked in the same step as the fit check.
        ``wanted``: asked in that step too; False means nobody needs the start any more,
        and nothing starts. ``reading_age_s``: a budget reading that recent may serve
        (``Budget.read``)."""
        if self._check_startable(dep_id) is None:
            return False
        reading = await self.budget.read(self.all(), max_age_s=reading_age_s)
        await self._read_missing()  # the GPUs' sizes are known now (nothing to read, mostly)
        # From here to the mark, no await: the check and the move are one step.
        self._book_missing()
        dep = self._check_startable(dep_id)
        if dep is None or (wanted is not None and not wanted()):
            return False
        held = held_for_others() if held_for_others is not None else None
        gpus = self.budget.check_fit(dep, self.all(), reading, held)
        waking = dep.state is State.ASLEEP
        old, new = self._mark(dep_id, State.STARTING, gpus=gpus)
        coro = self._wake(dep_id) if waking else self._start(dep_id)
        self._starts[dep_id] = self.tasks.spawn(coro, f"start {dep.name}")
        await self._persist(old, new, actor=actor, user=user, audit=audit,
                            text=text or ("waking" if waking else "starting"))
        return True

    def _check_startable(self, dep_id: int) -> Deployment | None:
        """The deployment if it can start now; None if it is starting, ready or being
        removed (nothing to do: wait); raises otherwise."""
        dep = self._get(dep_id)
        if dep.state in (State.STARTING, State.READY) or dep_id in self._removing:
            return None
        if dep.state is State.ASLEEP:
            if not warmth.has_sleep_api(dep):
                raise DeployerError(f"{dep.name} is asleep but {dep.engine} has no sleep mode")
        elif dep.state not in ADMIN_STARTABLE:
            raise DeployerError(f"{dep.name} is {dep.state}: it cannot be started now")
        return dep

    async def wait_started(self, dep_id: int) -> None:
        """Wait until a start ends: returns when ready; raises StartFailed or StartInterrupted."""
        while True:
            dep = self._deps.get(dep_id)
            if dep is None:
                raise StartInterrupted("removed")
            if dep.state is State.READY:
                return
            if dep.state is State.FAILED:
                raise StartFailed(dep.state_reason or "start failed")
            if dep.state is not State.STARTING:
                raise StartInterrupted(dep.state.value)
            await self.changed(dep_id)

    async def restart(self, dep_id: int, **kw: Any) -> None:
        """Start a stopped, failed or planned deployment (or wake an asleep one) and wait until it is ready."""
        await self.admit_start(dep_id, **kw)
        await self.wait_started(dep_id)

    def restart_lost(self, held_for_others: Callable[[int], Mapping[int, float]] | None = None
                     ) -> list[asyncio.Task[None]]:
        """Start again, in the background, the always-on deployments ``_take_back`` found
        without their engine; returns the tasks. Called by the app once everything that hears
        of a start listens (the controller, the LiteLLM sync); ``held_for_others``: the wait
        queue's holds, kept out of the fit check as for any start."""
        return [self.tasks.spawn(self._pay_start(dep_id, held_for_others), f"restart {self._deps[dep_id].name}")
                for dep_id in sorted(self._owed)]

    def _owes_start(self, dep_id: int) -> bool:
        """Still owed and still wanted always on (a switch to on demand since cancels it)."""
        dep = self._deps.get(dep_id)
        return dep_id in self._owed and dep is not None and Mode.ALWAYS_ON in (dep.mode, dep.pending_mode)

    async def _pay_start(self, dep_id: int, held_for_others: Callable[[int], Mapping[int, float]] | None) -> None:
        """Admit the owed start, as any start (the fit check, the start-up gates). A refusal
        (too little memory, the budget unreadable) is noted in the reason and tried again,
        10 s, then twice as long each time, up to 5 min: memory may free up, nvidia-smi come
        back. Ends once admitted, or once the debt is settled otherwise: an administrator's
        start or stop, a switch to on demand, a removal. (A request starts nothing meanwhile:
        the pending mode makes it wait for this start.)"""
        delay = self.restart_retry_s
        held = (lambda: held_for_others(dep_id)) if held_for_others is not None else None
        while self._owes_start(dep_id):
            try:
                # wanted: asked in the step that marks starting, so a stop during the fit
                # check's reading is never followed by this start.
                await self.admit_start(dep_id, actor="ondemand", text="starting again after ondemand restarted",
                                       held_for_others=held, wanted=lambda: self._owes_start(dep_id))
                break
            except (InsufficientMemory, BudgetError) as exc:
                if not self._owes_start(dep_id):
                    break
                name = self._deps[dep_id].name
                reason = (f"engine gone after ondemand restarted; its start was refused ({exc}): "
                          f"tried again in {delay:g} s")
                log.warning("%s: %s", name, reason)
                old, new = self._replace(dep_id, state_reason=reason)
                await self._persist(old, new, actor="ondemand", text=reason)
            except DeployerError:
                break  # removed, or being stopped: nothing is owed any more
            await asyncio.sleep(delay)
            delay = min(delay * 2, max(RESTART_RETRY_MAX_S, self.restart_retry_s))
        self._owed.discard(dep_id)

    async def _start(self, dep_id: int) -> None:
        async with self._gate(dep_id), self._through_gate(dep_id):
            await self._cold_start(dep_id)

    async def _cold_start(self, dep_id: int) -> None:
        """Create the engine and wait until it is ready; the caller holds its gates."""
        dep = self._deps.get(dep_id)
        if dep is None or dep.state is not State.STARTING:
            return  # stopped or removed while it waited at the gate
        try:
            how = self.launch(dep, secrets=True)
        except (FieldError, OSError, ValueError) as exc:
            what = f"deployer.hf_token_file: {exc}" if not isinstance(exc, FieldError) else str(exc)
            await self._transition(dep_id, State.FAILED, reason=f"cannot make its command line: {what}")
            return
        self.start_hooks.before(dep, how)
        try:
            engine = await self.backend.start(dep, how)
        except Exception as exc:  # a BackendError, or a defect: the start failed, it is not stuck
            if not isinstance(exc, BackendError):
                log.exception("starting %s failed", dep.name)
            tail = await self._tail(None, dep)
            await self._transition(dep_id, State.FAILED, reason=str(exc) or repr(exc), log_tail=tail)
            return
        self._attach(engine)
        self.start_hooks.after(dep, engine)
        await self._finish_start(dep_id, engine)

    async def _finish_start(self, dep_id: int, engine: Engine) -> None:
        dep = self._deps[dep_id]
        health = "/health"
        began = self.clock()
        deadline = began + self.start_timeout_s
        exited = self._exits[dep_id]
        changed = self.changed(dep_id)
        while True:
            dep_now = self._deps.get(dep_id)
            if dep_now is None or dep_now.state is not State.STARTING:
                return  # a stop took over; it stops the engine
            if exited.done():
                code = exited.result()
                await self._transition(dep_id, State.FAILED,
                                       reason=f"engine exited with code {code} before it was ready",
                                       log_tail=await self._tail(engine, dep))
                return
            if self.clock() >= deadline:
                await self._transition(dep_id, State.FAILED,
                                       reason=f"engine did not answer {health} within {self.start_timeout_s:g} s",
                                       log_tail=await self._tail(engine, dep))
                await self.backend.stop(engine, self.stop_timeout_s)
                return
            if await self._answers(engine, health):
                served = await self._served_names(engine, dep)
                dep_now = self._deps.get(dep_id)
                if served is not None and dep_now is not None and dep_now.state is State.STARTING:
                    if dep.served_name in served or not _checks_name(dep):
                        extra = {}
                        if warmth.idle_level(dep, self.budget.per_gpu) > 0:
                            # What every wake of this engine must answer again (torch_memory_saver #71).
                            extra["wake_check"] = await self._one_token(engine, dep)
                            cur = self._deps.get(dep_id)
                            if cur is None or cur.state is not State.STARTING:
                                return  # a stop took over; it stops the engine
                        await self._transition(dep_id, State.READY, text="ready", extra=extra)
                    else:
                        names = ", ".join(served) or "no model"
                        await self._transition(
                            dep_id, State.FAILED, log_tail=await self._tail(engine, dep),
                            reason=f"the engine serves {names}, not {dep.served_name} (served_name): requests "
                                   "for it would get the engine's 404; fix served_name or the engine's "
                                   "--served-model-name/--alias")
                        await self.backend.stop(engine, self.stop_timeout_s)
                    return
                if served is not None:
                    return
            if changed.done():
                changed = self.changed(dep_id)  # one future at a time, however long the start
            waits: list[asyncio.Future[Any]] = [exited, changed]
            await asyncio.wait(waits, timeout=ready_poll_s(self.clock() - began), return_when=asyncio.FIRST_COMPLETED)

    async def _wake(self, dep_id: int) -> None:
        """Wake an asleep engine (``starting`` since the admit), behind its gates: the engine
        calls of its level, then the wake check. A wake that fails, times out or answers
        otherwise than the check recorded stops the engine and starts it cold, audited
        ``ondemand_wake_failed``; only a failed cold start is a failed start (the backoff)."""
        async with self._gate(dep_id), self._through_gate(dep_id):
            sleeping = self._sleeping.get(dep_id)
            if sleeping is not None:
                await asyncio.shield(sleeping)  # the sleep's own call ends first: a wake never overtakes it
            dep = self._deps.get(dep_id)
            engine = self._engines.get(dep_id)
            if dep is None or dep.state is not State.STARTING:
                return
            level = dep.sleep_level or 1
            if engine is None:
                await self._wake_failed(dep_id, None, level, WakeFailed("failed", "no engine to wake"))
                return
            began = self.clock()
            self._waking.add(dep_id)
            try:
                await asyncio.wait_for(self._wake_engine(engine, dep, level), self.wake_timeout_s)
                failure = None
            except asyncio.TimeoutError:
                failure = WakeFailed("failed", f"the engine did not wake within {self.wake_timeout_s:g} s "
                                               "(deployer.wake_timeout_s)")
            except WakeFailed as exc:
                failure = exc
            finally:
                self._waking.discard(dep_id)
            seconds = self.clock() - began
            now = self._deps.get(dep_id)
            if now is None or now.state is not State.STARTING:
                return  # a stop took over; it stops the engine
            self.publish(Woken(dep_id, dep.name, failure.result if failure else "ready", seconds))
            if failure is not None:
                await self._wake_failed(dep_id, engine, level, failure)
                return
            await self._transition(dep_id, State.READY, text=f"woken from sleep level {level} in {seconds:.2f} s")

    async def _wake_engine(self, engine: Engine, dep: Deployment, level: int) -> None:
        """The engine calls that wake it, in order, then the wake check; raises WakeFailed."""
        for step in warmth.wake_steps(dep, level):
            await self._engine_call(engine, step)
        if dep.wake_check is None:
            if not await self._answers(engine, "/health"):
                raise WakeFailed("failed", "the engine does not answer /health after its wake")
            return
        try:
            got = await self._completion(engine, dep)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise WakeFailed("failed", f"the wake check's completion failed: {exc}") from exc
        if got != dep.wake_check:
            raise WakeFailed("mismatch", f"the wake check answered {got!r}, not {dep.wake_check!r} as after its "
                                         "start: its weights did not come back whole")

    async def _wake_failed(self, dep_id: int, engine: Engine | None, level: int, failure: WakeFailed) -> None:
        """Audit the failed wake, stop the engine and start it cold (its gates are held)."""
        dep = self._deps[dep_id]
        text = f"wake from sleep level {level} failed ({failure}): stopped and started cold"
        log.warning("%s: %s", dep.name, text)
        with contextlib.suppress(StateFileError):
            async with self.store.transaction():
                detail = {"reason": str(failure), "result": failure.result, "level": level}
                await self.store.write_event(actor="deployer", deployment_id=dep_id, text=text, detail=detail)
                await self.store.write_audit(action="ondemand_wake_failed", actor="ondemand", deployment_id=dep_id,
                                             text=text, detail=detail)
        if engine is not None:
            await self._stop_engine(engine, dep, "after its failed wake")
        now = self._deps.get(dep_id)
        if now is None or now.state is not State.STARTING:
            return
        self._replace(dep_id, sleep_level=None, host_gib=None, wake_check=None)  # a cold start from here
        await self._cold_start(dep_id)

    async def _engine_call(self, engine: Engine, step: warmth.Step) -> None:
        """One POST of the sleep API; raises WakeFailed unless it answers 200."""
        path, query, body = step
        try:
            async with self.http.post(engine.base_url + path, params=query, json=body,
                                      timeout=aiohttp.ClientTimeout(total=None)) as resp:
                if resp.status != 200:
                    raise WakeFailed("failed", f"POST {path} answered {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, OSError) as exc:
            raise WakeFailed("failed", f"POST {path} failed: {exc}") from exc

    async def _completion(self, engine: Engine, dep: Deployment) -> str | None:
        """The greedy one-token completion's text (None: not a completion); raises
        aiohttp.ClientError for an answer that is not 200."""
        async with self.http.post(engine.base_url + "/v1/completions", json=warmth.check_body(dep),
                                  timeout=aiohttp.ClientTimeout(total=self.wake_timeout_s)) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=(await resp.text())[:200])
            return warmth.check_text(await resp.json(content_type=None))

    async def _one_token(self, engine: Engine, dep: Deployment) -> str | None:
        """The wake check's answer after a cold start, or None (not a completion model:
        an embedding model's wakes are checked by /health only)."""
        try:
            got = await self._completion(engine, dep)
        except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as exc:
            log.info("%s: no wake check recorded (/v1/completions: %s); its wakes are checked by /health",
                     dep.name, exc)
            return None
        return got

    @contextlib.asynccontextmanager
    async def _gate(self, dep_id: int) -> AsyncIterator[None]:
        """The gates of the GPUs this start was given, taken in index order (two starts that
        share GPUs never hold one each and wait for the other's)."""
        dep = self._deps.get(dep_id)
        if dep is None:
            keys: list[int | None] = []  # removed meanwhile: its start ends at once
        elif not self.budget.per_gpu:
            keys = [None]
        else:
            keys = [*sorted(dep.gpus)]  # no GPU (gpu_count 0): no gate
        async with contextlib.AsyncExitStack() as held:
            for key in keys:
                await held.enter_async_context(self._gates.setdefault(key, asyncio.Lock()))
            yield

    @contextlib.asynccontextmanager
    async def _through_gate(self, dep_id: int) -> AsyncIterator[None]:
        self._gated.add(dep_id)
        try:
            yield
        finally:
            self._gated.discard(dep_id)

    async def _answers(self, engine: Engine, path: str) -> bool:
        try:
            async with self.http.get(engine.base_url + path,
                                     timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _served_names(self, engine: Engine, dep: Deployment) -> list[str] | None:
        """The model ids the engine's /v1/models lists; None while it does not answer yet."""
        try:
            async with self.http.get(engine.base_url + "/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                if resp.status != 200:
                    return None if _checks_name(dep) else []
                body = await resp.json(content_type=None)
        except ValueError:  # not JSON: no name can be read from it
            return None if _checks_name(dep) else []
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        data = body.get("data") if isinstance(body, dict) else None
        return [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def _attach(self, engine: Engine) -> None:
        self._engines[engine.deployment_id] = engine
        exited: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._exits[engine.deployment_id] = exited
        self.tasks.spawn(self._watch_exit(engine, exited), f"exit {engine.name}")

    async def _watch_exit(self, engine: Engine, exited: asyncio.Future[int | None]) -> None:
        try:
            code = await self.backend.wait_exit(engine)
        except BackendError as exc:
            log.warning("lost track of %s: %s", engine.name, exc)
            code = None
        if not exited.done():
            exited.set_result(code)
        dep_id = engine.deployment_id
        if self._engines.get(dep_id) is engine:
            del self._engines[dep_id]
        dep = self._deps.get(dep_id)
        if dep is not None and dep.state in (State.READY, State.ASLEEP):
            # Watchdog: an engine that exits while serving is failed, not stopped.
            await self._transition(dep_id, State.FAILED, reason=f"engine exited with code {code}",
                                   log_tail=await self._tail(engine, dep), actor="watchdog", cause=StopCause.FAILED)

    async def _watchdog(self) -> None:
        """An engine that stops answering while ready becomes failed, and is killed at once:
        it no longer answers, so a SIGTERM would go unheard (a hung or SIGSTOPped engine) and
        its in-flight requests would hang through the whole stop timeout. Engines are
        probed together, so one that hangs does not delay the others' checks."""
        misses: dict[int, int] = {}
        while True:
            await asyncio.sleep(self.watch_interval_s)
            engines = [(i, e) for i, _ in self.ready_engines() if (e := self._engines.get(i)) is not None]
            answers = await asyncio.gather(*(self._answers(e, "/health") for _, e in engines))
            for (dep_id, engine), ok in zip(engines, answers, strict=True):
                if ok:
                    misses.pop(dep_id, None)
                    continue
                misses[dep_id] = misses.get(dep_id, 0) + 1
                dep = self._deps.get(dep_id)
                if misses[dep_id] >= self.watch_failures and dep is not None and dep.state is State.READY:
                    misses.pop(dep_id, None)
                    await self._give_up_on(dep, engine)

    async def _give_up_on(self, dep: Deployment, engine: Engine) -> None:
        reason = f"engine stopped answering /health ({self.watch_failures} checks): killed"
        log.error("%s: its engine stopped answering /health (%d checks in a row): killing it now; "
                  "its in-flight requests end with it", dep.name, self.watch_failures)
        await self._transition(dep.id, State.FAILED, actor="watchdog", reason=reason,
                               log_tail=await self._tail(engine, dep), cause=StopCause.FAILED)
        await self.backend.stop(engine, 0)  # no grace: it cannot act on a SIGTERM

    async def _tail(self, engine: Engine | None, dep: Deployment) -> str:
        try:
            return await self.backend.log_tail(engine, dep)
        except Exception as exc:  # the tail is a courtesy; never fail a transition over it
            return f"(log tail unavailable: {exc})"

    # --- stop and sleep -------------------------------------------------------

    def _approve_stop(self, dep_id: int, precheck: Precheck | None) -> tuple[Deployment, Deployment] | None:
        """The stop decision, with no await: the precheck and the mark are one step."""
        dep = self._deps.get(dep_id)
        if dep is None or (precheck is not None and not precheck(dep)):
            return None
        owed = dep.state is State.STOPPED and dep_id in self._owed  # the stop cancels the start it is owed
        if not owed and (dep.state in (State.STOPPED, State.PLANNED, State.STOPPING) or
                         (dep.state is State.FAILED and dep_id not in self._engines)):
            return None
        return self._mark(dep_id, State.STOPPING)

    async def stop(self, dep_id: int, precheck: Precheck | None = None, *,
                   actor: str = "admin", user: str | None = None, text: str | None = None,
                   audit: str | None = None, cause: StopCause = StopCause.ADMIN) -> bool:
        """Stop the engine. With ``precheck``, only if it approves. Returns whether
        this call stopped it (False: refused, or nothing to stop). The approved stop
        is the one recorded (and audited when asked), with its ``cause``."""
        marked = self._approve_stop(dep_id, precheck)
        if marked is None:
            return False
        await self._persist(*marked, actor=actor, user=user, text=text, audit=audit, cause=cause)
        dep = marked[1]
        start = self._starts.get(dep_id)
        if start is not None and not start.done():
            if dep_id in self._gated and dep_id not in self._waking:
                # Let the start notice the stop; never cancel a backend call half-way.
                await asyncio.shield(start)
            else:
                # At the gate it holds nothing yet; a wake's engine calls are only HTTP to an
                # engine about to be stopped (a hung wake would hold the stop up to wake_timeout_s).
                start.cancel("stopped while waiting at the start-up gate or waking")
                with contextlib.suppress(asyncio.CancelledError):
                    await start
        engine = self._engines.get(dep_id)
        if engine is not None:
            await self._stop_engine(engine, dep)
        now = self._deps.get(dep_id)
        if now is not None and now.state is State.STOPPING:
            await self._transition(dep_id, State.STOPPED, actor=actor, user=user)
        return True

    async def _stop_engine(self, engine: Engine, dep: Deployment, why: str = "") -> None:
        """Stop the engine (SIGTERM, a kill after ``stop_timeout_s``) and wait for its exit to be
        seen, so that what it held is free when this returns."""
        try:
            await self.backend.stop(engine, self.stop_timeout_s)
        except BackendError as exc:
            log.error("stopping %s%s: %s", dep.name, f" {why}" if why else "", exc)
        exited = self._exits.get(engine.deployment_id)
        if exited is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), self.stop_timeout_s + 5)

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
        dep = self._get(dep_id)
        want = self._asked_level(dep, level)
        # From here to the mark, no await: the checks and the move are one step.
        engine = self._engines.get(dep_id)
        if dep.state is not State.READY or engine is None or dep_id in self._removing or \
                (precheck is not None and not precheck(dep)):
            if precheck is None:
                raise DeployerError(f"{dep.name} is {dep.state}, not ready")
            return None
        got = self._host_level(dep, want)
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
        marked = self._mark(dep_id, State.ASLEEP, extra={"sleep_level": got})
        if got == 1:
            self._host_reserved[dep_id] = warmth.predicted_host_gib(dep)  # until its call ends
        if on_marked is not None:
            on_marked()
        failure, before = await self._sleep_call(engine, dep, got, marked, actor=actor, user=user, audit=audit,
                                                 text=f"{text} (sleep level {got}){why}")
        now = self._deps.get(dep_id)
        if failure is not None:
            if now is not None and now.state is State.ASLEEP:  # not woken or stopped meanwhile
                await self.stop(dep_id, actor=actor, user=user, cause=cause,
                                text=f"the engine's sleep failed ({failure}): stopped")
                return 0
            return None
        self.publish(Slept(dep_id, dep.name, got, cause))  # it slept, even if a wake came meanwhile
        if now is None or now.state is not State.ASLEEP:
            return got  # a wake or a stop came during the call: it carries on from here
        if cause is StopCause.MAKE_ROOM:
            # A request waits for what this sleep frees: its settle and admit read the GPUs now,
            # and a measurement (nvidia-smi, /proc) at the same time only slows them down.
            self.tasks.spawn(self._measure_later(dep_id, engine, got, before), f"measure {dep.name}")
        else:
            await self._measure_sleeper(dep_id, engine, got, before)
        return got

    def _host_level(self, dep: Deployment, want: int) -> int:
        """The level the host reserve lets ``dep`` sleep at (0: neither level fits it)."""
        available = self.budget.host_available_gib()
        if available is not None:  # the level-1 sleeps under way have not moved their weights yet
            available -= sum(gib for other, gib in self._host_reserved.items() if other != dep.id)
        return warmth.host_level(dep, want, available, self.budget.host_reserve_gib, self.budget.per_gpu)

    def check_sleep(self, dep_id: int, level: int | None) -> None:
        """Raises DeployerError when ``sleep(dep_id, level)`` by an administrator would be refused
        now (not ready, no sleep API, a level its engine cannot take): asked before a drain."""
        dep = self._get(dep_id)
        self._asked_level(dep, level)
        if dep.state is not State.READY or dep_id not in self._engines or dep_id in self._removing:
            raise DeployerError(f"{dep.name} is {dep.state}, not ready")

    async def _measure_later(self, dep_id: int, engine: Engine, level: int, before: float | None) -> None:
        await asyncio.sleep(MEASURE_AFTER_MAKE_ROOM_S)
        await self._measure_sleeper(dep_id, engine, level, before)

    async def _sleep_call(self, engine: Engine, dep: Deployment, level: int, marked: tuple[Deployment, Deployment],
                          **persist: Any) -> tuple[str | None, float | None]:
        """Write the mark to asleep, then call the engine's sleep; (why it failed or None, the
        host memory before it, for a level 1). A wake meanwhile waits for the call to end."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleeping[dep.id] = done
        try:
            # Marked in memory: written before anything else is awaited, so a stop that comes
            # during the measurement below is written after it (the row never says asleep
            # for a stopped deployment).
            await self._persist(*marked, cause=None, detail={"level": level}, **persist)
            before = await self._host_gib(engine) if level == 1 else None
            gpus_before = await self._gpus_used(dep)
            try:
                await self._engine_call(engine, warmth.sleep_step(dep, level))
            except WakeFailed as exc:
                return str(exc), before
            gpus_after = await self._gpus_used(dep) if gpus_before is not None else None
            if gpus_before is not None and gpus_after is not None:
                self._gpu_drop[dep.id] = (gpus_before, gpus_after)
            return None, before
        finally:
            self._sleeping.pop(dep.id, None)
            self._host_reserved.pop(dep.id, None)
            done.set_result(None)

    def _asked_level(self, dep: Deployment, level: int | None) -> int:
        """The level ``dep`` is to sleep at when ``level`` is asked (None: its idle level, else
        1), before the host reserve; raises DeployerError when its engine cannot sleep so."""
        per_gpu = self.budget.per_gpu
        if not warmth.has_sleep_api(dep):
            raise DeployerError(f"{dep.engine} has no sleep mode; stop it instead")
        if dep.model is not None and not may_sleep(dep, per_gpu):
            # Its recipe left the sleep flags out (idle_action stop, or auto where a wake is not
            # reliable): the engine would refuse, and a failed sleep stops it.
            raise DeployerError(f"{dep.name} was started without the sleep flags (idle_action "
                                f"{dep.idle_action}): set idle_action sleep or sleep2, or stop it instead")
        want = level or warmth.idle_level(dep, per_gpu) or 1
        deepest = warmth.deepest_level(dep, per_gpu)
        if dep.engine == "sglang":
            if level is not None and level != deepest:  # its start flags chose the level, not the call
                raise DeployerError(f"{dep.name} sleeps at level {deepest} only: SGLang's level is set by its "
                                    "start flags (idle_action sleep: level 1, sleep2: level 2)")
            want = deepest
        if want not in warmth.LEVELS or want > deepest:
            raise DeployerError(f"{dep.name} cannot sleep at level {want}: its engine was started with SGLang's "
                                "--enable-weights-cpu-backup (level 1); set idle_action sleep2 for level 2")
        return want

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

    async def _measure_sleeper(self, dep_id: int, engine: Engine, level: int, before: float | None) -> None:
        """What the sleeper still holds: on its GPUs (nvidia-smi, its processes; none listed
        once it was measured awake means none), and in host memory (its process tree's, or its
        container's). A level-1 sleep's growth of host memory is the next one's prediction."""
        residue: float | None = None
        if self.budget.source == "nvidia-smi":
            with contextlib.suppress(BudgetError):
                apps = await self.budget.compute_apps()
                pids = await self.backend.pids(engine)
                residue = apps_gib(apps, pids) if pids else None
                dep = self._deps.get(dep_id)
                if residue is None and pids and dep is not None and dep.measured_gib is not None:
                    residue = 0.0  # its processes were listed awake: asleep they hold nothing
        drop = self._gpu_drop.pop(dep_id, None)
        dep = self._deps.get(dep_id)
        if residue is None and drop is not None and dep is not None:
            # No per-process rows (a container that cannot see the others' processes): what it
            # held before (measured, else booked) less what the sleep call freed on its GPUs.
            gpus = list(dep.gpus) or list(range(len(drop[0])))
            residue = residue_after_drop(dep.footprint_gib, gpus, *drop)
        host = await self._host_gib(engine)
        dep = self._deps.get(dep_id)
        if dep is None or dep.state is not State.ASLEEP:
            return
        fields: dict[str, Any] = {"host_gib": None if host is None else round(host, 3)}
        if residue is not None:
            fields["asleep_gib"] = round(residue, 3)
        if level == 1 and host is not None and before is not None:
            fields["sleep_host_gib"] = round(max(0.0, host - before), 3)
        with contextlib.suppress(StateFileError, DeployerError):
            await self.update(dep_id, actor="ondemand", **fields)
