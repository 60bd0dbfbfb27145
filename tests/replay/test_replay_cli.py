"""``ondemand replay`` as an admin runs it: a real process, the files it reads and writes, the
state file left as it was, and every bad input stopped before the replay with one line (exit 2)."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from ondemand.cli.replay import Progress
from ondemand.state.store import Store

DEPLOYMENTS = """\
[[deployment]]
name = "a"
served_name = "Org/A"
memory_gib = 50
weight = 3

[[deployment]]
name = "b"
memory_gib = 50
cold_start_s = 30
"""
TRACE = "timestamp,model,input_tokens,output_tokens\n" + "".join(
    f"2023-11-16 18:{m:02d}:{s:02d}.5,{'Org/A' if (m + s) % 3 else 'b'},1000,{50 + s}\n"
    for m in range(10) for s in range(0, 60, 20))
POLICIES = ["--policy", "current", "--policy", "ttl=60", "--policy", "always-on"]


def replay(*args: str, config: str | None = None, cwd=None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ondemand", *(["--config", config] if config else []), "replay", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
    return subprocess.run(argv, cwd=cwd or ROOT, capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "deps.toml").write_text(DEPLOYMENTS)
    (tmp_path / "trace.csv").write_text(TRACE)
    return tmp_path


def test_a_replay_prints_its_table_and_writes_its_json_and_page(inputs):
    out = inputs / "out.json"
    r = replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80",
               "--host-gib", "512", *POLICIES, "--json", str(out), "--html", str(inputs / "out.html"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no bar: stderr is not a terminal
    lines = r.stdout.splitlines()
    assert lines[0].split()[:7] == ["policy", "wait", "≤", "5", "s", "failed", "GiB-h"]
    assert [ln.split()[0] for ln in lines[1:]] == ["current", "ttl=60", "always-on"]
    doc = json.loads(out.read_text())
    assert doc["trace"]["requests"] == 30 and doc["trace"]["models"] == 2 and doc["box"] == {"gpus": [80.0]}
    assert list(doc["policies"]) == ["current", "ttl=60", "always-on"]
    assert doc["policies"]["always-on"]["per_deployment"]["b"]["failed"] == 10  # 50 + 50 GiB on one 80 GiB GPU
    assert doc["policies"]["current"]["cold_starts"] >= 2
    html = (inputs / "out.html").read_text()
    assert html.startswith("<!doctype html>") and html.count('aria-label="GPU 0"') == 3
    again = inputs / "again.json"
    replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80",
           "--host-gib", "512", *POLICIES, "--json", str(again))
    assert again.read_bytes() == out.read_bytes()  # the same inputs, the same bytes


def test_the_clairvoyant_reference_is_replayed_and_not_run_live(inputs):
    """It knows the trace ahead, which no serve can: ``--live`` says so and compares the others
    (here none: no serve is started)."""
    r = replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80",
               "--host-gib", "512", "--policy", "clairvoyant", "--live")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[0] == "clairvoyant"
    assert "clairvoyant: a reference that knows every arrival in advance, not run live" in r.stderr


def test_rows_without_a_model_follow_the_seed(inputs):
    (inputs / "nomodel.csv").write_text("timestamp,input_tokens,output_tokens\n" +
                                        "".join(f"{i * 7},100,10\n" for i in range(60)))
    runs = [replay(str(inputs / "nomodel.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "2x80",
                   "--host-gib", "512", "--seed", seed, "--json", str(inputs / f"{n}.json"))
            for n, seed in enumerate(["1", "1", "2"])]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    one, same, other = (json.loads((inputs / f"{n}.json").read_text()) for n in range(3))
    assert one == same and one != other
    assert one["policies"]["current"]["per_deployment"]["a"]["requests"] > 30  # weight 3 of 4


def test_adaptive_measured_after_a_warm_up(inputs):
    """--warmup-s 300: the requests that arrive from 300 s on are counted (15 of the 30: three a
    minute); the JSON says where the counts begin."""
    out = inputs / "warm.json"
    r = replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "2x80",
               "--host-gib", "512", "--policy", "adaptive", "--policy", "current", "--warmup-s", "300",
               "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()[1:]] == ["adaptive", "current"]
    doc = json.loads(out.read_text())
    assert doc["trace"]["requests"] == 30 and doc["trace"]["measured_from_s"] == 300
    assert [p["requests"] for p in doc["policies"].values()] == [15, 15]
    assert doc["policies"]["adaptive"]["prewarms"] == 0  # ten minutes teach nothing: as fixed


@pytest.mark.parametrize("args,says", [
    (["--policy", "bogus"], "unknown policy 'bogus'"),
    (["--warmup-s", "-5"], "--warmup-s -5: seconds of 0 or more"),
    (["--warmup-s", "60", "--live"], "--warmup-s 60: seconds of 0 or more, and not with --live"),
    (["--warmup-s", "600"], "--warmup-s 600: after the trace's last arrival (580 s): nothing would be measured"),
    (["--policy", "ttl=30"], "policy 'ttl=30': 30 s is below the box's min_idle_timeout_s (60 s)"),
    (["--policy", "current", "--policy", "current"], "policy 'current' is given twice"),
    (["--gpus", "eight"], "--gpus 'eight': how many GPUs and the GiB of each, as NxGIB (8x80)"),
    (["--gpus", "1x40"], "deps.toml:1: deployment 'a' cannot fit on this box at all"),
    (["--slo-s", "0"], "--slo-s 0: seconds above 0"),
    (["--slo-s", "nan"], "--slo-s nan: not a finite number"),
    (["--warmup-s", "nan"], "--warmup-s nan: not a finite number"),
    (["--host-gib", "inf"], "--host-gib inf: not a finite number"),
    (["--gpus", "9" * 4000 + "x80"], "how many GPUs and the GiB of each"),
])
def test_bad_input_is_one_line_and_exit_2(inputs, args, says):
    argv = [str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--host-gib", "512"]
    if "--gpus" not in args:
        argv += ["--gpus", "1x80"]
    r = replay(*argv, *args)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


BOUNDS = [
    ("digits.csv", "timestamp,model,input_tokens,output_tokens\n1,b," + "7" * 4000 + ",1\n", 2,
     "input_tokens '7777777777777777777777777777777777777777'... (4,000 characters) is more than 10,000,000 tokens"),
    ("field.csv", "timestamp,model,input_tokens,output_tokens\n1,b,1,1\n2," + "b" * 200_000 + ",1,1\n", 3,
     "not a CSV row: field larger than field limit (131072)"),
    ("years.csv", "timestamp,model,input_tokens,output_tokens\n1,b,1,1\n1000000001,b,1,1\n", 3,
     "timestamp '1000000001' is more than ten years after the first row's"),
    ("access.jsonl", '{"time": 1000, "method": "POST", "route": "completions", "deployment": "b", "bytes_in": 4, '
     '"duration_s": 1e308}\n', 1, "not an access log line: duration_s 1e+308 is more than 315,576,000 seconds (ten years)"),
]


@pytest.mark.parametrize("name,text,line,says", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_numbers_beyond_what_a_trace_can_mean_are_one_line_and_exit_2(inputs, name, text, line, says):
    """They ended in a traceback (exit 1), or ran for hours (a gap of 10^9 s)."""
    (inputs / name).write_text(text)
    r = replay(str(inputs / name), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80", "--host-gib", "512")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr[-2000:]
    assert r.stderr == f"{inputs / name}:{line}: {says}\n"


def test_an_engine_speed_no_engine_has_is_one_line_and_exit_2(inputs):
    """A prefill of 1e-50 tokens a second ran the replay forever: refused, FILE:LINE naming the
    deployment and the field, before the replay starts."""
    deps = inputs / "slow.toml"
    deps.write_text(DEPLOYMENTS.replace("weight = 3", "weight = 3\nprefill_tokens_per_s = 1e-50"))
    r = replay(str(inputs / "trace.csv"), "--deployments", str(deps), "--gpus", "1x80", "--host-gib", "512")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr[-2000:]
    assert r.stderr == (f"{deps}:6: deployment 'a': prefill_tokens_per_s: 1e-50 is not a finite number of at least 1 "
                        "and at most 10,000,000 (tokens a second)\n")


def test_a_trace_of_one_endless_line_is_refused_at_its_first_mib(inputs):
    """/dev/zero grew to 9-15 GB; here 256 MiB of its zeros (sparse), in a file named neither
    .csv nor .jsonl (its first line decides), and the process stays small."""
    zeros = inputs / "zeros"
    with open(zeros, "wb") as fh:
        fh.truncate(256 << 20)
    # The replay runs as a child of a small parent that reports the child's peak memory.
    parent = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", parent, sys.executable, "-m", "ondemand", "replay", str(zeros),
                        "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80", "--host-gib", "512"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = r.stderr.splitlines()
    assert (r.returncode, lines[0]) == (2, f"{zeros}:1: a line longer than 1 MiB"), r.stderr[-2000:]
    assert int(lines[1]) < 200 * 1024  # KiB: the 256 MiB were never held


def test_bad_files_are_named_with_their_line(inputs):
    (inputs / "bad.csv").write_text(TRACE + "2023-11-16 18:30:00,Org/C,10,10\n")
    r = replay(str(inputs / "bad.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80",
               "--host-gib", "512")
    assert r.returncode == 2 and r.stderr == f"{inputs / 'bad.csv'}:32: model 'Org/C' is served by no deployment\n"
    (inputs / "bad.toml").write_text(DEPLOYMENTS.replace("cold_start_s = 30", "cold_start_s = -1"))
    r = replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "bad.toml"), "--gpus", "1x80",
               "--host-gib", "512")
    assert r.returncode == 2 and r.stderr.startswith(f"{inputs / 'bad.toml'}:10: deployment 'b': cold_start_s: ")


def test_without_gpus_a_measured_budget_must_be_read(inputs):
    """The default budget reads nvidia-smi: without it (and without --gpus) the box is not known."""
    (inputs / "smi.toml").write_text('[budget]\nnvidia_smi = "/nonexistent/nvidia-smi"\n')
    r = replay(str(inputs / "trace.csv"), "--deployments", str(inputs / "deps.toml"), "--host-gib", "512",
               config=str(inputs / "smi.toml"))
    assert r.returncode == 2 and "give --gpus NxGIB" in r.stderr and r.stderr.count("\n") == 1


async def _state_file(state_dir) -> None:
    store = await Store.open(state_dir / "ondemand.db")
    try:
        for name in ("a", "b"):
            await store.insert_deployment(dict(name=name, served_name=name.upper(), engine="vllm",
                                               model=f"org/{name}", memory_gib=50, gpu_count=1, mode="on_demand",
                                               state="ready", role="model"))
        await store.write_start(1, at=1.0, duration_s=20.0, kind="start", keep=20)
    finally:
        await store.close()


def test_the_box_and_deployments_from_the_configuration_and_the_state_file(tmp_path):
    """The configuration's static budget is the box; the state file's deployments are replayed,
    with a's cold start from its history (20 s), and the state file is not written."""
    state = tmp_path / "state"
    asyncio.run(_state_file(state))
    (tmp_path / "ondemand.toml").write_text(f'state_dir = "{state}"\n[budget]\nsource = "static"\n'
                                            "gpu_capacity_gib = [80, 80]\n")
    (tmp_path / "t.csv").write_text("timestamp,model,input_tokens,output_tokens\n0,A,1000,100\n1,B,1000,100\n")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in state.iterdir()}
    r = replay(str(tmp_path / "t.csv"), "--host-gib", "512", "--json", str(tmp_path / "o.json"),
               config=str(tmp_path / "ondemand.toml"))
    assert r.returncode == 0, r.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in state.iterdir()} == before
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["box"] == {"gpus": [80.0, 80.0]}
    per = doc["policies"]["current"]["per_deployment"]
    assert per["a"]["ttft_s"]["max"] == 20.2 and per["b"]["ttft_s"]["max"] == 60.2


