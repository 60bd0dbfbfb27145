"""What the engine simulator's tests share (ondemand/sim/): a simulator on 127.0.0.1 in this
process (``simulator``) or in a process of its own (``spawn``, ``started``), and how they speak
to it (``sse``, ``call``, ``state``, ``content``, ``metrics_until``). The ``sim`` fixture is
conftest.py's."""
from __future__ import annotations

import asyncio
import contextlib
import sys

import aiohttp
from helpers import ROOT

from ondemand.sim.engine import SimOptions, SimServer


@contextlib.asynccontextmanager
async def simulator(**kw):
    """A simulator with these options (``model`` demo, a free port) in this process: an aiohttp
    session at its URL."""
    kw.setdefault("model", "demo")
    server = SimServer(SimOptions(port=0, **kw), shutdown_timeout=0.1)
    port = await server.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await server.stop()


def sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) of each SSE message."""
    out = []
    assert text.endswith("\n\n")
    for block in text[:-2].split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            else:
                assert field == "data", line
                data.append(value)
        out.append((event, "\n".join(data)))
    return out


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "say something nice"}]}


async def metrics_until(session, *lines: str) -> str:
    """The metrics text once it holds every line (a stream's end is seen by the server a token later)."""
    for _ in range(300):
        async with session.get("/metrics") as r:
            text = await r.text()
        if all(line + "\n" in text for line in lines):
            return text
        await asyncio.sleep(0.01)
    raise AssertionError(f"{lines} not in {text}")


async def spawn(*args: str, env: dict[str, str] | None = None):
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ondemand.sim.engine", "--port", "0", "--model", "demo", *args,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def started(proc) -> int:
    line = (await asyncio.wait_for(proc.stderr.readline(), 5)).decode()
    assert line.startswith("ondemand simulator (not a real engine) serving demo on 127.0.0.1:"), line
    return int(line.rsplit(":", 1)[1])


TOKS = " ".join(f"tok{i}" for i in range(16))


GARBAGE = " ".join(f"garbage{i}" for i in range(16))


async def content(s) -> str:
    async with s.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["message"]["content"]


async def state(s) -> dict:
    async with s.get("/_sim/state") as r:
        assert r.status == 200
        return await r.json()


async def call(s, method: str, path: str, status: int = 200, **kw):
    async with s.request(method, path, **kw) as r:
        assert r.status == status, (path, r.status, await r.text())
        return await r.json() if r.content_type == "application/json" else await r.read()


def awake(**kw) -> dict:
    return {"sleeping": {"weights": False, "kv_cache": False}, "level": 0, "garbage": False, **kw}
