"""LiteLLM registration: entries, the client and the sync, against the LiteLLM double over HTTP."""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json

import aiohttp
import pytest
from helpers import wait_for
from litellm_double import litellm_double

from ondemand.litellm.client import LiteLLMClient, LiteLLMError
from ondemand.litellm.entries import (
    ORDER_ASLEEP,
    ORDER_COLD,
    ORDER_READY,
    always_on_entry,
    entry_change,
    entry_order,
    entry_state,
    entry_warmth,
    names_view,
    ondemand_entry,
    params_fingerprint,
    warmth_order,
)
from ondemand.litellm.sync import LiteLLMSync
from ondemand.model import State

MASTER = "sk-master"
INTERNAL = "http://dgxmm:8090/dgxmm"
BOX = "box-a"


def fp(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def params_fp(api_base: str, timeout: int) -> str:
    covered = {"api_base": api_base, "health_check_params": {"extra_headers": {"x-dgxmm-health-check": "1"}},
               "num_retries": 0, "stream_timeout": timeout, "timeout": timeout}
    return fp(json.dumps(covered, sort_keys=True, separators=(",", ":")))


def dep(dep_id: int, name: str, *, mode: str | None = "on_demand", state: str = "stopped",
        role: str = "model", served_name: str | None = None) -> dict:
    return {"id": dep_id, "name": name, "served_name": served_name or f"{name}-served",
            "engine": "vllm", "state": state, "mode": mode, "role": role}


class World:
    """The deployments, key and engine addresses the sync reads."""

    def __init__(self, *deps: dict, key: str | None = "key-one"):
        self.deployments = list(deps)
        self.key = key
        self.addresses: dict[int, str] = {}
        self.delay = 0.0
        self.syncs = 0
        self.running = 0
        self.max_running = 0
        self.started = asyncio.Event()

    async def list_deployments(self) -> list[dict]:
        self.syncs += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.set()
        try:
            if self.delay:
                await asyncio.sleep(self.delay)  # a slow deployment listing: the behaviour under test
            return copy.deepcopy(self.deployments)
        finally:
            self.running -= 1

    def current_key(self) -> str | None:
        return self.key

    def engine_base_url(self, d: dict) -> str | None:
        return self.addresses.get(d["id"])

    def set(self, dep_id: int, **fields) -> None:
        next(d for d in self.deployments if d["id"] == dep_id).update(fields)


def make_client(double) -> LiteLLMClient:
    return LiteLLMClient(double.url, MASTER, timeout_s=2.0, verify_attempts=2, verify_delay_s=0.01)


def make_sync(double, world: World, *, queue_timeout_s: int = 900, interval_s: float = 60.0,
              instance: str = BOX, internal_url: str = INTERNAL, client: LiteLLMClient | None = None) -> LiteLLMSync:
    """The sync of ``world`` to the double; ``client``: the LiteLLM client it uses (a new one)."""
    return LiteLLMSync(client=client if client is not None else make_client(double), internal_url=internal_url,
                       queue_timeout_s=queue_timeout_s, list_deployments=world.list_deployments,
                       current_key=world.current_key, engine_base_url=world.engine_base_url,
                       interval_s=interval_s, instance=instance)


def by_dgxmm_id(double) -> dict:
    out: dict = {}
    for m in double.models:
        if "dgxmm_id" in m["model_info"]:
            out.setdefault(m["model_info"]["dgxmm_id"], []).append(m)
    return out


def assert_adds_before_deletes(calls) -> None:
    writes = [path for method, path, _ in calls if method == "POST"]
    assert "/model/new" in writes and "/model/delete" in writes
    assert max(i for i, p in enumerate(writes) if p == "/model/new") < \
        min(i for i, p in enumerate(writes) if p == "/model/delete"), writes


# ---------------------------------------------------------------------------
# Entries


def test_ondemand_entry_every_field():
    entry = ondemand_entry(dep(7, "qwen", served_name="Qwen/Qwen3-8B"), "secret-key", INTERNAL, 900, instance=BOX)
    api_base = "http://dgxmm:8090/dgxmm/ondemand/7/v1"
    assert entry == {
        "model_name": "Qwen/Qwen3-8B",
        "litellm_params": {
            "model": "openai/Qwen/Qwen3-8B",
            "api_base": api_base,
            "api_key": "secret-key",
            "timeout": 1500,
            "stream_timeout": 1500,
            "num_retries": 0,
            "order": 3,  # stopped: cold
        },
        "model_info": {
            "dgxmm_id": 7,
            "dgxmm_instance": BOX,
            "dgxmm_state": "cold",
            "dgxmm_key_fp": hashlib.sha256(b"secret-key").hexdigest()[:12],
            "dgxmm_params_fp": params_fp(api_base, 1500),
            "health_check_params": {"extra_headers": {"x-dgxmm-health-check": "1"}},
        },
    }
    # The floor is 1200 s; above it, the queue limit plus 600 s.
    assert ondemand_entry(dep(7, "q"), "k", INTERNAL, 60, instance=BOX)["litellm_params"]["timeout"] == 1200
    long = ondemand_entry(dep(7, "q"), "k", INTERNAL + "/", 1000, instance=BOX)
    assert long["litellm_params"]["stream_timeout"] == 1600
    assert long["litellm_params"]["api_base"] == api_base
    assert long["model_info"]["dgxmm_params_fp"] == params_fp(api_base, 1600)


def test_always_on_entry_every_field():
    entry = always_on_entry(dep(3, "llama", mode="always_on", served_name="llama-3"), "http://dgxmm-llama:8000", instance=BOX)
    assert entry == {
        "model_name": "llama-3",
        "litellm_params": {"model": "openai/llama-3", "api_base": "http://dgxmm-llama:8000/v1",
                           "api_key": "none", "order": 1},
        "model_info": {"dgxmm_id": 3, "dgxmm_instance": BOX, "dgxmm_state": "ready"},
    }


async def test_registered_entry_is_stored_exactly():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"))
        sync = make_sync(double, world)
        result = await sync.sync_now()
        assert result["error"] is None
        assert [a["dgxmm_id"] for a in result["added"]] == [1]
        (stored,) = double.models
        want = ondemand_entry(world.deployments[0], "key-one", INTERNAL, 900, instance=BOX)
        model_id = stored["model_info"].pop("id")
        assert result["added"][0]["model_id"] == model_id
        assert stored["model_info"] == {"db_model": True, **want["model_info"]}
        assert stored["model_name"] == want["model_name"]
        assert stored["litellm_params"] == want["litellm_params"]
        assert sync.status_of(1) == {"status": "registered", "code": None}
        assert sync.last_ok and sync.enabled
        await sync.close()


# ---------------------------------------------------------------------------
# Reconciliation


async def test_key_rotation_replaces_entries_adds_before_deletes():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b", state="ready"))
        sync = make_sync(double, world)
        assert (await sync.sync_now())["error"] is None
        old_ids = {m["model_info"]["id"] for m in double.models}
        world.key = "key-two"
        double.calls.clear()
        result = await sync.sync_now()
        assert result["error"] is None
        assert sorted(a["dgxmm_id"] for a in result["added"]) == [1, 2]
        assert {d["model_id"] for d in result["deleted"]} == old_ids
        assert_adds_before_deletes(double.calls)
        assert len(double.models) == 2
        for m in double.models:
            assert m["litellm_params"]["api_key"] == "key-two"
            assert m["model_info"]["dgxmm_key_fp"] == fp("key-two")
        await sync.close()


async def test_failed_deployment_entry_is_removed():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b"))
        sync = make_sync(double, world)
        await sync.sync_now()
        world.set(2, state="failed")
        result = await sync.sync_now()
        assert result["error"] is None and result["added"] == []
        assert [d["dgxmm_id"] for d in result["deleted"]] == [2]
        assert list(by_dgxmm_id(double)) == [1]
        assert sync.status_of(2) == {"status": "pending", "code": "deployment_failed"}
        # A removed deployment's entry goes as well.
        world.deployments = []
        await sync.sync_now()
        assert double.models == []
        await sync.close()


async def test_planned_deployment_is_not_registered_until_it_leaves_planned():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="planned"), dep(2, "b", mode="always_on", state="planned"))
        sync = make_sync(double, world)
        assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.models == [] and double.writes() == []
        assert sync.status_of(1) == {"status": "pending", "code": "deployment_planned"}
        assert sync.status_of(2) == {"status": "pending", "code": "deployment_planned"}
        # Leaving planned (an administrator's start) registers the on-demand one at once.
        world.set(1, state="starting")
        result = await sync.sync_now()
        assert [a["dgxmm_id"] for a in result["added"]] == [1] and result["deleted"] == []
        assert list(by_dgxmm_id(double)) == [1]
        assert sync.status_of(1) == {"status": "registered", "code": None}
        # Back to planned: its entry is removed, nothing else is touched.
        other = double.seed("not-ours", {"model": "openai/x", "api_base": "http://elsewhere/v1"})
        world.set(1, state="planned")
        result = await sync.sync_now()
        assert result["added"] == [] and [d["dgxmm_id"] for d in result["deleted"]] == [1]
        assert by_dgxmm_id(double) == {}
        assert [m["model_info"]["id"] for m in double.models] == [other]
        assert sync.status_of(1) == {"status": "pending", "code": "deployment_planned"}
        await sync.close()


