"""The ServeGen trace (bench/traces/servegen_language_7d.csv), read with the replay's own reader:
its size, its models, the spread of their rates and their idle gaps; and the script that made it
(scripts/servegen_trace.py) on a small release written here: the windows' counts kept, the
ladder, the token sources and the cap, the same file from the same seed."""
import collections
import csv
import hashlib
import json
import random

import pytest
from helpers import ROOT, load_script

from ondemand.replay.deployments import from_file
from ondemand.replay.trace import Trace
from ondemand.replay.types import Box

TRACE = ROOT / "bench" / "traces" / "servegen_language_7d.csv"
MIX = ROOT / "bench" / "box-mix.toml"
BOX = Box(gpus=(80.0,) * 16, host_gib=2048)


sg = load_script("servegen_trace")


def test_the_committed_trace_has_real_rhythms_for_the_box_mix():
    deps = from_file(str(MIX), BOX)
    served = {r.deployment.name: r.deployment.served_name for r in deps}
    times: dict[str, list[float]] = collections.defaultdict(list)
    previous = 0.0
    for req in Trace(str(TRACE), deps):
        assert req.at_s >= previous  # the reader refuses a row out of order; this checks it read all
        previous = req.at_s
        times[req.model].append(req.at_s)
    total = sum(len(t) for t in times.values())
    assert 100_000 <= total <= 300_000
    assert set(times) == set(served)  # all 16 deployments
    with open(TRACE, newline="") as fh:  # named by served_name, as a client names a model
        rows = csv.reader(fh)
        assert next(rows) == ["timestamp", "model", "input_tokens", "output_tokens"]
        assert {row[1] for row in rows} == set(served.values())
    counts = sorted(len(t) for t in times.values())
    assert counts[-1] / counts[0] >= 100  # one span for all: the rates' ratio is the counts'
    long_gaps = [m for m, t in times.items() if any(b - a > 1800 for a, b in zip(t, t[1:]))]
    assert len(long_gaps) >= 8
    # the busiest client on rank 1, and so on down the box's ranks
    by_rank = [len(times[r.deployment.name]) for r in deps]
    assert by_rank == sorted(by_rank, reverse=True)


def test_each_window_yields_its_count_inside_it():
    rng = random.Random(1)
    for pattern, shape in (("Gamma", 0.05), ("Gamma", 2.0), ("Weibull", 0.4), ("Weibull", 1.5)):
        for count in (1, 2, 37):
            got = sg.arrivals(sg.Window(1200, count, pattern, shape, 3.0), rng)
            # ServeGen's own generator yields count - 1: its last arrival is on the window's end
            assert len(got) == count
            # inside, or on its end where a Gamma shape near 0 leaves the last gap under rounding
            assert all(1200 <= t <= 1800 for t in got) and got == sorted(got)
    with pytest.raises(ValueError):
        sg.arrivals(sg.Window(0, 3, "Pareto", 1.0, 1.0), rng)


def test_the_ladder_takes_the_nearest_client_once_each():
    clients = [sg.Client("m-mid", n, (sg.Window(0, c, "Gamma", 1.0, 1.0),) if c else ())
               for n, c in enumerate((1000, 990, 320, 100, 95, 11, 0))]
    picked = sg.pick(clients, n=3, top=1000, spread=100)  # rungs 1000, 100, 10
    assert [c.number for c in picked] == [0, 3, 5]
    with pytest.raises(SystemExit):
        sg.pick(clients, n=7)  # one never sent a request


def write_release(root, clients):
    """A release of ``clients``: (service, number, {window start: count}, dataset or None)."""
    for service in sg.SERVICES:
        (root / "data" / "language" / service).mkdir(parents=True, exist_ok=True)
    for service, number, windows, dataset in clients:
        folder = root / "data" / "language" / service
        lines = [f"{s},{windows.get(s, 0) / 600},1.0,{'Gamma' if s in windows else ''},1.0,1.0"
                 for s in range(0, 14 * 86400, 600)]
        (folder / f"chunk-{number}-trace.csv").write_text("\n".join(lines) + "\n")
        if dataset is not None:
            (folder / f"chunk-{number}-dataset.json").write_text(json.dumps(dataset))


def fields(tokens_in: dict, tokens_out: dict) -> dict:
    return {"input_tokens": repr(tokens_in), "output_tokens": repr(tokens_out)}


def test_token_counts_come_from_the_window_then_the_next_then_azure(tmp_path):
    dataset = {"0": fields({}, {}), "21600": fields({100: 0.5, 40000: 0.5}, {7: 1.0}),
               "43200": fields({300: 1.0}, {20000: 1.0})}
    write_release(tmp_path, [("m-large", 1, {600: 50, 30000: 50, 49800: 50}, dataset),
                             ("m-small", 2, {600: 20}, None)])
    clients = {c.name: c for c in sg.read_release(tmp_path)}
    azure = [(11, 22), (33, 44)]
    rows, src = sg.requests(clients["m-large/1"], 1, tmp_path, azure)
    by_window = collections.defaultdict(set)
    for ms, _, tin, tout in rows:
        by_window[ms // 600_000 * 600].add((tin, tout))
    assert {rank for _, rank, _, _ in rows} == {1} and len(rows) == 150
    assert by_window[600] | by_window[30000] == {(100, 7), (32761, 7)}  # the 6 h window at or before, cut to fit
    assert by_window[49800] == {(300, 16384)}  # the output cut to half the context
    assert (src.servegen, src.later, src.azure) == (100, 50, 0)  # 600 s: before any non-empty window
    assert src.capped == 50 + sum(tin == 32761 for _, _, tin, _ in rows)
    rows, src = sg.requests(clients["m-small/2"], 2, tmp_path, azure)
    assert {(tin, tout) for _, _, tin, tout in rows} <= set(azure) and src.azure == 20


def test_the_script_writes_the_same_trace_from_the_same_release(tmp_path, capsys):
    release = tmp_path / "ServeGen"
    dataset = {"0": fields({10: 0.5, 2000: 0.5}, {5: 0.5, 50: 0.5})}
    write_release(release, [("m-mid", n, {600 * n: 10 + 40 * n, 86400 * 8: 999}, dataset) for n in range(16)])
    out = tmp_path / "a.csv"
    assert sg.main([str(release), "--out", str(out)]) == 0
    first = hashlib.sha256(out.read_bytes()).hexdigest()
    assert first in capsys.readouterr().out
    assert sg.main([str(release), "--out", str(out)]) == 0
    assert hashlib.sha256(out.read_bytes()).hexdigest() == first
    summary = Trace(str(out), from_file(str(MIX), BOX)).check()
    assert summary.requests == sum(10 + 40 * n for n in range(16))  # day 8 is past the span
    assert sg.main([str(release), "--out", str(out), "--seed", "1"]) == 0
    assert hashlib.sha256(out.read_bytes()).hexdigest() != first
