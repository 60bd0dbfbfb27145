"""ondemand/gateway/routes.py: the gateway's pipeline up to the admission, and its own answers,
against the whole ondemand on loopback with the engine simulator behind it (the real key file,
the real state file): the routes (everything else 404, never forwarded), raw paths, the key and
the rate limit on failed keys, the body's size and JSON, the deployment's checks, a defect of
ours, the model list from the record and the health checks answered here; and, on the module's
own functions, which route asks what of its deployment. The forwarding, queueing and hang-ups
behind the admission: test_gateway.py. (Named for its folder: ondemand/sim/ has a routes.py too.)"""
import asyncio
import contextlib

import aiohttp
import orjson
import pytest
from test_gateway import CHAT, err, recorded

from ondemand.control.admission import Want
from ondemand.errors import OndemandError
from ondemand.gateway import routes


async def test_models_from_the_record_never_wakes(server, http):
    a = await server.add("a")
    async with http.get(server.gw(a, "models"), headers=server.auth()) as r:
        body = await r.json()
    assert body["object"] == "list" and body["data"][0]["id"] == "A" and body["data"][0]["owned_by"] == "dgxmm"
    assert server.state(a) == "stopped"
    async with http.get(server.gw(a, "models/A"), headers=server.auth()) as r:
        assert await err(r) == (503, "ondemand_not_ready")
    await server.deployer.restart(a)
    async with http.get(server.gw(a, "models/A"), headers=server.auth()) as r:
        assert r.status == 200 and (await r.json())["id"] == "A"
    async with http.head(server.gw(a, "models/A"), headers=server.auth()) as r:
        assert r.status == 200
    assert server.controller.inflight(a) == 0



NOT_FORWARDED = [
    "sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "metrics", "health", "tokenize",
    "chat/completions/render", "messages/count_tokens", "load_lora_adapter", "responses/abc",
    "responses/abc/cancel", "models/A/extra", "embeddings/x"]



async def test_everything_else_is_404_and_never_reaches_the_engine(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)  # one engine for every path: a start is most of the time
    for path in NOT_FORWARDED:
        for method in ("GET", "POST"):
            async with http.request(method, server.gw(a, path), headers=server.auth(), json={}) as r:
                assert await err(r) == (404, "not_found"), (method, path)
    async with http.get(server.gw(a, "responses"), headers=server.auth()) as r:
        assert await err(r) == (404, "not_found")
    async with http.get(f"{server.url}/ondemand/{a}/v2/models", headers=server.auth()) as r:
        assert await err(r) == (404, "not_found")
    # The id is canonical decimal: another spelling of it is no deployment ("03" was 3).
    for other in (f"0{a}", f"00{a}", f"+{a}", "%D9%A1", "%C2%B9", "9" * 5000):
        for method, route in (("GET", "models"), ("POST", "chat/completions")):
            async with http.request(method, f"{server.url}/ondemand/{other}/v1/{route}", headers=server.auth(),
                                    json={"model": "A", "messages": []}) as r:
                assert await err(r) == (404, "not_found"), (other, method)
    assert await recorded(server, a) == []



@pytest.mark.parametrize("raw", [
    "/ondemand/1/v1/./chat/completions", "/ondemand/1/v1/../v1/chat/completions", "/ondemand/1//v1/models",
    "/ondemand/1/v1/chat%2fcompletions", "/ondemand/1/v1/chat%5Ccompletions", "/ondemand/1/v1/models%00",
    "/ondemand/1/v1/chat\\completions", "/ondemand/1/v1/models%23x", "/ondemand/1/v1/models%3fx",
    "/ondemand/1/v1/models?x=1", "/ondemand/1/v1/%2e%2e/models", "/ondemand/1/v1/models/"])