async def test_without_key_nothing_is_deleted():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b", mode="always_on", state="ready"))
        world.addresses[2] = "http://engine-b:8000"
        sync = make_sync(double, world)
        await sync.sync_now()
        before = double.models
        world.key = None
        double.calls.clear()
        result = await sync.sync_now()
        assert result == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.writes() == []
        assert double.models == before
        assert sync.status_of(1) == {"status": "error", "code": "ondemand_not_configured"}
        assert sync.status_of(2) == {"status": "registered", "code": None}
        # A new on-demand deployment is not registered without a key; always-on ones are.
        world.deployments.append(dep(3, "c"))
        world.deployments.append(dep(4, "d", mode=None, state="ready"))
        world.addresses[4] = "http://engine-d:8000"
        result = await sync.sync_now()
        assert [a["dgxmm_id"] for a in result["added"]] == [4]
        assert sorted(by_dgxmm_id(double)) == [1, 2, 4]
        assert sync.status_of(3) == {"status": "error", "code": "ondemand_not_configured"}
        await sync.close()


async def test_unchanged_state_writes_nothing():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b", mode="always_on", state="ready"),
                      dep(3, "c", state="asleep"))
        world.addresses[2] = "http://engine-b:8000"
        sync = make_sync(double, world)
        await sync.sync_now()
        double.calls.clear()
        for _ in range(2):
            assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.writes() == []
        assert [c[:2] for c in double.calls] == [("GET", "/model/info")] * 2
        await sync.close()


async def test_changed_queue_timeout_replaces_once_then_stable():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b"))
        sync = make_sync(double, world, queue_timeout_s=900)
        await sync.sync_now()
        sync.queue_timeout_s = 1200
        double.calls.clear()
        result = await sync.sync_now()
        assert len(result["added"]) == 2 and len(result["deleted"]) == 2
        assert_adds_before_deletes(double.calls)
        for m in double.models:
            assert m["litellm_params"]["timeout"] == 1800
        double.calls.clear()
        assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.writes() == []
        await sync.close()


async def test_entries_of_an_older_version_are_replaced_once():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"))
        want = ondemand_entry(world.deployments[0], "key-one", INTERNAL, 900, instance=BOX)
        # Same api_base and key fingerprint, but from before the health-check marker.
        old_id = double.seed(want["model_name"], want["litellm_params"],
                             {"dgxmm_id": 1, "dgxmm_key_fp": fp("key-one")})
        sync = make_sync(double, world)
        result = await sync.sync_now()
        assert [a["dgxmm_id"] for a in result["added"]] == [1]
        assert [d["model_id"] for d in result["deleted"]] == [old_id]
        assert_adds_before_deletes(double.calls)
        (m,) = double.models
        assert m["model_info"]["health_check_params"] == {"extra_headers": {"x-dgxmm-health-check": "1"}}
        double.calls.clear()
        assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.writes() == []
        await sync.close()


async def test_mode_switch_changes_api_base_add_then_delete():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"))
        sync = make_sync(double, world)
        await sync.sync_now()
        (gateway,) = double.models
        assert gateway["litellm_params"]["api_base"] == f"{INTERNAL}/ondemand/1/v1"
        # Switching: stays on_demand (pending_mode) while starting: the gateway entry stays.
        world.set(1, state="starting", pending_mode="always_on")
        assert (await sync.sync_now())["added"] == []
        # Ready: the mode is applied, the direct entry replaces the gateway one.
        world.set(1, state="ready", mode="always_on", pending_mode=None)
        world.addresses[1] = "http://engine-a:8000/"
        double.calls.clear()
        result = await sync.sync_now()
        assert [d["model_id"] for d in result["deleted"]] == [gateway["model_info"]["id"]]
        assert_adds_before_deletes(double.calls)
        (direct,) = double.models
        assert direct["litellm_params"] == {"model": "openai/a-served", "api_base": "http://engine-a:8000/v1",
                                            "api_key": "none", "order": 1}
        assert {k: v for k, v in direct["model_info"].items() if k not in ("id", "db_model")} == {
            "dgxmm_id": 1, "dgxmm_instance": BOX, "dgxmm_state": "ready"}
        # And back to on demand.
        world.set(1, mode="on_demand")
        double.calls.clear()
        await sync.sync_now()
        assert_adds_before_deletes(double.calls)
        (back,) = double.models
        assert back["litellm_params"]["api_base"] == f"{INTERNAL}/ondemand/1/v1"
        await sync.close()


