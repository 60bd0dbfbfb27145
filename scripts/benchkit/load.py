"""The proxy benchmark's load: closed loops of requests, of whole streams, and of time to first
byte, against a target (the gateway, the engine direct, another proxy), each a Run of counts,
latencies and CPU."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass
class Target:
    name: str        # "gateway", "direct", or another proxy beside them ("nginx", "bare aiohttp", "byte relay")
    url: str         # .../v1/chat/completions
    headers: dict[str, str]
    pid: int = 0     # the proxy process whose CPU a run counts (the gateway's for "direct": ~0)


@dataclass
class Run:
    n: int = 0
    errors: int = 0
    elapsed: float = 0.0
    events: int = 0
    lat: list[float] = field(default_factory=list)
    cpu: float = 0.0         # CPU seconds during the run: the gateway's,
    cpu_client: float = 0.0  # the load generator's (this process),
    cpu_engine: float = 0.0  # the engine's

    @property
    def rate(self) -> float:
        return self.n / self.elapsed if self.elapsed else 0.0

    @property
    def event_rate(self) -> float:
        return self.events / self.elapsed if self.elapsed else 0.0


def chat_body(model: str, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Say something."}],
                            "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, ignore_eos=True)
    return orjson.dumps(body)


async def closed_loop(session: aiohttp.ClientSession, t: Target, body: bytes, conc: int, seconds: float) -> Run:
    """``conc`` workers send non-streaming requests back to back until the deadline."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                async with session.post(t.url, data=body, headers=t.headers) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, OSError):
                ok = False
            if ok:
                run.n += 1
                run.lat.append(time.perf_counter() - t0)
            else:
                run.errors += 1

    await asyncio.gather(*(worker() for _ in range(conc)))
    run.elapsed = time.perf_counter() - start
    return run


async def one_stream(session: aiohttp.ClientSession, t: Target, body: bytes,
                     first: Callable[[float], None] | None = None) -> tuple[int, bool]:
    """One SSE stream read to its end: (events, complete with [DONE])."""
    t0 = time.perf_counter()
    events, tail = 0, b""
    async with session.post(t.url, data=body, headers=t.headers) as r:
        if r.status != 200:
            await r.read()
            return 0, False
        async for data in r.content.iter_any():
            if first is not None:
                first(time.perf_counter() - t0)
                first = None
            # SSE events end with a blank line; a separator may straddle two reads.
            events += data.count(b"\n\n") + (tail[-1:] == b"\n" and data[:1] == b"\n")
            tail = (tail + data)[-16:]
    return events, tail.endswith(b"data: [DONE]\n\n")


async def stream_loop(session: aiohttp.ClientSession, t: Target, body: bytes, conc: int, seconds: float) -> Run:
    """``conc`` workers read whole streams back to back until the deadline."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            try:
                events, done = await one_stream(session, t, body)
            except (aiohttp.ClientError, OSError):
                events, done = 0, False
            run.events += events
            if done:
                run.n += 1
            else:
                run.errors += 1

    await asyncio.gather(*(worker() for _ in range(conc)))
    run.elapsed = time.perf_counter() - start
    return run


async def ttfb_loop(session: aiohttp.ClientSession, t: Target, body: bytes, seconds: float) -> Run:
    """Streams one at a time: request sent to first body byte."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        got: list[float] = []
        try:
            _, done = await one_stream(session, t, body, got.append)
        except (aiohttp.ClientError, OSError):
            done = False
        if done and got:
            run.n += 1
            run.lat.append(got[0])
        else:
            run.errors += 1
    run.elapsed = time.perf_counter() - start
    return run

