"""The admin API and the wiring of the app: token and socket, validation,
mode switches, SSE events, audit, and the LiteLLM sync's triggers."""
import asyncio
import os
import stat

import aiohttp
import orjson
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


async def test_token_on_tcp_never_the_ondemand_key(server):
    assert (await api(server, "GET", "/host"))[0] == 200
    status, body = await api(server, "GET", "/host", headers={})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    status, _ = await api(server, "GET", "/host", headers={"Authorization": f"Bearer {server.key}"})
    assert status == 401
    status, _ = await api(server, "GET", "/host", headers={"Authorization": f"Bearer {server.token}x"})
    assert status == 401


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


async def test_host_view(server):
    status, host = await api(server, "GET", "/host")
    assert host["budget"] == {"source": "static", "capacity": 24.0, "used": 0.0, "starting": 0.0, "free": 24.0,
                              "ondemand_capacity": 24.0, "per_gpu": False,
                              "gpus": [{"index": 0, "uuid": None, "capacity": 24.0, "used": 0.0, "starting": 0.0,
                                        "free": 24.0, "ondemand_capacity": 24.0, "deployments": []}]}
    assert host["ondemand"]["configured"] is True and host["ondemand"]["key_fingerprint"] == keys.fingerprint(server.key)
    assert host["ondemand"]["litellm_ready"] is False
    assert host["ondemand"]["scheduler"] == "seed" and host["ondemand"]["slo_s"] == 5.0
    assert set(host["host_memory"]) == {"total_gib", "available_gib", "asleep_gib", "reserve_gib"}
    assert host["host_memory"]["asleep_gib"] == 0 and host["host_memory"]["reserve_gib"] == 16.0


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


@pytest.mark.parametrize("unix", [False, True])
async def test_routing_refusals_are_json_errors(server, unix):
    # aiohttp's own answers (no route, wrong method, body too large) in the
    # API's error form, on TCP and on the socket; nothing is created.
    headers = {} if unix else server.admin_headers()
    if unix:
        conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
        base = f"http://ondemand{server.cfg.base_path}"
    else:
        conn, base = None, server.url
    async with aiohttp.ClientSession(connector=conn) as s:
        async def call(method, path, **kw):
            kw.setdefault("headers", headers)
            async with s.request(method, base + path, **kw) as r:
                assert r.content_type == "application/json", (method, path, await r.text())
                return r.status, r.headers, await r.json()

        status, _, body = await call("GET", "/api/nosuch")
        assert status == 404 and body["error"]["code"] == "not_found"
        status, h, body = await call("PUT", "/api/host")
        assert status == 405 and body["error"]["code"] == "method_not_allowed" and "GET" in h["Allow"]
        assert "GET" in body["error"]["message"]
        status, _, body = await call("POST", "/api/deployments/1/mode")
        assert status == 405 and body["error"]["code"] == "method_not_allowed"
        status, _, body = await call("POST", "/api/deployments", data=b"x" * (16 * 2**20 + 2),
                                     headers={**headers, "Content-Type": "application/json"})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert set(body["error"]) == {"message", "type", "code"}
        status, _, body = await call("GET", "/elsewhere")  # outside the API too
        assert status == 404 and body["error"]["code"] == "not_found"
    assert server.deployer.all() == []
    # Redirects stay redirects.
    async with two_pools() as s, s.get(server.url + "/ui", allow_redirects=False) as r:
        assert r.status == 302 and r.headers["Location"].endswith("/ui/")


async def test_a_defect_of_ours_is_a_json_500(server, monkeypatch):
    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr(server.deployer, "all", broken)
    status, body = await api(server, "GET", "/deployments")
    assert status == 500 and body["error"]["code"] == "internal_error" and "a bug" not in body["error"]["message"]
    monkeypatch.undo()
    assert (await api(server, "GET", "/deployments"))[0] == 200


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


async def test_mode_switch_is_audited_and_bounded(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    status, err = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "on_demand", "idle_timeout_s": 5000000})
    assert status == 400 and err["error"]["message"] == "idle_timeout_s: must be 1 to 86400 seconds, or null"
    status, view = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "always_on"})
    assert status == 200 and view["pending_mode"] == "always_on" and view["mode"] == "on_demand"
    await wait_for(lambda: server.deployer.get(v["id"]).mode == "always_on", what="pending mode applied at ready")
    _, audit = await api(server, "GET", "/audit")
    row = [r for r in audit if r["action"] == "ondemand_mode"][0]
    assert row["detail"]["old"]["mode"] == "on_demand" and row["detail"]["new"]["pending_mode"] == "always_on"
    status, view = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "on_demand", "idle_timeout_s": 120})
    assert view["mode"] == "on_demand" and view["idle_timeout_s"] == 120