async def test_always_on_registered_only_while_ready_and_decision_is_direct():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "m", mode="always_on", state="starting"),
                      dep(2, "decider", mode="on_demand", state="ready", role="decision"),
                      dep(3, "sys", mode=None, state="ready", role="system"))
        world.addresses.update({2: "http://decider:8000", 3: "http://sys:8000"})
        sync = make_sync(double, world)
        await sync.sync_now()
        entries = by_dgxmm_id(double)
        assert sorted(entries) == [2, 3]
        assert entries[2][0]["litellm_params"]["api_base"] == "http://decider:8000/v1"
        assert sync.status_of(1) == {"status": "pending", "code": "engine_not_ready"}
        # Ready but no address yet: still not registered.
        world.set(1, state="ready")
        await sync.sync_now()
        assert 1 not in by_dgxmm_id(double)
        world.addresses[1] = "http://m:8000"
        await sync.sync_now()
        assert 1 in by_dgxmm_id(double)
        assert sync.status_of(1) == {"status": "registered", "code": None}
        # Leaving ready removes the direct entry.
        world.set(1, state="stopping")
        result = await sync.sync_now()
        assert [d["dgxmm_id"] for d in result["deleted"]] == [1]
        await sync.close()


async def test_an_always_on_start_pending_after_a_restart_keeps_the_gateway_entry_until_ready():
    """After ondemand's restart an always-on deployment whose engine is gone is owed a start
    (mode always_on, pending_mode always_on): its dead direct entry is replaced by the gateway
    entry, adds before deletes, which stays until ready; then the direct one. The decision
    model never goes through the gateway: it just waits for ready."""
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "m", mode="always_on", state="ready"),
                      dep(2, "decider", mode="always_on", state="ready", role="decision"))
        world.addresses.update({1: "http://old:8000", 2: "http://old-decider:8000"})
        sync = make_sync(double, world)
        await sync.sync_now()
        dead = by_dgxmm_id(double)[1][0]
        world.addresses.clear()
        world.set(1, state="stopped", pending_mode="always_on")
        world.set(2, state="stopped", pending_mode="always_on")
        double.calls.clear()
        result = await sync.sync_now()
        assert_adds_before_deletes(double.calls)
        assert sorted(d["dgxmm_id"] for d in result["deleted"]) == [1, 2]  # the dead direct entries
        assert dead["model_info"]["id"] in [d["model_id"] for d in result["deleted"]]
        (gateway,) = by_dgxmm_id(double)[1]
        assert gateway["litellm_params"]["api_base"] == f"{INTERNAL}/ondemand/1/v1"
        assert 2 not in by_dgxmm_id(double)
        world.set(1, state="starting")
        assert (await sync.sync_now())["added"] == []  # unchanged while it starts
        world.set(1, state="ready", pending_mode=None)
        world.addresses[1] = "http://new:8000"
        double.calls.clear()
        await sync.sync_now()
        assert_adds_before_deletes(double.calls)
        (direct,) = by_dgxmm_id(double)[1]
        assert direct["litellm_params"]["api_base"] == "http://new:8000/v1"
        await sync.close()


async def test_entries_not_ours_are_never_touched():
    async with litellm_double(MASTER) as double:
        foreign = [
            double.seed("a-served", {"model": "openai/a-served", "api_base": "http://elsewhere/v1"}),
            double.seed("gpt-4o", {"model": "openai/gpt-4o"}, {"team_id": None, "note": "x"}),
            double.seed("cfg", {"model": "openai/cfg"}, db_model=False),
        ]
        world = World(dep(1, "a"))
        sync = make_sync(double, world)
        await sync.sync_now()
        world.key = "key-two"
        await sync.sync_now()
        world.deployments = []
        await sync.sync_now()
        deleted = [body["id"] for method, path, body in double.calls if path == "/model/delete"]
        assert not set(deleted) & set(foreign)
        assert sorted(m["model_info"]["id"] for m in double.models) == sorted(foreign)
        await sync.close()


async def test_dgxmm_id_is_compared_robustly():
    async with litellm_double(MASTER) as double:
        world = World(dep(5, "a"))
        want = ondemand_entry(world.deployments[0], "key-one", INTERNAL, 900, instance=BOX)
        info = dict(want["model_info"], dgxmm_id="5")  # came back as a string
        double.seed(want["model_name"], want["litellm_params"], info)
        sync = make_sync(double, world)
        assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        assert double.writes() == []
        assert sync.status_of(5)["status"] == "registered"
        # Duplicates of one id are folded into one entry.
        double.seed(want["model_name"], want["litellm_params"], want["model_info"])
        result = await sync.sync_now()
        assert result["added"] == [] and len(result["deleted"]) == 1
        assert len(double.models) == 1
        await sync.close()


# ---------------------------------------------------------------------------
# LiteLLM failing


async def test_litellm_down_loses_nothing_and_recovers():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"), dep(2, "b"))
        sync = make_sync(double, world)
        await sync.sync_now()
        before = double.models
        world.key = "key-two"
        world.set(2, state="failed")
        world.deployments.append(dep(3, "c"))
        for down, code in ((True, "litellm_error"), ("close", "litellm_unreachable")):
            double.down = down
            result = await sync.sync_now()
            assert result == {"added": [], "patched": [], "deleted": [], "error": code}
            assert not sync.last_ok
            assert sync.status_of(1) == {"status": "registered", "code": None}
            assert sync.status_of(3) == {"status": "error", "code": code}
        assert double.models == before
        double.down = False
        result = await sync.sync_now()
        assert result["error"] is None and sync.last_ok
        assert sorted(a["dgxmm_id"] for a in result["added"]) == [1, 3]
        assert sorted(d["dgxmm_id"] for d in result["deleted"]) == [1, 2]
        assert sorted(by_dgxmm_id(double)) == [1, 3]
        await sync.close()


