#!/usr/bin/env python3
"""Could any per-deployment idle timeout meet adaptive warmth's targets on these traces?
(``make replay-bounds``: about 16 minutes of CPU, spread over the machine's cores.)

``make replay`` measures adaptive against the fixed sweep and finds it short of issue 32's
targets; this asks whether that is adaptive's fault or the traces'. It replays each trace and
window of ``make replay`` (the whole trace and its second half on the DGX H100, the second half on
16 x 80 GiB) under ``current`` with every deployment's ``idle_timeout_s`` chosen by hand, which is
the most any adaptive policy that rests a deployment after a learned time can do:

- **planned:** the eight most requested deployments each at 60 s (rest as soon as allowed) or
  600 s (the mix's timeout), every combination (256), the others at 600 s. Adaptive plans only
  for a deployment with 20 learned gaps, and on these traces only the busiest reach 20 in the
  hour (seven or eight of the sixteen; five by the half): the others behave as ``fixed`` at their
  600 s, whatever any policy learns;
- **by rank:** the top k at 600 s and the rest at 60 s, for every k (17 runs): what a rule that
  rested the rarely called models early would give, could it plan for them.

For each, the best assignment against the fixed curve, on both measures of waiting
(``replay_pareto.py``: ``wake + cold``, and every wait). The section goes into
``bench/replay.md`` between ``<!-- replay:bounds -->`` markers.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import replay_pareto as pareto  # noqa: E402
from replaykit import mix  # noqa: E402
from replaykit.markdown import write_md  # noqa: E402

from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Policy  # noqa: E402

PLANNED = 8  # the most requested deployments, whose timeouts the search chooses
REST, KEEP = 60, 600  # min_idle_timeout_s's default, and the mix's timeout
CASES = (("code", "whole trace", False, "dgx"), ("code", "second half", True, "dgx"),
         ("code", "second half, 16 x 80 GiB", True, "roomy"), ("conv", "whole trace", False, "dgx"),
         ("conv", "second half", True, "dgx"), ("conv", "second half, 16 x 80 GiB", True, "roomy"))
Point = tuple[float, int, int, int]  # GiB-hours, wake + cold, every wait, failed


def one(trace: str, second_half: bool, box_name: str, timeouts: tuple[int, ...]) -> Point:
    """The trace under ``current`` with deployment i (by the mix's order: by weight) at
    ``timeouts[i]``."""
    box = mix.BOX if box_name == "dgx" else mix.ROOMY
    deps = [dataclasses.replace(d, deployment=dataclasses.replace(d.deployment, idle_timeout_s=t))
            for d, t in zip(from_file(str(mix.MIX), box), timeouts, strict=True)]
    tr = Trace(str(mix.TRACES[trace]), deps, seed=0)
    span = tr.check().span_s
    r = replay(tr, deps, box, [Policy.parse("current")], slo_s=mix.SLO_S,
               measure_from_s=span / 2 if second_half else 0.0)[0]
    return pareto.gib_hours(r), pareto.waits(r, False), pareto.waits(r, True), r.total.failed


def ratio(curve: float, mine: int) -> float:
    """How many times these waits the fixed curve has there (1 when both are none)."""
    if mine == 0:
        return 1.0 if curve == 0 else float("inf")
    return curve / mine


def best(points: dict[tuple[int, ...], Point], fixed: list[Point], queue: bool) -> tuple[tuple[int, ...], Point, float]:
    curve = [(p[0], p[2] if queue else p[1]) for p in fixed]
    scored = [(ratio(pareto.curve_at(curve, p[0]), p[2] if queue else p[1]), t, p) for t, p in points.items()]
    r, t, p = max(scored, key=lambda s: (s[0], -s[2][0]))
    return t, p, r


def cells(p: Point, curves: tuple[list[tuple[float, int]], ...]) -> str:
    """GiB-hours, then each measure of waiting with the fixed curve's there and how many times it."""
    out = []
    for mine, curve in zip((p[1], p[2]), curves, strict=True):
        there = pareto.curve_at(curve, p[0])
        r = ratio(there, mine)
        out.append(f"{mine} ({there:.0f}: {r:.2f} x)" if math.isfinite(r) else f"{mine} ({there:.0f})")
    return f"{p[0]:.0f} | " + " | ".join(out) + f" | {p[3]}"


def describe(t: tuple[int, ...]) -> str:
    rested = [i + 1 for i, v in enumerate(t) if v == REST]
    if not rested:
        return "none rested"
    runs: list[list[int]] = []
    for r in rested:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    spans = [f"{g[0]}" if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in runs]
    return ("rank " if rested == [rested[0]] else "ranks ") + ", ".join(spans) + f" at {REST} s"


def main() -> int:
    n = len(from_file(str(mix.MIX), mix.BOX))
    planned = [c + (KEEP,) * (n - PLANNED) for c in itertools.product((REST, KEEP), repeat=PLANNED)]
    by_rank = [(KEEP,) * k + (REST,) * (n - k) for k in range(n + 1)]
    fixed_t = [(t,) * n for t in (60, 300, 600, 1800)]
    jobs = {(case, t) for case in CASES for t in {*planned, *by_rank, *fixed_t}}
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(one, key[0][0], key[0][2], key[0][3], key[1]) for key in sorted(jobs)}
        done = {key: f.result() for key, f in futures.items()}
    rows = ["| trace | measured | timeouts chosen | the best for wake + cold | GiB-h | wake + cold (the curve's) "
            "| every wait (the curve's) | failed | the best for every wait | GiB-h | wake + cold (the curve's) "
            "| every wait (the curve's) | failed |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for case in CASES:
        fixed = [done[(case, t)] for t in fixed_t]
        rows.append(f"| {case[0]} | {case[1]} | the fixed sweep | "
                    + ", ".join(f"{t[0]} s: {p[0]:.0f} GiB-h, {p[1]} / {p[2]} waits, {p[3]} failed"
                                for t, p in zip(fixed_t, fixed, strict=True)) + " | | | | | | | | | |")
        curves = ([(p[0], p[1]) for p in fixed], [(p[0], p[2]) for p in fixed])
        for label, ts in ((f"planned (the top {PLANNED})", planned), ("by rank", by_rank)):
            points = {t: done[(case, t)] for t in ts}
            t1, p1, _ = best(points, fixed, False)
            t2, p2, _ = best(points, fixed, True)
            rows.append(f"| {case[0]} | {case[1]} | {label} | {describe(t1)} | {cells(p1, curves)} "
                        f"| {describe(t2)} | {cells(p2, curves)} |")
    body = "\n".join(rows) + "\n"
    print(body)
    write_md({"bounds": body})
    return 0


if __name__ == "__main__":
    sys.exit(main())
