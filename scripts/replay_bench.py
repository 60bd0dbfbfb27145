#!/usr/bin/env python3
"""The replay's benchmark (``make replay``): the Azure LLM inference traces of 2023 over the box
mix, under ondemand's policies and its peers', in virtual time.

Run from the repository root::

    .venv/bin/python scripts/replay_bench.py            # both traces x nine policies, and adaptive's targets
    .venv/bin/python scripts/replay_bench.py --speed    # the speed target alone (make bench)

Both traces (``bench/traces/``) over ``bench/box-mix.toml`` on 8 x 80 GiB with a DGX H100's
2 TiB of host memory, each under ``always-on``, ``ttl=300``, ``sleep-ttl=300``, ``fixed=600``,
``current``, ``fixed=60``, ``fixed=300``, ``fixed=1800`` and ``adaptive``; then adaptive against
the fixed sweep and always-on (``replay_pareto.py``), over the whole trace and over its second
half with the first half as a warm-up (``measure_from_s``: what adaptive learned in it, and
what every policy left running, carry over). The tables go into ``bench/replay.md`` between its
markers (``<!-- replay:NAME -->`` ... ``<!-- /replay:NAME -->``; the words around them are
kept), the page into ``bench/replay.html``, the Pareto picture into
``bench/replay-pareto.svg``. ``--speed`` replays the
conv trace under the first six policies and fails when it takes 60 s of CPU or more (its own
cost: on a shared machine the wall clock says as much of the other runs; both are printed), or
when its memory grew with the policies (it streams the trace: nothing is held per policy).
"""
from __future__ import annotations

import argparse
import re
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import replay_pareto as pareto  # noqa: E402

from ondemand.replay import page, report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Box, Policy, PolicyResult, Replayed  # noqa: E402