async def test_litellm_stopped_is_unreachable():
    async with litellm_double(MASTER) as double:
        url = double.url
    client = LiteLLMClient(url, MASTER, timeout_s=1.0)
    with pytest.raises(LiteLLMError) as info:
        await client.list_models()
    assert info.value.code == "litellm_unreachable"
    await client.close()


async def test_no_db_is_a_clear_error():
    async with litellm_double(MASTER, no_db=True) as double:
        config_id = double.seed("cfg", {"model": "openai/cfg"}, db_model=False)
        world = World(dep(1, "a"))
        sync = make_sync(double, world)
        result = await sync.sync_now()
        assert result == {"added": [], "patched": [], "deleted": [], "error": "litellm_no_db"}
        assert sync.status_of(1) == {"status": "error", "code": "litellm_no_db"}
        assert not sync.last_ok
        assert [m["model_info"]["id"] for m in double.models] == [config_id]
        client = LiteLLMClient(double.url, MASTER)
        with pytest.raises(LiteLLMError) as info:
            await client.add_model("x", {"model": "openai/x"}, {"dgxmm_id": 9})
        assert info.value.code == "litellm_no_db"
        assert "database" in info.value.message
        assert "No DB Connected" in info.value.detail
        with pytest.raises(LiteLLMError) as info:
            await client.delete_model(config_id)
        assert info.value.code == "litellm_no_db"
        # A database but STORE_MODEL_IN_DB unset: the same code.
        double.no_db, double.no_store = False, True
        with pytest.raises(LiteLLMError) as info:
            await client.add_model("x", {"model": "openai/x"}, {"dgxmm_id": 9})
        assert info.value.code == "litellm_no_db"
        assert "STORE_MODEL_IN_DB" in info.value.detail
        await client.close()
        await sync.close()


async def test_silent_store_failure_is_detected_and_keeps_the_old_entry():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"))
        sync = make_sync(double, world)
        await sync.sync_now()
        before = double.models
        world.key = "key-two"
        double.store_silently_fails = True
        result = await sync.sync_now()
        assert result == {"added": [], "patched": [], "deleted": [], "error": "litellm_not_stored"}
        assert sync.status_of(1) == {"status": "error", "code": "litellm_not_stored"}
        assert double.models == before  # the old entry stays: the name never vanishes
        assert not sync.last_ok
        double.store_silently_fails = False
        result = await sync.sync_now()
        assert len(result["added"]) == 1 and len(result["deleted"]) == 1
        assert sync.last_ok
        await sync.close()


async def test_add_model_verifies_with_a_read():
    async with litellm_double(MASTER) as double:
        client = LiteLLMClient(double.url, MASTER, verify_attempts=2, verify_delay_s=0.01)
        entry = await client.add_model("x", {"model": "openai/x", "api_base": "http://e/v1"}, {"dgxmm_id": 9})
        assert entry["model_info"]["dgxmm_id"] == 9 and "api_key" not in entry["litellm_params"]
        for trap in (True, "null"):
            double.store_silently_fails = trap
            with pytest.raises(LiteLLMError) as info:
                await client.add_model("y", {"model": "openai/y"}, {"dgxmm_id": 10})
            assert info.value.code == "litellm_not_stored"
        assert [m["model_name"] for m in double.models] == ["x"]
        assert await client.delete_model(entry["model_info"]["id"]) is True
        assert await client.delete_model(entry["model_info"]["id"]) is False  # already gone
        await client.close()


async def test_wrong_master_key_is_unauthorized():
    async with litellm_double(MASTER) as double:
        client = LiteLLMClient(double.url, "sk-wrong")
        with pytest.raises(LiteLLMError) as info:
            await client.list_models()
        assert info.value.code == "litellm_unauthorized"
        await client.close()
        async with aiohttp.ClientSession() as session, session.get(double.url + "/model/info") as resp:
            assert resp.status == 401
            body = await resp.json()
        assert body == {"error": {"message": "Authentication Error, No api key passed in.",
                                  "type": "auth_error", "param": "None", "code": "401"}}


async def test_empty_litellm_without_router_lists_nothing():
    async with litellm_double(MASTER) as double:
        double.no_router = True
        world = World(dep(1, "a"))
        sync = make_sync(double, world)
        assert (await sync.sync_now())["error"] is None
        assert list(by_dgxmm_id(double)) == [1]
        await sync.close()


async def test_double_answers_like_litellm():
    async with litellm_double(MASTER) as double:
        headers = {"Authorization": f"Bearer {MASTER}"}
        entry = ondemand_entry(dep(1, "a"), "key-one", INTERNAL, 900, instance=BOX)
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(double.url + "/model/new", json=entry) as resp:
                assert resp.status == 200
                row = await resp.json()
            assert set(row) >= {"model_id", "model_name", "litellm_params", "model_info"}
            assert row["litellm_params"]["api_key"] != "key-one"  # encrypted in the row
            for path in ("/model/info", "/v2/model/info"):
                async with session.get(double.url + path) as resp:
                    (listed,) = (await resp.json())["data"]
                assert "api_key" not in listed["litellm_params"]
                assert listed["litellm_params"]["timeout"] == 1500.0
                assert listed["model_info"]["id"] == row["model_id"]
            async with session.post(double.url + "/model/delete", json={"id": "nope"}) as resp:
                assert resp.status == 400
                assert await resp.json() == {"error": {
                    "message": "{'error': 'Model with id=nope not found in db'}",
                    "type": "auth_error", "param": "None", "code": "400"}}
            double.no_db = True
            async with session.post(double.url + "/model/new", json=entry) as resp:
                assert resp.status == 500
                err = (await resp.json())["error"]
            assert err["message"] == ("{'error': \"No DB Connected. Here's how to do it - "
                                      "https://docs.litellm.ai/docs/proxy/virtual_keys\"}")
            assert err["code"] == "500" and err["type"] == "auth_error"


# ---------------------------------------------------------------------------
# Scheduling


async def test_triggers_coalesce_and_syncs_never_overlap():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"))
        world.delay = 0.1
        sync = make_sync(double, world)
        sync.trigger()
        sync.trigger()  # before the first sync started: the same sync
        await asyncio.wait_for(world.started.wait(), 2)
        for _ in range(20):
            sync.trigger()
        direct = asyncio.create_task(sync.sync_now(), name="direct-sync")
        await sync.wait_idle()
        await direct
        assert world.syncs == 3  # the first, exactly one for the burst, the direct one
        assert world.max_running == 1
        sync.trigger()
        await sync.wait_idle()
        assert world.syncs == 4
        await sync.close()


