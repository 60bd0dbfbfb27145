#!/usr/bin/env python3
"""Start phases: the error of a start's ETA, and what reading the weights ahead saves.

Run from the repository root (``make bench`` runs it after ``scripts/bench_wake.py``)::

    .venv/bin/python scripts/bench_phases.py           # about 5 minutes
    .venv/bin/python scripts/bench_phases.py --quick   # fewer starts, a smaller checkpoint

Against ``python -m ondemand serve`` (process backend, ``benchkit.gateway.Gateway``) and the engine
simulator, it measures:

1. **The ETA's error.** One deployment, started cold over and over (``POST .../start``, then
   ``stop``); before each start its command is edited to draw the simulator's phase times
   around the same medians (``--weights-delay``, ``--compile-delay`` and the serving tail, each
   its median times a uniform factor in [0.7, 1.3]; the process phase is the simulator's own
   start, as it comes). The estimate is the view's ``start_eta_s`` as the start begins (the
   start's answer), the actual is from the start's request to the view showing it ready. After
   ``--learn`` starts that only teach ondemand the phases, ``--starts`` starts are measured:
   the median and 90th percentile of |estimate − actual| / actual, against 20 % and 40 %.
   Beside it, what the single ETA (the median of the last five whole starts) would have said.
2. **The weights read ahead.** A vLLM recipe whose command is the simulator with
   ``--load-weights`` (it reads the checkpoint's files as an engine's loader does) and whose
   model is a synthetic checkpoint of ``--gib`` GiB on this disk. Before each start the files
   are evicted from the page cache (``posix_fadvise(DONTNEED)``); one gateway reads them ahead
   (``budget.host_reserve_gib = 0``), the other cannot (a reserve larger than the host: skipped,
   "memory is short"). Twice: an engine that loads at once, and one that loads after
   ``--imports`` seconds of start-up (a shell ``sleep`` before it, as vLLM's imports before its
   load). Each start's weights phase is the simulator's "Loading weights took", the start
   is the request's cold start and answer.

It writes (or replaces) the "Start phases" section of ``bench/results.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit.gateway import Gateway, ask  # noqa: E402
from benchkit.measure import median, pct  # noqa: E402
from benchkit.procs import ROOT, Procs, child_env, raise_nofile  # noqa: E402
from benchkit.results import write_section  # noqa: E402

from ondemand.engines.readahead import read_files  # noqa: E402

OUT = ROOT / "bench" / "results.md"
SECTION = "## Start phases"
T_MEDIAN, T_P90 = 0.20, 0.40
MEDIANS = {"weights": 1.5, "compile": 2.5, "tail": 0.5}  # seconds; the tail: serving until ready
SPREAD = 0.3
SINGLE_OF = 5  # the single ETA: the median of this many last starts (control/starts.py)


# --- 1. the ETA's error --------------------------------------------------------------------

def draw(rng: random.Random) -> dict[str, float]:
    return {k: round(m * rng.uniform(1 - SPREAD, 1 + SPREAD), 3) for k, m in MEDIANS.items()}


def sim_command(name: str, t: dict[str, float]) -> list[str]:
    total = t["weights"] + t["compile"] + t["tail"]
    return ["ondemand", "sim-engine", "--port", "{port}", "--model", name, "--startup-delay", f"{total:.3f}",
            "--weights-delay", f"{t['weights']:.3f}", "--compile-delay", f"{t['compile']:.3f}"]


async def wait_state(gw: Gateway, dep_id: int, want: str, within: float = 120) -> float:
    """Poll the view every 10 ms until its state is ``want``; when it was seen."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        view = await gw.api("GET", f"/deployments/{dep_id}")
        if view["state"] == want:
            return time.monotonic()
        if view["state"] == "failed":
            raise RuntimeError(f"the start failed: {view.get('state_reason')}")
        await asyncio.sleep(0.01)
    raise RuntimeError(f"not {want} within {within} s")