async def test_audit_pages_newest_first(server):
    for i in range(5):
        await server.deployer.store.write_audit(action="ondemand_mode", actor="admin", text=f"row {i}")
    _, first = await api(server, "GET", "/audit?limit=2")
    assert [r["text"] for r in first] == ["row 4", "row 3"]
    _, second = await api(server, "GET", f"/audit?limit=2&before={first[-1]['id']}")
    assert [r["text"] for r in second] == ["row 2", "row 1"]
    _, last = await api(server, "GET", f"/audit?limit=2&before={second[-1]['id']}")
    assert [r["text"] for r in last] == ["row 0"]
    status, err = await api(server, "GET", "/audit?before=soon")
    assert status == 400 and err["error"]["code"] == "invalid_field"


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


async def test_a_deployment_id_in_a_path_is_canonical_decimal(server):
    i = (await api(server, "POST", "/deployments", new_dep("a")))[1]["id"]
    assert i == 1
    assert (await api(server, "GET", "/deployments/1"))[0] == 200
    # "01" and "٣" were deployment 1 and 3; "¹" and 5,000 digits were a 500 (int() raised)
    for raw in ("01", "001", "+1", "1.0", "%D9%A1", "%C2%B9", "%EF%BC%91", "9" * 5000, "99999999999999999999"):
        for method, path, body in (("GET", f"/deployments/{raw}", None), ("PATCH", f"/deployments/{raw}", {"port": 9}),
                                   ("DELETE", f"/deployments/{raw}", None), ("POST", f"/deployments/{raw}/stop", None),
                                   ("GET", f"/deployments/{raw}/logs", None)):
            status, err = await api(server, method, path, body)
            assert status == 404 and err["error"]["code"] == "not_found", (raw, method, path, err)
            assert len(err["error"]["message"]) < 80
    assert server.deployer.get(i).port == 8000 and server.state(i) == "stopped"
    # a log tail's count: ASCII digits, a few ("¹" and 5,000 digits were a 500 too)
    for tail in ("%C2%B9", "1" * 5000, "-1", "10001"):
        status, err = await api(server, "GET", f"/deployments/{i}/logs?tail={tail}")
        assert status == 400 and err["error"]["message"].startswith("tail:"), (tail, err)


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


