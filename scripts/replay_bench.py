"""The replay's benchmark (``make replay``): three traces over the box mix, on a DGX H100 and on
16 x 80 GiB, under ondemand's policies, its peers' and the clairvoyant reference, in virtual time.

Run from the repository root::

    .venv/bin/python scripts/replay_bench.py            # every table (bench/replay.md, .html, .svg)
    .venv/bin/python scripts/replay_bench.py --speed    # the speed target alone (make bench)

The traces (``bench/traces/``): the Azure LLM inference traces of 2023 (code and conv, an hour
each, no model column: rows go to the mix's deployments by weight) and the ServeGen trace (a
week of 16 production clients, one per deployment: real per-model rhythms). The boxes: a DGX
H100 (8 x 80 GiB, 2 TiB of host memory; always-on fits 8 of the 16 models) and 16 x 80 GiB (every
model fits). Each table: the policies' rows (``report.markdown``), then each one's distance to
``clairvoyant`` and who dominates it (``replay_front.table``), and in words where ondemand's own
lose (``replay_front.words``). The tables go into ``bench/replay.md`` between its markers
(``<!-- replay:NAME -->`` ... ``<!-- /replay:NAME -->``; the words around them are kept), the
pages of the Azure traces into ``bench/replay.html``, the Pareto picture of every table into
``bench/replay-pareto.svg``. ``--speed`` replays the conv trace under the first six policies and
fails when it takes 60 s of CPU or more, or when its memory grew with the policies (it streams
the trace: nothing is held per policy).
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

import replay_front as front  # noqa: E402

from ondemand.replay import page, report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.run import replay  # noqa: E402
from ondemand.replay.trace import Trace  # noqa: E402
from ondemand.replay.types import Box, Policy, PolicyResult, Replayed  # noqa: E402

MIX = ROOT / "bench" / "box-mix.toml"
TRACES = {"code": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_code.csv",
          "conv": ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv",
          "servegen": ROOT / "bench" / "traces" / "servegen_language_7d.csv"}
TITLES = {"code": "Azure LLM inference trace 2023, code", "conv": "Azure LLM inference trace 2023, conv",
          "servegen": "ServeGen, 16 clients, a week"}
POLICIES = ("always-on", "seed", "ttl=300", "sleep-ttl=300", "lru=300", "sleep-lru=300", "fixed=60", "fixed=300",
            "fixed=600", "fixed=1800", "adaptive", "cost", "clairvoyant")
BOXES = {"dgx": Box(gpus=(80.0,) * 8, host_gib=2048),  # a DGX H100: 8 x 80 GiB, 2 TiB of host memory
         "16x80": Box(gpus=(80.0,) * 16, host_gib=2048)}  # where always-on fits: 1045 GiB booked on 1280
BOX = BOXES["dgx"]
ROOMY = BOXES["16x80"]
SLO_S = 5.0
SPEED_LIMIT_S = 60.0


def known(policies: tuple[str, ...]) -> tuple[str, ...]:
    """The policies this tree can replay (``cost`` and ``clairvoyant`` come with their issues)."""
    out = []
    for name in policies:
        try:
            Policy.parse(name)
        except ValueError:
            continue
        out.append(name)
    return tuple(out)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(name: str, deps: list[Replayed], policies: tuple[str, ...], *, box: Box = BOX
        ) -> tuple[list[PolicyResult], dict[str, float]]:
    """The trace under ``policies`` on ``box``."""
    trace = Trace(str(TRACES[name]), deps, seed=0)
    summary = trace.check()
    wall, cpu = time.monotonic(), time.process_time()
    results = replay(trace, deps, box, [Policy.parse(p) for p in policies], slo_s=SLO_S)
    took = {"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu, "rss_mib": peak_rss_mib(),
            "requests": summary.requests, "models": len(summary.models)}
    return results, took


def per_deployment(result: PolicyResult) -> str:
    """Where requests failed or waited, by deployment: one policy's rows."""
    lines = ["| deployment | requests | wait ≤ SLO | timed out | refused | wait p99 | wake | cold | queue | "
             "cold starts | wakes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for dep, tally in result.per_deployment.items():
        j = report.tally_json(tally)
        p99 = j["wait_s"]["p99"]
        lines.append(f"| {dep} | {j['requests']} | {100 * j['wait_slo_met']:.1f} % | {j['timed_out']} | "
                     f"{j['refused']} | {'-' if p99 is None else f'{p99:.1f} s'} | {j['waited']['wake']} | "
                     f"{j['waited']['cold']} | {j['waited']['queue']} | {j['cold_starts']} | {j['wakes']} |")
    return "\n".join(lines) + "\n"


def section(results: list[PolicyResult], took: dict[str, float]) -> str:
    end = max(r.end_s for r in results)
    by = front.by_name(results)
    return (f"{took['requests']:,} requests over {end / 3600:.2f} h of virtual time, {took['models']} deployments "
            f"requested; replayed under {len(results)} policies in {took['wall_s']:.1f} s "
            f"({took['cpu_s']:.1f} s of CPU).\n\n" + report.markdown(results, SLO_S)
            + "\nEach policy against the reference and the others (the front: dominated by none):\n\n"
            + front.table(results) + "\nWhere ondemand's own policies stand:\n\n" + front.words(results)
            + "\nBy deployment, `seed` (today's default):\n\n" + per_deployment(by["seed"]))


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
    policies = known(POLICIES)
    sections, parts, panels = {}, [], []
    for name in TRACES:
        for box_name, box in BOXES.items():
            results, took = run(name, deps, policies, box=box)
            print(f"{name} on {box_name}: {took['wall_s']:.1f} s ({took['cpu_s']:.1f} s of CPU)", file=sys.stderr)
            print(report.table(results, SLO_S))
            sections[f"{name}-{box_name}"] = section(results, took)
            panels.append((f"{TITLES[name]}, {'DGX H100' if box_name == 'dgx' else '16 x 80 GiB'}", results))
            if name != "servegen" and box_name == "dgx":
                parts.append(page.section(results, box, title=TITLES[name], slo_s=SLO_S))
    write_md(sections)
    (ROOT / "bench" / "replay.html").write_text(page.document("ondemand replay: the box mix", parts))
    (ROOT / "bench" / "replay-pareto.svg").write_text(front.svg(panels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
