"""LiteLLM's admin API as ondemand's client meets it (ondemand/litellm/client.py), against the
LiteLLM double over HTTP (tests/litellm_double.py): each answer of LiteLLM's turned into its
error code (unreachable, unauthorized, no database, not stored), an add and a patch verified by
a read, a patch's outcomes; and the double's own answers, shaped as LiteLLM's (checked against
the real proxy by tests/heavy/test_litellm_e2e.py). The entries are test_entries.py's, the sync
test_sync.py's."""
from __future__ import annotations

import aiohttp
import pytest
from litellm_double import litellm_double
from sync_world import BOX, INTERNAL, MASTER, World, by_dgxmm_id, dep, make_sync

from ondemand.litellm.client import LiteLLMClient, LiteLLMError
from ondemand.litellm.entries import ondemand_entry


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
