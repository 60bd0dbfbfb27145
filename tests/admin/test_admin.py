"""The admin API's deployments (ondemand/admin/deployments.py and fields.py) and the wiring of the
app, against the whole ondemand on loopback: the socket born 0600, creation and its validation,
edits in place, and the LiteLLM sync's triggers. Its other modules have their own files here:
test_api.py (the guard, host, audit, UI, /healthz), test_wire.py, test_actions.py,
test_streams.py, test_components.py. ``api`` and ``new_dep`` are theirs too."""
import asyncio
import os
import stat

import aiohttp
import pytest
from helpers import run_app, sim_command, two_pools, wait_for
from litellm_double import litellm_double

from ondemand.gateway import keys


async def api(server, method, path, body=None, headers=None, unix=False):
    if unix:
        conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
        url = f"http://ondemand{server.cfg.base_path}/api{path}"
    else:
        conn = None
        url = f"{server.url}/api{path}"
        headers = server.admin_headers() if headers is None else headers
    async with aiohttp.ClientSession(connector=conn) as s, s.request(method, url, json=body, headers=headers) as r:
        return r.status, await r.json()


def new_dep(name="a", **kw):
    body = {"name": name, "command": sim_command(name), "memory_gib": 10, "mode": "on_demand"}
    body.update(kw)
    return body


