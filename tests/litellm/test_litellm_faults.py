"""A LiteLLM that hangs or answers garbage never holds up the gateway: the sync runs on its
own, with a timeout, and says what went wrong (BEHAVIOUR.md, "LiteLLM registration")."""
import asyncio
import time

import pytest
from aiohttp import web
from helpers import free_port, run_app, two_pools, wait_for

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
