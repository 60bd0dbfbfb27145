"""Many streams open through the gateway at once (the proxy benchmark's memory test): the
connections opened beforehand, in batches the listen backlog takes; then the streams held open,
read as a client would, while the gateway's RSS, fds and CPU are sampled."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp

from .load import Target, chat_body
from .measure import cpu_s, n_fds, rss_mib


async def prewarm(http: aiohttp.ClientSession, targets: list[Target], n: int, batch: int = 100) -> float:
    """Open ``n`` keep-alive connections to the gateway before the streams start.

    A burst of new connections overflows the gateway's listen backlog (aiohttp's default
    128; the dropped handshakes come back only after SYN-ACK retransmits, 1, 3, 7, 15 s
    later), and under streaming load uvloop accepts about one connection per event-loop
    iteration. So the connections are made first, in batches smaller than the backlog,
    by ``n`` concurrent non-streaming requests that each spend about 0.5 s in a slow
    engine (no bytes flow meanwhile); the streams then reuse them from the pool.
    """
    t0 = time.perf_counter()
    failed: list[str] = []

    async def one(i: int) -> None:
        t = targets[i % len(targets)]
        try:
            async with http.post(t.url, data=chat_body(f"bench-slow-{i % len(targets)}", 10, False),
                                 headers=t.headers) as r:
                await r.read()
                if r.status != 200:
                    failed.append(str(r.status))
        except (aiohttp.ClientError, OSError) as exc:
            failed.append(repr(exc))

    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one(i)))
        if i % batch == batch - 1:
            await asyncio.sleep(0.03)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    if failed:
        raise RuntimeError(f"pre-opening {n} connections: {len(failed)} failed, e.g. {failed[0]}")
    return time.perf_counter() - t0

async def hold_streams(http: aiohttp.ClientSession, gw_pid: int, targets: list[Target], want: int,
                       open_wait: float, hold_s: float) -> dict[str, Any]:
    """Open ``want`` streams at once; once all had their first chunk (or after ``open_wait``),
    keep them open ``hold_s`` seconds, reading, while the gateway's RSS, fds and CPU are sampled."""
    opened = 0
    events = 0
    all_open = asyncio.Event()
    errors: list[str] = []

    async def hold(t: Target, model: str) -> None:
        nonlocal opened, events
        body = chat_body(model, 400, True)
        try:
            async with http.post(t.url, data=body, headers=t.headers) as r:
                if r.status != 200:
                    errors.append(f"{r.status} {(await r.text())[:200]}")
                    return
                await r.content.readany()
                opened += 1
                if opened == want:
                    all_open.set()
                async for data in r.content.iter_any():  # keep reading, as a client would
                    events += data.count(b"\n\n")
        except (aiohttp.ClientError, OSError) as exc:
            errors.append(repr(exc))

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(hold(targets[i % len(targets)], f"bench-slow-{i % len(targets)}"))
             for i in range(want)]
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(all_open.wait(), open_wait)
        out["open_s"] = time.perf_counter() - t0
        out["opened"] = opened
        peak, fds = rss_mib(gw_pid), n_fds(gw_pid)
        c0, ev0, h0 = cpu_s(gw_pid), events, time.perf_counter()
        end = h0 + hold_s
        while time.perf_counter() < end:
            peak = max(peak, rss_mib(gw_pid))
            fds = max(fds, n_fds(gw_pid))
            await asyncio.sleep(0.05)
        held = time.perf_counter() - h0
        cpu, n_ev = cpu_s(gw_pid) - c0, events - ev0
        out.update(rss_peak=peak, fds=fds, still_open=sum(not t.done() for t in tasks),
                   chunk_rate=n_ev / held if held else float("nan"),
                   chunk_us=cpu / n_ev * 1e6 if n_ev else float("nan"),
                   core_share=cpu / held if held else float("nan"))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out["errors"] = errors
    return out
