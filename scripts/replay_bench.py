"""The replay's benchmark (``make replay``): three traces over the box mix, on a DGX H100 and on
16 x 80 GiB, under ondemand's policies, its peers' and the clairvoyant reference, in virtual time.

Run from the repository root::

    .venv/bin/python scripts/replay_bench.py            # every table (bench/replay.md, .html, .svg)
    .venv/bin/python scripts/replay_bench.py --speed    # the speed target alone (make bench)
    .venv/bin/python scripts/replay_bench.py --mapping-seed 1   # the Azure traces mapped anew: prints only

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import replay_front as front  # noqa: E402
from replaykit.markdown import per_deployment, write_md  # noqa: E402
from replaykit.mix import BOX, BOXES, MIX, ROOT, SLO_S, TITLES, TRACES, known, run  # noqa: E402
from replaykit.targets import words as target_words  # noqa: E402

from ondemand.replay import page, report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.types import PolicyResult, Replayed  # noqa: E402

POLICIES = ("always-on", "seed", "ttl=300", "sleep-ttl=300", "lru=300", "sleep-lru=300", "fixed=60", "fixed=300",
            "fixed=600", "fixed=1800", "adaptive", "cost", "clairvoyant", "clairvoyant=60")
SPEED_LIMIT_S = 60.0


def section(results: list[PolicyResult], took: dict[str, float], roomy: bool) -> str:
    end = max(r.end_s for r in results)
    by = front.by_name(results)
    targets = target_words(results, roomy)
    return (f"{took['requests']:,} requests over {end / 3600:.2f} h of virtual time, {took['models']} deployments "
            f"requested; replayed under {len(results)} policies in {took['wall_s']:.1f} s "
            f"({took['cpu_s']:.1f} s of CPU).\n\n" + report.markdown(results, SLO_S)
            + "\nEach policy against the reference and the others (the front: dominated by none):\n\n"
            + front.table(results) + "\nWhere ondemand's own policies stand:\n\n" + front.words(results)
            + (f"\n`cost` against its targets:\n\n{targets}" if targets else "")
            + "\nBy deployment, `seed` (today's default):\n\n" + per_deployment(by["seed"]))


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
    ap.add_argument("--mapping-seed", type=int, default=0, metavar="N",
                    help="send the Azure traces' rows to the deployments by this seed instead of 0 (traffic the "
                         "tables were not made with): prints the sections, writes nothing")
    args = ap.parse_args()
    deps = from_file(str(MIX), BOX)
    if args.speed:
        return speed(deps)
    policies = known(POLICIES)
    sections, parts, panels = {}, [], []
    for name in TRACES:
        if args.mapping_seed and name == "servegen":
            continue  # one client a deployment: no mapping to vary
        for box_name, box in BOXES.items():
            results, took = run(name, deps, policies, box=box, seed=args.mapping_seed)
            print(f"{name} on {box_name}: {took['wall_s']:.1f} s ({took['cpu_s']:.1f} s of CPU)", file=sys.stderr)
            sections[f"{name}-{box_name}"] = section(results, took, roomy=box_name != "dgx")
            if args.mapping_seed:
                print(f"## {name} on {box_name}, mapping seed {args.mapping_seed}\n\n{sections[f'{name}-{box_name}']}")
                continue
            print(report.table(results, SLO_S))
            panels.append((f"{TITLES[name]}, {'DGX H100' if box_name == 'dgx' else '16 x 80 GiB'}", results))
            if name != "servegen" and box_name == "dgx":
                parts.append(page.section(results, box, title=TITLES[name], slo_s=SLO_S))
    if args.mapping_seed:
        return 0
    write_md(sections)
    (ROOT / "bench" / "replay.html").write_text(page.document("ondemand replay: the box mix", parts))
    (ROOT / "bench" / "replay-pareto.svg").write_text(front.svg(panels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
