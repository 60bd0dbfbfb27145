"""A real vLLM (its CPU build) started cold twice through the recipe with ``deployer.compile_cache``:
the first start with an empty compile cache, the second with the first's. Without
``--enforce-eager`` (test_vllm.py passes it to dodge the compilation; here the compilation is
what is measured).

What is checked: both starts compiled (vLLM's "Warming up model for the compilation"), the engine
was given its configuration's directory (``VLLM_CACHE_ROOT``), the first found it cold and left
torch.compile's artifacts in it, the second found it warm, both answered the same greedy request
the same way, and ondemand read each start's phases from vLLM's lines. What is measured (not
asserted: a shared 2-core machine's times are not a test's): each start's phases as ondemand
saw them, the lines vLLM logs about its own load and compilation, and the whole start. With
``ONDEMAND_BENCH_OUT`` naming a file (``make test-vllm`` names bench/results.md) they are written
there as its section "Warm compile cache, a real vLLM".

Anything else the engine could carry from one start to the next is kept apart: each start gets
a temporary directory of its own (``TMPDIR``, where torch's default Inductor cache lives), so
the compile cache is the only thing the second start shares with the first.

Needs ``VLLM_PY`` and ``TINY_LLAMA``, as test_vllm.py; about 3 minutes on 2 idle cores.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from helpers import ROOT, run_app, wait_for

from ondemand.admin.components import BUS
from ondemand.engines.backends.logs import RUN_MARKER
from ondemand.events import StartTimed

NAME = SERVED = "tiny"
MODULE = "vllm.entrypoints.openai.api_server"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
SECTION = "## Warm compile cache, a real vLLM"
# vLLM's lines about its load and compilation (vllm-cpu 0.32 on the CPU; the GPU's forms too).
EVIDENCE = ("Starting to load model", "Loading weights took", "Model loading took", "Warming up model for the compilation",
            "torch.compile", "AOT", "Compiling model again", "Compiling a graph", "compiled graph", "Directly load",
            "init engine (profile, create kv cache, warmup model) took", "Graph capturing finished",
            "Starting vLLM server on", "Starting vLLM API server", "Application startup complete")
_STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d+))?\b")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif("VLLM_PY" not in os.environ or "TINY_LLAMA" not in os.environ, reason=(
        "needs a real vLLM and the tiny Llama: VLLM_PY and TINY_LLAMA are unset (make test-vllm sets them "
        "from scripts/heavy/vllm-cpu.sh and scripts/heavy/tiny-llama.sh)")),
]


def _engine_files() -> tuple[str, str]:
    py, model = os.environ["VLLM_PY"], os.environ["TINY_LLAMA"]
    if not (py and os.access(py, os.X_OK)):
        pytest.fail(f"VLLM_PY={py!r} is not an executable python (scripts/heavy/vllm-cpu.sh prints it last)")
    if not (model and (Path(model) / "config.json").is_file()):
        pytest.fail(f"TINY_LLAMA={model!r} is no model directory (scripts/heavy/tiny-llama.sh prints it last)")
    return py, model


def _group_alive(pid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[2]) == pid and fields[0] != "Z":
                    return True
    return False


def engine_environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def last_run(log: Path) -> str:
    """The engine's log from the last run marker on: this start's lines."""
    text = log.read_bytes().decode(errors="replace")
    return RUN_MARKER + text.rpartition(RUN_MARKER)[2]


def stamp(line: str) -> float | None:
    """vLLM's own time of a line (seconds within its year; vLLM writes MM-DD HH:MM:SS)."""
    m = _STAMP.search(line)
    if m is None:
        return None
    month, day, h, mi, s, frac = m.groups()
    return ((int(month) * 31 + int(day)) * 24 + int(h)) * 3600 + int(mi) * 60 + int(s) + float("0." + (frac or "0"))


def evidence(text: str, cache: Path) -> list[str]:
    """vLLM's lines about its load and compilation, each from its level on (the pid prefix dropped,
    the compile cache's path written $CACHE)."""
    out = []
    for line in text.splitlines():
        if any(n in line for n in EVIDENCE):
            m = re.search(r"\b(INFO|WARNING|DEBUG) \d\d-\d\d ", line)
            out.append((line[m.start():] if m else line).strip().replace(str(cache), "$CACHE")[:400])
    return out