async def test_socket_is_open_and_0600(tmp_path):
    import os as _os

    from ondemand import config
    # served as `serve` does: the socket is born 0600
    cfg = config.load(env={}, overrides={"state_dir": str(tmp_path / "s"), "listen": "127.0.0.1:0",
                                         "deployer.backend": "process", "budget.source": "static",
                                         "budget.capacity_gib": 10, "ondemand_allowed_cidrs": ["127.0.0.0/8"]})
    from ondemand import app as app_mod
    ready = asyncio.Event()
    task = asyncio.ensure_future(app_mod.serve(cfg, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        mode = stat.S_IMODE(_os.stat(cfg.admin_socket).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(_os.stat(cfg.token_file).st_mode) == 0o600
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(cfg.admin_socket))) as s:
            async with s.get("http://x/dgxmm/api/host") as r:
                assert r.status == 200 and (await r.json())["version"]
    finally:
        os.kill(os.getpid(), 15)  # SIGTERM: the graceful path
        await asyncio.wait_for(task, 15)
    assert not cfg.admin_socket.exists()


@pytest.mark.parametrize("body, field", [
    ({"name": "Bad Name"}, "name"), ({"name": "a", "engine": "tgi"}, "engine"),
    ({"name": "a", "mode": "sometimes"}, "mode"), ({"name": "a", "memory_gib": -1}, "memory_gib"),
    ({"name": "a", "idle_timeout_s": 0}, "idle_timeout_s"), ({"name": "a", "idle_timeout_s": 90000}, "idle_timeout_s"),
    ({"name": "a", "role": "decision", "mode": "on_demand"}, "mode"), ({"name": "a", "port": 0}, "port"),
    ({"name": "a", "colour": "red"}, "colour"), ({"name": "a", "command": "not a list"}, "command"),
    ({"name": "a", "gpu_count": -1}, "gpu_count"), ({"name": "a", "gpu_count": True}, "gpu_count"),
    ({"name": "a", "gpu_ids": [0, 0]}, "gpu_ids"), ({"name": "a", "gpu_ids": []}, "gpu_ids"),
    ({"name": "a", "gpu_count": 2, "gpu_ids": [1]}, "gpu_ids"), ({"name": "a", "gpu_ids": "0,1"}, "gpu_ids"),
    ({"name": "a", "idle_action": "nap"}, "idle_action"),
    ({"name": "a", "engine": "llamacpp", "idle_action": "sleep"}, "idle_action"),
    ({"name": "a", "engine": "custom", "idle_action": "sleep2"}, "idle_action"),
])
async def test_validation_names_the_field(server, body, field):
    full = {"command": sim_command("A"), **body}
    status, err = await api(server, "POST", "/deployments", full)
    assert status == 400 and err["error"]["code"] == "invalid_field"
    assert err["error"]["message"].startswith(field + ":")
    assert server.deployer.all() == []


async def test_create_defaults_and_states(server):
    status, view = await api(server, "POST", "/deployments", {"name": "ao", "served_name": "AO", "command": sim_command("AO"),
                                                        "memory_gib": 4})
    assert status == 201 and view["mode"] == "always_on"  # the default
    await wait_for(lambda: server.state(view["id"]) == "ready", what="always on starts at once")
    status, od = await api(server, "POST", "/deployments", new_dep("od"))
    assert od["mode"] == "on_demand" and od["state"] == "stopped"
    assert od["ondemand"] == {"inflight": 0, "queued": 0, "last_request_at": None, "phase": "sleeping", "queue_position": None, "idle_until": None, "backoff_until": None, "held_for": None, "put_away_early": None}
    status, planned = await api(server, "POST", "/deployments", new_dep("pl", mode="always_on", start=False))
    assert planned["state"] == "planned"
    status, err = await api(server, "POST", "/deployments", new_dep("od"))
    assert status == 409 and err["error"]["code"] == "name_taken"
    status, lst = await api(server, "GET", "/deployments")
    assert [v["name"] for v in lst] == ["ao", "od", "pl"]
    status, err = await api(server, "GET", "/deployments/99")
    assert status == 404


async def test_edit_in_place(server):
    _, a = await api(server, "POST", "/deployments", new_dep("a"))
    _, b = await api(server, "POST", "/deployments", new_dep("b"))
    i = a["id"]
    before = server.deployer.get(i).as_dict()
    # unknown or bad values: 400 in the creation's form, nothing changed
    for body, field in [({"id": 7}, "id"), ({"start": True}, "start"), ({"port": 0}, "port"),
                        ({"memory_gib": -1}, "memory_gib"), ({"engine": "tgi"}, "engine"),
                        ({"name": "Bad Name"}, "name"), ({"served_name": ""}, "served_name"),
                        ({"role": "decision"}, "mode"), ({"idle_timeout_s": 0}, "idle_timeout_s"),
                        ({"command": "sim --port {port}"}, "command"), ({"command": []}, "command"),
                        ({"served_name": "ok", "port": 70000}, "port"), ({"mode": "always_on"}, "mode")]:
        status, err = await api(server, "PATCH", f"/deployments/{i}", body)
        assert status == 400, (body, err)
        assert err["error"]["code"] == "invalid_field" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(field + ":"), err
    status, err = await api(server, "PATCH", f"/deployments/{i}", [1])
    assert status == 400 and err["error"]["code"] == "invalid_json"
    # another deployment's name: a clear 409
    status, err = await api(server, "PATCH", f"/deployments/{i}", {"name": "b"})
    assert status == 409 and err["error"]["code"] == "name_taken"
    status, err = await api(server, "PATCH", "/deployments/99", {"port": 9000})
    assert status == 404 and err["error"]["code"] == "not_found"
    assert server.deployer.get(i).as_dict() == before
    _, audit = await api(server, "GET", "/audit")
    assert not [r for r in audit if r["action"] == "deployment_update"]
    # success: same id, the view shows the new values, one audit row with old and new
    status, view = await api(server, "PATCH", f"/deployments/{i}",
                             {"name": "a2", "served_name": "A2", "memory_gib": 12, "idle_timeout_s": 120,
                              "port": 8000})  # port unchanged: not in the audit
    assert status == 200 and view["id"] == i
    assert (view["name"], view["served_name"], view["memory_gib"], view["idle_timeout_s"]) == ("a2", "A2", 12.0, 120)
    assert (await api(server, "GET", f"/deployments/{i}"))[1]["served_name"] == "A2"
    stored = await server.deployer.store.deployment(i)
    assert (stored["name"], stored["served_name"], stored["memory_gib"]) == ("a2", "A2", 12.0)
    _, audit = await api(server, "GET", "/audit")
    (row,) = [r for r in audit if r["action"] == "deployment_update"]
    assert row["deployment_id"] == i and row["user"] == "token"
    assert row["detail"] == {"old": {"name": "a", "served_name": "a", "memory_gib": 10.0, "idle_timeout_s": None},
                             "new": {"name": "a2", "served_name": "A2", "memory_gib": 12.0, "idle_timeout_s": 120}}
    # the old name is free again; the new one is taken
    assert (await api(server, "PATCH", f"/deployments/{b['id']}", {"name": "a"}))[0] == 200
    assert (await api(server, "PATCH", f"/deployments/{b['id']}", {"name": "a2"}))[1]["error"]["code"] == "name_taken"
    # it starts with the edited configuration (an engine that serves the new name: readiness asks)
    assert (await api(server, "PATCH", f"/deployments/{i}", {"command": sim_command("A2")}))[0] == 200
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready"
    # busy (starting, ready, asleep, stopping): 409 and nothing changed
    before = server.deployer.get(i).as_dict()
    status, err = await api(server, "PATCH", f"/deployments/{i}", {"served_name": "X"}, unix=True)
    assert status == 409 and err["error"]["code"] == "deployment_busy" and "stop it first" in err["error"]["message"]
    assert server.deployer.get(i).as_dict() == before and (await server.deployer.store.deployment(i))["served_name"] == "A2"
    await api(server, "POST", f"/deployments/{i}/stop")
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"served_name": "X"}, unix=True)
    assert status == 200 and view["served_name"] == "X" and view["state"] == "stopped"


