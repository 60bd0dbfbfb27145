"""The simulator's failures after the start (ondemand/sim/faults.py, ``--fail``): a crash in
the middle of a stream and the exit some seconds after ready, each in a simulator process of its
own (they end it), and the wake that fails or hangs, on a simulator in this process."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from sim_helpers import CHAT, call, simulator, spawn, started, state


async def test_crash_mid_stream_subprocess():
    proc = await spawn("--fail", "crash-mid-stream")
    try:
        port = await started(proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                assert r.status == 200
            received = []
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  json={**CHAT, "stream": True}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            received.append(line[6:].strip())
        assert await asyncio.wait_for(proc.wait(), 5) == 1
        assert len(received) == 4 and b"[DONE]" not in received  # the role chunk, then 3 tokens
        assert json.loads(received[-1])["choices"][0]["delta"]["content"] == " tok2"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_exit_after_subprocess():
    proc = await spawn("--fail", "exit-after", "0.2")
    try:
        await started(proc)
        assert await asyncio.wait_for(proc.wait(), 5) == 1
        assert b"exit-after" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_wake_fails_and_hangs():
    async with simulator(fail="wake-fails") as s:
        await call(s, "POST", "/sleep")
        err = (await call(s, "POST", "/wake_up", 500))["error"]
        assert "wake-fails" in err["message"] and err["code"] == 500
        assert (await state(s))["sleeping"] == {"weights": True, "kv_cache": True}
    async with simulator(fail="wake-hangs") as s:
        await call(s, "POST", "/sleep")
        with pytest.raises(asyncio.TimeoutError):
            await call(s, "POST", "/wake_up", timeout=aiohttp.ClientTimeout(total=0.3))
        assert await call(s, "GET", "/is_sleeping") == {"is_sleeping": True}