MIX = ROOT / "bench" / "box-mix.toml"
TRACES = {"code": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_code.csv",
          "conv": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv"}
POLICIES = ("always-on", "ttl=300", "sleep-ttl=300", "fixed=600", "current", "fixed=60", "fixed=300", "fixed=1800",
            "adaptive")
PARETO = ("always-on", *pareto.FIXED, "adaptive")  # the second half's policies
BOX = Box(gpus=(80.0,) * 8, host_gib=2048)  # a DGX H100: 8 x 80 GiB, 2 TiB of host memory
ROOMY = Box(gpus=(80.0,) * 16, host_gib=2048)  # the same mix where always-on fits: 1045 GiB on 1280
SLO_S = 5.0
SPEED_LIMIT_S = 60.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(name: str, deps: list[Replayed], policies: tuple[str, ...], *, second_half: bool = False, box: Box = BOX
        ) -> tuple[list[PolicyResult], dict[str, float]]:
    """The trace under ``policies`` on ``box``; with ``second_half``, counted from the middle of
    its arrivals."""
    trace = Trace(str(TRACES[name]), deps, seed=0)
    summary = trace.check()
    wall, cpu = time.monotonic(), time.process_time()
    measure_from_s = summary.span_s / 2 if second_half else 0.0
    results = replay(trace, deps, box, [Policy.parse(p) for p in policies], slo_s=SLO_S,
                     measure_from_s=measure_from_s)
    took = {"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu, "rss_mib": peak_rss_mib(),
            "requests": summary.requests, "models": len(summary.models), "from_s": measure_from_s}
    return results, took


def per_deployment(result: PolicyResult) -> str:
    """Where requests failed or waited, by deployment: one policy's rows."""
    lines = ["| deployment | requests | failed | TTFT p50 | p99 | wake | cold | queue | cold starts | wakes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dep, tally in result.per_deployment.items():
        j = report.tally_json(tally)
        p50, p99 = j["ttft_s"]["p50"], j["ttft_s"]["p99"]
        lines.append(f"| {dep} | {j['requests']} | {j['failed']} | {'-' if p50 is None else f'{p50:.2f} s'} | "
                     f"{'-' if p99 is None else f'{p99:.1f} s'} | {j['waited']['wake']} | {j['waited']['cold']} | "
                     f"{j['waited']['queue']} | {j['cold_starts']} | {j['wakes']} |")
    return "\n".join(lines) + "\n"


def section(name: str, results: list[PolicyResult], took: dict[str, float]) -> str:
    end = max(r.end_s for r in results)
    by = {r.policy.name: r for r in results}
    return (f"{took['requests']:,} requests over {end / 3600:.2f} h of virtual time, {took['models']} deployments "
            f"requested; replayed under {len(results)} policies in {took['wall_s']:.1f} s "
            f"({took['cpu_s']:.1f} s of CPU).\n\n" + report.markdown(results, SLO_S)
            + "\nBy deployment, `current` (today's default: `fixed=600`):\n\n" + per_deployment(by["current"])
            + "\nBy deployment, `ttl=300`:\n\n" + per_deployment(by["ttl=300"])
            + "\nBy deployment, `adaptive`:\n\n" + per_deployment(by["adaptive"]))


Runs = dict[str, tuple[list[PolicyResult], list[PolicyResult], list[PolicyResult], dict[str, float]]]


def adaptive_section(runs: Runs) -> str:
    """Adaptive against the fixed sweep and always-on: the targets, then each trace's second
    half, policy by policy and adaptive by deployment, and on the roomy box."""
    rows = []
    for name, (whole, half, roomy, _) in runs.items():
        rows.append((name, "whole trace", pareto.verdict({r.policy.name: r for r in whole})))
        rows.append((name, "second half", pareto.verdict({r.policy.name: r for r in half})))
        rows.append((name, "second half, 16 x 80 GiB", pareto.verdict({r.policy.name: r for r in roomy})))
    out = [pareto.table(rows)]
    for name, (_, half, roomy, took) in runs.items():
        by = {r.policy.name: r for r in half}
        out.append(f"\nThe {name} trace's second half (from {took['from_s']:.0f} s; the first half replayed "
                   f"uncounted), {by['adaptive'].total.requests:,} requests:\n\n" + report.markdown(half, SLO_S)
                   + "\nBy deployment, `adaptive`, second half:\n\n" + per_deployment(by["adaptive"])
                   + "\nThe same on 16 x 80 GiB, where always-on fits:\n\n" + report.markdown(roomy, SLO_S))
    return "".join(out)


def write_md(sections: dict[str, str]) -> None:
    path = ROOT / "bench" / "replay.md"
    text = path.read_text()
    for name, body in sections.items():
        begin, end = f"<!-- replay:{name} -->", f"<!-- /replay:{name} -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        m = pattern.search(text)
        if m is None:
            raise SystemExit(f"{path}: no {begin} ... {end} markers")
        text = text[:m.start()] + f"{begin}\n{body}{end}" + text[m.end():]
    path.write_text(text)


def speed(deps: list[Replayed]) -> int:
    _, one = run("conv", deps, POLICIES[:1])
    _, six = run("conv", deps, POLICIES[:6])
    print(f"replay speed: the conv trace ({six['requests']:,} requests) x six policies in {six['wall_s']:.1f} s "
          f"({six['cpu_s']:.1f} s of CPU); peak RSS {one['rss_mib']:.0f} MiB after one policy, "
          f"{six['rss_mib']:.0f} MiB after six")
    slow = six["cpu_s"] >= SPEED_LIMIT_S
    grew = six["rss_mib"] > one["rss_mib"] * 1.5
    if slow or grew:
        print(f"replay speed: {'over 60 s' if slow else ''}{' and ' if slow and grew else ''}"
              f"{'memory grew with the policies' if grew else ''}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", action="store_true", help="the speed target alone")
    args = ap.parse_args()
    deps = from_file(str(MIX), BOX)
    if args.speed:
        return speed(deps)
    sections, parts, panels = {}, [], []
    runs: Runs = {}
    for name in TRACES:
        results, took = run(name, deps, POLICIES)
        half, half_took = run(name, deps, PARETO, second_half=True)
        roomy, roomy_took = run(name, deps, PARETO, second_half=True, box=ROOMY)
        print(f"{name}: {took['wall_s']:.1f} s, its second half {half_took['wall_s']:.1f} s, on 16 GPUs "
              f"{roomy_took['wall_s']:.1f} s", file=sys.stderr)
        for one in (results, half, roomy):
            print(report.table(one, SLO_S))
        sections[name] = section(name, results, took)
        runs[name] = (results, half, roomy, half_took)
        panels += [(f"{name} trace, whole", {r.policy.name: r for r in results}),
                   (f"{name} trace, second half", {r.policy.name: r for r in half}),
                   (f"{name} trace, second half, 16 x 80 GiB", {r.policy.name: r for r in roomy})]
        parts.append(page.section(results, BOX, title=f"Azure LLM inference trace 2023, {name}", slo_s=SLO_S))
    sections["adaptive"] = adaptive_section(runs)
    write_md(sections)
    (ROOT / "bench" / "replay.html").write_text(page.document("ondemand replay: the box mix", parts))
    (ROOT / "bench" / "replay-pareto.svg").write_text(pareto.svg(panels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
