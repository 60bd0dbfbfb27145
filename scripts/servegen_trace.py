#!/usr/bin/env python3
"""A replay trace with real per-model rhythms, made from Alibaba's ServeGen release: 16 of its
clients, one for each deployment of ``bench/box-mix.toml``, over the release's first 7 days
(``bench/traces/servegen_language_7d.csv``; ``bench/traces/README.md`` describes it).

The release (github.com/alibaba/ServeGen, Apache-2.0; the trace was made from commit
``f891d1189eb32b3868dfc443800c4150548c282a``)::

    git clone https://github.com/alibaba/ServeGen
    git -C ServeGen checkout f891d1189eb32b3868dfc443800c4150548c282a
    .venv/bin/python scripts/servegen_trace.py ServeGen            # writes the trace, prints its table

What the release holds, per client of three LLM services (``data/language/{m-large,m-mid,m-small}``,
314 clients): ``chunk-N-trace.csv``, 14 days of 10-minute windows, no header, each
``start_s,rate_rps,cv,pattern,shape,scale`` (pattern ``Gamma`` or ``Weibull``, empty when the client
sent nothing); ``chunk-N-dataset.json``, every 6 hours the input and output token counts' distributions
(``{"21600": {"input_tokens": "{224: 0.0003, ...}", ...}}``, ``{}`` where it has none).

**The clients** (only the ``trace.csv`` files decide): each client's requests over the first 7 days
(rate x 600 summed over its windows; a whole number in every window), then 16 rungs of a ladder,
80,000 requests at the top and each rung 1000^(1/15) (about 1.58) times below the one above, so the
16th is 80; for each rung, busiest first, the client not taken yet whose count is nearest to it in
ratio (ties: service, then client number). Client k goes to the box's deployment of rank k (its
k-th ``[[deployment]]``), named by its ``served_name`` in the ``model`` column. The counts span three
orders of magnitude, as the box's own weights do (rank^-2.5: 1 to 1/1024).

**Arrivals**, ServeGen's own method (``servegen/construct.py``'s ``_sample_iats``, Apache-2.0,
ported to the standard library: ``random.gammavariate(shape, scale)`` is scipy's
``gamma(a=shape, scale=scale)``, ``random.weibullvariate(scale, shape)`` its
``weibull_min(c=shape, scale=scale)``): in each active window, inter-arrival times drawn from the
window's pattern, rescaled so that they fill the window, their running sums the arrivals. One
change: ServeGen draws n = ceil(rate x 600) gaps, whose sum ends on the window's end, and drops the
arrival there (its ``< end`` filter), so a window of one request yields none and every window one
less than it counted; here n + 1 gaps are drawn and the first n sums kept, so each window yields
the count the release gives it.

**Token counts**: ServeGen's ``_sample_data_batch`` (inverse CDF over the window's distribution)
from the dataset window ServeGen's ``_get_dataset_window`` picks (the latest non-empty one at or
before the window), else the client's next non-empty one (where ServeGen raises), else, for a
client without a ``dataset.json`` (some clones lack the largest ones), a (ContextTokens,
GeneratedTokens) row of the Azure conv trace (``bench/traces/AzureLLMInferenceTrace_conv.csv``).
One change: ServeGen draws one uniform number for both fields, so a request's output is always the
same quantile as its input; the release gives their marginals only, so here they are drawn
independently. Cap: the box's engines hold 32,768 tokens (``max_model_len``), so the output is cut
to 16,384 and the input to 32,768 less the output (a client truncates a prompt too long for the
model; the replay itself would not refuse it).

Deterministic: one ``random.Random`` per client for arrivals and one for tokens, seeded by
``SEED`` and the client's name: the same file from the same release (the committed one was made
with CPython 3.11.7; another version's ``random`` could draw other numbers).
Rows are in time order (to the millisecond, then by rank), seconds from the start of the
release's first window.
"""
from __future__ import annotations

import argparse
import ast
import bisect
import csv
import dataclasses
import hashlib
import itertools
import json
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand.replay.deployments import from_file  # noqa: E402
from ondemand.replay.types import Box  # noqa: E402

COMMIT = "f891d1189eb32b3868dfc443800c4150548c282a"
SERVICES = ("m-large", "m-mid", "m-small")
WINDOW_S = 600
SPAN_S = 7 * 86400
TOP = 80_000  # the ladder's first rung: requests over the span
SPREAD = 1000.0  # the first rung over the last
SEED = 0
MAX_MODEL_LEN = 32768
MAX_OUTPUT = MAX_MODEL_LEN // 2
MIX = ROOT / "bench" / "box-mix.toml"
AZURE = ROOT / "bench" / "traces" / "AzureLLMInferenceTrace_conv.csv"
OUT = ROOT / "bench" / "traces" / "servegen_language_7d.csv"