async def test_an_edit_that_changes_nothing_is_taken_in_any_state(server):
    """A field given its current value is no change: on a ready or asleep deployment such an
    edit is 200, writes nothing and restarts nothing (it was 409 deployment_busy: the busy
    check saw no field changed, so not "only priority, max_inflight and keep_warm")."""
    _, v = await api(server, "POST", "/deployments", new_dep("a", engine="vllm", idle_action="sleep",
                                                             priority="high", keep_warm="fixed"))
    i = v["id"]
    assert (await api(server, "POST", f"/deployments/{i}/start?wait=1"))[0] == 200
    engine = server.deployer.base_url(i)
    same = ({"priority": "high"}, {"keep_warm": "fixed"}, {}, {"priority": "high", "max_inflight": None},
            {"served_name": "a", "memory_gib": 10, "port": 8000})
    for state in ("ready", "asleep"):
        if state == "asleep":
            assert (await api(server, "POST", f"/deployments/{i}/sleep", {"level": 1}))[0] == 200
        before = server.deployer.get(i).as_dict()
        for body in same:
            status, view = await api(server, "PATCH", f"/deployments/{i}", body)
            assert status == 200 and view["state"] == state, (state, body, view)
        for body in ({"served_name": "X"}, {"priority": "high", "memory_gib": 12}):
            status, err = await api(server, "PATCH", f"/deployments/{i}", body)
            assert status == 409 and err["error"]["code"] == "deployment_busy", (state, body, err)
        assert server.deployer.get(i).as_dict() == before and server.deployer.base_url(i) == engine
    assert not [r for r in await server.deployer.store.audit(i) if r["action"] == "deployment_update"]


