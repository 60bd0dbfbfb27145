"""Request ids: kept from the client or LiteLLM, else made; checked; sent to the engine and
returned on every answer of the gateway."""
import aiohttp

from ondemand import app as app_mod

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hello"}]}


async def recorded(server, dep_id):
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep_id) + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"].startswith("/v1/") and x["path"] != "/v1/models"]


async def test_request_id_kept_sent_to_the_engine_and_returned(server, http):
    a = await server.add("a")
    await server.deployer.restart(a)
    cases = [({"x-request-id": "client-1"}, "client-1"), ({"x-litellm-call-id": "lite-2"}, "lite-2"),
             ({"x-request-id": "évil", "x-litellm-call-id": "lite-3"}, "lite-3"),
             ({"x-request-id": "x" * 200}, None), ({}, None)]
    returned = []
    for headers, expected in cases:
        async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers={**server.auth(), **headers}) as r:
            assert r.status == 200
            rid = r.headers["x-request-id"]
            assert r.headers.getall("x-request-id") == [rid]
        if expected is not None:
            assert rid == expected
        else:
            assert len(rid) == 32 and rid not in returned
        returned.append(rid)
    sent = []
    for req in await recorded(server, a):
        ids = [v for k, v in req["headers"] if k.lower() == "x-request-id"]
        assert len(ids) == 1
        sent.append(ids[0])
    assert sent == returned


async def test_request_id_on_the_gateways_own_answers(server, http):
    a = await server.add("a")
    for headers, status in [({}, 401), ({**server.auth()}, 200), ({**server.auth(), "x-dgxmm-health-check": "1"}, 200)]:
        async with http.post(server.gw(a, "chat/completions"), json=CHAT,
                             headers={**headers, "x-dgxmm-health-check": "1", "x-request-id": "mine"}) as r:
            assert r.status == status and r.headers["x-request-id"] == "mine"
    async with http.get(server.gw(999, "models"), headers={**server.auth(), "x-request-id": "nf"}) as r:
        assert r.status == 404 and r.headers["x-request-id"] == "nf"
    async with http.get(f"{server.url}/api/host", headers=server.admin_headers()) as r:
        assert "x-request-id" not in r.headers  # the gateway's only


async def test_request_id_on_a_queued_stream(server, http):
    big = await server.add("big", 15)
    x = await server.add("x", 12)
    await server.deployer.restart(big)
    slot = await server.admission.acquire(big)
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(server.gw(x, "chat/completions"), json=body,
                         headers={**server.auth(), "x-request-id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        await r.content.readuntil(b"\n\n")  # the queued notice
        slot.release()
        server.controller.record(big).last_activity = 0
        await server.app[app_mod.SAMPLER].sample_once()
        server.controller.tick()
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    (req,) = await recorded(server, x)
    assert [v for k, v in req["headers"] if k.lower() == "x-request-id"] == ["s-1"]