Cdf = tuple[list[int], list[float]]  # token counts, ascending, and their cumulative probabilities
Row = tuple[int, int, int, int]  # (milliseconds, rank, input tokens, output tokens)


@dataclasses.dataclass(frozen=True)
class Window:
    """An active 10-minute window: its start (s), its requests, its arrival pattern."""
    start: int
    count: int
    pattern: str
    shape: float
    scale: float


@dataclasses.dataclass(frozen=True)
class Client:
    service: str
    number: int
    windows: tuple[Window, ...]  # the active ones in the span

    @property
    def name(self) -> str:
        return f"{self.service}/{self.number}"

    @property
    def count(self) -> int:
        return sum(w.count for w in self.windows)


def read_windows(path: Path, span_s: int) -> tuple[Window, ...]:
    """A ``chunk-N-trace.csv``'s active windows that start in the span."""
    out = []
    with open(path) as fh:
        for line in fh:
            start, rate, _cv, pattern, shape, scale = line.strip().split(",")
            if pattern and int(start) < span_s:
                out.append(Window(int(start), round(float(rate) * WINDOW_S), pattern, float(shape), float(scale)))
    return tuple(out)


def read_release(root: Path, span_s: int = SPAN_S) -> list[Client]:
    clients = []
    for service in SERVICES:
        folder = root / "data" / "language" / service
        if not folder.is_dir():
            raise SystemExit(f"{folder}: no such folder: is {root} a checkout of alibaba/ServeGen?")
        for path in folder.glob("chunk-*-trace.csv"):
            clients.append(Client(service, int(path.name.split("-")[1]), read_windows(path, span_s)))
    clients.sort(key=lambda c: (c.service, c.number))
    return clients


def pick(clients: Sequence[Client], n: int = 16, top: float = TOP, spread: float = SPREAD) -> list[Client]:
    """The ladder (module doc): for each rung, busiest first, the nearest client not yet taken."""
    left = [c for c in clients if c.count > 0]
    if len(left) < n:
        raise SystemExit(f"only {len(left)} clients sent a request in the span; {n} are needed")
    out = []
    for k in range(n):
        rung = top * spread ** (-k / (n - 1))
        best = min(left, key=lambda c: abs(math.log(c.count / rung)))  # the first of a tie: sorted by name
        left.remove(best)
        out.append(best)
    return out


def arrivals(window: Window, rng: random.Random) -> list[float]:
    """ServeGen's ``_sample_iats`` with n + 1 gaps (module doc): ``count`` seconds in the window."""
    if window.pattern == "Gamma":
        gaps = [rng.gammavariate(window.shape, window.scale) for _ in range(window.count + 1)]
    elif window.pattern == "Weibull":
        gaps = [rng.weibullvariate(window.scale, window.shape) for _ in range(window.count + 1)]
    else:
        raise ValueError(f"unknown arrival pattern {window.pattern!r}")
    total = sum(gaps)
    if total <= 0:  # a Gamma shape near 0 can underflow every draw: no spacing to keep
        gaps, total = [1.0] * len(gaps), float(len(gaps))
    factor = WINDOW_S / total
    return [window.start + s * factor for s in itertools.accumulate(gaps[:-1])]


def cdf(text: str) -> Cdf | None:
    """A distribution as the release writes it (``{224: 0.0003, ...}``; ``{}`` for none)."""
    pdf = ast.literal_eval(text)
    if not pdf:
        return None
    tokens = sorted(pdf)
    return tokens, list(itertools.accumulate(pdf[t] for t in tokens))


def draw(dist: Cdf, u: float) -> int:
    """ServeGen's inverse CDF (``np.searchsorted(cdf, u)``), the last count where rounding leaves
    the sum under u."""
    tokens, cum = dist
    return tokens[min(bisect.bisect_left(cum, u), len(tokens) - 1)]


class Lengths:
    """A client's token distributions, by 6-hour dataset window (the non-empty ones)."""

    def __init__(self, path: Path):
        with open(path) as fh:
            raw = json.load(fh)
        self.windows: list[tuple[int, Cdf, Cdf]] = []
        for start in sorted(raw, key=int):
            fields = raw[start]
            got = cdf(fields.get("input_tokens", "{}")), cdf(fields.get("output_tokens", "{}"))
            if got[0] is not None and got[1] is not None:
                self.windows.append((int(start), got[0], got[1]))
        self.starts = [w[0] for w in self.windows]

    def at(self, start: int) -> tuple[Cdf, Cdf, bool] | None:
        """The window's distributions, and whether ServeGen's own rule found them."""
        if not self.windows:
            return None
        i = bisect.bisect_right(self.starts, start)
        _, tin, tout = self.windows[i - 1] if i else self.windows[0]
        return tin, tout, i > 0