async def test_bad_paths_are_400(server, raw):
    reader, writer = await asyncio.open_connection("127.0.0.1", int(server.url.split(":")[2].split("/")[0]))
    writer.write(f"GET /dgxmm{raw} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n"
                 f"Connection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert orjson.loads(body)["error"]["code"] == "invalid_path"



async def test_key_checks(server, http):
    a = await server.add("a")
    async with http.get(server.gw(a, "models")) as r:
        assert await err(r) == (401, "invalid_api_key")
    async with http.get(server.gw(a, "models"), headers={"Authorization": "Bearer " + server.key + "x"}) as r:
        assert await err(r) == (401, "invalid_api_key")
    async with http.get(server.gw(a, "models"), headers={"Authorization": "Basic " + server.key}) as r:
        assert await err(r) == (401, "invalid_api_key")
    # the admin token does not open the gateway, nor the key the admin API
    async with http.get(server.gw(a, "models"), headers=server.auth(server.token)) as r:
        assert await err(r) == (401, "invalid_api_key")
    async with http.get(server.url + "/api/host", headers=server.auth()) as r:
        assert r.status == 401



async def test_a_remembered_path_is_still_checked_every_time(server, http):
    """The gateway remembers a checked (method, path) with its route: the key is checked on
    every request all the same, and what one method may do another may not."""
    a = await server.add("a")
    chat = server.gw(a, "chat/completions")
    async with http.post(chat, json=CHAT, headers=server.auth()) as r:
        assert r.status == 200
    for headers in ({}, {"Authorization": "Bearer " + server.key + "x"}, server.auth(server.token)):
        async with http.post(chat, json=CHAT, headers=headers) as r:
            assert await err(r) == (401, "invalid_api_key")
    async with http.get(chat, headers=server.auth()) as r:  # remembered for POST only
        assert await err(r) == (404, "not_found")
    async with http.post(chat, json=CHAT, headers=server.auth()) as r:
        assert r.status == 200
    assert len(await recorded(server, a)) == 2  # the refused ones never reached the engine



async def test_rate_limit_after_20_failures(server, http):
    a = await server.add("a")
    for _ in range(20):
        async with http.get(server.gw(a, "models"), headers=server.auth("wrong")) as r:
            assert r.status == 401
    async with http.get(server.gw(a, "models"), headers=server.auth()) as r:
        assert await err(r) == (429, "rate_limited")
        assert r.headers["Retry-After"] == "60"
    # another peer is not limited
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as other:
        async with other.get(server.gw(a, "models").replace("127.0.0.1", "127.0.0.1"), headers=server.auth()) as r:
            assert r.status == 200



@pytest.mark.server(write_key=False)
async def test_not_configured_without_a_key(server, http):
    a = await server.add("a")
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "ondemand_not_configured")
    assert server.state(a) == "stopped"



async def test_body_limit(server, http):
    a = await server.add("a")
    big = b'{"model": "A", "x": "' + b"x" * (16 * 2**20) + b'"}'
    async with http.post(server.gw(a, "chat/completions"), data=big,
                         headers={**server.auth(), "Content-Type": "application/json"}) as r:
        assert await err(r) == (413, "request_too_large")

    async def chunked():
        for _ in range(17):
            yield b"x" * 2**20
    async with http.post(server.gw(a, "audio/transcriptions"), data=chunked(), headers=server.auth()) as r:
        assert await err(r) == (413, "request_too_large")
    assert server.state(a) == "stopped" and server.controller.waiting() == 0



