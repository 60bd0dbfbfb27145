"""The replay's memory against the trace's length (bench/replay.md, "Memory"): a trace, then the
same trace N times over in time (each copy shifted to begin a minute after the one before it
ended its arrivals), under the policies given; the peak of Python's memory (tracemalloc) during
each replay, as ``ondemand replay`` runs without ``--html`` (``--timelines``: with the page's
timelines, which grow with the trace's changes). A replay that holds nothing per request peaks
alike at 1x and at Nx; exit 1 when the Nx peak is more than ``MARGIN`` over the 1x one.

Run from the repository root::

    .venv/bin/python scripts/replay_memory.py                      # conv, 1x and 4x, six policies
    .venv/bin/python scripts/replay_memory.py --trace code --times 8 --policies seed,adaptive

The ``clairvoyant`` reference is left out of the defaults: it is given the whole trace in
advance by design (run.py), so its memory grows with the trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Box, Policy, Replayed, Request  # noqa: E402

MIX = ROOT / "bench" / "box-mix.toml"
TRACES = {"code": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_code.csv",
          "conv": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv",
          "servegen": ROOT / "bench" / "traces" / "servegen_language_7d.csv"}
BOX = Box(gpus=(80.0,) * 8, host_gib=2048)  # make replay's DGX H100
POLICIES = "always-on,seed,ttl=300,sleep-ttl=300,lru=300,sleep-lru=300"  # make bench's speed check's six
# The Nx peak may be this much over the 1x one: what fills up to a bound still grows over a short
# trace (each deployment's last 500 idle gaps under each policy, the sketches' spans: conv 1x, 4x,
# 8x peak at 7.4, 8.6, 9.0 MiB); a value kept per request made it +195 % at 4x (bench/replay.md).
MARGIN = 0.25


def repeated(trace: Trace, times: int, span_s: float) -> Iterator[Request]:
    """The trace ``times`` over, copy k shifted by k x (its span and a minute), read as it goes."""
    shift = math.ceil(span_s) + 60.0
    for k in range(times):
        for req in trace:
            yield dataclasses.replace(req, at_s=req.at_s + k * shift)


def measure(trace: Trace, deps: list[Replayed], policies: list[Policy], times: int, span_s: float,
            timelines: bool) -> tuple[int, float, float]:
    """(requests, peak MiB of traced memory, seconds of CPU) of one replay of the trace ``times`` over."""
    count = 0

    def counted() -> Iterator[Request]:
        nonlocal count
        for req in repeated(trace, times, span_s):
            count += 1
            yield req
    tracemalloc.start()
    cpu = time.process_time()
    try:
        replay(counted(), deps, BOX, policies, slo_s=5.0, timelines=timelines)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return count, peak / (1 << 20), time.process_time() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=sorted(TRACES), default="conv")
    ap.add_argument("--times", type=int, default=4, help="the longer trace's copies (default 4)")
    ap.add_argument("--policies", default=POLICIES, help=f"comma-separated (default {POLICIES})")
    ap.add_argument("--timelines", action="store_true",
                    help="keep the page's timelines too (--html's; they grow with the trace's changes)")
    args = ap.parse_args()
    deps = from_file(str(MIX), BOX)
    trace = Trace(str(TRACES[args.trace]), deps, seed=0)
    span = trace.check().span_s
    policies = [Policy.parse(p) for p in args.policies.split(",")]
    rows = [measure(trace, deps, policies, n, span, args.timelines) for n in (1, args.times)]
    print("| trace | requests | policies | peak traced memory | CPU (traced) |\n| --- | ---: | ---: | ---: | ---: |")
    for n, (requests, peak, cpu) in zip((1, args.times), rows, strict=True):
        print(f"| {args.trace} x{n} | {requests:,} | {len(policies)} | {peak:.1f} MiB | {cpu:.0f} s |")
    (_, one, _), (_, many, _) = rows
    print(f"\n{args.times}x the requests: peak {100 * (many / one - 1):+.1f} %")
    return 0 if many <= one * (1 + MARGIN) else 1


if __name__ == "__main__":
    sys.exit(main())
