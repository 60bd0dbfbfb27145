"""ondemand/admin/wire.py: what the admin routes share. Through the whole ondemand on loopback,
aiohttp's own refusals in the API's error form (TCP and socket) and a deployment id in a path,
canonical decimal or 404; on aiohttp's own objects, the JSON answer, the error form of an
HTTP exception and a refusal's closing of its connection."""
import aiohttp
import orjson
import pytest
from aiohttp import web
from helpers import two_pools
from test_admin import api, new_dep

from ondemand.admin import wire
from ondemand.errors import OndemandError


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


def test_a_json_answer_takes_any_key_and_says_json():
    # A view's folded counters are keyed by numbers: orjson refuses them unless told.
    resp = wire.json_answer({1: "a", "b": [2]}, status=201)
    assert (resp.status, resp.content_type, resp.body) == (201, "application/json", b'{"1":"a","b":[2]}')


def test_aiohttps_own_refusals_get_the_apis_code_and_keep_allow():
    resp = wire.http_error(web.HTTPMethodNotAllowed("PUT", ["GET", "HEAD"]), 16 * 2**20)
    body = orjson.loads(resp.body)["error"]
    assert resp.status == 405 and resp.headers["Allow"] == "GET,HEAD" and resp.content_type == "application/json"
    assert body["code"] == "method_not_allowed" and body["message"].endswith("allowed: GET,HEAD")
    resp = wire.http_error(web.HTTPRequestEntityTooLarge(max_size=2**20, actual_size=2**21), 16 * 2**20)
    body = orjson.loads(resp.body)["error"]
    assert (resp.status, body["code"]) == (413, "request_too_large") and "16 MiB" in body["message"]
    assert "Allow" not in resp.headers
    # a status without a code of ours: its reason, as a code
    resp = wire.http_error(web.HTTPRequestTimeout(), 2**20)
    assert (resp.status, orjson.loads(resp.body)["error"]["code"]) == (408, "request_timeout")


def test_a_refusal_keeps_its_headers_and_closes_when_its_error_says():
    kept = wire.refusal(OndemandError(503, "busy", "later", headers={"Retry-After": "5"}))
    assert kept.status == 503 and kept.headers["Retry-After"] == "5" and kept.keep_alive is not False
    assert orjson.loads(kept.body) == {"error": {"message": "later", "type": "server_error", "code": "busy"}}
    closing = wire.refusal(OndemandError(400, "bad", "no", headers={"Connection": "close", "X-A": "1"}))
    assert closing.keep_alive is False and "Connection" not in closing.headers and closing.headers["X-A"] == "1"
    assert wire.refusal(OndemandError(400, "bad", "no"), close=True).keep_alive is False


async def test_a_body_that_is_no_json_object_is_refused_and_the_caller_is_socket_or_token(server):
    async with two_pools() as s:
        for raw, message in ((b"{nope", "not valid JSON"), (b"[1]", "must be a JSON object")):
            async with s.post(f"{server.url}/api/deployments", data=raw, headers=server.admin_headers()) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["code"] == "invalid_json" and message in err["message"], err
    assert server.deployer.all() == []
    # an empty body is an empty object (a sleep or a start needs none)
    i = (await api(server, "POST", "/deployments", new_dep("a")))[1]["id"]
    async with two_pools() as s, s.patch(f"{server.url}/api/deployments/{i}", data=b"",
                                         headers=server.admin_headers()) as r:
        assert r.status == 200
    await api(server, "PATCH", f"/deployments/{i}", {"served_name": "T"})
    await api(server, "PATCH", f"/deployments/{i}", {"served_name": "S"}, unix=True)
    users = [r["user"] for r in await server.deployer.store.audit(i) if r["action"] == "deployment_update"]
    assert sorted(users) == ["socket", "token"]
