#!/usr/bin/env python3
"""The wake path: the time to first token of a request for an awake, an asleep and a stopped model.

Run from the repository root (``make bench`` runs it after ``scripts/bench_cold.py``)::

    .venv/bin/python scripts/bench_wake.py            # about 3 minutes
    .venv/bin/python scripts/bench_wake.py --quick    # tiny delays, 2 rounds (the smoke test)

Against ``python -m ondemand serve`` (process backend, ``benchkit.gateway.Gateway``) and the engine
simulator as a vLLM engine with sleep mode (``--startup-delay 5 --wake-delay 0.3 --sleep-delay
0.2``; ``idle_action = "sleep"``), it measures, for each budget (static, one pool; measured:
the tests' fake nvidia-smi with one GPU), the time from sending a streamed chat completion to
its first content chunk (the ``ondemand-queued`` notice is not content) for:

1. an **awake** model (the gateway's own path: the floor of every row);
2. a **level-1 sleeper** (put to sleep by ``POST /api/deployments/{id}/sleep {"level": 1}``):
   ``/wake_up``, then the one-token wake check, then the request;
3. a **level-2 sleeper**: the four calls of vLLM's level-2 wake, the check, the request;
4. a **stopped** model: a cold start;
5. a **make-room swap**: two models that do not fit at once, the target asleep and the
   victim awake and idle for its whole timeout: the request puts the victim to sleep, then
   wakes the target.

Each case runs ``--rounds`` times (5); overhead = measured − the engine's own delays (the
wake, the start, the victim's sleep). Every simulator writes a journal (``--journal``: each
request's arrival and end, Unix time), so each round is also cut into its steps: where the
time goes. It writes (or replaces) the "Wake path" section of ``bench/results.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import results as results_md  # noqa: E402
from benchkit.gateway import FAKE_SMI, Gateway, fake_gpu  # noqa: E402
from benchkit.load import chat_body  # noqa: E402
from benchkit.measure import median  # noqa: E402
from benchkit.procs import ROOT, Procs, child_env, raise_nofile  # noqa: E402

OUT = ROOT / "bench" / "results.md"
SECTION = "## Wake path"
T_WAKE_MS = 100.0   # a wake: the engine's wake time + at most this (the wake check included)
T_SWAP_MS = 200.0   # a swap: the victim's sleep + the target's wake + at most this
WAKE_PATHS = ("/wake_up", "/collective_rpc", "/reset_prefix_cache")
GIB_MIB = 1024


@dataclass(frozen=True)
class Delays:
    startup: float
    wake: float
    sleep: float

    def sim(self) -> tuple[str, ...]:
        return ("--startup-delay", f"{self.startup:g}", "--wake-delay", f"{self.wake:g}",
                "--sleep-delay", f"{self.sleep:g}")


@dataclass
class Case:
    name: str
    engine_s: float             # the engine's own delays in this case
    engine_text: str
    target_ms: float | None     # the overhead's target (None: a reference)
    ttft: list[float] = field(default_factory=list)      # ms
    steps: list[dict[str, float]] = field(default_factory=list)  # ms per step, per round

    @property
    def overhead(self) -> list[float]:
        return [t - self.engine_s * 1000 for t in self.ttft]


class WakeGateway(Gateway):
    """The benchmarks' gateway, sampling every ``metrics_s`` (benchkit.gateway: 0.2 s). The footprint
    sampler runs nvidia-smi at that interval too (ondemand's default is 10 s): every 0.2 s it
    would be a load of its own on the measured budget's rows."""

    def __init__(self, procs: Procs, tmp: Path, name: str, budget: str, env: dict[str, str], metrics_s: float):
        super().__init__(procs, tmp, name, budget, env)
        self.metrics_s = metrics_s
        self.cfg.write_text(self.cfg.read_text().replace("metrics_interval_s = 0.2",
                                                         f"metrics_interval_s = {metrics_s:g}"))


# --- the engines' journals -------------------------------------------------------------

@dataclass
class Call:
    path: str
    req: float
    end: float


def journal(path: Path) -> tuple[list[Call], list[float]]:
    """(the calls, in arrival order, but the metrics sampler's; the boots' times)."""
    if not path.exists():
        return [], []
    reqs: dict[tuple[int, int], tuple[str, float]] = {}
    ends: dict[tuple[int, int], float] = {}
    boots = []
    for line in path.read_bytes().splitlines():
        e = orjson.loads(line)
        if e["ev"] == "req":
            reqs[(e["pid"], e["n"])] = (e["path"], e["t"])
        elif e["ev"] == "end":
            ends[(e["pid"], e["n"])] = e["t"]
        elif e["ev"] == "boot":
            boots.append(e["t"])
    calls = [Call(p, t, ends.get(k, float("nan"))) for k, (p, t) in reqs.items() if p != "/metrics"]
    return sorted(calls, key=lambda c: c.req), boots


def first(calls: list[Call], path: str | tuple[str, ...], since: float) -> Call:
    paths = (path,) if isinstance(path, str) else path
    for c in calls:
        if c.req >= since and c.path in paths:
            return c
    raise RuntimeError(f"the engine's journal has no {paths} after {since}")


def wake_steps(calls: list[Call], since: float, sent: float, got: float, wake_s: float) -> dict[str, float]:
    """The steps of a wake, from ``since`` (the request, or the victim's sleep's end)."""
    wakes = [c for c in calls if c.req >= since and c.path in WAKE_PATHS]
    check = first(calls, "/v1/completions", wakes[-1].end)
    chat = first(calls, "/v1/chat/completions", check.end)
    return {"to_wake": (wakes[0].req - since) * 1000,
            "wake_calls": (wakes[-1].end - wakes[0].req - wake_s) * 1000,
            "check": (check.end - wakes[-1].end) * 1000,
            "forward": (chat.req - check.end) * 1000,
            "answer": (got - chat.req) * 1000}


class Tracer:
    """``--trace``: each measured round printed as a timeline, from the engines' journals, the
    deployments' events (their ``at``, stamped in the transaction that records them) and the
    calls of nvidia-smi (a wrapper of the fake that logs each call's start and end)."""

    def __init__(self, on: bool, smi_log: Path | None = None):
        self.on, self.smi_log = on, smi_log

    async def round(self, gw: Gateway, what: str, sent: float, got: float,
                    engines: dict[str, tuple[int, Path]]) -> None:
        if not self.on:
            return
        entries: list[tuple[float, str]] = []
        for label, (dep_id, log) in engines.items():
            calls, boots = journal(log)
            for c in calls:
                if sent <= c.req <= got and c.path != "/health":
                    entries.append((c.req, f"{label}: {c.path} arrives"))
                    entries.append((c.end, f"{label}: {c.path} answered ({(c.end - c.req) * 1000:.1f} ms)"))
            entries += [(t, f"{label}: the engine process boots") for t in boots if sent <= t <= got]
            for e in await gw.api("GET", f"/deployments/{dep_id}/events"):
                if sent <= e["at"] <= got:
                    entries.append((e["at"], f"{label}: event \"{e['text'][:90]}\""))
        if self.smi_log is not None and self.smi_log.exists():
            for line in self.smi_log.read_text().splitlines():
                start, end, *args = line.split()
                if sent <= float(start) <= got:
                    query = next((a.split("=", 1)[1] for a in args if a.startswith("--query")), " ".join(args))
                    entries.append((float(start), f"nvidia-smi {query} "
                                                  f"({(float(end) - float(start)) * 1000:.1f} ms)"))
        entries.append((got, "first content chunk at the client"))
        print(f"\n[{gw.name}] {what}: request sent at +0.0 ms", flush=True)
        for t, text in sorted(entries):
            print(f"  +{(t - sent) * 1000:8.1f} ms  {text}", flush=True)


NO_TRACE = Tracer(False)
TRACE_SMI = """#!/bin/bash
# The fake nvidia-smi, each call's start and end logged (Unix time) to {log}.
s=$EPOCHREALTIME
"{real}" "$@"
rc=$?
echo "$s $EPOCHREALTIME $*" >> "{log}"
exit $rc
"""


# --- the requests ----------------------------------------------------------------------

async def ttft(http: aiohttp.ClientSession, gw: Gateway, dep_id: int, model: str) -> tuple[float, float]:
    """Send a streamed chat completion: (when it was sent, when its first content chunk came)."""
    sent = time.time()
    got = None
    async with http.post(gw.url(dep_id), data=chat_body(model, 4, True), headers=gw.headers(),
                         timeout=aiohttp.ClientTimeout(total=120)) as r:
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {(await r.text())[:300]}")
        async for line in r.content:
            if got is not None or not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("id") == "ondemand-queued":
                continue
            choices = chunk.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                got = time.time()
    if got is None:
        raise RuntimeError(f"{model}: the stream had no content")
    return sent, got


async def state(gw: Gateway, dep_id: int) -> str:
    return str((await gw.api("GET", f"/deployments/{dep_id}"))["state"])


async def expect(gw: Gateway, dep_id: int, want: str) -> None:
    got = await state(gw, dep_id)
    if got != want:
        raise RuntimeError(f"deployment {dep_id} is {got}, not {want}")


# --- the cases -------------------------------------------------------------------------

async def one_model(http: aiohttp.ClientSession, gw: Gateway, tmp: Path, d: Delays, rounds: int,
                    gpu: tuple[str, ...], tracer: Tracer = NO_TRACE) -> list[Case]:
    """One deployment, awake, then asleep at level 1, at level 2, then stopped."""
    log = tmp / f"{gw.name}-m.journal"
    dep = await gw.create("m", 4, *d.sim(), "--journal", str(log), *gpu, idle_action="sleep",
                          idle_timeout_s=3600, **({"gpu_count": 1} if gpu else {}))
    await ttft(http, gw, dep, "m")  # its first start, not counted
    awake = Case("Awake", 0.0, "–", None)
    l1 = Case("Asleep, level 1", d.wake, f"wake {d.wake * 1000:.0f}", T_WAKE_MS)
    l2 = Case("Asleep, level 2", d.wake, f"wake {d.wake * 1000:.0f}", T_WAKE_MS)
    cold = Case("Stopped (cold start)", d.startup, f"start {d.startup * 1000:,.0f}", None)
    for _ in range(rounds):
        await asyncio.sleep(0.2)
        sent, got = await ttft(http, gw, dep, "m")
        awake.ttft.append((got - sent) * 1000)
    for case, level in ((l1, 1), (l2, 2)):
        for _ in range(rounds):
            await gw.api("POST", f"/deployments/{dep}/sleep", {"level": level})
            await expect(gw, dep, "asleep")
            await asyncio.sleep(0.3)
            sent, got = await ttft(http, gw, dep, "m")
            case.ttft.append((got - sent) * 1000)
            calls, _ = journal(log)
            case.steps.append(wake_steps(calls, sent, sent, got, d.wake))
            await tracer.round(gw, case.name, sent, got, {"m": (dep, log)})
    for _ in range(rounds):
        await gw.api("POST", f"/deployments/{dep}/stop")
        await expect(gw, dep, "stopped")
        await asyncio.sleep(0.3)
        sent, got = await ttft(http, gw, dep, "m")
        cold.ttft.append((got - sent) * 1000)
        calls, boots = journal(log)
        boot = next(t for t in boots if t >= sent)
        check = first(calls, "/v1/completions", boot)
        chat = first(calls, "/v1/chat/completions", check.end)
        cold.steps.append({"to_boot": (boot - sent) * 1000,
                           "ready_seen": (check.req - boot - d.startup) * 1000,
                           "record": (check.end - check.req) * 1000,
                           "forward": (chat.req - check.end) * 1000,
                           "answer": (got - chat.req) * 1000})
        await tracer.round(gw, cold.name, sent, got, {"m": (dep, log)})
    await gw.api("POST", f"/deployments/{dep}/stop")  # out of the swap's way
    return [awake, l1, l2, cold]


async def swap(http: aiohttp.ClientSession, gw: WakeGateway, tmp: Path, d: Delays, rounds: int,
               gpu: bool, tracer: Tracer = NO_TRACE) -> Case:
    """a and b (12 GiB each, 20 GiB in all): one asleep, the other awake. Each round asks for
    the asleep one once the awake one has been idle for its whole timeout (1 s): make-room
    puts the awake one to sleep and the asleep one wakes. The roles swap each round."""
    extra = ("--gpu-mib", str(12 * GIB_MIB), "--sleep-gpu-mib", str(GIB_MIB)) if gpu else ()
    fields = {"gpu_count": 1} if gpu else {}
    logs = {n: tmp / f"{gw.name}-{n}.journal" for n in ("a", "b")}
    ids = {n: await gw.create(n, 12, *d.sim(), *extra, "--journal", str(logs[n]), idle_action="sleep",
                              idle_timeout_s=1, **fields) for n in ("a", "b")}
    await ttft(http, gw, ids["a"], "a")
    await gw.api("POST", f"/deployments/{ids['a']}/sleep", {"level": 1})
    await ttft(http, gw, ids["b"], "b")
    case = Case("Make-room swap", d.sleep + d.wake, f"sleep {d.sleep * 1000:.0f} + wake {d.wake * 1000:.0f}",
                T_SWAP_MS)
    target, victim = "a", "b"
    for _ in range(rounds):
        await expect(gw, ids[target], "asleep")
        await expect(gw, ids[victim], "ready")
        await asyncio.sleep(max(1.0, gw.metrics_s) + 0.4)  # the victim idle for its timeout, and its metrics say so
        sent, got = await ttft(http, gw, ids[target], target)
        case.ttft.append((got - sent) * 1000)
        await expect(gw, ids[victim], "asleep")
        vcalls, _ = journal(logs[victim])
        slept = first(vcalls, "/sleep", sent)
        woke = wake_steps(journal(logs[target])[0], slept.end, sent, got, d.wake)
        case.steps.append({"to_sleep": (slept.req - sent) * 1000,
                           "sleep_call": (slept.end - slept.req - d.sleep) * 1000,
                           "sleep_to_wake": woke.pop("to_wake"), **woke})
        await tracer.round(gw, f"{case.name} ({target} woken, {victim} put to sleep)", sent, got,
                           {f"target {target}": (ids[target], logs[target]),
                            f"victim {victim}": (ids[victim], logs[victim])})
        target, victim = victim, target
    for n in ids:
        await gw.api("POST", f"/deployments/{ids[n]}/stop")
    return case


# --- the report --------------------------------------------------------------------------

STEP_NAMES = {
    "to_sleep": "request → the victim's `/sleep` arrives",
    "sleep_call": "the `/sleep` call beyond its delay",
    "sleep_to_wake": "the victim's sleep answered → the target's first wake call arrives",
    "to_wake": "request → the first wake call arrives",
    "to_boot": "request → the engine process is up (spawn, imports)",
    "ready_seen": "engine ready → the wake check's completion is asked (readiness poll, /v1/models)",
    "wake_calls": "the wake calls beyond the engine's wake delay",
    "check": "last wake call answered → the wake check answered",
    "record": "the wake check's first answer recorded",
    "forward": "check answered → the request arrives at the engine",
    "answer": "request at the engine → first content chunk at the client",
}


def _mm(values: list[float]) -> str:
    return f"{median(values):,.0f} / {max(values):,.0f}"


def _flag(case: Case) -> str:
    """PASS or MISS on the median overhead (the max's beside it)."""
    target = case.target_ms
    if target is None:
        return "reference"

    def ok(v: float) -> str:
        return "PASS" if v <= target else "MISS"
    return f"≤ {target:g} ms: **{ok(median(case.overhead))}** (max: {ok(max(case.overhead))})"


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def section(results: dict[str, list[Case]], d: Delays, rounds: int, quick: bool, load: tuple[str, str]) -> str:
    lines = [
        SECTION, "",
        f"`scripts/bench_wake.py{' --quick' if quick else ''}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        "ondemand serve with the process backend; the engine simulator as a vLLM engine with sleep mode "
        f"(`--startup-delay {d.startup:g} --wake-delay {d.wake:g} --sleep-delay {d.sleep:g}`, "
        "`idle_action = \"sleep\"`). Time to first token: a streamed chat completion through the gateway, "
        f"from sending it to its first content chunk; {rounds} rounds each; overhead = measured − the engine's "
        f"own delays. Load average (1/5/15 min, {os.cpu_count()} cores) at the start {load[0]}, at the end "
        f"{load[1]}.", "",
    ]
    for budget, cases in results.items():
        lines += [f"**{budget}**", "",
                  "| Case | Engine's own delays (ms) | TTFT median / max (ms) | Overhead median / max (ms) | Target |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {c.name} | {c.engine_text} | {_mm(c.ttft)} | {_mm(c.overhead)} | {_flag(c)} |" for c in cases]
        lines.append("")
    lines += [
        "What is on the paths: a wake is the admit (its fit check reads the budget anew, after the request "
        "arrived: nvidia-smi once on the measured budget, nothing on the static one; that fresh reading is what "
        "the measured rows' first step, request to the first wake call, adds over the static ones), the "
        "engine's wake calls (one at level 1, four at level 2), "
        "the one-token wake check, the move to ready (one SQLite transaction), then the waiting request is "
        "forwarded; nothing is polled. A swap adds, before the wake, the refused admit's reading and the victim's "
        "sleep call, and after that call the victim's measurement (nvidia-smi `--query-compute-apps` and two "
        "walks of /proc) and the settle's reading, which the admit then takes as its own (the one reading a fit "
        "check reuses): three nvidia-smi calls in series on the measured budget, none on the static one. On the "
        "measured budget an engine's move to ready also wakes "
        "the footprint sampler, whose nvidia-smi is forked from the event loop as the waiting request is "
        "forwarded. The fake nvidia-smi is a shell pipeline (sh, sed, awk, sort); the real tool takes tens "
        "of ms as well.", "",
        "Where the time goes (medians in ms; from the simulators' journals: each request's "
        "arrival and end at the engine):", ""]
    for budget, cases in results.items():
        for c in cases:
            if not c.steps:
                continue
            parts = "; ".join(f"{STEP_NAMES[k]} {median([s[k] for s in c.steps]):.1f}" for k in c.steps[0])
            lines.append(f"- {budget}, {c.name.lower()}: {parts}.")
    lines.append("")
    return "\n".join(lines)


def write_section(text: str, out: Path) -> None:
    """This section of ``out`` replaced by ``text``, the others kept (``benchkit.results.write_section``)."""
    results_md.write_section(text, out, SECTION)


async def run(tmp: Path, procs: Procs, d: Delays, rounds: int, only: str | None,
              trace: bool = False, metrics_s: float = 1.0) -> dict[str, list[Case]]:
    env = child_env()
    smi = FAKE_SMI
    tracer = NO_TRACE
    if trace:
        smi = tmp / "nvidia-smi-traced"
        smi.write_text(TRACE_SMI.format(real=FAKE_SMI, log=tmp / "nvidia-smi.log"))
        smi.chmod(0o755)
        tracer = Tracer(True, tmp / "nvidia-smi.log")
    env.update(fake_gpu(tmp, 20 * GIB_MIB))
    # Plenty of host memory (the tests' fake meminfo): a level-1 sleep stays level 1 whatever is free.
    host = f'host_reserve_gib = 0\nmeminfo_path = "{ROOT / "tests" / "fakes" / "meminfo"}"\n'
    plans = {"static": ("Static budget (one pool of 20 GiB)",
                        '[budget]\nsource = "static"\ncapacity_gib = 20\n' + host, False),
             "measured": ("Measured budget (nvidia-smi: the tests' fake, one GPU of 20 GiB)",
                          f'[budget]\nsource = "nvidia-smi"\nnvidia_smi = "{smi}"\n' + host,
                          True)}
    results: dict[str, list[Case]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for name, (title, budget, gpu) in plans.items():
            if only is not None and name != only:
                continue
            gw = WakeGateway(procs, tmp, name, budget, env, metrics_s)
            await gw.start()
            try:
                cases = await one_model(http, gw, tmp, d, rounds, ("--gpu-mib", str(4 * GIB_MIB),
                                                                   "--sleep-gpu-mib", "512") if gpu else (),
                                        tracer)
                cases.append(await swap(http, gw, tmp, d, rounds, gpu, tracer))
                results[title] = cases
            finally:
                await gw.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny delays and 2 rounds (the smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (5; --quick 2)")
    ap.add_argument("--only", choices=("static", "measured"), help="one budget only")
    ap.add_argument("--trace", action="store_true",
                    help="print each round's timeline (the measured budget's nvidia-smi through a logging wrapper)")
    ap.add_argument("--metrics-interval", type=float, default=1.0, metavar="S",
                    help="ondemand's metrics_interval_s (the engines' metrics and the footprints' nvidia-smi)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    d = Delays(0.2, 0.05, 0.05) if args.quick else Delays(5.0, 0.3, 0.2)
    rounds = args.rounds or (2 if args.quick else 5)
    raise_nofile(8192)
    load_start = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ondemand-wake-"))
    procs = Procs(tmp / "static" / "state")
    try:
        import uvloop
        results = uvloop.run(run(tmp, procs, d, rounds, args.only, args.trace, args.metrics_interval))
    except Exception as exc:
        print(f"bench_wake: failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        Procs(tmp / "measured" / "state").cleanup()  # its engines, had its gateway been killed
        shutil.rmtree(tmp, ignore_errors=True)
    text = section(results, d, rounds, args.quick, (load_start, loadavg()))
    print(text)
    if not args.no_write and not args.trace:  # the wrapper's own cost is in a traced run's figures
        write_section(text, args.out)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