async def test_run_syncs_periodically_and_cancels_cleanly():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a"))
        sync = make_sync(double, world, interval_s=0.05)
        task = asyncio.create_task(sync.run(), name="litellm-sync-run")
        await wait_for(lambda: world.syncs >= 3, timeout=5, what="three periodic syncs")
        assert sync.last_ok
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        count = world.syncs
        await asyncio.sleep(0.1)  # stays: a window of two intervals in which no sync may run
        assert world.syncs == count
        await sync.close()
        sync.trigger()  # closed: no-op
        assert world.syncs == count


async def test_disabled_sync():
    world = World(dep(1, "a"))
    sync = LiteLLMSync(client=None, internal_url=INTERNAL, queue_timeout_s=900,
                       list_deployments=world.list_deployments, current_key=world.current_key,
                       engine_base_url=world.engine_base_url, instance=BOX)
    assert not sync.enabled and not sync.last_ok
    assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": "litellm_disabled"}
    sync.trigger()
    await sync.run()  # returns at once
    assert world.syncs == 0
    assert sync.status_of(1) == {"status": "error", "code": "litellm_disabled"}
    await sync.close()


# ---------------------------------------------------------------------------
# Several boxes behind one LiteLLM

INTERNAL_B = "http://box-b:8090/dgxmm"


async def test_two_instances_with_the_same_ids_never_touch_each_other():
    async with litellm_double(MASTER) as double:
        world_a = World(dep(1, "a"), dep(2, "b", mode="always_on", state="ready"))
        world_a.addresses[2] = "http://engine-a:8000"
        world_b = World(dep(1, "a"), dep(2, "b", mode="always_on", state="ready"))
        world_b.addresses[2] = "http://engine-b:8000"
        sync_a = make_sync(double, world_a)
        sync_b = make_sync(double, world_b, instance="box-b", internal_url=INTERNAL_B)
        for sync in (sync_a, sync_b, sync_a, sync_b):
            assert (await sync.sync_now())["deleted"] == []
        owners = sorted((m["model_info"]["dgxmm_instance"], m["model_info"]["dgxmm_id"]) for m in double.models)
        assert owners == [("box-a", 1), ("box-a", 2), ("box-b", 1), ("box-b", 2)]
        # A key rotation and a removal on A: only A's entries change.
        b_entries = [m for m in double.models if m["model_info"]["dgxmm_instance"] == "box-b"]
        world_a.key = "key-two"
        await sync_a.sync_now()
        world_a.deployments = []
        result = await sync_a.sync_now()
        assert sorted(d["dgxmm_id"] for d in result["deleted"]) == [1, 2]
        assert double.models == b_entries
        assert await sync_b.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        await sync_a.close()
        await sync_b.close()


async def test_entries_from_before_instances_are_adopted_by_their_owner_only():
    async with litellm_double(MASTER) as double:
        world_a = World(dep(1, "a"), dep(2, "b", mode="always_on", state="ready"))
        world_a.addresses[2] = "http://engine-a:8000"
        world_b = World(dep(1, "a"))
        for internal in (INTERNAL, INTERNAL_B):
            want = ondemand_entry(dep(1, "a"), "key-one", internal, 900, instance="x")
            del want["model_info"]["dgxmm_instance"]
            double.seed(want["model_name"], want["litellm_params"], want["model_info"])
        old_direct = double.seed("b-served", {"model": "openai/b-served", "api_base": "http://engine-a:8000/v1"},
                                 {"dgxmm_id": 2})
        stranger = double.seed("a-served", {"model": "openai/a-served", "api_base": "http://elsewhere/v1"},
                               {"dgxmm_id": 1})
        old = {m["litellm_params"]["api_base"]: m["model_info"]["id"] for m in double.models}
        sync_a = make_sync(double, world_a)
        double.calls.clear()
        result = await sync_a.sync_now()
        assert_adds_before_deletes(double.calls)
        assert sorted(d["model_id"] for d in result["deleted"]) == sorted(
            [old[f"{INTERNAL}/ondemand/1/v1"], old_direct])
        sync_b = make_sync(double, world_b, instance="box-b", internal_url=INTERNAL_B)
        result = await sync_b.sync_now()
        assert [d["model_id"] for d in result["deleted"]] == [old[f"{INTERNAL_B}/ondemand/1/v1"]]
        ids = {m["model_info"]["id"] for m in double.models}
        assert stranger in ids  # another api_base, no instance: nobody's to touch
        assert sorted((m["model_info"].get("dgxmm_instance", ""), m["model_info"]["dgxmm_id"])
                      for m in double.models) == [("", 1), ("box-a", 1), ("box-a", 2), ("box-b", 1)]
        for sync in (sync_a, sync_b):  # adopted once: stable from now on
            assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
            await sync.close()


async def test_names_show_which_instances_serve_each_name():
    async with litellm_double(MASTER) as double:
        world_a = World(dep(1, "a", state="ready"), dep(2, "b"))
        world_b = World(dep(1, "a"))
        double.seed("a-served", {"model": "openai/x", "api_base": "http://cloud/v1", "order": 3})
        double.seed("other", {"model": "openai/other"})
        sync_a = make_sync(double, world_a)
        sync_b = make_sync(double, world_b, instance="box-b", internal_url=INTERNAL_B)
        await sync_a.sync_now()
        await sync_b.sync_now()
        names = await sync_b.names()
        assert [n["name"] for n in names] == ["a-served", "b-served"]  # "other" has no ondemand entry
        a = names[0]
        assert a["ready"] == ["box-a"]
        assert [(e["instance"], e["dgxmm_id"], e["state"], e["order"], e["this"]) for e in a["entries"]] == [
            ("box-a", 1, "ready", 1, False), ("box-b", 1, "cold", 3, True), (None, None, "external", 3, False)]
        assert names[1]["ready"] == [] and names[1]["entries"][0]["state"] == "cold"
        double.down = True
        with pytest.raises(LiteLLMError):
            await sync_a.names()
        await sync_a.close()
        await sync_b.close()


# ---------------------------------------------------------------------------
# Warmth: order 1 ready, 2 asleep, 3 cold, written in place (issue 22)


def test_warmth_order_and_state_of_each_deployment_state():
    assert (ORDER_READY, ORDER_ASLEEP, ORDER_COLD) == (1, 2, 3)
    for state in State:
        want = {"ready": ("ready", 1), "asleep": ("asleep", 2)}.get(state.value, ("cold", 3))
        assert (entry_warmth(state), warmth_order(entry_warmth(state))) == want, state
        assert entry_warmth(state.value) == want[0]
        entry = ondemand_entry(dep(1, "a", state=state.value), "k", INTERNAL, 900, instance=BOX)
        assert (entry["model_info"]["dgxmm_state"], entry["litellm_params"]["order"]) == want, state
        assert (entry_state(entry), entry_order(entry)) == want
    assert entry_warmth(None) == "cold"


