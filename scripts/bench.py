#!/usr/bin/env python3
"""Benchmark of the on-demand gateway against the engine it forwards to.

Run from the repository root::

    .venv/bin/python scripts/bench.py            # about 2 minutes on 2 cores
    .venv/bin/python scripts/bench.py --quick    # about 30 seconds (the smoke test)

What it does, loopback only, every loop bounded in time:

1. Writes a temporary configuration (process backend, static budget, the
   gateway on a free loopback port), runs ``ondemand key init`` and starts
   ``python -m ondemand --config CFG serve`` as a subprocess.
2. Creates on-demand deployments through the admin socket: ``bench`` (the
   engine simulator with ``--token-delay 0``, so the proxy's cost dominates)
   and a few ``bench-slow-N`` (``--token-delay 0.05``) for the open-streams
   memory test. The gateway starts their engines itself on the first request.
3. Reads the engine's ``base_url`` from the admin API: the "direct" runs hit
   the very engine the gateway forwards to.
4. Interleaved rounds, gateway and direct in alternating order (ABBA), so
   drift affects both: non-streaming chat at concurrency 1, 16 and 64,
   streams of 200 chunks at 16 and 64 concurrent streams, time to first byte.
5. The gateway's RSS at idle and while 1,000 streams are open through it.
6. Prints a Markdown report and writes it to ``bench/results.md`` (``--out``).

The load generator runs in this process (uvloop, one aiohttp session,
unlimited connector) and shares the machine's cores with the gateway and the
engine, as a LiteLLM on the same host would; the report says so.

Exit status: 0 when the run completed (targets met or not: the report says
which), 1 when it failed or requests failed, 130 when interrupted.

All subprocesses are stopped on exit, on Ctrl-C and on errors; the gateway
also gets SIGTERM if this process dies (PR_SET_PDEATHSIG), and it stops the
engines it started.

Its parts, and what the other benchmarks share with it, are in scripts/benchkit/.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit.procs import ROOT, Procs, raise_nofile  # noqa: E402
from benchkit.proxy import FULL, QUICK, Bench, Plan  # noqa: E402
from benchkit.proxy_report import report, scan_log  # noqa: E402
from benchkit.results import write_keeping  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results.md"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about 30 s), e.g. for a smoke test")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the Markdown report (default {DEFAULT_OUT})")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    ap.add_argument("--keep", action="store_true", help="keep the temporary state directory (logs)")
    ap.add_argument("--access-log", choices=("off", "text", "json"), default="off",
                    help="the gateway's access_log setting (default off)")
    ap.add_argument("--scrape", type=float, default=0.0, metavar="S",
                    help="GET /metrics every S seconds during the rounds, as Prometheus would (default: never)")
    return ap.parse_args(argv)


def measure(bench: Bench) -> dict[str, Any]:
    """The run on uvloop (asyncio's loop without it)."""
    try:
        import uvloop
        return uvloop.run(bench.run())
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(bench.run())


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    plan: Plan = QUICK if args.quick else FULL

    # Client + gateway inbound + gateway to engine + engines: about 3 fds per open stream.
    nofile = raise_nofile(max(8192, plan.open_streams * 4 + 1024))
    if nofile < plan.open_streams * 3 + 256:
        print(f"bench: RLIMIT_NOFILE is {nofile}, too low for {plan.open_streams} open streams", file=sys.stderr)
        return 2

    # SIGTERM is handled as Ctrl-C: the event loop's SIGINT handler cancels the run, and the
    # finally below stops the subprocesses. SIGINT also when started with it ignored (nohup, &).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))

    tmp = Path(tempfile.mkdtemp(prefix="ondemand-bench-"))
    procs = Procs(tmp / "state")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    bench = Bench(plan, procs, tmp, log, access_log=args.access_log, scrape_s=args.scrape)
    bench.results.update(access_log=args.access_log, scrape_s=args.scrape)
    log_scan: tuple[int, list[tuple[int, str]]] = (0, [])
    try:
        res = measure(bench)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"bench: failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        log_scan = scan_log(tmp / "serve.log")
        if args.keep:
            print(f"bench: state and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return finish(args, res, plan, time.perf_counter() - started, log_scan, log)


def finish(args: argparse.Namespace, res: dict[str, Any], plan: Plan, wall_s: float,
           log_scan: tuple[int, list[tuple[int, str]]], log: Callable[[str], None]) -> int:
    """The report printed and written; 1 when requests failed (the numbers are not valid)."""
    text, all_met = report(res, plan, args.quick, wall_s, log_scan)
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_keeping(text, args.out)
        log(f"wrote {args.out}")
    failed = sum(r.errors for runs in res["phases"].values() for side in runs.values() for r in side)
    failed += len(res["held"]["errors"])
    if failed:
        log(f"{failed} requests failed: the numbers are not valid")
        return 1
    log("all targets met" if all_met else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
