"""ondemand/admin/api.py: the admin API's guard and its routes of its own, against the whole
ondemand on loopback (the ``server`` fixture): the admin token on TCP (never the on-demand key),
a defect of ours as a JSON 500, the host view, the audit's pages, the UI's static files and
/healthz while the state file does not answer. The deployments' routes: test_admin.py."""
import asyncio
import logging

import pytest
from helpers import two_pools, wait_for
from raw_http import port
from test_admin import api

from ondemand.gateway import keys


async def test_token_on_tcp_never_the_ondemand_key(server):
    assert (await api(server, "GET", "/host"))[0] == 200
    status, body = await api(server, "GET", "/host", headers={})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    status, _ = await api(server, "GET", "/host", headers={"Authorization": f"Bearer {server.key}"})
    assert status == 401
    status, _ = await api(server, "GET", "/host", headers={"Authorization": f"Bearer {server.token}x"})
    assert status == 401



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



async def test_a_defect_of_ours_is_a_json_500(server, monkeypatch):
    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr(server.deployer, "all", broken)
    status, body = await api(server, "GET", "/deployments")
    assert status == 500 and body["error"]["code"] == "internal_error" and "a bug" not in body["error"]["message"]
    monkeypatch.undo()
    assert (await api(server, "GET", "/deployments"))[0] == 200



@pytest.mark.parametrize("unix", [False, True])
async def test_a_client_that_hangs_up_mid_body_is_no_defect(server, caplog, unix):
    """An admin client that closes with its body unsent (Content-Length 1000, 5 bytes) was logged
    as ERROR "... failed" with two tracebacks ending in ConnectionResetError (wait_for handed on
    the read's error rather than aiohttp's cancellation). Now one debug line, nothing done."""
    caplog.set_level(logging.DEBUG, logger="ondemand")
    a = await server.add("alpha")
    before = server.deployer.get(a).as_dict()
    api_path = f"{server.cfg.base_path}/api/deployments"
    for method, path in (("PATCH", f"{api_path}/{a}"), ("POST", api_path), ("PATCH", f"{api_path}/{a}/mode"),
                         ("POST", f"{api_path}/{a}/sleep")):
        if unix:
            _, writer = await asyncio.open_unix_connection(str(server.cfg.admin_socket))
        else:
            _, writer = await asyncio.open_connection("127.0.0.1", port(server))
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"a\":".encode())
        await writer.drain()
        writer.close()
        heads = (f"{method} {path}: ", f"{method} {path} failed")  # the debug line, or the defect's
        said = await wait_for(lambda heads=heads: [r for r in caplog.records if r.getMessage().startswith(heads)],
                              what=f"{method} {path} ended")
        assert [(r.levelno, r.exc_info) for r in said] == [(logging.DEBUG, None)], [r.getMessage() for r in said]
        assert "hung up" in said[0].getMessage()
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("ondemand.admin",
                                                                                              "ondemand.http"))]
    assert not loud and not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in loud]
    assert server.deployer.get(a).as_dict() == before and [d.name for d in server.deployer.all()] == ["alpha"]


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


async def test_audit_query_out_of_its_range_is_400_naming_it(server):
    # An id beyond SQLite's 64 bits was a 500; a limit out of 1..1000 was clamped; any bad
    # value was refused as "limit: ...".
    for i in range(3):
        await server.deployer.store.write_audit(action="ondemand_mode", actor="admin", text=f"row {i}")
    huge = "99999999999999999999999"
    for query, field in ((f"before={huge}", "before"), (f"deployment_id={huge}", "deployment_id"),
                         ("deployment_id=abc", "deployment_id"), ("deployment_id=-1", "deployment_id"),
                         ("before=1.5", "before"), ("limit=0", "limit"), ("limit=-5", "limit"),
                         ("limit=1001", "limit"), ("limit=100000", "limit"), (f"limit={huge}", "limit"),
                         ("limit=²", "limit"), ("limit=ten", "limit")):
        status, err = await api(server, "GET", f"/audit?{query}")
        assert status == 400 and err["error"]["code"] == "invalid_field", (query, status, err)
        assert err["error"]["message"].startswith(f"{field}: "), (query, err)
    for query, rows in (("limit=1", 1), ("limit=1000", 3), ("deployment_id=999999999999999999", 0),
                        ("before=999999999999999999", 3), ("deployment_id=&before=", 3)):
        status, got = await api(server, "GET", f"/audit?{query}")
        assert status == 200 and len(got) == rows, (query, got)



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
