"""The deployer: owner of every deployment's state and of its engine.

States: planned, starting, ready, asleep, stopping, stopped, failed (and
removal). Only the deployer changes a state. Each transition updates the
in-memory row at once (readers on the event loop see it without an await),
then writes the row, its event and any audit row in one transaction, then
tells the listeners (the app publishes the view; the controller wakes its
waiters; the LiteLLM sync is triggered).

Two locks, each with one reason:

- ``_lock`` orders the decisions that read a state and then change it across
  an await (a fit check reads nvidia-smi), so a stop cannot slip between a
  start's check and its ``starting``; and ``stop(precheck=...)`` runs the
  precheck and marks ``stopping`` under it with no await in between, so that
  handing out a slot (controller, no await either) and approving a stop can
  never interleave (design document, "Never stopping a busy model").
- ``_gate`` is the start-up gate: engines start one at a time, from create to
  ready, so two cold starts do not fight over memory while neither shows it.

Waking a vLLM engine from sleep mode goes through ``starting`` too: it takes
memory back, may fail, and its waiters wait like a start's.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

import aiohttp

from .backends import Backend, BackendError, Engine
from .budget import Budget, BudgetError
from .errors import DeployerError
from .store import Store
from .tasks import TaskGroup

log = logging.getLogger("ondemand.deployer")

STARTABLE = frozenset({"planned", "stopped", "failed"})
# Fields whose change means "a changed model or configuration" (start backoff reset).
CONFIG_FIELDS = frozenset({"served_name", "engine", "image", "args", "command", "port", "memory_gib"})

Listener = Callable[[int, "dict[str, Any] | None", "str | None"], None]


class StartFailed(Exception):
    """The engine did not become ready; the deployment is failed."""


class StartInterrupted(Exception):
    """The deployment was stopped or removed while it was starting."""

    def __init__(self, state: str):
        super().__init__(f"deployment was {state} while it was starting")
        self.state = state


class Deployer:
    def __init__(self, store: Store, backend: Backend, budget: Budget, *,
                 start_timeout_s: float = 1800.0, stop_timeout_s: float = 30.0,
                 watch_interval_s: float = 5.0, watch_failures: int = 3, probe_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.backend = backend
        self.budget = budget
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.watch_interval_s = watch_interval_s
        self.watch_failures = watch_failures
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self.listeners: list[Listener] = []
        self._deps: dict[int, dict[str, Any]] = {}
        self._engines: dict[int, Engine] = {}
        self._starts: dict[int, asyncio.Task] = {}
        self._gated: set[int] = set()  # starts past the gate: busy with the backend
        self._exits: dict[int, asyncio.Future] = {}
        self._changes: dict[int, list[asyncio.Future]] = {}
        self._lock = asyncio.Lock()
        self._gate = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None
        self.tasks = TaskGroup("deployer")

    # --- reads (no await: safe to combine with a decision) ------------------

    def get(self, dep_id: int) -> dict[str, Any] | None:
        """The live row. Read it, never change it: the deployer owns it."""
        return self._deps.get(dep_id)

    def all(self) -> list[dict[str, Any]]:
        return list(self._deps.values())

    def base_url(self, dep_id: int) -> str | None:
        engine = self._engines.get(dep_id)
        return engine.base_url if engine else None

    def ready_engines(self) -> list[tuple[int, str]]:
        return self.engines_in(("ready",))

    def engines_in(self, states: tuple[str, ...]) -> list[tuple[int, str]]:
        """(id, base URL) of the engines whose deployment is in one of ``states``."""
        return [(i, e.base_url) for i, e in self._engines.items()
                if self._deps.get(i, {}).get("state") in states]

    def changed(self, dep_id: int) -> asyncio.Future:
        """A future resolved at the next transition or removal of ``dep_id``."""
        fut = asyncio.get_running_loop().create_future()
        self._changes.setdefault(dep_id, []).append(fut)
        return fut

    def _get(self, dep_id: int) -> dict[str, Any]:
        dep = self._deps.get(dep_id)
        if dep is None:
            raise DeployerError(f"deployment {dep_id} does not exist")
        return dep

    # --- life of the deployer -------------------------------------------------

    async def load(self) -> None:
        """Read the rows and take back what survived our restart."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, connect=5))
        for row in await self.store.deployments():
            self._deps[row["id"]] = row
        for dep in list(self._deps.values()):
            try:
                engine = await self.backend.adopt(dep)
            except BackendError as exc:
                log.warning("cannot look for the engine of %s: %s", dep["name"], exc)
                engine = None
            state = dep["state"]
            if engine is not None and state in ("ready", "asleep", "starting"):
                log.info("adopted the running engine of %s (%s)", dep["name"], engine.base_url)
                self._attach(engine)
                if state == "starting":
                    self._starts[dep["id"]] = self.tasks.spawn(
                        self._finish_start(dep["id"], engine), f"start {dep['name']}")
            elif engine is not None:
                await self.backend.stop(engine, self.stop_timeout_s)
                if state == "stopping":
                    await self._transition(dep["id"], "stopped", text="stopped after ondemand restarted")
            elif state in ("starting", "ready", "asleep", "stopping"):
                await self._transition(dep["id"], "stopped", reason="engine gone after ondemand restarted",
                                       text="engine gone after ondemand restarted")
        self.tasks.spawn(self._watchdog(), "watchdog")

    async def close(self, stop_engines: bool) -> None:
        """Stop background work; with ``stop_engines`` also the engines (process backend)."""
        await self.tasks.close()
        if stop_engines:
            engines = list(self._engines.values())
            await asyncio.gather(*(self.backend.stop(e, self.stop_timeout_s) for e in engines),
                                 return_exceptions=True)
            for e in engines:  # the rows say what is true for the next start
                dep = self._deps.get(e.deployment_id)
                if dep is not None and dep["state"] in ("starting", "ready", "asleep", "stopping"):
                    with contextlib.suppress(Exception):
                        await self._transition(dep["id"], "stopped", text="stopped at shutdown")
        if self._http is not None:
            await self._http.close()
        await self.backend.close()

    # --- transitions ----------------------------------------------------------

    async def _transition(self, dep_id: int, state: str, *, reason: str | None = None,
                          log_tail: str | None = None, text: str | None = None, actor: str = "deployer",
                          user: str | None = None, audit: str | None = None,
                          detail: dict | None = None) -> None:
        dep = self._deps[dep_id]
        old = dep["state"]
        dep["state"] = state
        dep["state_reason"] = reason
        dep["updated_at"] = time.time()
        if log_tail is not None or state in ("starting", "ready"):
            dep["log_tail"] = log_tail
        if state in ("ready", "failed", "stopped") and dep.get("pending_mode"):
            # Design document, "Switch to always on": in the same transaction.
            dep["mode"], dep["pending_mode"] = dep["pending_mode"], None
        text = text or f"{old} → {state}" + (f": {reason}" if reason else "")
        try:
            async with self.store.transaction():
                await self.store.update_deployment(
                    dep_id, state=dep["state"], state_reason=dep["state_reason"], log_tail=dep.get("log_tail"),
                    mode=dep.get("mode"), pending_mode=dep.get("pending_mode"), updated_at=dep["updated_at"])
                await self.store.write_event(actor=actor, user=user, deployment_id=dep_id, text=text,
                                             detail={"from": old, "to": state, **(detail or {})})
                if audit:
                    await self.store.write_audit(action=audit, actor=actor, user=user, deployment_id=dep_id,
                                                 text=text, detail={"from": old, "to": state, **(detail or {})})
        finally:
            log.info("%s: %s", dep["name"], text)
            self._notify(dep_id, dep, old)

    def _notify(self, dep_id: int, dep: dict[str, Any] | None, old: str | None) -> None:
        for fut in self._changes.pop(dep_id, ()):
            if not fut.done():
                fut.set_result(None)
        for listener in list(self.listeners):
            try:
                listener(dep_id, dep, old)
            except Exception:
                log.exception("deployment listener failed")

    # --- create, change, remove ----------------------------------------------

    async def create(self, fields: dict[str, Any], *, actor: str = "admin", user: str | None = None) -> dict:
        row = await self.store.insert_deployment(fields)
        async with self.store.transaction():
            await self.store.write_event(actor=actor, user=user, deployment_id=row["id"],
                                         text=f"created ({row['mode'] or 'always_on'})")
        self._deps[row["id"]] = row
        self._notify(row["id"], row, None)
        return row

    async def update(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                     text: str | None = None, audit: str | None = None, detail: dict | None = None,
                     **fields: Any) -> dict[str, Any]:
        """Change stored fields (not the state) in one transaction with its event."""
        dep = self._get(dep_id)
        bad = set(fields) & {"id", "state", "state_reason"}
        if bad:
            raise DeployerError(f"not changeable through update: {', '.join(sorted(bad))}")
        fields["updated_at"] = time.time()
        dep.update(fields)
        async with self.store.transaction():
            await self.store.update_deployment(dep_id, **fields)
            if text:
                await self.store.write_event(actor=actor, user=user, deployment_id=dep_id, text=text,
                                             detail=detail or {})
            if audit:
                await self.store.write_audit(action=audit, actor=actor, user=user, deployment_id=dep_id,
                                             text=text or audit, detail=detail or {})
        self._notify(dep_id, dep, dep["state"])
        return dep

    async def remove(self, dep_id: int, *, actor: str = "admin", user: str | None = None) -> None:
        dep = self._get(dep_id)
        await self.stop(dep_id, actor=actor, user=user, text="stopped for removal")
        with contextlib.suppress(BackendError):
            await self.backend.remove(dep)
        async with self.store.transaction():
            await self.store.delete_deployment(dep_id)
            await self.store.write_event(actor=actor, user=user, deployment_id=dep_id,
                                         text=f"removed {dep['name']}")
        self._deps.pop(dep_id, None)
        self._notify(dep_id, None, dep["state"])

    # --- start and wake -------------------------------------------------------

    async def admit_start(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                          text: str | None = None, audit: str | None = None) -> bool:
        """Fit check and the move to ``starting``; the engine then starts in the
        background behind the start-up gate. Returns False when the deployment
        is starting or ready already (nothing to do, wait for it). Raises
        InsufficientMemory, or DeployerError for a state that cannot start."""
        async with self._lock:
            dep = self._get(dep_id)
            state = dep["state"]
            if state in ("starting", "ready"):
                return False
            if state not in STARTABLE and state != "asleep":
                raise DeployerError(f"{dep['name']} is {state}: it cannot be started now")
            if state == "asleep" and dep["engine"] != "vllm":
                raise DeployerError(f"{dep['name']} is asleep but {dep['engine']} has no sleep mode")
            try:
                await self.budget.fit(dep, self.all())
            except BudgetError as exc:
                raise DeployerError(f"memory budget unreadable: {exc}") from exc
            waking = state == "asleep"
            await self._transition(dep_id, "starting", actor=actor, user=user, audit=audit,
                                   text=text or ("waking" if waking else "starting"))
            coro = self._wake(dep_id) if waking else self._start(dep_id)
            self._starts[dep_id] = self.tasks.spawn(coro, f"start {dep['name']}")
            return True

    async def wait_started(self, dep_id: int) -> None:
        """Wait until a start ends: returns when ready; raises StartFailed or StartInterrupted."""
        while True:
            dep = self._deps.get(dep_id)
            if dep is None:
                raise StartInterrupted("removed")
            if dep["state"] == "ready":
                return
            if dep["state"] == "failed":
                raise StartFailed(dep.get("state_reason") or "start failed")
            if dep["state"] in ("stopping", "stopped", "planned", "asleep"):
                raise StartInterrupted(dep["state"])
            await self.changed(dep_id)

    async def restart(self, dep_id: int, **kw: Any) -> None:
        """Start a stopped, failed or planned deployment and wait until it is ready."""
        await self.admit_start(dep_id, **kw)
        await self.wait_started(dep_id)

    async def wake(self, dep_id: int, **kw: Any) -> None:
        """Wake an asleep (vLLM sleep mode) deployment and wait until it is ready."""
        dep = self._get(dep_id)
        if dep["state"] not in ("asleep", "starting", "ready"):
            raise DeployerError(f"{dep['name']} is {dep['state']}, not asleep")
        await self.admit_start(dep_id, **kw)
        await self.wait_started(dep_id)

    async def _start(self, dep_id: int) -> None:
        async with self._gate, self._through_gate(dep_id):
            dep = self._deps.get(dep_id)
            if dep is None or dep["state"] != "starting":
                return  # stopped or removed while it waited at the gate
            try:
                engine = await self.backend.start(dep)
            except BackendError as exc:
                tail = await self._tail(None, dep)
                await self._transition(dep_id, "failed", reason=str(exc), log_tail=tail)
                return
            self._attach(engine)
            await self._finish_start(dep_id, engine)

    async def _finish_start(self, dep_id: int, engine: Engine) -> None:
        dep = self._deps[dep_id]
        health = "/health" if dep["engine"] == "llamacpp" else "/v1/models"
        deadline = self.clock() + self.start_timeout_s
        exited = self._exits[dep_id]
        while True:
            if self._deps.get(dep_id) is not dep or dep["state"] != "starting":
                return  # a stop took over; it stops the engine
            if exited.done():
                code = exited.result()
                await self._transition(dep_id, "failed", reason=f"engine exited with code {code} before it was ready",
                                       log_tail=await self._tail(engine, dep))
                return
            if self.clock() >= deadline:
                await self._transition(dep_id, "failed",
                                       reason=f"engine did not answer {health} within {self.start_timeout_s:g} s",
                                       log_tail=await self._tail(engine, dep))
                await self.backend.stop(engine, self.stop_timeout_s)
                return
            if await self._answers(engine, health):
                if dep["state"] == "starting":
                    await self._transition(dep_id, "ready", text="ready")
                return
            await asyncio.wait([exited, self.changed(dep_id)], timeout=0.2, return_when=asyncio.FIRST_COMPLETED)

    async def _wake(self, dep_id: int) -> None:
        async with self._gate, self._through_gate(dep_id):
            dep = self._deps.get(dep_id)
            engine = self._engines.get(dep_id)
            if dep is None or dep["state"] != "starting":
                return
            if engine is None:
                await self._transition(dep_id, "failed", reason="no engine to wake")
                return
            try:
                async with self._http.post(engine.base_url + "/wake_up") as resp:  # type: ignore[union-attr]
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                          message=(await resp.text())[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                await self._transition(dep_id, "failed", reason=f"wake_up failed: {exc}",
                                       log_tail=await self._tail(engine, dep))
                return
            await self._finish_start(dep_id, engine)

    @contextlib.asynccontextmanager
    async def _through_gate(self, dep_id: int):
        self._gated.add(dep_id)
        try:
            yield
        finally:
            self._gated.discard(dep_id)

    async def _answers(self, engine: Engine, path: str) -> bool:
        try:
            async with self._http.get(engine.base_url + path,  # type: ignore[union-attr]
                                      timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _attach(self, engine: Engine) -> None:
        self._engines[engine.deployment_id] = engine
        exited = asyncio.get_running_loop().create_future()
        self._exits[engine.deployment_id] = exited
        self.tasks.spawn(self._watch_exit(engine, exited), f"exit {engine.name}")

    async def _watch_exit(self, engine: Engine, exited: asyncio.Future) -> None:
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
        if dep is not None and dep["state"] in ("ready", "asleep"):
            # Watchdog: an engine that exits while serving is failed, not stopped.
            await self._transition(dep_id, "failed", reason=f"engine exited with code {code}",
                                   log_tail=await self._tail(engine, dep), actor="watchdog")

    async def _watchdog(self) -> None:
        """An engine that stops answering while ready becomes failed."""
        misses: dict[int, int] = {}
        while True:
            await asyncio.sleep(self.watch_interval_s)
            for dep_id, base_url in self.ready_engines():
                dep = self._deps[dep_id]
                engine = self._engines.get(dep_id)
                if engine is None:
                    continue
                if await self._answers(engine, "/health"):
                    misses.pop(dep_id, None)
                    continue
                misses[dep_id] = misses.get(dep_id, 0) + 1
                if misses[dep_id] >= self.watch_failures and dep["state"] == "ready":
                    misses.pop(dep_id, None)
                    await self._transition(dep_id, "failed", actor="watchdog",
                                           reason=f"engine stopped answering /health ({self.watch_failures} checks)",
                                           log_tail=await self._tail(engine, dep))
                    await self.backend.stop(engine, self.stop_timeout_s)

    async def _tail(self, engine: Engine | None, dep: dict[str, Any]) -> str:
        try:
            return await self.backend.log_tail(engine, dep)
        except Exception as exc:  # the tail is a courtesy; never fail a transition over it
            return f"(log tail unavailable: {exc})"

    # --- stop and sleep -------------------------------------------------------

    async def stop(self, dep_id: int, precheck: Callable[[dict[str, Any]], bool] | None = None, *,
                   actor: str = "admin", user: str | None = None, text: str | None = None,
                   audit: str | None = None) -> bool:
        """Stop the engine. With ``precheck``, only if it approves: it runs under
        the lock with no await before ``stopping`` is marked. Returns whether
        this call stopped it (False: refused, or nothing to stop)."""
        async with self._lock:
            dep = self._deps.get(dep_id)
            if dep is None:
                return False
            if precheck is not None and not precheck(dep):
                return False
            state = dep["state"]
            if state in ("stopped", "planned", "stopping") or (state == "failed" and dep_id not in self._engines):
                return False
            # _transition sets the state before its first await. The approved
            # stop is the one that is recorded (and audited when asked).
            await self._transition(dep_id, "stopping", actor=actor, user=user, text=text, audit=audit)
        start = self._starts.get(dep_id)
        if start is not None and not start.done():
            if dep_id in self._gated:
                # Let the start notice the stop; never cancel a backend call half-way.
                await asyncio.shield(start)
            else:
                start.cancel("stopped while waiting at the start-up gate")  # it holds nothing yet
                with contextlib.suppress(asyncio.CancelledError):
                    await start
        engine = self._engines.get(dep_id)
        if engine is not None:
            try:
                await self.backend.stop(engine, self.stop_timeout_s)
            except BackendError as exc:
                log.error("stopping %s: %s", dep["name"], exc)
            exited = self._exits.get(dep_id)
            if exited is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), self.stop_timeout_s + 5)
        if self._deps.get(dep_id) is dep and dep["state"] == "stopping":
            await self._transition(dep_id, "stopped", actor=actor, user=user)
        return True

    async def sleep(self, dep_id: int, *, actor: str = "admin", user: str | None = None) -> None:
        """vLLM sleep mode level 1: the engine keeps running, its weights leave the GPU."""
        async with self._lock:
            dep = self._get(dep_id)
            if dep["engine"] != "vllm":
                raise DeployerError(f"{dep['engine']} has no sleep mode; stop it instead")
            if dep["state"] != "ready":
                raise DeployerError(f"{dep['name']} is {dep['state']}, not ready")
            engine = self._engines[dep_id]
            try:
                async with self._http.post(engine.base_url + "/sleep", params={"level": "1"}) as resp:  # type: ignore[union-attr]
                    if resp.status != 200:
                        raise DeployerError(f"engine refused /sleep: {resp.status} {(await resp.text())[:200]}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise DeployerError(f"engine unreachable: {exc}") from exc
            await self._transition(dep_id, "asleep", actor=actor, user=user, text="put to sleep (sleep mode)")

    async def edit(self, dep_id: int, changes: dict[str, Any], *, actor: str = "admin",
                   user: str | None = None) -> dict[str, Any]:
        """Edit a stopped, failed or planned deployment in place (same id): the
        validated ``changes``, audited ``deployment_update`` with the old and new
        values of the fields that differ. Under ``_lock``, so no start's fit check
        runs between the check and the change; no await between the state check
        and ``update``'s in-memory change. Raises DeploymentBusy in any other state
        (or while its engine still runs), NameTaken for another deployment's name."""
        from .errors import DeploymentBusy, NameTaken  # here: this method is the only user
        async with self._lock:
            dep = self._get(dep_id)
            if dep["state"] not in ("stopped", "failed", "planned") or dep_id in self._engines:
                running = " and its engine still runs" if dep["state"] in ("stopped", "failed", "planned") else ""
                raise DeploymentBusy(f"{dep['name']} is {dep['state']}{running}: only a stopped, failed or "
                                     "planned deployment can be edited; stop it first")
            changed = {k: v for k, v in changes.items() if dep.get(k) != v}
            if not changed:
                return dep
            name = changed.get("name")
            if name is not None and any(d["name"] == name for i, d in self._deps.items() if i != dep_id):
                raise NameTaken(f"name: a deployment named {name!r} exists")
            old = {k: dep.get(k) for k in changed}
            return await self.update(dep_id, actor=actor, user=user, text="edited " + ", ".join(sorted(changed)),
                                     audit="deployment_update", detail={"old": old, "new": dict(changed)},
                                     **changed)