async def test_a_name_or_served_name_with_a_control_character_is_refused(server):
    # served_name took them, and they reached the log lines that quote it
    i = (await api(server, "POST", "/deployments", new_dep("a")))[1]["id"]
    before = server.deployer.get(i).as_dict()
    for c in ("\x00", "\t", "\n", "\r", "\x1b", "\x1f", "\x7f", "\x80", "\x85", "\x9b", "\x9f"):
        for field in ("name", "served_name"):
            for method, path, body in (("POST", "/deployments", {**new_dep("b"), field: f"b{c}x"}),
                                       ("PATCH", f"/deployments/{i}", {field: f"a{c}x"})):
                status, err = await api(server, method, path, body)
                assert status == 400 and err["error"]["code"] == "invalid_field", (field, c, err)
                assert err["error"]["message"].startswith(f"{field}:"), err
    assert [d.name for d in server.deployer.all()] == ["a"] and server.deployer.get(i).as_dict() == before
    # what is not a control character is a served name as before (a space, non-ASCII)
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"served_name": "Qwen 3 · 8B é"})
    assert status == 200 and view["served_name"] == "Qwen 3 · 8B é"


async def test_edit_resets_the_start_backoff(server):
    # a command that exits at once: the request's start fails and later ones are refused for a while
    _, v = await api(server, "POST", "/deployments", new_dep("a", command=["false", "{port}"]))
    i = v["id"]
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}

    async def ask():
        async with two_pools() as s:
            async with s.post(server.gw(i, "chat/completions"), headers=server.auth(), json=chat) as r:
                return r.status, await r.json()
    for _ in range(2):  # the failed start, then the backoff's refusal
        status, body = await ask()
        assert status == 503 and body["error"]["code"] == "start_failed", body
    assert server.state(i) == "failed"
    status, view = await api(server, "PATCH", f"/deployments/{i}", {"command": sim_command("a")})
    assert status == 200 and view["state"] == "failed"
    status, body = await ask()  # no backoff: the edited deployment starts at once
    assert status == 200, body


async def test_edit_of_served_name_is_synced_to_litellm(tmp_path):
    async with litellm_double("sk-m") as double:
        mk = tmp_path / "master.key"
        mk.write_text("sk-m\n")
        async with run_app(tmp_path, **{"litellm.url": double.url, "litellm.master_key_file": str(mk)}) as server:
            _, v = await api(server, "POST", "/deployments", new_dep("a"))
            await wait_for(lambda: [m["model_name"] for m in double.models] == ["a"], what="registered")
            status, _ = await api(server, "PATCH", f"/deployments/{v['id']}", {"served_name": "renamed"})
            assert status == 200
            await wait_for(lambda: [m["model_name"] for m in double.models] == ["renamed"],
                           what="the entry follows the new served_name")


async def test_litellm_sync_is_wired(tmp_path):
    async with litellm_double("sk-m") as double:
        mk = tmp_path / "master.key"
        mk.write_text("sk-m\n")
        async with run_app(tmp_path, **{"litellm.url": double.url, "litellm.master_key_file": str(mk),
                                        "internal_url": "http://ondemand:8090/dgxmm"}) as server:
            _, v = await api(server, "POST", "/deployments", new_dep("a"))
            await wait_for(lambda: any(m["model_name"] == "a" for m in double.models), what="registered")
            entry = [m for m in double.models if m["model_name"] == "a"][0]
            assert entry["litellm_params"]["api_base"] == f"http://ondemand:8090/dgxmm/ondemand/{v['id']}/v1"
            _, host = await api(server, "GET", "/host")
            await wait_for(lambda: server.app[__import__("ondemand.admin.components", fromlist=["SYNC"]).SYNC].last_ok)
            _, host = await api(server, "GET", "/host")
            assert host["ondemand"]["litellm_ready"] is True
            _, view = await api(server, "GET", f"/deployments/{v['id']}")
            assert view["litellm"]["status"] == "registered"
            # a rotated key re-registers without a restart
            new = keys.generate_key()
            keys.write_key_file(server.cfg.key_file, new)
            fp = keys.fingerprint(new)
            await wait_for(lambda: any(m["model_info"].get("dgxmm_key_fp") == fp for m in double.models),
                           timeout=10, what="re-registered with the new key")
            status, result = await api(server, "POST", "/sync")
            assert status == 200 and result["error"] is None and result["added"] == [] and result["deleted"] == []


