#!/usr/bin/env python3
"""The cold path: how soon ondemand acts when an engine becomes ready or memory is freed.

Run from the repository root (``make bench`` runs it after ``scripts/bench.py``)::

    .venv/bin/python scripts/bench_cold.py           # about a minute
    .venv/bin/python scripts/bench_cold.py --quick   # a few rounds

Against ``python -m ondemand serve`` (process backend, the engine simulator), it measures:

1. **Ready → first byte**: a request waits for a cold start; a poller of ours asks the
   engine itself every 2 ms when it answers; the figure is the time from the engine's
   first 200 to the first byte of the waiting request's answer (how soon ondemand noticed
   and forwarded).
2. **Make-room, static budget**: two models fit; a third is asked for, so the least
   recently used idle one is stopped for it. From the victim's exit (its process gone
   from /proc, polled every 1 ms) to the newcomer's start (its ``starting`` event).
3. **Make-room, measured budget**: the same with ``budget.source = nvidia-smi`` and the
   tests' fake nvidia-smi, whose GPU shows the victim's memory until its process is gone:
   from the memory showing free to the start.
4. **A burst of first requests**: N requests at once for a cold model: one start, every
   one answered, and the time from ready to the last answer.

It writes (or replaces) the "Cold path" section of ``bench/results.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import results  # noqa: E402
from benchkit.gateway import FAKE_SMI, Gateway, ask, fake_gpu  # noqa: E402
from benchkit.measure import median, pct  # noqa: E402
from benchkit.procs import ROOT, Procs, child_env, raise_nofile  # noqa: E402

OUT = ROOT / "bench" / "results.md"
SECTION = "## Cold path"
T_READY_MS = 50.0
T_MAKE_ROOM_MS = 100.0


async def engine_ready_at(http: aiohttp.ClientSession, gw: Gateway, dep_id: int) -> float:
    """When the engine itself first answers /v1/models 200 (its address from the admin API)."""
    while True:
        url = (await gw.api("GET", f"/deployments/{dep_id}")).get("base_url")
        if url:
            break
        await asyncio.sleep(0.002)
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with http.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return time.time()
        await asyncio.sleep(0.002)


async def ready_to_first_byte(http: aiohttp.ClientSession, gw: Gateway, rounds: int) -> list[float]:
    dep_id = await gw.create("cold", 1, "--startup-delay", "0.7")
    out = []
    for _ in range(rounds):
        ready = asyncio.ensure_future(engine_ready_at(http, gw, dep_id))
        status, head = await ask(http, gw, dep_id, "cold")
        ready_at = await ready
        if status != 200:
            raise RuntimeError(f"the waiting request got {status}")
        out.append((head - ready_at) * 1000)
        await gw.api("POST", f"/deployments/{dep_id}/stop")
    return out


def gone_at(pid: int, within: float = 30) -> float:
    """Poll /proc every 1 ms: when the process is gone (or a zombie: its memory is freed)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return time.time()
        except OSError:
            return time.time()
        time.sleep(0.001)
    raise RuntimeError(f"pid {pid} did not exit")


async def make_room(http: aiohttp.ClientSession, gw: Gateway, rounds: int, gpu: bool) -> list[float]:
    """Two models of 10 GiB fit (capacity 20); each round asks for the one that is stopped,
    so the least recently used of the two ready ones is stopped for it."""
    extra = ("--gpu-mib", str(10 * 1024)) if gpu else ()
    ids = [await gw.create(f"m{i}", 10, *extra, idle_timeout_s=1) for i in range(3)]
    for i in ids[:2]:
        status, _ = await ask(http, gw, i, f"m{ids.index(i)}")
        assert status == 200
    out = []
    for r in range(rounds):
        views = {v["id"]: v for v in await gw.api("GET", "/deployments")}
        cold = next(i for i in ids if views[i]["state"] == "stopped")
        victim = min((i for i in ids if views[i]["state"] == "ready"),
                     key=lambda i: views[i]["ondemand"]["last_request_at"] or 0)
        pid = int((gw.state / "logs" / f"m{ids.index(victim)}.pid").read_text().split()[0])
        await asyncio.sleep(1.1)  # both ready ones idle for their whole timeout
        asking = asyncio.ensure_future(ask(http, gw, cold, f"m{ids.index(cold)}"))
        exited = await asyncio.to_thread(gone_at, pid)
        status, _ = await asking
        if status != 200:
            raise RuntimeError(f"round {r}: the request for the cold model got {status}")
        events = await gw.api("GET", f"/deployments/{cold}/events")
        started = max(e["at"] for e in events if e["text"] in ("Started for a request", "starting"))
        out.append((started - exited) * 1000)
    return out