def test_warmth_is_outside_the_params_fingerprint():
    entries = {s: ondemand_entry(dep(1, "a", state=s), "k", INTERNAL, 900, instance=BOX)
               for s in ("ready", "asleep", "stopped")}
    fps = {e["model_info"]["dgxmm_params_fp"] for e in entries.values()}
    assert len(fps) == 1
    e = entries["ready"]
    assert params_fingerprint(dict(e["litellm_params"], order=3), dict(e["model_info"], dgxmm_state="cold")) \
        == params_fingerprint(e["litellm_params"], e["model_info"])
    # What LiteLLM calls is inside it.
    assert params_fingerprint(dict(e["litellm_params"], timeout=1), e["model_info"]) not in fps
    assert params_fingerprint(dict(e["litellm_params"], api_base="http://x/v1"), e["model_info"]) not in fps


def test_entry_change_patches_warmth_and_replaces_what_litellm_calls():
    ready, asleep, cold = (ondemand_entry(dep(1, "a", state=s), "k", INTERNAL, 900, instance=BOX)
                           for s in ("ready", "asleep", "stopped"))
    assert entry_change(ready, ready) == "same"
    assert entry_change(ready, asleep) == entry_change(asleep, cold) == entry_change(cold, ready) == "warmth"
    # Order alone, or state alone: still warmth (LiteLLM normalised one, an old box wrote the other).
    assert entry_change(dict(ready, litellm_params=dict(ready["litellm_params"], order=2)), ready) == "warmth"
    assert entry_change(dict(ready, model_info=dict(ready["model_info"], dgxmm_state="cold")), ready) == "warmth"
    # Another key, address, timeout, name, model or instance: replaced, whatever the warmth.
    for other in (ondemand_entry(dep(1, "a", state="ready"), "k2", INTERNAL, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL_B, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL, 1200, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready", served_name="b"), "k", INTERNAL, 900, instance=BOX),
                  ondemand_entry(dep(1, "a", state="ready"), "k", INTERNAL, 900, instance="box-b")):
        assert entry_change(other, ready) == entry_change(other, cold) == "replace"
    direct = always_on_entry(dep(1, "a", mode="always_on", state="ready"), "http://e:8000", instance=BOX)
    assert entry_change(direct, direct) == "same" and entry_change(ready, direct) == "replace"


def test_entry_state_reads_dgxmm_state_else_the_order():
    assert entry_state({"model_info": {"dgxmm_state": "ready"}, "litellm_params": {"order": 2}}) == "ready"
    assert entry_state({"model_info": {"dgxmm_state": "asleep"}, "litellm_params": {"order": 2}}) == "asleep"
    # An old box's entry: 2 meant cold, with or without its dgxmm_state.
    assert entry_state({"model_info": {"dgxmm_state": "cold"}, "litellm_params": {"order": 2}}) == "cold"
    assert entry_state({"model_info": {}, "litellm_params": {"order": 2.0}}) == "cold"
    assert entry_state({"model_info": {}, "litellm_params": {"order": 3}}) == "cold"
    assert entry_state({"model_info": {"order": 1}, "litellm_params": {}}) == "ready"
    assert entry_state({"model_info": {"dgxmm_state": "odd"}, "litellm_params": {"order": 7}}) == "unknown"
    assert entry_state({"litellm_params": {"model": "x"}}) == "unknown"
    assert entry_order({"litellm_params": {"order": True}}) is None


def warmth(double) -> tuple:
    (m,) = double.models
    return m["model_info"]["id"], m["litellm_params"]["order"], m["model_info"]["dgxmm_state"]


async def test_a_change_of_warmth_is_patched_in_place_and_keeps_the_litellm_id():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"))
        client = make_client(double)
        sync = make_sync(double, world, client=client)
        await sync.sync_now()
        model_id, order, state = warmth(double)
        assert (order, state) == (3, "cold")
        seen = []
        for step in ("starting", "ready", "ready", "asleep", "asleep", "ready", "stopping", "stopped"):
            world.set(1, state=step)
            double.calls.clear()
            result = await sync.sync_now()
            assert result["error"] is None and result["added"] == [] and result["deleted"] == [], result
            seen.append((step, warmth(double)[1:], [(p["order"], p["state"]) for p in result["patched"]]))
            assert warmth(double)[0] == model_id  # the same LiteLLM id all along
            for method, path, body in double.writes():
                assert (method, path) == ("PATCH", f"/model/{model_id}/update")
                assert body == {"litellm_params": {"order": warmth(double)[1]},
                                "model_info": {"id": model_id, "dgxmm_state": warmth(double)[2]}}
            if result["patched"]:
                (p,) = result["patched"]
                assert p == {"dgxmm_id": 1, "model_name": "a-served", "model_id": model_id,
                             "order": p["order"], "state": p["state"]}
        assert seen == [
            ("starting", (3, "cold"), []), ("ready", (1, "ready"), [(1, "ready")]), ("ready", (1, "ready"), []),
            ("asleep", (2, "asleep"), [(2, "asleep")]), ("asleep", (2, "asleep"), []),
            ("ready", (1, "ready"), [(1, "ready")]), ("stopping", (3, "cold"), [(3, "cold")]),
            ("stopped", (3, "cold"), [])]
        assert double.adds[1:] == [] and double.deletes == []
        assert client.patch_route is True
        # The rest of the entry is untouched by the patches.
        (m,) = double.models
        want = ondemand_entry(world.deployments[0], "key-one", INTERNAL, 900, instance=BOX)
        assert m["litellm_params"] == {**want["litellm_params"], "timeout": 1500.0, "stream_timeout": 1500.0}
        assert {k: v for k, v in m["model_info"].items() if k not in ("id", "db_model")} == want["model_info"]
        assert sync.status_of(1) == {"status": "registered", "code": None}
        await sync.close()


async def test_a_wake_keeps_the_asleep_rank_until_ready_and_a_failed_wakes_cold_start_is_cold():
    """Issue 29: while an asleep deployment wakes (starting, its sleep level kept) its entry
    keeps order 2 and dgxmm_state asleep; ready is the one change written, in place. A cold
    start after a failed wake (the level dropped) ranks cold."""
    async with litellm_double(MASTER) as double:
        world = World(dict(dep(1, "a", state="asleep"), sleep_level=1))
        sync = make_sync(double, world)
        await sync.sync_now()
        model_id = warmth(double)[0]
        seen = []
        for step, level in (("starting", 1), ("ready", None), ("asleep", 2), ("starting", 2),
                            ("starting", None), ("ready", None)):
            world.set(1, state=step, sleep_level=level)
            result = await sync.sync_now()
            assert result["error"] is None and result["added"] == [] and result["deleted"] == [], result
            seen.append((step, level, warmth(double)[1:], len(result["patched"])))
            assert warmth(double)[0] == model_id
        assert seen == [("starting", 1, (2, "asleep"), 0), ("ready", None, (1, "ready"), 1),
                        ("asleep", 2, (2, "asleep"), 1), ("starting", 2, (2, "asleep"), 0),
                        ("starting", None, (3, "cold"), 1), ("ready", None, (1, "ready"), 1)]
        await sync.close()


async def test_a_failed_wakes_cold_start_asks_for_a_sync():
    """A wake keeps its asleep rank (its sync, as it leaves asleep, writes nothing: the test
    above); once it failed and the cold start begins (the level dropped, still starting: no
    change LiteLLM's list needs) the entry must rank cold now, not at the next periodic sync:
    the wake's StartEnded (failed or mismatch) asks for it."""
    from ondemand.events import DeploymentChanged, StartEnded
    from ondemand.litellm.sync import sync_needed, wake_failed
    from ondemand.model import Deployment

    def d(state: State, level: int | None) -> Deployment:
        return Deployment(id=1, name="a", served_name="A", engine="vllm", state=state, sleep_level=level)

    def ended(kind: str, result: str) -> StartEnded:
        return StartEnded(1, "a", kind, 1 if kind == "wake" else None, 1.0, result, 0.0, False, None)
    assert wake_failed(ended("wake", "failed")) and wake_failed(ended("wake", "mismatch"))  # it failed
    assert not wake_failed(ended("wake", "ready")) and not wake_failed(ended("cold", "failed"))
    assert not wake_failed(ended("wake", "stopped"))  # a stop's change to stopping asks what it asks
    assert not sync_needed(DeploymentChanged(1, d(State.STARTING, None), d(State.STARTING, 1)))  # the change
    assert not sync_needed(DeploymentChanged(1, d(State.STARTING, None), d(State.STARTING, None)))  # an edit
    assert sync_needed(DeploymentChanged(1, d(State.READY, None), d(State.STARTING, None)))
    async with litellm_double(MASTER) as double:
        world = World(dict(dep(1, "a", state="starting"), sleep_level=1))  # waking: the asleep rank
        sync = make_sync(double, world)
        await sync.sync_now()
        assert warmth(double)[1:] == (2, "asleep")
        world.set(1, state="starting", sleep_level=None)  # the wake failed: its cold start began
        sync.on_start_ended(ended("wake", "mismatch"))
        await sync.wait_idle()
        assert warmth(double)[1:] == (3, "cold")
        await sync.close()


async def test_a_key_change_still_replaces_even_with_a_change_of_warmth():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="ready"), dep(2, "b", state="asleep"))
        sync = make_sync(double, world)
        await sync.sync_now()
        old_ids = {m["model_info"]["id"] for m in double.models}
        world.key = "key-two"
        world.set(1, state="asleep")  # warmth and key at once: the key wins, a replace
        double.calls.clear()
        result = await sync.sync_now()
        assert result["patched"] == [] and len(result["added"]) == 2
        assert {d["model_id"] for d in result["deleted"]} == old_ids
        assert not [c for c in double.calls if c[0] == "PATCH"]
        assert_adds_before_deletes(double.calls)
        assert sorted((m["model_info"]["dgxmm_id"], m["litellm_params"]["order"]) for m in double.models) == [(1, 2), (2, 2)]
        await sync.close()


