#!/usr/bin/env python3
"""The replay's benchmark (``make replay``): the Azure LLM inference traces of 2023 over the box
mix, under ondemand's policies and its peers', in virtual time.

Run from the repository root::

    .venv/bin/python scripts/replay_bench.py            # both traces x eight policies
    .venv/bin/python scripts/replay_bench.py --speed    # the speed target alone (make bench)

Both traces (``bench/traces/``) over ``bench/box-mix.toml`` on 8 x 80 GiB with a DGX H100's
2 TiB of host memory, each under ``always-on``, ``ttl=300``, ``sleep-ttl=300``, ``fixed=600``,
``current``, ``fixed=60``, ``fixed=300`` and ``fixed=1800``. The tables go into
``bench/replay.md`` between its markers (``<!-- replay:NAME -->`` ... ``<!-- /replay:NAME -->``;
the words around them are kept), the page into ``bench/replay.html``. ``--speed`` replays the
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

from ondemand.replay import page, report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Box, Policy, PolicyResult, Replayed  # noqa: E402

MIX = ROOT / "bench" / "box-mix.toml"
TRACES = {"code": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_code.csv",
          "conv": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv"}
POLICIES = ("always-on", "ttl=300", "sleep-ttl=300", "fixed=600", "current", "fixed=60", "fixed=300", "fixed=1800")
BOX = Box(gpus=(80.0,) * 8, host_gib=2048)  # a DGX H100: 8 x 80 GiB, 2 TiB of host memory
SLO_S = 5.0
SPEED_LIMIT_S = 60.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(name: str, deps: list[Replayed], policies: tuple[str, ...]) -> tuple[list[PolicyResult], dict[str, float]]:
    trace = Trace(str(TRACES[name]), deps, seed=0)
    summary = trace.check()
    wall, cpu = time.monotonic(), time.process_time()
    results = replay(trace, deps, BOX, [Policy.parse(p) for p in policies], slo_s=SLO_S)
    took = {"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu, "rss_mib": peak_rss_mib(),
            "requests": summary.requests, "models": len(summary.models)}
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
            + "\nBy deployment, `ttl=300`:\n\n" + per_deployment(by["ttl=300"]))


def write_md(sections: dict[str, str]) -> None:
    path = ROOT / "bench" / "replay.md"
    text = path.read_text()
    for name, body in sections.items():
        begin, end = f"<!-- replay:{name} -->", f"<!-- /replay:{name} -->"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no {begin} ... {end} markers")
        text = pattern.sub(lambda _m, b=begin, e=end, s=body: f"{b}\n{s}{e}", text)
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
    sections, parts = {}, []
    for name in TRACES:
        results, took = run(name, deps, POLICIES)
        print(f"{name}: {took['wall_s']:.1f} s", file=sys.stderr)
        print(report.table(results, SLO_S))
        sections[name] = section(name, results, took)
        parts.append(page.section(results, BOX, title=f"Azure LLM inference trace 2023, {name}", slo_s=SLO_S))
    write_md(sections)
    (ROOT / "bench" / "replay.html").write_text(page.document("ondemand replay: the box mix", parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