async def test_deployment_checks(server, http):
    async with http.post(server.gw(99, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (404, "not_found")
    d = await server.add("d", role="decision", mode="always_on")
    async with http.post(server.gw(d, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "not_on_demand")
    ao = await server.add("ao", mode="always_on")
    async with http.post(server.gw(ao, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "not_on_demand")
    assert server.state(ao) == "stopped"  # never started by the gateway
    await server.deployer.restart(ao)
    async with http.post(server.gw(ao, "chat/completions"), json={**CHAT, "model": "AO"},
                         headers=server.auth()) as r:
        assert r.status == 200
    assert server.controller.inflight(ao) == 0 and server.controller.status(ao)["last_request_at"] is None



async def test_a_defect_of_ours_is_a_json_500_and_leaves_no_trace(server, http, monkeypatch, caplog):
    a = await server.add("a")

    async def broken(*args, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(server.admission, "wait", broken)
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (500, "internal_error")
    assert "a bug" in caplog.text  # the traceback is in the log, not in the answer
    monkeypatch.undo()
    assert server.controller.inflight(a) == 0 and server.controller.waiting() == 0
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert r.status == 200  # and the gateway goes on serving



@pytest.mark.parametrize("body", [b"{nope", b"[1, 2]", b"null", b"", None])
async def test_invalid_json_starts_nothing(server, http, body):
    a = await server.add("a")
    async with http.post(server.gw(a, "chat/completions"), data=body,
                         headers={**server.auth(), "Content-Type": "application/json"}) as r:
        assert await err(r) == (400, "invalid_json")
    assert server.state(a) == "stopped"
    assert server.controller.inflight(a) == 0 and server.controller.waiting() == 0



HEALTH_SHAPES = [("chat/completions", "chat.completion"), ("completions", "text_completion"),
                 ("responses", "response"), ("messages", "message"), ("embeddings", "list")]



async def test_health_checks_are_answered_here(server, http):
    a = await server.add("a")
    h = {**server.auth(), "x-dgxmm-health-check": "1"}
    for route, shape in HEALTH_SHAPES:
        async with http.post(server.gw(a, route), json=CHAT, headers=h) as r:
            assert r.status == 200 and r.headers["x-dgxmm-ondemand-state"] == "stopped", route
            body = await r.json()
            assert body.get("object", body.get("type")) == shape, route
        assert server.state(a) == "stopped" and server.controller.status(a)["last_request_at"] is None, route
    await server.deployer.restart(a)  # one engine for every route: a start is most of the time
    for route, _ in HEALTH_SHAPES:
        async with http.post(server.gw(a, route), json=CHAT, headers=h) as r:
            assert r.status == 200 and r.headers["x-dgxmm-ondemand-state"] == "ready", route
        async with http.post(server.gw(a, route), json=CHAT, headers={"x-dgxmm-health-check": "1"}) as r:
            assert r.status == 401, route  # the header needs the key
    assert await recorded(server, a) == []  # never forwarded, even when ready



async def test_health_check_other_cases(server, http):
    a = await server.add("a", 10, "--fail", "exit-at-start")
    h = {**server.auth(), "x-dgxmm-health-check": "1"}
    async with http.post(server.gw(a, "rerank"), json={}, headers=h) as r:
        assert await err(r) == (503, "ondemand_health_unsupported")
    with contextlib.suppress(Exception):
        await server.deployer.restart(a)
    async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=h) as r:
        assert await err(r) == (503, "ondemand_not_ready")



@pytest.mark.parametrize("segs, method, expected", [
    (["1", "v1", "chat/completions"], "POST", (1, "chat/completions", Want.TRAFFIC)),
    (["7", "v1", "audio", "transcriptions"], "POST", (7, "audio/transcriptions", Want.TRAFFIC)),
    (["1", "v1", "models"], "GET", (1, "models", Want.LIST)),
    (["1", "v1", "models", "A"], "HEAD", (1, "models/A", Want.MODEL)),
    (["1", "v1", "chat", "completions"], "GET", None), (["1", "v1", "models"], "POST", None),
    (["1", "v1", "models", "A", "x"], "GET", None), (["1", "v2", "models"], "GET", None),
    (["01", "v1", "models"], "GET", None), (["1", "v1"], "GET", None), (["x", "v1", "models"], "GET", None)])
def test_a_route_is_what_it_asks_of_its_deployment_or_404(segs, method, expected):
    if expected is None:
        with pytest.raises(OndemandError) as caught:
            routes._route(segs, method)
        assert (caught.value.status, caught.value.code) == (404, "not_found")
    else:
        assert routes._route(segs, method) == expected


def test_a_json_routes_body_is_an_object():
    assert routes._json_object(b'{"model": "A"}') == {"model": "A"}
    for body, says in ((b"", "empty"), (b"{nope", "not valid JSON"), (b"null", "JSON object"), (b"[1]", "JSON object")):
        with pytest.raises(OndemandError) as caught:
            routes._json_object(body)
        assert caught.value.code == "invalid_json" and says in caught.value.message, body


async def test_a_refusal_that_a_retry_would_only_repeat_says_so(server, http):
    """The OpenAI SDKs retry a 5xx unless told: a refusal that would come again says x-should-retry: false."""
    ao = await server.add("ao", mode="always_on")
    async with http.post(server.gw(ao, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (503, "not_on_demand") and r.headers["x-should-retry"] == "false"
    async with http.post(server.gw(99, "chat/completions"), json=CHAT, headers=server.auth()) as r:
        assert await err(r) == (404, "not_found") and "x-should-retry" not in r.headers