@pytest.mark.parametrize("missing", [None, 405])
async def test_without_the_patch_route_a_change_of_warmth_is_replaced_and_patch_is_not_tried_again(missing):
    async with litellm_double(MASTER) as double:
        double.patch_route = missing
        world = World(dep(1, "a", state="stopped"), dep(2, "b", state="stopped"))
        client = make_client(double)
        sync = make_sync(double, world, client=client)
        await sync.sync_now()
        assert client.patch_route is None  # not tried yet
        old = {m["model_info"]["dgxmm_id"]: m["model_info"]["id"] for m in double.models}
        world.set(1, state="ready")
        world.set(2, state="asleep")
        double.calls.clear()
        result = await sync.sync_now()
        assert result["error"] is None and result["patched"] == []
        assert sorted(a["dgxmm_id"] for a in result["added"]) == [1, 2]
        assert sorted(d["model_id"] for d in result["deleted"]) == sorted(old.values())
        patches = [c for c in double.calls if c[0] == "PATCH"]
        assert len(patches) == 1  # the first answer is remembered, even within the round
        assert_adds_before_deletes(double.calls)
        assert client.patch_route is False
        assert sorted((m["model_info"]["dgxmm_id"], m["litellm_params"]["order"], m["model_info"]["dgxmm_state"])
                      for m in double.models) == [(1, 1, "ready"), (2, 2, "asleep")]
        # The next sync does not try again (until a restart, even once the route is there).
        double.patch_route = 200
        world.set(1, state="asleep")
        double.calls.clear()
        result = await sync.sync_now()
        assert [a["dgxmm_id"] for a in result["added"]] == [1] and len(result["deleted"]) == 1
        assert not [c for c in double.calls if c[0] == "PATCH"]
        assert sync.status_of(1) == {"status": "registered", "code": None}
        await sync.close()


async def test_an_entry_of_an_older_box_with_order_2_is_read_as_cold_and_rewritten_in_place():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"), dep(2, "b", state="stopped"), dep(3, "c", state="asleep"))
        old_ids = {}
        for d in world.deployments:
            want = ondemand_entry(d, "key-one", INTERNAL, 900, instance=BOX)
            info = dict(want["model_info"])
            if d["id"] == 1:
                del info["dgxmm_state"]  # written before dgxmm_state: order 2 alone said cold
            else:
                info["dgxmm_state"] = "cold"  # written before issue 22: cold was 2
            old_ids[d["id"]] = double.seed(want["model_name"], dict(want["litellm_params"], order=2), info)
        assert [(e["state"], e["order"]) for n in names_view(double.models, BOX) for e in n["entries"]] == [("cold", 2)] * 3
        sync = make_sync(double, world)
        result = await sync.sync_now()
        assert result["error"] is None and result["added"] == [] and result["deleted"] == []
        assert sorted((p["dgxmm_id"], p["order"], p["state"]) for p in result["patched"]) == [
            (1, 3, "cold"), (2, 3, "cold"), (3, 2, "asleep")]
        assert {m["model_info"]["dgxmm_id"]: (m["model_info"]["id"], m["litellm_params"]["order"],
                                              m["model_info"]["dgxmm_state"]) for m in double.models} == {
            1: (old_ids[1], 3, "cold"), 2: (old_ids[2], 3, "cold"), 3: (old_ids[3], 2, "asleep")}
        assert await sync.sync_now() == {"added": [], "patched": [], "deleted": [], "error": None}
        await sync.close()


