"""The LiteLLM sync: keeps LiteLLM's entries equal to what the deployments want.

It reconciles LiteLLM's list with the deployments, adds before deletes, never
concurrently, on triggers and every ``interval_s``, and keeps each deployment's
LiteLLM status for the deployment views and ``ondemand.litellm_ready``. What it
says to LiteLLM is ``litellm.client``'s; the entries themselves, ``litellm.entries``'.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..events import DeploymentChanged, StartEnded
from ..model import SYNC_STATES
from ..tasks import TaskGroup
from .client import LiteLLMClient, LiteLLMError
from .entries import (
    always_on_entry,
    entry_change,
    entry_dgxmm_id,
    entry_id,
    entry_instance,
    entry_owned,
    names_view,
    ondemand_entry,
)

log = logging.getLogger(__name__)

# Codes for which a sync stops at once: every further write would fail the same way.
_GLOBAL_CODES = frozenset({"litellm_unreachable", "litellm_unauthorized", "litellm_no_db"})


def _status(status: str, code: str | None = None) -> dict[str, Any]:
    return {"status": status, "code": code}


class _Stop(Exception):
    """LiteLLM failed in a way every further write would repeat (``_GLOBAL_CODES``)."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


@dataclasses.dataclass
class _Round:
    """One reconciliation's working state."""
    wanted: dict[int, dict[str, Any]]  # the entry each registered deployment wants
    left_alone: set[int]  # ids whose existing entries are kept as they are
    statuses: dict[int, dict[str, Any]]  # the statuses this round ends with
    previous: dict[int, dict[str, Any]]  # the statuses before it, of deployments that still exist
    added: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    patched: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    deleted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    first_error: str | None = None

    def result(self, error: str | None) -> dict[str, Any]:
        return {"added": self.added, "patched": self.patched, "deleted": self.deleted, "error": error}


def _warmth_view(dep: dict[str, Any]) -> dict[str, Any]:
    """The deployment as its entry's warmth reads it: a wake (``starting`` with the sleep level
    it keeps until ready; a failed wake's cold start has none) keeps the asleep rank (order 2,
    ``dgxmm_state`` asleep) until it is ready, so a wake writes one change (to ready), not two."""
    if dep.get("state") == "starting" and dep.get("sleep_level") is not None:
        return {**dep, "state": "asleep"}
    return dep


def _empty(error: str) -> dict[str, Any]:
    return {"added": [], "patched": [], "deleted": [], "error": error}


def sync_needed(e: DeploymentChanged) -> bool:
    """A change that changes what LiteLLM should list: created, removed, an edit of
    what its entry shows (mode or pending mode, names, role), entering or leaving
    ready, failed or planned. (A wake that became a cold start: ``wake_failed``.)"""
    if e.dep is None or e.old is None:
        return True
    if (e.old.mode, e.old.pending_mode, e.old.name, e.old.served_name, e.old.role) != \
            (e.dep.mode, e.dep.pending_mode, e.dep.name, e.dep.served_name, e.dep.role):
        return True
    return e.old.state is not e.dep.state and (e.old.state in SYNC_STATES or e.dep.state in SYNC_STATES)


def wake_failed(e: StartEnded) -> bool:
    """A wake that failed: its cold start begins in the same ``starting``, without the sleep
    level, so its entry ranks cold now (``_warmth_view``), not at the next sync."""
    return e.kind == "wake" and e.result in ("failed", "mismatch")


