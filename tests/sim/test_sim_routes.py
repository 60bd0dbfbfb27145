"""The simulator's routes (ondemand/sim/routes.py) on a real simulator on 127.0.0.1, spoken to
over HTTP: the model list and card, /health and /metrics by flavor, 503 while loading (and for
ever with --fail never-ready) while /_sim/* answers, the record of requests; and the options a
simulator refuses to start with."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from sim_helpers import CHAT, metrics_until, simulator

from ondemand.sim.engine import SimOptions, SimServer


async def test_models(sim):
    async with sim.get("/v1/models") as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "demo" and card["object"] == "model"
    assert card["owned_by"] == "ondemand-simulator"
    assert card["root"] == "demo" and card["max_model_len"] == 4096 and isinstance(card["created"], int)
    async with sim.get("/v1/models/demo") as r:
        assert r.status == 200 and (await r.json())["id"] == "demo"
    async with sim.get("/v1/models/other") as r:
        assert r.status == 404
        assert (await r.json())["error"] == {"message": "The model `other` does not exist.",
                                             "type": "NotFoundError", "param": "model", "code": 404}


async def test_health_is_503_during_startup_delay():
    t0 = time.monotonic()
    async with simulator(startup_delay=0.5) as s:
        for path in ("/health", "/v1/models"):
            async with s.get(path) as r:
                assert r.status == 503
        async with s.post("/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503
        async with s.get("/_sim/requests") as r:
            assert r.status == 200 and len(await r.json()) == 3
        while True:
            async with s.get("/health") as r:
                if r.status == 200:
                    assert await r.read() == b""
                    break
                assert r.status == 503
            await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= 0.5
        async with s.get("/v1/models") as r:
            assert r.status == 200


async def test_never_ready():
    async with simulator(fail="never-ready") as s, s.get("/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["message"] == "Loading model"


async def test_llamacpp_flavor():
    async with simulator(flavor="llamacpp", token_delay=0.02, tokens=500) as s:
        async with s.get("/health") as r:
            assert await r.json() == {"status": "ok"}
        r = await s.post("/v1/chat/completions", json={**CHAT, "stream": True, "model": "any"})
        await r.content.readuntil(b"\n\n")
        await metrics_until(s, "llamacpp:requests_processing 1", "llamacpp:requests_deferred 0")
        r.close()
        await metrics_until(s, "llamacpp:requests_processing 0")


async def test_requests_are_recorded():
    async with simulator(record_limit=3) as s:
        async with s.post("/v1/chat/completions?x=1", json=CHAT, headers={"X-Tenant": "acme"}) as r:
            assert r.status == 200
        async with s.get("/_sim/requests") as r:
            [rec] = await r.json()
        assert rec["method"] == "POST" and rec["path"] == "/v1/chat/completions" and rec["query"] == "x=1"
        assert ["X-Tenant", "acme"] in rec["headers"]
        assert json.loads(rec["body"]) == CHAT
        for _ in range(4):
            await (await s.get("/health")).release()
        async with s.get("/_sim/requests") as r:
            assert [x["path"] for x in await r.json()] == ["/health"] * 3
        async with s.delete("/_sim/requests") as r:
            assert r.status == 204
        async with s.get("/_sim/requests") as r:
            assert await r.json() == []


def test_a_simulator_refuses_options_it_cannot_play():
    """A test in the same process gives ``SimOptions`` without the command line's checks: a
    flavor or failure ``options.py`` does not name, or no token to answer, is refused at once."""
    for bad, says in (({"flavor": "tgi"}, "flavor must be one of"), ({"fail": "explode"}, "fail must be one of"),
                      ({"tokens": 0}, "tokens must be at least 1")):
        with pytest.raises(ValueError, match=says):
            SimServer(SimOptions(port=0, **bad))