async def test_a_failed_patch_falls_back_to_a_replace_and_a_missing_db_stops_the_sync():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"))
        client = make_client(double)
        sync = make_sync(double, world, client=client)
        await sync.sync_now()
        (old,) = double.models
        # 200 and nothing changed: not trusted; the entry is replaced instead.
        double.patch_silently_fails = True
        world.set(1, state="ready")
        double.calls.clear()
        result = await sync.sync_now()
        assert result["error"] is None and result["patched"] == []
        assert len(result["added"]) == 1 and [d["model_id"] for d in result["deleted"]] == [old["model_info"]["id"]]
        assert_adds_before_deletes(double.calls)
        assert warmth(double)[1:] == (1, "ready") and client.patch_route is True  # the route is there
        double.patch_silently_fails = False
        # No database: the sync stops, deletes nothing, the entry stays as it was.
        double.no_db = True
        before = double.models
        world.set(1, state="asleep")
        result = await sync.sync_now()
        assert result == {"added": [], "patched": [], "deleted": [], "error": "litellm_no_db"}
        assert double.models == before and sync.status_of(1) == {"status": "registered", "code": None}
        double.no_db = False
        result = await sync.sync_now()
        assert [p["state"] for p in result["patched"]] == ["asleep"] and result["added"] == []
        await sync.close()


async def test_patch_warmth_answers():
    async with litellm_double(MASTER) as double:
        client = LiteLLMClient(double.url, MASTER, verify_attempts=2, verify_delay_s=0.01)
        entry = await client.add_model("x", {"model": "openai/x", "order": 3}, {"dgxmm_id": 9, "dgxmm_state": "cold"})
        model_id = entry["model_info"]["id"]
        assert await client.patch_warmth(model_id, 2, "asleep") == "patched" and client.patch_route is True
        (m,) = double.models
        assert m["model_info"]["id"] == model_id and m["litellm_params"]["order"] == 2
        assert m["model_info"]["dgxmm_state"] == "asleep" and m["model_info"]["dgxmm_id"] == 9
        # An id LiteLLM does not hold: patch_model's own 404, not a missing route.
        assert await client.patch_warmth("nope", 1, "ready") == "gone" and client.patch_route is True
        config_id = double.seed("cfg", {"model": "openai/cfg"}, db_model=False)
        with pytest.raises(LiteLLMError) as info:
            await client.patch_warmth(config_id, 1, "ready")
        assert info.value.code == "litellm_error" and "config-based" in info.value.detail
        for no_db, no_store, marker in ((True, False, "DB not connected"), (False, True, "DB-stored models")):
            double.no_db, double.no_store = no_db, no_store
            with pytest.raises(LiteLLMError) as info:
                await client.patch_warmth(model_id, 1, "ready")
            assert info.value.code == "litellm_no_db" and marker in info.value.detail
        double.no_db = double.no_store = False
        double.patch_silently_fails = True
        with pytest.raises(LiteLLMError) as info:
            await client.patch_warmth(model_id, 1, "ready")
        assert info.value.code == "litellm_not_stored"
        wrong = LiteLLMClient(double.url, "sk-wrong")
        with pytest.raises(LiteLLMError) as info:
            await wrong.patch_warmth(model_id, 1, "ready")
        assert info.value.code == "litellm_unauthorized" and wrong.patch_route is None
        for missing in (None, 405):
            double.patch_route = missing
            fresh = LiteLLMClient(double.url, MASTER)
            assert await fresh.patch_warmth(model_id, 1, "ready") == "no_route" and fresh.patch_route is False
            await fresh.close()
        await wrong.close()
        await client.close()


async def test_double_patch_answers_like_litellm():
    """The shapes read in patch_model and checked against the real proxy by test_litellm_e2e."""
    async with litellm_double(MASTER) as double:
        headers = {"Authorization": f"Bearer {MASTER}"}
        entry = ondemand_entry(dep(1, "a"), "key-one", INTERNAL, 900, instance=BOX)
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(double.url + "/model/new", json=entry) as resp:
                model_id = (await resp.json())["model_id"]
            url = f"{double.url}/model/{model_id}/update"
            async with session.patch(url, json={"litellm_params": {"order": 1}}) as resp:
                assert resp.status == 200
                row = await resp.json()
            assert row["model_id"] == model_id and row["litellm_params"]["api_key"] != "key-one"
            (m,) = double.models
            assert m["litellm_params"]["order"] == 1 and m["litellm_params"]["api_key"] == "key-one"
            assert m["model_info"]["dgxmm_state"] == "cold"  # model_info not in the patch: kept
            async with session.patch(url) as resp:
                assert resp.status == 422
            async with session.patch(double.url + "/model/nope/update", json={}) as resp:
                assert resp.status == 404
                assert await resp.json() == {"error": {"message": "Model nope not found on proxy.",
                                                       "type": "not_found_error", "param": None, "code": "404"}}
            async with session.get(url) as resp:
                assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}
            double.no_db = True
            async with session.patch(url, json={}) as resp:
                assert resp.status == 500
                assert (await resp.json())["detail"]["error"].startswith("DB not connected.")
            double.patch_route = None
            async with session.patch(url, json={}) as resp:
                assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}


async def test_an_entry_gone_before_its_patch_is_added_anew():
    async with litellm_double(MASTER) as double:
        world = World(dep(1, "a", state="stopped"))
        client = make_client(double)
        sync = make_sync(double, world, client=client)
        await sync.sync_now()
        patch = client.patch_warmth

        async def deleted_meanwhile(model_id, order, state):
            double._models.clear()  # someone deleted it after the sync's read
            return await patch(model_id, order, state)
        client.patch_warmth = deleted_meanwhile
        world.set(1, state="ready")
        double.calls.clear()
        result = await sync.sync_now()
        assert result["error"] is None and result["patched"] == [] and result["deleted"] == []
        assert [a["dgxmm_id"] for a in result["added"]] == [1]
        assert [c[1] for c in double.writes()][-1] == "/model/new"  # nothing left to delete
        assert warmth(double)[1:] == (1, "ready") and client.patch_route is True
        assert sync.status_of(1) == {"status": "registered", "code": None}
        await sync.close()
