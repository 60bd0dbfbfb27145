"""The cost scheduler against its targets on eighteen tables, in about a minute: the six of ``make
replay`` and the Azure traces mapped anew by three more seeds (``--mapping-seed`` 1 to 3, traffic
the tables were not made with), ``cost`` alone replayed, the other policies' points read from a
cache. For trying a change of the cost scheduler's rules (``ondemand/control/cost.py``, ``value.py``,
``relocation.py``): ``make replay`` replays all thirteen policies on six tables, about three minutes.

Run from the repository root::

    .venv/bin/python scripts/replay_cost.py               # eighteen tables, one line each
    .venv/bin/python scripts/replay_cost.py code-dgx-s1   # some of them (trace-box-sSEED)

The cache (``.cache/replay-peers-HASH.json``, ignored by git) holds the other policies' points per
table; HASH covers the peers' names, the package's sources but the cost scheduler's own modules,
the box mix and the traces, so a change anywhere else replays the peers anew (about five minutes). The verdicts
are ``scripts/replaykit/targets.py``'s (``judge``): a line ends ``OK`` or says what was missed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay_front import REFERENCE, Point, point  # noqa: E402
from replaykit.mix import BOX, BOXES, MIX, ROOT, TRACES, known, run  # noqa: E402
from replaykit.targets import judge  # noqa: E402

from ondemand.replay import report  # noqa: E402
from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.types import PolicyResult, Replayed  # noqa: E402

PEERS = ("always-on", "seed", "ttl=300", "sleep-ttl=300", "lru=300", "sleep-lru=300", "fixed=60", "fixed=300",
         "fixed=600", "fixed=1800", "adaptive", "clairvoyant", "clairvoyant=60")
# cost's rules: not in the hash (no peer runs them; the clairvoyant reference reads only cost.py's
# names, IDLE_TIMEOUT and the CoreView protocol)
OWN = {"control/cost.py", "control/value.py", "control/relocation.py"}
Entry = dict[str, Any]  # a policy's point (replay_front.Point's fields) and its memory-queue waits
MAPPINGS = (1, 2, 3)  # the Azure traces sent to the deployments by these seeds too
TABLES = [f"{t}-{b}-s0" for t in TRACES for b in BOXES] + [f"{t}-{b}-s{m}" for m in MAPPINGS
                                                           for t in ("code", "conv") for b in BOXES]


def peers_hash() -> str:
    h = hashlib.sha256("\0".join(PEERS).encode())  # a policy added to PEERS is replayed, not missed
    pkg = ROOT / "ondemand"
    for path in sorted(pkg.rglob("*.py")):
        name = path.relative_to(pkg).as_posix()
        if name not in OWN:
            h.update(name.encode() + b"\0" + path.read_bytes())
    for path in [MIX, *TRACES.values()]:
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode())
    return h.hexdigest()[:16]


def entry(r: PolicyResult) -> Entry:
    return {**point(r).__dict__, "queue": report.tally_json(r.total)["waited"]["queue"]}


def peers(deps: list[Replayed], tables: list[str]) -> dict[str, dict[str, Entry]]:
    """Each table's peers' points, from the cache or replayed (and cached)."""
    path = ROOT / ".cache" / f"replay-peers-{peers_hash()}.json"
    cached: dict[str, dict[str, Entry]] = json.loads(path.read_text()) if path.exists() else {}
    for key in tables:
        if key not in cached:
            trace, box, seed = key.split("-")
            results, took = run(trace, deps, known(PEERS), box=BOXES[box], seed=int(seed[1:]))
            cached[key] = {r.policy.name: entry(r) for r in results}
            print(f"(peers of {key} replayed in {took['cpu_s']:.0f} s of CPU)", file=sys.stderr)
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(cached))
    return cached


def table_line(key: str, cost: Entry, others: dict[str, Entry]) -> tuple[bool, str]:
    """(all met, one line): ``cost``'s point and the targets it misses (replaykit.targets.judge)."""
    pts = {name: Point(**{k: v for k, v in p.items() if k != "queue"}) for name, p in {**others, "cost": cost}.items()}
    queued = {name: p["queue"] for name, p in {**others, "cost": cost}.items()}
    said = [f"{what} ({facts})" for what, ok, facts in judge(pts, queued, roomy="-dgx-" not in key) if not ok]
    ref = others[REFERENCE]
    return not said, (f"{key:18} {100 * cost['within']:6.2f} % (reference {100 * ref['within']:6.2f} %), "
                      f"{cost['timed_out']:4d} timed out, {cost['gib_h']:9,.0f} GiB-h: "
                      + ("; ".join(f"missed: {x}" for x in said) or "OK"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="*", metavar="TABLE", help="of " + ", ".join(TABLES) + " (default: all)")
    tables = ap.parse_args().tables or TABLES
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        ap.error(f"no table {', '.join(unknown)}: one of {', '.join(TABLES)}")
    deps = from_file(str(MIX), BOX)
    known_peers = peers(deps, tables)
    met = 0
    for key in tables:
        trace, box, seed = key.split("-")
        (r,), _ = run(trace, deps, ("cost",), box=BOXES[box], seed=int(seed[1:]))
        ok, line = table_line(key, entry(r), known_peers[key])
        met += ok
        print(line, flush=True)
    print(f"{met} of {len(tables)} tables met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
