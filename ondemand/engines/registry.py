"""The registry: every deployment's :class:`~.unit.Unit`, and the one writer of their rows.

States (``model.State``): planned, starting, ready, asleep, stopping, stopped, failed, and
removal. Only the registry changes a deployment. Each change replaces the frozen
``Deployment`` in memory at once (``amend``: readers on the event loop see it without an
await), then writes the row, its event and any audit row in one transaction (``persist``),
then publishes ``DeploymentChanged`` on the bus (the controller decides, the app publishes the
view, the LiteLLM sync is triggered) and resolves the unit's futures of its next change.
A transition is the two halves: ``mark`` (no await, so it can share a step with a decision)
then ``persist``; ``transition`` does both. A mark that moves a deployment out of ``starting``
ends its unit's start (``start.py``); the start events since the last change are published
before it (``StartEnded``, then ``StartBegan``, then ``DeploymentChanged``).

It books too: a recipe without ``memory_gib`` is booked from its checkpoint on this box
(``recipes.booking``, read in a thread by ``book``, taken by ``with_booking`` in a step with no
await), and ``launch`` says how a deployment's engine runs on this box (``recipes.launch``).

The deployer (``deployer.py``) is this registry and the operations on its units (admit a
start, stop, sleep, take back after a restart, the watchdog).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import DeployerError, DeploymentBusy, NameTaken, StateFileError
from ..events import DeploymentChanged, StopCause
from ..model import EDITABLE, Deployment, Mode, State, plain
from ..state.store import Store
from . import rules
from .backends import Engine
from .memory import Sizes
from .recipes import Box, Launch, booking, is_secret, launch
from .start import ended_by
from .unit import Booked, Unit

log = logging.getLogger("ondemand.engines.deployer")

# An edit of these makes another engine: what the old one was measured to use no longer holds.
_REMEASURE = frozenset({"engine", "model", "image", "args", "command", "memory_gib", "gpu_count", "gpu_ids"})
# What a booking without memory_gib is derived from (recipes.booking).
_REBOOK = frozenset({"engine", "model", "args", "memory_gib", "gpu_count", "gpu_ids"})
# Read by the gateway and the controller only, never by an engine: editable in any state, so
# a limit or a priority changes without a restart.
LIVE_FIELDS = frozenset({"priority", "max_inflight", "keep_warm"})


def _shown(field: str, value: Any) -> Any:
    """A field's value as an audit row keeps it: a secret's value in ``env`` masked."""
    out = plain(value, field)
    if field == "env":
        out = {k: "***" if is_secret(k) else v for k, v in out.items()}
    return out


class Registry:
    def __init__(self, store: Store, sizes: Sizes, box: Box, publish: Callable[[object], None],
                 make_unit: Callable[[Deployment, Booked | None], Unit]):
        self.store = store
        self.box = box
        self.publish = publish
        self._sizes = sizes
        self._make_unit = make_unit  # the deployer's: a unit runs its lifecycle through it
        self._units: dict[int, Unit] = {}

    # --- reads (no await: safe to combine with a decision) ------------------

    def get(self, dep_id: int) -> Deployment | None:
        unit = self._units.get(dep_id)
        return unit.dep if unit is not None else None

    def all(self) -> list[Deployment]:
        return [unit.dep for unit in self._units.values()]

    def as_read(self) -> list[Deployment]:
        """The deployments as a fit check counts them (``rules.as_read``: a sleep whose engine
        call is out still holds its whole footprint)."""
        return rules.as_read(self.all(), lambda dep_id: self._units[dep_id].sleeping)

    def unit(self, dep_id: int) -> Unit | None:
        return self._units.get(dep_id)

    def units(self) -> list[Unit]:
        return list(self._units.values())

    def engine(self, dep_id: int) -> Engine | None:
        unit = self._units.get(dep_id)
        return unit.engine if unit is not None else None

    def base_url(self, dep_id: int) -> str | None:
        engine = self.engine(dep_id)
        return engine.base_url if engine else None

    def ready_engines(self) -> list[tuple[int, str]]:
        return self.engines_in((State.READY,))

    def engines_in(self, states: tuple[State, ...]) -> list[tuple[int, str]]:
        """(id, base URL) of the engines whose deployment is in one of ``states``."""
        return [(unit.id, unit.engine.base_url) for unit in self._units.values()
                if unit.engine is not None and unit.dep.state in states]

    def _unit_of(self, dep_id: int) -> Unit:
        unit = self._units.get(dep_id)
        if unit is None:
            raise DeployerError(f"deployment {dep_id} does not exist")
        return unit

    def _get(self, dep_id: int) -> Deployment:
        return self._unit_of(dep_id).dep

    # --- how it runs, and what it is booked ---------------------------------------

    def launch(self, dep: Deployment, *, secrets: bool = False) -> Launch:
        """How ``dep``'s engine runs on this box (``recipes.launch``). The memory share is of
        the GPUs it holds (a start's), else of the smallest; with ``secrets`` the token is read
        (a start only). Raises FieldError or OSError (``secrets``)."""
        sizes = self._sizes.sizes() or ()
        per_gpu = self._sizes.per_gpu
        held = [sizes[g] for g in dep.gpus if g < len(sizes)] if per_gpu else []
        size = min(held or sizes) if sizes else None
        return launch(dep, self.box, gpu_size_gib=size, box_gpus=len(sizes) if per_gpu else 1,
                      per_gpu=per_gpu, secrets=secrets)

    def with_booking(self, dep: Deployment) -> Deployment:
        """``dep`` with the booking a recipe without ``memory_gib`` gets on this box
        (``recipes.booking``). No await: the booking ``book`` read for the same fields and GPUs,
        else derived here (reading the checkpoint's headers on the event loop)."""
        unit = self._units.get(dep.id)
        read = unit.booked if unit is not None else None
        if read is not None and read[0] == self._booking_inputs(dep):
            found = read[1]
        else:
            found = booking(dep, self.box, self._sizes.sizes(), self._sizes.per_gpu)
        return dep if found == dep.booking else dep.replace(booking=found)

    async def book(self, dep: Deployment) -> Deployment:
        """``with_booking``, the checkpoint read in a thread: its headers and config on slow
        storage would hold up the event loop (every request). The async callers (load, create,
        edit, a start's missing bookings, a dry run) call it before their step without an await,
        whose ``with_booking`` then takes what was read."""
        booked, read = await self._read_booking(dep)
        unit = self._units.get(dep.id)
        if read is not None and unit is not None:
            unit.booked = read
        return booked

    async def _read_booking(self, dep: Deployment) -> tuple[Deployment, Booked | None]:
        """``dep`` booked, and what was read for it (None: nothing to read)."""
        if dep.memory_gib > 0 or dep.model is None:
            return self.with_booking(dep), None  # nothing to read
        inputs, sizes = self._booking_inputs(dep), self._sizes.sizes()
        found = await asyncio.to_thread(booking, dep, self.box, sizes, self._sizes.per_gpu)
        booked = dep if found == dep.booking else dep.replace(booking=found)
        return booked, ((inputs, found) if dep.id else None)  # a dry run's is not kept

    def _booking_inputs(self, dep: Deployment) -> tuple[Any, ...]:
        """What ``recipes.booking`` derives a booking from, besides the box and the checkpoint."""
        return (dep.engine, dep.model, dep.args, dep.memory_gib, dep.gpu_count, dep.gpu_ids,
                tuple(self._sizes.sizes() or ()))

    def _unbooked(self) -> list[Unit]:
        return [u for u in self._units.values() if u.dep.booking is None and u.dep.memory_gib <= 0
                and u.dep.model is not None]

    async def _read_missing(self) -> None:
        """Read the checkpoints ``_book_missing`` will book from, each once for its GPUs' sizes."""
        for unit in self._unbooked():
            if unit.booked is None or unit.booked[0] != self._booking_inputs(unit.dep):
                await self.book(unit.dep)

    def _book_missing(self) -> None:
        """Derive the bookings not derived yet (the GPUs' sizes were not known). No await."""
        for unit in self._unbooked():
            unit.dep = self.with_booking(unit.dep)

    async def _load_rows(self) -> None:
        """Every row of the state file, booked, as a unit."""
        for row in await self.store.deployments():
            dep, read = await self._read_booking(Deployment.from_row(row))
            self._units[dep.id] = self._make_unit(dep, read)

    # --- changes ----------------------------------------------------------------

    def amend(self, dep_id: int, **changes: Any) -> tuple[Deployment, Deployment]:
        """Replace the live deployment (no await, nothing written); returns (old, new)."""
        unit = self._units[dep_id]
        old = unit.dep
        new = old.replace(updated_at=time.time(), **changes)
        if set(changes) & _REBOOK:
            new = self.with_booking(new)
        unit.dep = new
        return old, new

    def mark(self, dep_id: int, state: State, reason: str | None = None,
             log_tail: str | None = None, gpus: tuple[int, ...] | None = None,
             extra: Mapping[str, Any] | None = None) -> tuple[Deployment, Deployment]:
        """The in-memory half of a transition (no await): the fields ``rules.marked`` says
        (``gpus``: the GPUs a start was given; a switch of mode under way applied in the same
        transaction as the state it waited for)."""
        unit = self._units[dep_id]
        changes = rules.marked(unit.dep, state, reason, log_tail, gpus, extra)
        unit.owed = False  # any transition settles a start owed: admitted, or stopped
        old, new = self.amend(dep_id, **changes)
        if state is not State.STARTING:  # its start, if one was under way, ended here
            unit.end_start(ended_by(state, unit.removing), at=new.updated_at)
        return old, new

    async def owe_start(self, dep_id: int, *, reason: str, text: str, cause: StopCause | None = None) -> None:
        """Mark it stopped and owed a start to always on, with ``pending_mode`` always_on in the
        same transaction. That is a switch's mark, so nothing else needs telling: LiteLLM keeps
        (or gets) the gateway entry and the gateway holds its requests for the start, until
        ready (then the direct entry), and make-room never picks it. In the row, the debt
        outlives another restart of ondemand (``unit.owed_a_start``)."""
        old, _ = self.mark(dep_id, State.STOPPED, reason)  # a switch under way is applied: always on now
        _, new = self.amend(dep_id, pending_mode=Mode.ALWAYS_ON)
        self._units[dep_id].owed = True
        await self.persist(old, new, text=text, cause=cause)

    async def transition(self, dep_id: int, state: State, *, reason: str | None = None,
                         log_tail: str | None = None, text: str | None = None, actor: str = "deployer",
                         user: str | None = None, audit: str | None = None,
                         detail: dict[str, Any] | None = None, cause: StopCause | None = None,
                         extra: Mapping[str, Any] | None = None) -> None:
        old, new = self.mark(dep_id, state, reason, log_tail, extra=extra)
        await self.persist(old, new, text=text, actor=actor, user=user, audit=audit, detail=detail, cause=cause)

    async def persist(self, old: Deployment, new: Deployment, *, text: str | None = None, actor: str = "deployer",
                      user: str | None = None, audit: str | None = None,
                      detail: dict[str, Any] | None = None, cause: StopCause | None = None) -> None:
        """The stored half of a transition marked with ``mark``: the row, its event and
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
            self._notify(new.id, self._units.get(new.id), old, cause)

    async def note(self, dep_id: int, text: str, detail: dict[str, Any], *, audit: str) -> None:
        """An event and its audit row with no change of the row (a failed wake); one that cannot
        be written is lost (what follows it is a transition, written whole)."""
        try:
            async with self.store.transaction():
                await self.store.write_event(actor="deployer", deployment_id=dep_id, text=text, detail=detail)
                await self.store.write_audit(action=audit, actor="ondemand", deployment_id=dep_id,
                                             text=text, detail=detail)
        except StateFileError:
            pass

    def _notify(self, dep_id: int, unit: Unit | None, old: Deployment | None,
                cause: StopCause | None = None) -> None:
        if unit is not None:
            unit.settle()
            self._announce(unit)  # the starts that ended and began up to this change, before it
        self.publish(DeploymentChanged(dep_id, None if unit is None or unit.removed else unit.dep, old, cause))

    def _announce(self, unit: Unit) -> None:
        """Publish the unit's start events not published yet."""
        for event in unit.announced():
            self.publish(event)

    # --- create, change, forget ----------------------------------------------

    async def create(self, fields: dict[str, Any], *, actor: str = "admin", user: str | None = None) -> Deployment:
        row = await self.store.insert_deployment(fields)
        dep, read = await self._read_booking(Deployment.from_row(row))
        async with self.store.transaction():
            await self.store.write_event(actor=actor, user=user, deployment_id=dep.id, text=f"created ({dep.mode})")
        unit = self._units[dep.id] = self._make_unit(dep, read)
        self._notify(dep.id, unit, None)
        return dep

    async def update(self, dep_id: int, *, actor: str = "admin", user: str | None = None,
                     text: str | None = None, audit: str | None = None, detail: dict[str, Any] | None = None,
                     **fields: Any) -> Deployment:
        """Change stored fields (not the state) in one transaction with its event.
        The in-memory change is made before the first await."""
        bad = set(fields) & {"id", "state", "state_reason"}
        if bad:
            raise DeployerError(f"not changeable through update: {', '.join(sorted(bad))}")
        unit = self._unit_of(dep_id)
        old, new = self.amend(dep_id, **fields)
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
            if unit.dep is new:  # an administrator's change that was not stored: undone
                unit.dep = old
            raise
        self._notify(dep_id, self._units.get(dep_id), old)
        return new

    async def record_footprint(self, dep_id: int, gib: float) -> None:
        """What a ready engine was measured to use (``footprint``): kept when it moved by
        more than 1 % (or 50 MiB); one beyond 10 % over its declared size is logged and
        recorded as an event the first time."""
        dep = self.get(dep_id)
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
        ``LIVE_FIELDS`` change: a field given its current value is no change, and an edit that
        changes nothing is taken in any state), NameTaken for another deployment's name."""
        if set(changes) & _REBOOK:  # read before the step: ``update`` books from what was read
            await self.book(self._get(dep_id).replace(**changes))
        unit = self._unit_of(dep_id)
        dep = unit.dep
        edited = dep.replace(**changes)
        changed = {k: getattr(edited, k) for k in changes if getattr(edited, k) != getattr(dep, k)}
        if not changed:
            return dep
        if (dep.state not in EDITABLE or unit.engine is not None) and not set(changed) <= LIVE_FIELDS:
            running = " and its engine still runs" if dep.state in EDITABLE else ""
            raise DeploymentBusy(f"{dep.name} is {dep.state}{running}: only a stopped, failed or planned "
                                 "deployment can be edited; stop it first")
        name = changed.get("name")
        if name is not None and any(d.name == name for d in self.all() if d.id != dep_id):
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

    async def _forget(self, unit: Unit, *, actor: str, user: str | None) -> None:
        """The removal's row: deleted with its event; the unit leaves the registry."""
        dep = unit.dep
        async with self.store.transaction():
            await self.store.delete_deployment(dep.id)
            await self.store.write_event(actor=actor, user=user, deployment_id=dep.id, text=f"removed {dep.name}")
        self._units.pop(dep.id, None)
        unit.removed = True
        self._notify(dep.id, unit, unit.dep)