async def burst(http: aiohttp.ClientSession, gw: Gateway, n: int) -> dict[str, Any]:
    dep_id = await gw.create("burst", 1, "--startup-delay", "2")
    ready = asyncio.ensure_future(engine_ready_at(http, gw, dep_id))
    results = await asyncio.gather(*(ask(http, gw, dep_id, "burst") for _ in range(n)), return_exceptions=True)
    ready_at = await ready
    ok = [r for r in results if isinstance(r, tuple) and r[0] == 200]
    audit = await gw.api("GET", f"/audit?deployment_id={dep_id}&limit=1000")
    return {"n": n, "ok": len(ok), "starts": sum(1 for a in audit if a["action"] == "ondemand_start"),
            "last_after_ready_s": max(r[1] for r in ok) - ready_at if ok else None}


def _ms(values: list[float]) -> str:
    return f"{median(values):.1f} / {pct(values, 90):.1f} / {max(values):.1f}"


def section(res: dict[str, Any], quick: bool) -> str:
    ready, static, measured, b = res["ready"], res["static"], res["measured"], res["burst"]

    def met(ok: bool) -> str:
        return "**met**" if ok else "**MISSED**"
    lines = [
        SECTION, "",
        f"`scripts/bench_cold.py{' --quick' if quick else ''}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        "ondemand serve with the process backend and the engine simulator, on this machine.", "",
        "| Figure | p50 / p90 / max | Rounds | Target |", "|---|---:|---:|---|",
        f"| Engine ready → first byte to the waiting client (ms) | {_ms(ready)} | {len(ready)} | "
        f"p50 ≤ {T_READY_MS:g} ms: {met(median(ready) <= T_READY_MS)} |",
        f"| Make-room, static budget: victim's exit → the next start (ms) | {_ms(static)} | {len(static)} | "
        f"≤ {T_MAKE_ROOM_MS:g} ms: {met(max(static) <= T_MAKE_ROOM_MS)} |",
        f"| Make-room, measured budget: freed memory showing → the next start (ms) | {_ms(measured)} | "
        f"{len(measured)} | ≤ {T_MAKE_ROOM_MS:g} ms: {met(median(measured) <= T_MAKE_ROOM_MS)} |",
        "",
        f"A burst of {b['n']:,} first requests for a cold model: {b['starts']} start, {b['ok']:,} answered 200; "
        f"the last answer {b['last_after_ready_s']:.2f} s after the engine was ready.", "",
        "What dominates: readiness is asked every 20 ms for a start's first 2 s, then every 50 ms; a "
        "freed GPU is read again 50 ms after each nvidia-smi reading (the fake answers in a few ms, "
        "the real tool in tens); on a static budget nothing is read, the start follows the stop's report.",
        "",
    ]
    return "\n".join(lines)


def write_section(text: str, out: Path, section: str = SECTION) -> None:
    """Put ``text`` (which begins with ``section``) in ``out`` in place of that section."""
    results.write_section(text, out, section)


async def run(tmp: Path, procs: Procs, quick: bool) -> dict[str, Any]:
    env = child_env()
    env.update(fake_gpu(tmp, 20 * 1024))
    static = Gateway(procs, tmp, "static", '[budget]\nsource = "static"\ncapacity_gib = 20\n', env)
    measured = Gateway(procs, tmp, "measured", f'[budget]\nsource = "nvidia-smi"\nnvidia_smi = "{FAKE_SMI}"\n', env)
    rounds = 4 if quick else 12
    res: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for gw in (static, measured):
            await gw.start()
        try:
            res["ready"] = await ready_to_first_byte(http, static, rounds)
            res["static"] = await make_room(http, static, rounds, gpu=False)
            res["measured"] = await make_room(http, measured, rounds, gpu=True)
            res["burst"] = await burst(http, static, 200 if quick else 1000)
        finally:
            for gw in (static, measured):
                await gw.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds, 200 in the burst")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    raise_nofile(8192)
    tmp = Path(tempfile.mkdtemp(prefix="ondemand-cold-"))
    procs = Procs(tmp / "static" / "state")
    try:
        import uvloop
        res = uvloop.run(run(tmp, procs, args.quick))
    except Exception as exc:
        print(f"bench_cold: failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    text = section(res, args.quick)
    print(text)
    if not args.no_write:
        write_section(text, args.out)
    return 0 if res["burst"]["starts"] == 1 and res["burst"]["ok"] == res["burst"]["n"] else 1


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
