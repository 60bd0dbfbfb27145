#!/usr/bin/env python3
"""Adaptive warmth where models have rhythms of their own: a synthetic day over the box mix
(``make replay-rhythms``, about 20 s of CPU). Not the issue's measurement, which is the Azure
traces' (``make replay``): those have no model column, so no model there has a rhythm; this shows
what the mechanism does when they do, on the same box, deployments and costs.

The day (12 hours, seeded, written to a temporary CSV with a model column, so that nothing is
assigned by weight):

- the two busiest deployments (the general chat model and the coding assistant) get steady
  memoryless traffic, a request every 4 and 12 s on average;
- ranks 3 to 10 are each called by a job on a period of its own (15, 20, 30, 45, 60, 90, 120 and
  180 minutes, each at its own phase, ±2 % jitter), in a burst of 3 to 12 requests a few seconds
  apart, as an agent pipeline, a nightly-style batch or a scheduled evaluation calls a model;
- ranks 11 to 16 are called now and then (memoryless, every 40 minutes on average).

Policies: always-on, the fixed sweep and adaptive, over the whole day and over its second half
(the first half replayed uncounted, adaptive learning in it) on the DGX H100 of ``make replay``,
and over its second half on 16 x 80 GiB (room to come back into).
The comparison (``replay_pareto.py``'s table) goes into ``bench/replay.md`` between
``<!-- replay:rhythms -->`` markers.
"""
from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import replay_pareto as pareto  # noqa: E402
from replaykit import mix  # noqa: E402
from replaykit.markdown import per_deployment, write_md  # noqa: E402

from ondemand.replay import report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Policy, PolicyResult, Replayed  # noqa: E402

DAY_S = 12 * 3600.0
SEED = 0
STEADY_EVERY_S = (4.0, 12.0)  # ranks 1 and 2: mean seconds between requests
PERIODS_MIN = (15, 20, 30, 45, 60, 90, 120, 180)  # ranks 3 to 10
JITTER = 0.02
RARE_EVERY_S = 2400.0  # ranks 11 to 16
POLICIES = ("always-on", *pareto.FIXED, "adaptive")


def day(deps: list[Replayed], seed: int = SEED) -> list[tuple[float, str, int, int]]:
    """The requests: (seconds, model, input tokens, output tokens), in order."""
    rng = random.Random(seed)
    out: list[tuple[float, str, int, int]] = []

    def tokens() -> tuple[int, int]:
        return int(rng.lognormvariate(7.0, 0.8)), int(rng.lognormvariate(5.0, 0.7))

    def memoryless(name: str, every_s: float) -> None:
        t = rng.expovariate(1 / every_s)
        while t < DAY_S:
            out.append((t, name, *tokens()))
            t += rng.expovariate(1 / every_s)

    names = [d.deployment.name for d in deps]
    for name, every_s in zip(names[:2], STEADY_EVERY_S, strict=True):
        memoryless(name, every_s)
    for name, minutes in zip(names[2:10], PERIODS_MIN, strict=True):
        period = minutes * 60.0
        t = rng.uniform(0, period)
        while t < DAY_S:
            at = t
            for _ in range(rng.randint(3, 12)):
                out.append((at, name, *tokens()))
                at += rng.uniform(1.0, 6.0)
            t += period * (1 + rng.uniform(-JITTER, JITTER))
    for name in names[10:]:
        memoryless(name, RARE_EVERY_S)
    out.sort()
    return out


def write_csv(rows: list[tuple[float, str, int, int]], path: Path) -> None:
    with open(path, "w") as fh:
        fh.write("timestamp,model,input_tokens,output_tokens\n")
        for at, model, tin, tout in rows:
            fh.write(f"{at:.3f},{model},{tin},{tout}\n")


def main() -> int:
    deps = from_file(str(mix.MIX), mix.BOX)
    rows = []
    halves: dict[str, list[PolicyResult]] = {}
    with tempfile.TemporaryDirectory(prefix="ondemand-rhythms-") as work:
        csv = Path(work) / "rhythms.csv"
        write_csv(day(deps), csv)
        for label, box, from_s in (("whole day", mix.BOX, 0.0), ("second half", mix.BOX, DAY_S / 2),
                                   ("second half, 16 x 80 GiB", mix.ROOMY, DAY_S / 2)):
            trace = Trace(str(csv), deps, seed=0)
            summary = trace.check()
            results = replay(trace, deps, box, [Policy.parse(p) for p in POLICIES], slo_s=mix.SLO_S,
                             measure_from_s=from_s)
            print(f"{label}:\n{report.table(results, mix.SLO_S)}")
            rows.append(("synthetic day", label, pareto.verdict({r.policy.name: r for r in results})))
            halves[label] = results
    roomy = halves["second half, 16 x 80 GiB"]
    by = {r.policy.name: r for r in roomy}
    body = (f"{summary.requests:,} requests over {DAY_S / 3600:.0f} hours (seed {SEED}), 16 deployments.\n\n"
            + pareto.table(rows)
            + "\nIts second half on 16 x 80 GiB, policy by policy:\n\n" + report.markdown(roomy, mix.SLO_S)
            + "\nBy deployment, `adaptive`, there:\n\n" + per_deployment(by["adaptive"])
            + "\nBy deployment, `fixed=600`, there:\n\n" + per_deployment(by["fixed=600"]))
    write_md({"rhythms": body})
    return 0


if __name__ == "__main__":
    sys.exit(main())