async def test_actions(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    i = v["id"]
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready" and view["base_url"].startswith("http://127.0.0.1:")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep")
    assert view["state"] == "asleep"
    status, view = await api(server, "POST", f"/deployments/{i}/wake?wait=1")
    assert view["state"] == "ready"
    status, view = await api(server, "POST", f"/deployments/{i}/stop")
    assert view["state"] == "stopped"
    status, err = await api(server, "POST", f"/deployments/{i}/wake")
    assert status == 409
    _, big = await api(server, "POST", "/deployments", new_dep("big", memory_gib=20))
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, err = await api(server, "POST", f"/deployments/{big['id']}/start")
    assert status == 409 and err["error"]["code"] == "insufficient_memory"
    status, body = await api(server, "DELETE", f"/deployments/{i}")
    assert status == 200 and server.deployer.get(i) is None
    _, events = await api(server, "GET", f"/deployments/{big['id']}/events")
    assert events[-1]["text"].startswith("created")


async def test_events_stream_views_and_folds_counters(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    i = v["id"]
    await server.deployer.restart(i)
    got = []

    async def reader():
        async with two_pools() as s:
            async with s.get(f"{server.url}/api/events", headers=server.admin_headers()) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(orjson.loads(line[6:]))
    task = asyncio.ensure_future(reader())
    await wait_for(lambda: got, what="initial views")
    got.clear()
    slots = [await server.admission.acquire(i) for _ in range(10)]
    for s in slots:
        s.release()
    # the last of the folded changes arrives (the burst is held back, at most one event a second)
    await wait_for(lambda: any(e.get("id") == i and e.get("ondemand", {}).get("inflight") == 0 for e in got),
                   timeout=5, what="the event with the counters back at 0")
    task.cancel()
    counters = [e for e in got if e.get("id") == i]
    assert 1 <= len(counters) <= 2  # twenty changes, at most one event a second
    assert counters[0]["ondemand"]["inflight"] >= 1 and counters[-1]["ondemand"]["inflight"] == 0


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


async def test_published_views_of_a_cold_start(server):
    """The view published with `starting` says starting_for_request; updated_at follows the file."""
    from ondemand.admin import components
    _, v = await api(server, "POST", "/deployments", new_dep("a", command=sim_command("a", "--startup-delay", "0.3")))
    i = v["id"]
    seen = []
    from ondemand.events import ViewPublished
    server.app[components.BUS].subscribe(ViewPublished, lambda e: e.view.get("id") == i and seen.append(
        (e.view["state"], e.view["ondemand"]["phase"], e.view["updated_at"])))
    async with two_pools() as s, s.post(server.gw(i, "chat/completions"), headers=server.auth(),
                      json={"model": "a", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
    phases = [(state, phase) for state, phase, _ in seen]
    assert ("starting", "starting_for_request") in phases, phases
    stored = await server.deployer.store.deployment(i)
    _, view = await api(server, "GET", f"/deployments/{i}")
    assert view["updated_at"] == stored["updated_at"] > v["created_at"]
    assert seen[-1][2] >= seen[0][2]


async def test_ui_page_is_served_without_data(server):
    """Three static files, no credentials to load them, a strict CSP (scripts and styles from
    the page's own files), and nothing else under the package reachable."""
    page = {}
    async with two_pools() as s:
        for name, kind in (("", "text/html"), ("app.js", "text/javascript"), ("app.css", "text/css")):
            async with s.get(f"{server.url}/ui/{name}") as r:
                assert r.status == 200 and r.content_type == kind, name
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
                assert "unsafe-inline" not in r.headers["Content-Security-Policy"]
                page[name] = await r.text()
        for name in ("../admin.py", "app.py", "index.html%00.js", "BEHAVIOUR.md"):
            async with s.get(f"{server.url}/ui/{name}") as r:
                assert r.status == 404, name
    assert 'src="app.js"' in page[""] and "../api/" in page["app.js"] and "events" in page["app.js"]
    assert "<script>" not in page[""] and " style=" not in page[""]  # nothing inline: the CSP forbids it
    for text in page.values():
        assert server.token not in text and server.key not in text


async def test_healthz_needs_no_credentials_and_fails_while_the_state_file_does_not_answer(server, monkeypatch):
    from ondemand.admin import api as admin
    async with two_pools() as s:
        async with s.get(f"{server.url}/healthz") as r:  # no token, no key
            assert r.status == 200 and await r.json() == {"status": "ok"}
        monkeypatch.setattr(admin, "HEALTH_TIMEOUT_S", 0.2)
        async with server.deployer.store.transaction():  # a transaction that does not end: reads wait
            async with s.get(f"{server.url}/healthz") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == "unavailable" and "in time" in body["reason"]
        async with s.get(f"{server.url}/healthz") as r:
            assert r.status == 200


async def _logs(server, dep_id, query=""):
    async with two_pools() as s, \
            s.get(f"{server.url}/api/deployments/{dep_id}/logs{query}", headers=server.admin_headers()) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def test_logs_route_tail_and_its_errors(server):
    status, body = await api(server, "POST", "/deployments", new_dep("lg"))
    dep_id = body["id"]
    assert await _logs(server, dep_id) == (200, "text/plain; charset=utf-8", b"")  # never ran: empty
    status, _, raw = await _logs(server, 999)
    assert status == 404 and orjson.loads(raw)["error"]["code"] == "not_found"
    for bad in ("?tail=-1", "?tail=x", "?tail=10001", "?follow=2"):
        status, _, raw = await _logs(server, dep_id, bad)
        assert status == 400 and orjson.loads(raw)["error"]["code"] == "invalid_field", bad
        assert orjson.loads(raw)["error"]["message"].startswith(bad[1:].split("=")[0])
    assert (await api(server, "POST", f"/deployments/{dep_id}/start?wait=1"))[0] == 200
    status, _, raw = await _logs(server, dep_id, "?tail=1")
    assert status == 200 and b"serving lg" in raw and raw.count(b"\n") == 1
    status, _, raw = await _logs(server, dep_id, "?tail=0&follow=0")
    assert (status, raw) == (200, b"")
    # Over the socket too, as the command line reads it.
    conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
    async with aiohttp.ClientSession(connector=conn) as s, \
            s.get(f"http://ondemand{server.cfg.base_path}/api/deployments/{dep_id}/logs?tail=5") as r:
        assert r.status == 200 and b"serving lg" in await r.read()


async def test_logs_follow_a_start_live_until_the_engine_stops(server):
    status, body = await api(server, "POST", "/deployments", new_dep("fl", command=sim_command(
        "FL", "--startup-delay", "30")))
    dep_id = body["id"]
    assert (await api(server, "POST", f"/deployments/{dep_id}/start"))[0] == 200
    got = b""
    async with two_pools() as s, s.get(f"{server.url}/api/deployments/{dep_id}/logs?follow=1&tail=0",
                                                   headers=server.admin_headers()) as r:
        assert r.status == 200
        while b"serving FL" not in got:
            got += await asyncio.wait_for(r.content.readany(), 20)
        assert server.state(dep_id) == "starting"  # followed while it starts
        assert (await api(server, "POST", f"/deployments/{dep_id}/stop"))[0] == 200
        got += await asyncio.wait_for(r.content.read(), 20)  # the answer ends with the engine's log
    assert b"serving FL" in got


async def test_a_follower_that_hangs_up_leaves_nothing_behind(server):
    status, body = await api(server, "POST", "/deployments", new_dep("hu"))
    dep_id = body["id"]
    assert (await api(server, "POST", f"/deployments/{dep_id}/start?wait=1"))[0] == 200
    backend = server.deployer.backend
    before = {t.get_name() for t in asyncio.all_tasks()}
    async with two_pools() as s:
        r = await s.get(f"{server.url}/api/deployments/{dep_id}/logs?follow=1", headers=server.admin_headers())
        assert b"serving hu" in await asyncio.wait_for(r.content.readany(), 10)
        assert backend.followers("hu") == 1
        r.close()  # hang up while the engine runs on
    await wait_for(lambda: backend.followers("hu") == 0, what="the follower gone with its client")
    await wait_for(lambda: {t.get_name() for t in asyncio.all_tasks()} <= before, what="no task left")
    assert server.state(dep_id) == "ready"


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