def test_the_slo_is_the_configurations_unless_asked(inputs):
    """``slo_s`` of the configuration is what the replay measures against (what ``cost`` aims
    at), and ``--slo-s`` says otherwise: b's one request waits for its 30 s cold start, within
    70 s and not within 5 s."""
    (inputs / "slo.toml").write_text("slo_s = 70\n")
    (inputs / "t.csv").write_text("timestamp,model,input_tokens,output_tokens\n0,b,100,10\n")
    args = [str(inputs / "t.csv"), "--deployments", str(inputs / "deps.toml"), "--gpus", "1x80", "--host-gib", "512"]
    r = replay(*args, "--json", str(inputs / "a.json"), config=str(inputs / "slo.toml"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[:5] == ["policy", "wait", "≤", "70", "s"]
    assert json.loads((inputs / "a.json").read_text())["policies"]["current"]["wait_slo_met"] == 1.0
    r = replay(*args, "--slo-s", "5", "--json", str(inputs / "b.json"), config=str(inputs / "slo.toml"))
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:5] == ["policy", "wait", "≤", "5", "s"]
    assert json.loads((inputs / "b.json").read_text())["policies"]["current"]["wait_slo_met"] == 0.0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_on_a_terminal_after_a_few_seconds_and_is_wiped():
    now = [0.0]
    term = Terminal()
    bar = Progress(1000, "requests", term, clock=lambda: now[0])
    bar(100)
    assert term.getvalue() == ""  # too soon
    now[0] = 2.5
    bar(500)
    assert term.getvalue().startswith("\rreplaying [###############...............] 500/1,000 requests")
    now[0] = 2.55
    bar(600)
    assert "600" not in term.getvalue()  # redrawn at most every 0.1 s
    bar.close()
    assert term.getvalue().endswith("\r")
    piped = io.StringIO()
    quiet = Progress(1000, "requests", piped, clock=lambda: 10.0)
    quiet(500)
    assert piped.getvalue() == ""  # not a terminal: nothing