def read_azure(path: Path) -> list[tuple[int, int]]:
    with open(path, newline="") as fh:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(fh)]


def fit(tokens_in: int, tokens_out: int) -> tuple[int, int]:
    """The cap (module doc): the output to half the context, the input to what is left."""
    tokens_out = min(tokens_out, MAX_OUTPUT)
    return min(tokens_in, MAX_MODEL_LEN - tokens_out), tokens_out


@dataclasses.dataclass
class Sources:
    """Where a client's token counts came from, request by request, and how many were cut."""
    servegen: int = 0
    later: int = 0
    azure: int = 0
    capped: int = 0


def requests(client: Client, rank: int, root: Path, azure: Sequence[tuple[int, int]],
             seed: int = SEED) -> tuple[list[Row], Sources]:
    """One client's requests, on the deployment of ``rank``."""
    times = random.Random(f"{seed}/{client.name}/arrivals")
    sizes = random.Random(f"{seed}/{client.name}/tokens")
    path = root / "data" / "language" / client.service / f"chunk-{client.number}-dataset.json"
    lengths = Lengths(path) if path.exists() else None
    rows: list[Row] = []
    src = Sources()
    for window in client.windows:
        found = lengths.at(window.start) if lengths else None
        for at in arrivals(window, times):
            if found is None:
                tin, tout = azure[sizes.randrange(len(azure))]
                src.azure += 1
            else:
                tin, tout = draw(found[0], sizes.random()), draw(found[1], sizes.random())
                src.servegen, src.later = src.servegen + found[2], src.later + (not found[2])
            cut = fit(tin, tout)
            src.capped += cut != (tin, tout)
            rows.append((round(at * 1000), rank, *cut))
    return rows, src


def write(rows: list[Row], names: Sequence[str], out: Path) -> str:
    """The CSV, in time order; returns its SHA-256."""
    rows.sort()
    with open(out, "w", newline="") as fh:
        fh.write("timestamp,model,input_tokens,output_tokens\n")
        for ms, rank, tin, tout in rows:
            fh.write(f"{ms // 1000}.{ms % 1000:03d},{names[rank - 1]},{tin},{tout}\n")
    return hashlib.sha256(out.read_bytes()).hexdigest()


def table(picked: Sequence[Client], names: Sequence[str], sources: Sequence[Sources], rows: Sequence[Row]) -> str:
    """The README's table, a row per rank: its client, requests, active windows, idle gaps,
    mean tokens and where they came from."""
    mine: dict[int, list[Row]] = {}
    for row in rows:  # in time order
        mine.setdefault(row[1], []).append(row)
    lines = ["| rank | model | client | requests | active windows | gaps > 30 min | longest gap | mean in / out "
             "| tokens: ServeGen's window / next / Azure | capped |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for k, (c, name, s) in enumerate(zip(picked, names, sources), 1):
        got = mine.get(k, [])
        gaps = [b[0] - a[0] for a, b in zip(got, got[1:])]
        mean_in = sum(r[2] for r in got) / max(len(got), 1)
        mean_out = sum(r[3] for r in got) / max(len(got), 1)
        lines.append(f"| {k} | `{name}` | {c.name} | {len(got):,} | {len(c.windows)} | "
                     f"{sum(g > 1_800_000 for g in gaps)} | {max(gaps, default=0) / 3_600_000:.1f} h | "
                     f"{mean_in:,.0f} / {mean_out:,.0f} | {s.servegen:,} / {s.later:,} / {s.azure:,} | {s.capped:,} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("release", type=Path, help="a checkout of github.com/alibaba/ServeGen")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--deployments", default=str(MIX))
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    names = [r.deployment.served_name for r in from_file(args.deployments, Box(gpus=(80.0,) * 16, host_gib=2048))]
    picked = pick(read_release(args.release), n=len(names))
    azure = read_azure(AZURE)
    rows: list[Row] = []
    sources = []
    for rank, client in enumerate(picked, 1):
        got, src = requests(client, rank, args.release, azure, args.seed)
        rows += got
        sources.append(src)
    digest = write(rows, names, args.out)
    print(table(picked, names, sources, rows))
    print(f"\n{len(rows):,} requests, span {rows[-1][0] / 3_600_000:.1f} h; {args.out}: "
          f"{args.out.stat().st_size:,} bytes, SHA-256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
