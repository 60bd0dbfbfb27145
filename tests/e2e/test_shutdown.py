"""Shutdown with requests waiting (BEHAVIOUR.md, "Shutdown"): once it begins nothing is
started or stopped to make room, a waiting request gets ``ondemand_shutting_down`` at
once, and the server is gone within ``shutdown_grace_s``."""
import asyncio
import time

import aiohttp
from helpers import run_app, wait_for


async def test_a_queued_request_hears_of_the_shutdown_at_once_and_nothing_is_started(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with run_app(tmp_path, shutdown_grace_s=2) as server:
            busy = await server.add("b", 20, "--token-delay", "0.2", "--tokens", "40", idle_timeout_s=1)
            x = await server.add("x", 10)
            await server.deployer.restart(busy)
            stream = asyncio.ensure_future(http.post(server.gw(busy, "chat/completions"),
                                                     json={**chat, "model": "B", "stream": True},
                                                     headers=server.auth()))
            await wait_for(lambda: server.controller.inflight(busy) == 1, what="the busy model serving")
            queued = asyncio.ensure_future(http.post(server.gw(x, "chat/completions"), json={**chat, "model": "X"},
                                                     headers=server.auth()))
            await wait_for(lambda: x in server.controller.queue, what="x queued for memory (b is busy)")
            began = time.monotonic()
        # The server is down. The queued request was answered at once, not at the end.
        async with await queued as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "ondemand_shutting_down", body
            assert r.headers["Retry-After"] == "10"
        assert time.monotonic() - began < 4  # grace 2 s for the stream, then out
        (await stream).close()
    # Nothing was started or stopped for it: x never started, b was not a victim.
    async with run_app(tmp_path) as server:
        audit = await server.deployer.store.audit()
        assert not any(r["deployment_id"] == x and r["action"] == "ondemand_start" for r in audit)
        assert not any(r["deployment_id"] == busy and r["action"] == "ondemand_sleep" for r in audit)