async def eta_errors(gw: Gateway, learn: int, starts: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    name = "eta"
    dep = await gw.api("POST", "/deployments", {"name": name, "served_name": name, "engine": "vllm",
                                                "memory_gib": 1, "mode": "on_demand",
                                                "command": sim_command(name, MEDIANS)})
    dep_id = int(dep["id"])
    out = []
    for n in range(learn + starts):
        t = draw(rng)
        await gw.api("PATCH", f"/deployments/{dep_id}", {"command": sim_command(name, t)})
        began = time.monotonic()
        view = await gw.api("POST", f"/deployments/{dep_id}/start")
        answered = time.monotonic()
        ready = await wait_state(gw, dep_id, "ready")
        await gw.api("POST", f"/deployments/{dep_id}/stop")
        # The view's start_eta_s is what was left when it answered: the estimate at the beginning
        # is that plus the moments the answer took.
        est = view.get("start_eta_s")
        estimate = None if est is None else est + (answered - began)
        actual = ready - began
        out.append({"learn": n < learn, "drawn": t, "estimate": estimate, "actual": actual,
                    "error": None if estimate is None else abs(estimate - actual) / actual})
    return out


def single_errors(rows: list[dict[str, Any]], learned: list[float]) -> list[float]:
    """What the single ETA (the median of the last SINGLE_OF starts) would have erred by."""
    history = list(learned)
    errors = []
    for row in rows:
        if history:
            est = statistics.median(history[-SINGLE_OF:])
            errors.append(abs(est - row["actual"]) / row["actual"])
        history.append(row["actual"])
    return errors


# --- 2. the weights read ahead ----------------------------------------------------------------

def make_checkpoint(where: Path, gib: float, shards: int = 4) -> list[Path]:
    """A synthetic checkpoint: ``shards`` safetensors-named files of random bytes, ``gib`` in all."""
    where.mkdir(parents=True)
    (where / "config.json").write_text("{}")
    block = os.urandom(8 * 2**20)
    per = int(gib * 2**30 / shards)
    files = []
    for i in range(shards):
        path = where / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as fh:
            left = per
            while left > 0:
                left -= fh.write(block[:min(left, len(block))])
            fh.flush()
            os.fsync(fh.fileno())
        files.append(path)
    return files


def evict(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LOADED = re.compile(r"Loading weights took ([0-9.]+) seconds")


def weights_s(log: Path) -> float | None:
    found = _LOADED.findall(log.read_text(errors="replace")) if log.exists() else []
    return float(found[-1]) if found else None


def recipe_command(imports_s: float) -> list[str]:
    """The simulator as a vLLM command that reads its weights; after ``imports_s`` of start-up."""
    sim = [sys.executable, "-m", "ondemand", "sim-engine", "--load-weights", "--startup-delay", "0.5",
           "--weights-delay", "0", "--compile-delay", "0.3"]
    if imports_s <= 0:
        return sim
    return ["sh", "-c", f'sleep {imports_s:g}; exec {" ".join(sim)} "$@"', "sh"]


async def read_ahead_rounds(http: aiohttp.ClientSession, gw: Gateway, name: str, model: Path,
                            files: list[Path], rounds: int, expect_skipped: bool) -> list[dict[str, Any]]:
    dep = await gw.api("POST", "/deployments", {"name": name, "served_name": name, "engine": "vllm",
                                                "model": str(model), "memory_gib": 1, "mode": "on_demand"})
    dep_id = int(dep["id"])
    out = []
    for _ in range(rounds):
        await asyncio.to_thread(evict, files)
        began = time.monotonic()
        status, _head = await ask(http, gw, dep_id, name)
        start_s = time.monotonic() - began
        if status != 200:
            raise RuntimeError(f"{name}: the request got {status}")
        view = await gw.api("GET", f"/deployments/{dep_id}")
        ahead = (view.get("read_ahead") or {}).get("state")
        if (ahead == "skipped") != expect_skipped:
            raise RuntimeError(f"{gw.name}: the read-ahead was {ahead!r}: {view.get('read_ahead')}")
        out.append({"start": start_s, "weights": weights_s(gw.state / "logs" / f"{name}.log"), "ahead": ahead})
        await gw.api("POST", f"/deployments/{dep_id}/stop")
        for _ in range(1200):  # the next round's eviction must not race this round's read
            if ((await gw.api("GET", f"/deployments/{dep_id}")).get("read_ahead") or {}).get("state") != "reading":
                break
            await asyncio.sleep(0.05)
    await gw.api("DELETE", f"/deployments/{dep_id}")
    return out


def gateway(procs: Procs, tmp: Path, name: str, env: dict[str, str], imports_s: float, reserve_gib: float) -> Gateway:
    cmd = json.dumps(recipe_command(imports_s))
    extra = (f"commands = {{ vllm = {cmd} }}\n[budget]\nsource = \"static\"\ncapacity_gib = 20\n"
             f"host_reserve_gib = {reserve_gib:g}\n")
    return Gateway(procs, tmp, name, extra, env)


# --- the section --------------------------------------------------------------------------

def section(res: dict[str, Any], args: argparse.Namespace) -> str:

    def met(ok: bool) -> str:
        return "**met**" if ok else "**MISSED**"
    rows = res["eta"]
    errors = [r["error"] for r in rows if r["error"] is not None]
    single = res["single"]
    med, p90 = median(errors), pct(errors, 90)
    lines = [
        SECTION, "",
        f"`scripts/bench_phases.py{' --quick' if args.quick else ''}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: ondemand serve with the process backend and the "
        f"engine simulator, on this machine ({os.cpu_count()} cores, load average {res['load'][0]:.1f} before and "
        f"{res['load'][1]:.1f} after).", "",
        f"**The ETA's error.** {len(rows)} cold starts of one deployment (after {args.learn} that taught it the "
        f"phases), each phase drawn around the same medians (weights {MEDIANS['weights']:g} s, compile "
        f"{MEDIANS['compile']:g} s, serving {MEDIANS['tail']:g} s, each × U[{1 - SPREAD:g}, {1 + SPREAD:g}]; the "
        "process phase is the simulator's own start). The estimate is the view's `start_eta_s` as the start "
        "began; the error |estimate − actual| / actual.", "",
        "| ETA | Median error | p90 error | Max | Target |", "|---|---:|---:|---:|---|",
        f"| By phase (ondemand's) | {med:.1%} | {p90:.1%} | {max(errors):.1%} | median ≤ {T_MEDIAN:.0%}, "
        f"p90 ≤ {T_P90:.0%}: {met(med <= T_MEDIAN and p90 <= T_P90)} |",
        f"| Single (median of the last {SINGLE_OF} starts), for comparison | {median(single):.1%} | "
        f"{pct(single, 90):.1%} | {max(single):.1%} | |", "",
        f"Actual starts: median {median([r['actual'] for r in rows]):.2f} s, from "
        f"{min(r['actual'] for r in rows):.2f} to {max(r['actual'] for r in rows):.2f} s.", "",
    ]
    ra = res["read_ahead"]
    lines += [
        f"**The weights read ahead.** A synthetic checkpoint of {args.gib:g} GiB ({ra['shards']} safetensors "
        f"files) on this disk, evicted from the page cache before each start (`posix_fadvise(DONTNEED)`); the "
        "simulator as a vLLM recipe reads every byte of it as its load (`--load-weights`). Reading the "
        f"evicted files here: {ra['cold_read_s']:.2f} s; from the page cache: {ra['warm_read_s']:.2f} s. "
        f"Medians of {args.rounds} starts; seconds.", "",
        "| Engine | Read ahead | Weights phase (the engine's \"Loading weights took\") | Whole start (request to "
        "answer) |", "|---|---|---:|---:|",
    ]
    for case in ra["cases"]:
        for label, runs in (("no (skipped: memory is short)", case["off"]), ("yes", case["on"])):
            w = [r["weights"] for r in runs if r["weights"] is not None]
            lines.append(f"| {case['label']} | {label} | {median(w):.2f} | {median([r['start'] for r in runs]):.2f} |")
    lines += [
        "",
        "ondemand begins the read as the start begins and asks the kernel to read each file ahead "
        "(`POSIX_FADV_WILLNEED`), in a thread beside the engine: an engine that spends seconds starting up "
        "before its load (vLLM imports torch and starts its engine core first) finds the weights in memory; "
        "one that loads at once reads beside it (and gained here too: the first two rows). The page cache "
        "keeps them for the next start while the host has the memory.",
        "",
    ]
    return "\n".join(lines)


def cold_read_s(files: list[Path]) -> tuple[float, float]:
    """Reading the files evicted, then again from the page cache."""
    evict(files)
    began = time.monotonic()
    read_files(files, threading.Event())
    cold = time.monotonic() - began
    began = time.monotonic()
    read_files(files, threading.Event())
    return cold, time.monotonic() - began


async def run(tmp: Path, procs: Procs, args: argparse.Namespace) -> dict[str, Any]:
    env = child_env()
    res: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    eta_gw = Gateway(procs, tmp, "eta", '[budget]\nsource = "static"\ncapacity_gib = 20\n', env)
    await eta_gw.start()
    try:
        rows = await eta_errors(eta_gw, args.learn, args.starts, args.seed)
    finally:
        await eta_gw.close()
    res["eta"] = [r for r in rows if not r["learn"]]
    res["single"] = single_errors(res["eta"], [r["actual"] for r in rows if r["learn"]])

    model = tmp / "checkpoint"
    files = await asyncio.to_thread(make_checkpoint, model, args.gib)
    cold, warm = await asyncio.to_thread(cold_read_s, files)
    cases = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for imports_s, label in ((0.0, "loads at once"), (args.imports, f"loads after {args.imports:g} s of start-up")):
            case: dict[str, Any] = {"label": label}
            for key, reserve in (("off", 1e6), ("on", 0.0)):
                gw = gateway(procs, tmp, f"ra-{key}-{int(imports_s * 10)}", env, imports_s, reserve)
                await gw.start()
                try:
                    case[key] = await read_ahead_rounds(http, gw, "weights", model, files, args.rounds,
                                                        expect_skipped=key == "off")
                finally:
                    await gw.close()
            cases.append(case)
    res["read_ahead"] = {"cases": cases, "shards": len(files), "cold_read_s": cold, "warm_read_s": warm}
    res["load"].append(os.getloadavg()[0])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 starts, 2 rounds, a 0.25 GiB checkpoint")
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--learn", type=int, default=3, help="starts that only teach ondemand the phases")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=4.0, help="the synthetic checkpoint's size")
    ap.add_argument("--imports", type=float, default=5.0, help="seconds of start-up before the engine loads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.starts, args.learn, args.rounds, args.gib, args.imports = 6, 2, 2, 0.25, 1.0
    raise_nofile(8192)
    tmp = Path(tempfile.mkdtemp(prefix="ondemand-phases-"))
    procs = Procs(tmp / "eta" / "state")
    try:
        import uvloop
        res = uvloop.run(run(tmp, procs, args))
    except Exception as exc:
        print(f"bench_phases: failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    text = section(res, args)
    print(text)
    if not args.no_write:
        write_section(text, args.out, SECTION)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