async def test_planned_deployment_is_registered_in_litellm_once_started(tmp_path):
    async with litellm_double("sk-m") as double:
        mk = tmp_path / "master.key"
        mk.write_text("sk-m\n")
        async with run_app(tmp_path, **{"litellm.url": double.url, "litellm.master_key_file": str(mk)}) as server:
            from ondemand.admin import components
            sync = server.app[components.SYNC]
            _, v = await api(server, "POST", "/deployments", new_dep("p", start=False))
            assert v["state"] == "planned"
            await wait_for(lambda: sync.status_of(v["id"])["code"] == "deployment_planned", what="planned seen")
            await sync.wait_idle()
            assert double.models == []
            await api(server, "POST", f"/deployments/{v['id']}/start")
            await wait_for(lambda: any(m["model_name"] == "p" for m in double.models), what="registered at its start")


async def test_priority_and_max_inflight_fields(server):
    _, d = await api(server, "POST", "/deployments", new_dep("d"))
    assert (d["priority"], d["max_inflight"]) == ("normal", None)  # the defaults
    _, e = await api(server, "POST", "/deployments", {**new_dep("e"), "priority": "high", "max_inflight": 10000})
    assert (e["priority"], e["max_inflight"]) == ("high", 10000)
    for body, field in [({"priority": "urgent"}, "priority"), ({"priority": None}, "priority"),
                        ({"priority": 2}, "priority"), ({"max_inflight": 0}, "max_inflight"),
                        ({"max_inflight": 10001}, "max_inflight"), ({"max_inflight": 1.5}, "max_inflight"),
                        ({"max_inflight": True}, "max_inflight"), ({"max_inflight": "4"}, "max_inflight")]:
        for method, path, payload in (("POST", "/deployments", {**new_dep("f"), **body}),
                                      ("PATCH", f"/deployments/{d['id']}", body)):
            status, err = await api(server, method, path, payload)
            assert status == 400 and err["error"]["code"] == "invalid_field", (method, body, err)
            assert err["error"]["message"].startswith(field + ":"), err
    status, view = await api(server, "PATCH", f"/deployments/{d['id']}", {"priority": "low", "max_inflight": 2})
    assert status == 200 and (view["priority"], view["max_inflight"]) == ("low", 2)
    status, view = await api(server, "PATCH", f"/deployments/{d['id']}", {"max_inflight": None})
    assert status == 200 and view["max_inflight"] is None
    (row, *_) = [r for r in await server.deployer.store.audit(d["id"]) if r["action"] == "deployment_update"]
    assert row["detail"] == {"old": {"max_inflight": 2}, "new": {"max_inflight": None}}


async def test_gpu_count_above_1_on_a_one_pool_budget_is_refused_at_create_and_at_edit(server):
    """The default server's budget is static with capacity_gib: one pool, which cannot place an
    engine on several GPUs (issue 29)."""
    status, err = await api(server, "POST", "/deployments", new_dep("a", gpu_count=2))
    assert status == 400 and err["error"]["code"] == "invalid_field"
    assert err["error"]["message"].startswith("gpu_count:") and "one pool" in err["error"]["message"]
    status, a = await api(server, "POST", "/deployments", new_dep("a", gpu_count=1))
    assert status == 201, a
    status, err = await api(server, "PATCH", f"/deployments/{a['id']}", {"gpu_count": 2})
    assert status == 400 and err["error"]["message"].startswith("gpu_count:")
    status, err = await api(server, "PATCH", f"/deployments/{a['id']}", {"gpu_ids": [0, 1]})
    assert status == 400 and err["error"]["message"].startswith("gpu_ids:")  # named as sent (it sets the count)
    assert server.deployer.get(a["id"]).gpu_count == 1
