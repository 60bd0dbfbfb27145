"""The registry, the one writer of the deployments' rows (ondemand/engines/registry.py), on a
real state file: a change is in memory at once and stored with its event before it is
published; ``update`` and ``edit`` keep to what they may change; a measured footprint is kept
only when it moved. Its operations on engines (start, stop, sleep): test_deployer.py; edits
through the admin API: test_admin.py."""
from __future__ import annotations

import contextlib
import sqlite3

import pytest
from helpers import dep_fields, running_deployer

from ondemand.errors import DeployerError, DeploymentBusy, NameTaken
from ondemand.events import DeploymentChanged
from ondemand.model import Priority, State


async def row(store, dep_id: int) -> dict:
    return next(r for r in await store.deployments() if r["id"] == dep_id)


async def test_a_transition_is_in_memory_at_once_and_stored_with_its_event_before_it_is_published(tmp_path, store):
    published: list[tuple[DeploymentChanged, str, list[str]]] = []

    def on_change(event) -> None:  # the file as another reader sees it when the change is published
        if isinstance(event, DeploymentChanged) and event.dep is not None:
            with contextlib.closing(sqlite3.connect(store.path)) as db:
                state = db.execute("SELECT state FROM deployments WHERE id = ?", (event.dep_id,)).fetchone()[0]
                texts = [t for (t,) in db.execute("SELECT text FROM events WHERE deployment_id = ?",
                                                   (event.dep_id,))]
            published.append((event, state, texts))
    async with running_deployer(tmp_path, store, publish=on_change) as d:
        a = (await d.create(dep_fields("a"))).id
        assert published[0][0].created and published[0][1:] == ("stopped", ["created (on_demand)"])
        old, new = d.mark(a, State.FAILED, "exit code 1")
        assert d.get(a) is new and new.state is State.FAILED  # readers see it without an await
        assert (await row(store, a))["state"] == "stopped" and len(published) == 1  # not yet written or told
        await d.persist(old, new)
        [_, (event, state, texts)] = published  # told once
        assert event.old is old and event.dep is new
        assert state == "failed" and texts[-1] == "stopped → failed: exit code 1"  # stored before it was told


async def test_update_changes_stored_fields_never_the_state(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        a = (await d.create(dep_fields("a"))).id
        for bad in ({"state": "ready"}, {"id": 9}, {"state_reason": "x"}):
            with pytest.raises(DeployerError, match="not changeable through update"):
                await d.update(a, **bad)
        assert d.get(a).state is State.STOPPED
        await d.update(a, priority=Priority.HIGH, text="raised", audit="deployment_update")
        assert d.get(a).priority is Priority.HIGH and (await row(store, a))["priority"] == "high"
        assert [r["text"] for r in await store.audit(a) if r["action"] == "deployment_update"] == ["raised"]


async def test_an_engine_that_runs_is_edited_in_its_live_fields_only_and_a_name_stays_unique(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        a = (await d.create(dep_fields("a"))).id
        b = (await d.create(dep_fields("b"))).id
        with pytest.raises(NameTaken):
            await d.edit(b, {"name": "a"})
        old, new = d.mark(a, State.READY)
        await d.persist(old, new)
        with pytest.raises(DeploymentBusy, match="a is ready: only a stopped"):
            await d.edit(a, {"memory_gib": 12})
        assert (await d.edit(a, {"max_inflight": 4, "priority": "low"})).max_inflight == 4
        assert await d.edit(a, {"max_inflight": 4}) is d.get(a)  # nothing differs: nothing written
        for same in ({"memory_gib": 10}, {}):  # no change is no edit, whatever the fields: not busy
            assert await d.edit(a, same) is d.get(a)
        [audit] = [r for r in await store.audit(a) if r["action"] == "deployment_update"]
        assert audit["detail"] == {"old": {"max_inflight": None, "priority": "normal"},
                                   "new": {"max_inflight": 4, "priority": "low"}}


async def test_an_edit_masks_secret_values_in_its_audit_row_and_forgets_the_old_engines_measurements(tmp_path,
                                                                                                     store):
    async with running_deployer(tmp_path, store) as d:
        a = (await d.create(dep_fields("a", env={"HF_TOKEN": "hf_old", "MODE": "x"}))).id
        await d.update(a, measured_gib=9.5, asleep_gib=1.0)
        await d.edit(a, {"env": {"HF_TOKEN": "hf_new", "MODE": "y"}, "memory_gib": 12})
        [audit] = [r for r in await store.audit(a) if r["action"] == "deployment_update"]
        assert audit["detail"]["old"]["env"] == {"HF_TOKEN": "***", "MODE": "x"}
        assert audit["detail"]["new"]["env"] == {"HF_TOKEN": "***", "MODE": "y"}
        assert "hf_new" not in str(await store.audit(a)) and d.get(a).env == (("HF_TOKEN", "hf_new"), ("MODE", "y"))
        dep = d.get(a)
        assert dep.measured_gib is None and dep.asleep_gib is None  # another engine: measured again


async def test_a_measured_footprint_is_kept_when_it_moved_and_over_declared_is_told_once(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        a = (await d.create(dep_fields("a", 10))).id
        await d.record_footprint(a, 9.0)
        assert d.get(a).measured_gib is None  # not ready: no engine of its own to measure
        old, new = d.mark(a, State.READY)
        await d.persist(old, new)
        await d.record_footprint(a, 9.0)
        assert d.get(a).measured_gib == 9.0
        await d.record_footprint(a, 9.04)  # less than 50 MiB: the same
        assert d.get(a).measured_gib == 9.0 and (await row(store, a))["measured_gib"] == 9.0
        for gib in (11.5, 12.0):  # over 10 % above the 10 GiB declared
            await d.record_footprint(a, gib)
        assert d.get(a).measured_gib == 12.0
        told = [e["text"] for e in await store.events(a) if "more than the" in e["text"]]
        assert told == ["uses 11.5 GiB of GPU memory, more than the 10 GiB it declared: fit checks count the "
                        "measured size; raise memory_gib"]