class LiteLLMSync:
    """Keeps LiteLLM's entries equal to what the deployments want.

    Rules (BEHAVIOUR.md, "LiteLLM registration"):

    - On-demand deployments are registered in every state except failed and planned, as
      gateway entries, while a key is readable. A planned deployment waits for an
      administrator's start: the gateway refuses its requests, so it is not listed.
      Without a key they are not registered, their existing entries are left alone,
      and their status is error ondemand_not_configured.
    - Always-on deployments are registered as direct entries only while ready *and*
      their engine has an address: a direct entry of an engine that is not serving would
      only produce errors, and the design syncs whenever a deployment enters or leaves
      ready. While a start to always on is pending (``pending_mode``: a switch, during which
      the deployment stays on_demand, or an always-on deployment started again after
      ondemand's own restart) it has the gateway entry until ready, so the name is callable
      during the whole start and the gateway holds its requests for it.
    - The decision model (role "decision") never goes through the gateway: it is always
      treated as always on, i.e. a direct entry while ready, whatever its mode says.
      System deployments follow their mode like models.
    - An existing entry of a wanted id is kept when model name, model, api_base, instance,
      both fingerprints and its warmth (order, dgxmm_state; a wake keeps the asleep rank
      until ready) match. When only the warmth
      differs it is patched in place (``PATCH /model/{id}/update``: it keeps its LiteLLM
      id, so its spend records, cooldown and health state carry over). Otherwise, and when
      LiteLLM has no PATCH route (404/405: remembered by the client, not tried again until
      a restart) or the patch fails, the new entry is added and the old ones deleted: all
      patches, then all adds of a sync before all its deletes, so a name is never missing.
      Entries of ids no longer wanted (removed, failed, planned, always-on not ready) are
      deleted; entries without dgxmm_id, and those of other instances, are never touched;
      an unchanged state writes nothing.
    - LiteLLM unreachable, without a database or refusing the key: the sync reports the
      code, deletes nothing, and the next trigger or period retries.
    """

    def __init__(self, *, client: LiteLLMClient | None, internal_url: str, queue_timeout_s: int,
                 list_deployments: Callable[[], Awaitable[list[dict[str, Any]]]],
                 current_key: Callable[[], str | None],
                 engine_base_url: Callable[[dict[str, Any]], str | None],
                 instance: str, interval_s: float = 60.0, on_result: Callable[[bool], None] | None = None):
        """``on_result(ok)`` hears of every sync that ran (the metrics)."""
        self._client = client
        self.instance = instance
        self.internal_url = internal_url
        self.queue_timeout_s = queue_timeout_s
        self._list_deployments = list_deployments
        self._current_key = current_key
        self._engine_base_url = engine_base_url
        self._interval_s = interval_s
        self._on_result = on_result
        self._lock = asyncio.Lock()
        self._pending = False
        self._drain_task: asyncio.Task[None] | None = None
        self._tasks = TaskGroup("litellm")
        self._closed = False
        self._last_ok = False
        self.last_result: dict[str, Any] | None = None
        self._statuses: dict[int, dict[str, Any]] = {}

    # -- state --------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._client is not None

    @property
    def last_ok(self) -> bool:
        """LiteLLM enabled and its last sync succeeded (``ondemand.litellm_ready``)."""
        return self.enabled and self._last_ok

    def status_of(self, dep_id: int) -> dict[str, Any]:
        """{"status": "registered"|"pending"|"error", "code"} of a deployment's entry."""
        if not self.enabled:
            return _status("error", "litellm_disabled")
        return dict(self._statuses.get(int(dep_id), _status("pending")))

    async def names(self) -> list[dict[str, Any]]:
        """Which instances serve each name in LiteLLM, and in what state, read from its
        ``/model/info`` now (``litellm.names_view``); raises ``LiteLLMError``."""
        if self._client is None:
            raise LiteLLMError("litellm_disabled", "LiteLLM is not configured (litellm.url, litellm.master_key_file)")
        return names_view(await self._client.list_models(), self.instance)

    # -- scheduling ---------------------------------------------------------

    def on_deployment(self, e: DeploymentChanged) -> None:
        """The event bus's ``DeploymentChanged``: a sync when the change changes what LiteLLM
        should list (:func:`sync_needed`)."""
        if sync_needed(e):
            self.trigger()

    def on_start_ended(self, e: StartEnded) -> None:
        """The event bus's ``StartEnded``: a sync when a wake failed (:func:`wake_failed`)."""
        if wake_failed(e):
            self.trigger()

    def trigger(self) -> None:
        """Ask for a sync soon. Triggers while one runs fold into exactly one more."""
        if not self.enabled or self._closed:
            return
        self._pending = True
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = self._tasks.spawn(self._drain(), "sync")

    async def _drain(self) -> None:
        # No await between the last check of _pending and the task's end, so a trigger
        # either lands before the check (one more round) or sees the task done (new task).
        while self._pending:
            self._pending = False
            try:
                await self.sync_now()
            except asyncio.CancelledError:
                raise
            except Exception:  # sync_now reports errors itself; this is a bug
                log.exception("LiteLLM sync failed unexpectedly")

    async def run(self) -> None:
        """Sync at once, then every ``interval_s`` and on each trigger, until cancelled."""
        if not self.enabled:
            return
        try:
            while True:
                self.trigger()
                await asyncio.sleep(self._interval_s)
        finally:
            await self._cancel_drain()

    async def wait_idle(self) -> None:
        """Return once no triggered sync is running or pending."""
        while self._drain_task is not None and not self._drain_task.done():
            await asyncio.wait({self._drain_task})

    async def _cancel_drain(self) -> None:
        task, self._drain_task = self._drain_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop scheduling, cancel a running sync and close the client."""
        self._closed = True
        await self._cancel_drain()
        await self._tasks.close()
        if self._client is not None:
            await self._client.close()

    # -- the sync -----------------------------------------------------------

    async def sync_now(self) -> dict[str, Any]:
        """One reconciliation; {"added": [...], "patched": [...], "deleted": [...],
        "error": None|code}: added and deleted items are {"dgxmm_id", "model_name",
        "model_id"}, patched ones also "order" and "state" (the new warmth)."""
        if self._client is None:
            return _empty("litellm_disabled")
        async with self._lock:
            result = await self._sync_locked(self._client)
        self.last_result = result
        if self._on_result is not None:
            self._on_result(result["error"] is None)
        return result

    def _plan(self, deployments: list[dict[str, Any]], key: str | None
              ) -> tuple[dict[int, dict[str, Any]], set[int], dict[int, dict[str, Any]]]:
        """What each deployment wants: (wanted entries by id, ids left alone, statuses)."""
        wanted: dict[int, dict[str, Any]] = {}
        left_alone: set[int] = set()
        statuses: dict[int, dict[str, Any]] = {}
        for dep in deployments:
            dep_id = int(dep["id"])
            if dep.get("state") == "failed":
                statuses[dep_id] = _status("pending", "deployment_failed")
                continue
            if dep.get("state") == "planned":  # waits for an administrator's start
                statuses[dep_id] = _status("pending", "deployment_planned")
                continue
            # A pending start to always on keeps the gateway entry, not a direct one: the switch's
            # rule, reused for a start after ondemand's restart (the registry's owe_start) rather than a
            # second one, so both hold the name the same way.
            on_demand = ((dep.get("mode") or "always_on") == "on_demand" or dep.get("pending_mode") == "always_on") \
                and dep.get("role") != "decision"
            if on_demand:
                if key is None:
                    left_alone.add(dep_id)
                    statuses[dep_id] = _status("error", "ondemand_not_configured")
                    continue
                wanted[dep_id] = ondemand_entry(_warmth_view(dep), key, self.internal_url, self.queue_timeout_s,
                                                instance=self.instance)
                continue
            base = self._engine_base_url(dep) if dep.get("state") == "ready" else None
            if not base:
                statuses[dep_id] = _status("pending", "engine_not_ready")
                continue
            wanted[dep_id] = always_on_entry(dep, base, instance=self.instance)
        return wanted, left_alone, statuses

    async def _sync_locked(self, client: LiteLLMClient) -> dict[str, Any]:
        try:
            deployments = await self._list_deployments()
            key = self._current_key() or None
            wanted, left_alone, statuses = self._plan(deployments, key)
        except Exception:
            log.exception("LiteLLM sync: could not read the deployments")
            self._last_ok = False
            return _empty("internal_error")
        known = {int(d["id"]) for d in deployments}
        rnd = _Round(wanted, left_alone, statuses, {i: s for i, s in self._statuses.items() if i in known})
        try:
            try:
                entries = await client.list_models()
            except LiteLLMError as exc:
                log.warning("LiteLLM sync: %s (%s)", exc.message, exc.detail)
                raise _Stop(exc.code) from None
            to_add, to_patch, replace = self._diff(rnd, entries, patch=client.patch_route is not False)
            await self._patch(client, rnd, to_patch, to_add, replace)
            await self._add(client, rnd, to_add, replace)
            await self._delete(client, rnd, replace)
        except _Stop as stop:
            return self._fail(rnd, stop.code)
        self._statuses = rnd.statuses
        self._last_ok = rnd.first_error is None
        if rnd.added or rnd.patched or rnd.deleted:
            log.info("LiteLLM sync: added %s, patched %s, deleted %s",
                     [a["model_name"] for a in rnd.added],
                     [f"{p['model_name']} ({p['state']})" for p in rnd.patched],
                     [d["model_name"] for d in rnd.deleted])
        return rnd.result(rnd.first_error)

    def _fail(self, rnd: _Round, code: str) -> dict[str, Any]:
        """End a round that LiteLLM stopped. Entries of registered deployments are still
        in LiteLLM (nothing was deleted); the others wait with the reason."""
        merged = dict(rnd.statuses)
        for dep_id in rnd.wanted:
            done = any(a["dgxmm_id"] == dep_id for a in rnd.added + rnd.patched)
            was = rnd.previous.get(dep_id, {}).get("status")
            if dep_id in merged:
                continue
            merged[dep_id] = _status("registered") if done or was == "registered" else _status("error", code)
        self._statuses = merged
        self._last_ok = False
        return rnd.result(code)

    def _ours(self, entry: dict[str, Any], wanted: dict[int, dict[str, Any]]) -> bool:
        """This instance's entry: its own, or one it wrote before instances existed (a
        gateway entry under internal_url, or a direct entry at the address it would
        write now). Such an old entry matches nothing wanted, so it is replaced once."""
        if entry_owned(entry, self.instance, self.internal_url):
            return True
        dep_id = entry_dgxmm_id(entry)
        want = wanted.get(dep_id) if isinstance(dep_id, int) else None
        base = (entry.get("litellm_params") or {}).get("api_base")
        return (entry_instance(entry) is None and want is not None and isinstance(base, str)
                and base.rstrip("/") == want["litellm_params"]["api_base"].rstrip("/"))

    def _diff(self, rnd: _Round, entries: list[dict[str, Any]], *, patch: bool = True
              ) -> tuple[list[int], dict[int, dict[str, Any]], dict[int | str, list[dict[str, Any]]]]:
        """The ids to add, the entries to patch (their warmth alone differs; only with
        ``patch``), and the entries to delete by id once their adds succeeded."""
        ours: dict[int | str, list[dict[str, Any]]] = {}
        for entry in entries:
            dep_id = entry_dgxmm_id(entry)
            if dep_id is not None and self._ours(entry, rnd.wanted):
                ours.setdefault(dep_id, []).append(entry)
        to_add: list[int] = []
        to_patch: dict[int, dict[str, Any]] = {}
        # Deletes allowed once the ids' adds succeeded (None key: needs no add).
        replace: dict[int | str, list[dict[str, Any]]] = {}
        for dep_id, want in rnd.wanted.items():
            existing = ours.get(dep_id, [])
            changes = [entry_change(e, want) for e in existing]
            keep = next((e for e, c in zip(existing, changes, strict=True) if c == "same"), None)
            if keep is None and patch:
                keep = next((e for e, c in zip(existing, changes, strict=True)
                             if c == "warmth" and entry_id(e) is not None), None)
                if keep is not None:
                    to_patch[dep_id] = keep
            if keep is None:
                to_add.append(dep_id)
                replace[dep_id] = existing
            else:
                if dep_id not in to_patch:
                    rnd.statuses[dep_id] = _status("registered")
                # Duplicates (e.g. a row stored but loaded late after a failed verify).
                replace[dep_id] = [e for e in existing if e is not keep]
        for dep_id, existing in ours.items():
            if dep_id not in rnd.wanted and dep_id not in rnd.left_alone:
                replace[dep_id] = existing
        return to_add, to_patch, replace

    @staticmethod
    async def _patch(client: LiteLLMClient, rnd: _Round, to_patch: dict[int, dict[str, Any]],
                     to_add: list[int], replace: dict[int | str, list[dict[str, Any]]]) -> None:
        """Every change of warmth alone, in place. One LiteLLM cannot patch (no route, the
        entry gone, an error) is replaced instead: added with the round's adds, the old
        entry deleted after them."""
        for dep_id, entry in to_patch.items():
            want = rnd.wanted[dep_id]
            model_id = entry_id(entry)
            assert model_id is not None  # _diff patches only entries with an id
            order = want["litellm_params"]["order"]
            state = want["model_info"]["dgxmm_state"]
            outcome = "no_route"
            if client.patch_route is not False:  # may have been learned earlier this round
                try:
                    outcome = await client.patch_warmth(model_id, order, state)
                except LiteLLMError as exc:
                    if exc.code in _GLOBAL_CODES:
                        raise _Stop(exc.code) from None
                    log.warning("LiteLLM sync: patching %s in place failed, replacing it: %s (%s)",
                                want["model_name"], exc.message, exc.detail)
                    outcome = "failed"
                if outcome == "no_route":  # said once: the client remembers it
                    log.warning("LiteLLM sync: LiteLLM at %s has no PATCH /model/{id}/update (404/405): "
                                "a change of warmth replaces the entry (a new LiteLLM id) until "
                                "ondemand restarts", client.base_url)
            if outcome == "patched":
                rnd.statuses[dep_id] = _status("registered")
                rnd.patched.append({"dgxmm_id": dep_id, "model_name": want["model_name"],
                                    "model_id": model_id, "order": order, "state": state})
                continue
            to_add.append(dep_id)
            if outcome != "gone":  # a gone entry has nothing left to delete
                replace.setdefault(dep_id, []).append(entry)

    @staticmethod
    async def _add(client: LiteLLMClient, rnd: _Round, to_add: list[int],
                   replace: dict[int | str, list[dict[str, Any]]]) -> None:
        """Every add of the round; a failed one keeps its old entry (the name must not vanish)."""
        for dep_id in to_add:
            want = rnd.wanted[dep_id]
            try:
                entry = await client.add_model(want["model_name"], want["litellm_params"],
                                               want["model_info"])
            except LiteLLMError as exc:
                log.warning("LiteLLM sync: adding %s failed: %s (%s)",
                            want["model_name"], exc.message, exc.detail)
                if exc.code in _GLOBAL_CODES:
                    raise _Stop(exc.code) from None
                rnd.first_error = rnd.first_error or exc.code
                rnd.statuses[dep_id] = _status("error", exc.code)
                replace.pop(dep_id, None)  # keep the old entry: the name must not vanish
                continue
            rnd.statuses[dep_id] = _status("registered")
            rnd.added.append({"dgxmm_id": dep_id, "model_name": want["model_name"],
                              "model_id": entry_id(entry)})

    @staticmethod
    async def _delete(client: LiteLLMClient, rnd: _Round, replace: dict[int | str, list[dict[str, Any]]]) -> None:
        """Every delete of the round, after all its adds."""
        for dep_id, existing in replace.items():
            for entry in existing:
                model_id = entry_id(entry)
                if model_id is None:
                    continue  # nothing LiteLLM could delete it by
                try:
                    await client.delete_model(model_id)
                except LiteLLMError as exc:
                    log.warning("LiteLLM sync: deleting %s failed: %s (%s)",
                                entry.get("model_name"), exc.message, exc.detail)
                    if exc.code in _GLOBAL_CODES:
                        raise _Stop(exc.code) from None
                    rnd.first_error = rnd.first_error or exc.code
                    continue
                rnd.deleted.append({"dgxmm_id": dep_id, "model_name": entry.get("model_name"),
                                    "model_id": model_id})