def compile_span(lines: list[str]) -> float | None:
    """vLLM's compilation by its own clock: from "Warming up model for the compilation" to the last
    line after it that speaks of compiling (the AOT function saved, a graph compiled) before the
    engine's init ends. None without both."""
    begin = next((stamp(x) for x in lines if "Warming up model for the compilation" in x), None)
    ends = [stamp(x) for x in lines if ("AOT" in x or "compiled" in x.lower() or "Compiling a graph" in x)
            and "Warming up" not in x]
    ends = [e for e in ends if e is not None and begin is not None and e >= begin]
    return max(ends) - begin if begin is not None and ends else None


def stated(lines: list[str], needle: str) -> float | None:
    """The seconds vLLM states right after ``needle`` in its line ("... took 18.2 seconds")."""
    for line in lines:
        if needle in line:
            m = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)", line.split(needle, 1)[1])
            if m:
                return float(m[1])
    return None


def chat() -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0,
            "max_tokens": 8}


async def test_the_second_start_finds_the_firsts_compile_cache(tmp_path, monkeypatch):
    py, model = _engine_files()
    cc = tmp_path / "cc"
    overrides = {
        "deployer.commands.vllm": [py, "-m", MODULE, "--model"], "deployer.compile_cache": str(cc),
        "deployer.sleep_flags": False, "budget.host_reserve_gib": 0,
        "deployer.start_timeout_s": 900, "ondemand_queue_timeout_s": 900, "deployer.stop_timeout_s": 20,
    }
    runs: list[dict] = []
    temps: list[str] = []
    pids: list[int] = []
    try:
        # The gateway's requests and the admin API's on connections of their own (an admin
        # request's connection answers a gateway request 421).
        async with run_app(tmp_path, **overrides) as server, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as http, \
                aiohttp.ClientSession() as admin:
            dep = await server.deployer.create(dict(
                name=NAME, served_name=SERVED, engine="vllm", model=model, env=ENGINE_ENV, gpu_count=1,
                memory_gib=3, mode="on_demand", state="stopped", role="model", idle_timeout_s=3600,
                idle_action="stop"))
            d = dep.id
            timed: list[StartTimed] = []
            server.app[BUS].subscribe(StartTimed, timed.append)
            for n in (1, 2):
                # Anything outside the compile cache starts empty for each start (torch's default
                # Inductor cache is under the temporary directory); short: vLLM's IPC sockets live there.
                temps.append(tempfile.mkdtemp(prefix=f"odv{n}-", dir="/tmp"))
                monkeypatch.setenv("TMPDIR", temps[-1])
                t = time.monotonic()
                async with http.post(server.gw(d, "chat/completions"), json=chat(), headers=server.auth()) as r:
                    raw = await r.read()
                    assert r.status == 200, raw[:1000]
                total = time.monotonic() - t
                async with admin.get(f"{server.url}/api/deployments/{d}", headers=server.admin_headers()) as r:
                    view = await r.json()
                pid = server.deployer.engine(d).ref.pid
                pids.append(pid)
                environ = engine_environ(pid)
                await wait_for(lambda n=n: len(timed) >= n, timeout=10, what="the start's phases recorded")
                runs.append({"total": total, "view": view, "load": os.getloadavg()[0], "root": environ.get("VLLM_CACHE_ROOT"),
                             "phases": timed[-1].phases, "answer": orjson.loads(raw)["choices"],
                             "log": last_run(server.cfg.state_dir / "logs" / f"{NAME}.log")})
                await server.deployer.stop(d)
                # The backend's stop waits for the API server (the group's leader); its engine core
                # and worker, SIGTERMed with it, may take a moment longer. The next start must not
                # share the machine with them.
                await wait_for(lambda pid=pid: not _group_alive(pid), timeout=60, interval=0.1,
                               what="every process of the stopped engine gone")
    finally:
        for pid in pids:  # never leave a vLLM behind, whatever failed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)

    first, second = runs
    key = first["view"]["compile_cache"]["key"]
    assert first["view"]["compile_cache"] == {"key": key, "warm": False}
    assert second["view"]["compile_cache"] == {"key": key, "warm": True}
    assert first["root"] == second["root"] == str(cc / key)
    assert (cc / key / "torch_compile_cache").is_dir(), sorted(p.name for p in (cc / key).iterdir())
    for run in runs:
        run["lines"] = evidence(run["log"], cc)
        assert any("Warming up model for the compilation" in x for x in run["lines"]), run["lines"]  # compiled
        assert {"weights", "compile", "serving"} <= run["phases"].keys(), run["phases"]
    assert second["answer"] == first["answer"]  # the cached compilation answers as the fresh one

    text = section(runs, key)
    print("\n" + text)
    out = os.environ.get("ONDEMAND_BENCH_OUT")
    if out:
        sys.path.insert(0, str(ROOT / "scripts"))
        try:
            from bench_cold import write_section
        finally:
            sys.path.remove(str(ROOT / "scripts"))
        write_section(text, Path(out) if os.path.isabs(out) else ROOT / out, SECTION)


