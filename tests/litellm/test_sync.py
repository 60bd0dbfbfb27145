"""The LiteLLM sync (ondemand/litellm/sync.py) against the LiteLLM admin-API double over HTTP
(tests/litellm_double.py): it keeps LiteLLM's entries equal to what the deployments want, adds
before it deletes, never touches an entry not its own (another box's, a hand-made one), patches
a change of warmth in place, says what went wrong when LiteLLM fails and loses nothing, coalesces
its triggers and never overlaps, and never holds up the gateway. The entries themselves are
test_entries.py's; the client's answers to LiteLLM's, test_litellm.py's."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from helpers import free_port, run_app, two_pools, wait_for
from litellm_double import litellm_double
from sync_world import (
    BOX,
    INTERNAL,
    INTERNAL_B,
    MASTER,
    World,
    assert_adds_before_deletes,
    by_dgxmm_id,
    dep,
    fp,
    make_client,
    make_sync,
    warmth,
)

from ondemand.litellm.client import LiteLLMError
from ondemand.litellm.entries import names_view, ondemand_entry
from ondemand.litellm.sync import LiteLLMSync
from ondemand.model import State

# ---------------------------------------------------------------------------
# Registration


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


# ---------------------------------------------------------------------------
# LiteLLM broken: the gateway never waits for it

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}


async def bad_litellm(kind: str) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "garbage":
            return web.Response(body=b"\x00<html>not json{", content_type="application/json")
        resp = web.StreamResponse()  # headers, then a connection cut half-way through a body
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"data": [')
        request.transport.close()
        return resp
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["hang", "garbage", "cut"])
async def test_a_broken_litellm_never_holds_up_the_gateway(tmp_path, kind):
    """A LiteLLM that hangs, answers garbage or cuts its answer never holds up the gateway: the
    sync runs on its own, with a timeout, and says what went wrong (BEHAVIOUR.md, "LiteLLM
    registration"). The whole ondemand on loopback."""
    runner, url = await bad_litellm(kind)
    master = tmp_path / "litellm.key"
    master.write_text("sk-master\n")
    master.chmod(0o600)
    try:
        async with run_app(tmp_path, **{"litellm.url": url, "litellm.master_key_file": str(master)}) as server:
            a = await server.add("a", 4)
            async with two_pools() as http:
                t0 = time.monotonic()
                async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
                    assert r.status == 200  # a cold start, while the sync is stuck or failing
                for _ in range(20):  # and requests to the ready model, each at once
                    t1 = time.monotonic()
                    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
                        assert r.status == 200
                    assert time.monotonic() - t1 < 1.0
                assert time.monotonic() - t0 < 8  # nothing waited on LiteLLM
                async with http.get(f"{server.url}/api/host", headers=server.admin_headers()) as r:
                    host = await r.json()
                    assert r.status == 200 and host["ondemand"]["litellm_ready"] is False
            if kind != "hang":
                sync = server.app[__import__("ondemand.app", fromlist=["SYNC"]).SYNC]
                await wait_for(lambda: sync.last_result and sync.last_result.get("error"), timeout=15,
                               what="the sync's error")
    finally:
        await runner.cleanup()


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
# Warmth written in place (issue 22)


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