def section(runs: list[dict], key: str) -> str:
    first, second = runs

    def row(label: str, a: float | None, b: float | None) -> str:
        def f(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.1f}"
        change = f"{(b / a - 1) * 100:+.0f} %" if a and b is not None else "n/a"
        return f"| {label} | {f(a)} | {f(b)} | {change} |"
    phases = ["container", "process", "weights", "compile", "serving"]
    rows = [row(f"ondemand's `{p}` phase", first["phases"].get(p), second["phases"].get(p)) for p in phases]
    for run in runs:
        run["span"] = compile_span(run["lines"])
        run["init"] = stated(run["lines"], "init engine (profile, create kv cache, warmup model) took")
        run["weights"] = stated(run["lines"], "Loading weights took")
    saved = (first["phases"].get("compile") or 0) - (second["phases"].get("compile") or 0)

    def halved(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or b is None else "**met**" if b <= 0.5 * a else "**missed**"
    lines = [
        SECTION, "",
        f"`make test-vllm` (tests/heavy/test_vllm_cache.py), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        "vllm-cpu 0.32 serving the tiny Llama on this machine's CPU, started cold twice through the "
        f"recipe with `deployer.compile_cache` (key `{key}`), without `--enforce-eager`: the first start "
        "with an empty cache, the second with the first's. Seconds. ondemand's phases, read from vLLM's "
        "lines: `process` from the spawn to \"Starting to load model\", `weights` to \"Loading weights "
        "took\", `compile` to \"Starting vLLM server on\" (on the CPU: the compilation, the profile run, "
        "the KV cache, the warm-up), `serving` to ready.", "",
        "| | First start (cold cache) | Second start (warm cache) | Change |", "|---|---:|---:|---|",
        *rows,
        row("vLLM: weights (its \"Loading weights took\")", first["weights"], second["weights"]),
        row("vLLM: compilation, by its own clock (\"Warming up model for the compilation\" to the last "
            "compile line)", first["span"], second["span"]),
        row("vLLM: engine init (its \"init engine (profile, create kv cache, warmup model) took\")",
            first["init"], second["init"]),
        row("Whole start: the request's cold start and its answer, through the gateway", first["total"],
            second["total"]),
        "",
        f"The compile phase saved {saved:.1f} s; the whole start took {first['total'] - second['total']:.1f} s "
        "less (the rest of the difference is the process phase: vLLM importing torch and starting its engine "
        "core and worker, which the compile cache does not touch and the machine's load moves by tens of "
        "seconds). Target, the second start's compile phase at least 50 % shorter: ondemand's compile phase "
        f"{halved(first['phases'].get('compile'), second['phases'].get('compile'))}, vLLM's compilation "
        f"{halved(first['span'], second['span'])}. The load average as each start ended: "
        f"{first['load']:.1f} and {second['load']:.1f}, on {os.cpu_count()} cores.",
        "",
    ]
    for n, run in enumerate(runs, 1):
        lines += [f"vLLM's lines, start {n}:", "", "```", *run["lines"], "```", ""]
    return "\n".join(lines)

