"""The proxy benchmark's report (bench/results.md, its own part): the gateway against the engine
direct, its targets, the other proxies beside it, where the CPU goes, the details and the set-up."""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .load import Run
from .measure import median, pct
from .proxy import CHAT_SMALL, STREAM_TOKENS, Plan

# Targets (the gateway's performance budget).
T_RPS16 = 0.60        # requests/s at concurrency 16: at least 60 % of direct
T_STREAM = 0.80       # streaming chunks/s: at least 80 % of direct
T_ADDED_P50_MS = 1.0  # added latency p50 at concurrency 1
T_RSS_MIB = 150.0     # peak RSS with 1,000 open streams
# The lean path's targets, as ratios in one run (beside nginx and direct).
T_LEAN_CPU_X = 3.0      # gateway CPU per request at c=64: at most 3x nginx's
T_LEAN_RPS16 = 0.70     # requests/s at c=16: at least 0.70x direct
T_LEAN_ADDED_MS = 0.2   # added latency p50 at c=1

Row = tuple[str, str, str, str, str]
Check = tuple[str, bool]


def _fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(mod: str) -> str:
    with contextlib.suppress(Exception):
        return str(__import__(mod).__version__)
    return "?"


def scan_log(path: Path) -> tuple[int, list[tuple[int, str]]]:
    """ERROR lines of the gateway's log, and its distinct exceptions with their counts."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return 0, []
    errors = sum(1 for line in lines if " ERROR " in line or " CRITICAL " in line)
    exc: dict[str, int] = {}
    for line in lines:
        if line[:1].isalpha() and ("Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]) \
                and " ERROR " not in line and " WARNING " not in line:
            exc[line[:160]] = exc.get(line[:160], 0) + 1
    return errors, sorted(((n, m) for m, n in exc.items()), reverse=True)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and a == a and b == b else "n/a"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


class Phases:
    """The rounds' runs (``res["phases"]``: phase, then who, then one Run a round), read as the
    report needs them."""

    def __init__(self, ph: dict[str, dict[str, list[Run]]]):
        self.ph = ph

    def med_rate(self, p: str, who: str, events: bool = False) -> float:
        return median([r.event_rate if events else r.rate for r in self.ph[p][who]])

    def lat(self, p: str, who: str) -> list[float]:
        return [x * 1000 for r in self.ph[p][who] for x in r.lat]

    def errs(self, p: str, who: str) -> int:
        return sum(r.errors for r in self.ph[p][who])


def latency_rows(f: Phases, rows: list[Row], checks: list[Check]) -> None:
    g1, d1 = f.lat("c1", "gateway"), f.lat("c1", "direct")
    gp50, dp50, gp99, dp99 = pct(g1, 50), pct(d1, 50), pct(g1, 99), pct(d1, 99)
    added50, added99 = gp50 - dp50, gp99 - dp99
    ok = added50 <= T_ADDED_P50_MS
    checks.append((f"adds ≤ {T_ADDED_P50_MS:g} ms p50 at concurrency 1: {added50:.2f} ms", ok))
    rows.append(("Latency p50, concurrency 1 (ms)", _fmt(gp50, 2), _fmt(dp50, 2), ratio(gp50, dp50), ""))
    rows.append(("Latency p99, concurrency 1 (ms)", _fmt(gp99, 2), _fmt(dp99, 2), ratio(gp99, dp99), ""))
    rows.append(("**Added latency p50**, concurrency 1 (gateway − direct, ms)", _fmt(added50, 2), "", "",
                 f"≤ {T_ADDED_P50_MS:g} ms: {verdict(ok)}"))
    rows.append(("Added latency p99, concurrency 1 (gateway − direct, ms)", _fmt(added99, 2), "", "", ""))


def rate_rows(f: Phases, rows: list[Row], checks: list[Check]) -> None:
    for p, conc in (("c1", 1), ("c16", 16), ("c64", 64)):
        g, d = f.med_rate(p, "gateway"), f.med_rate(p, "direct")
        target = ""
        if conc == 16:
            ok = g >= T_RPS16 * d
            checks.append((f"≥ {T_RPS16:.0%} of direct requests/s at concurrency 16: {g / d:.0%}", ok))
            target = f"≥ {T_RPS16:.2f}: {verdict(ok)}"
        rows.append((f"Requests/s, concurrency {conc}" + (" (**target**)" if conc == 16 else ""),
                     _fmt(g), _fmt(d), ratio(g, d), target))

    for p, conc in (("s16", 16), ("s64", 64)):
        g, d = f.med_rate(p, "gateway", True), f.med_rate(p, "direct", True)
        ok = g >= T_STREAM * d
        checks.append((f"≥ {T_STREAM:.0%} of direct streaming chunks/s, {conc} streams: {g / d:.0%}", ok))
        rows.append((f"Streaming chunks/s, {conc} streams × {STREAM_TOKENS} tokens", _fmt(g), _fmt(d),
                     ratio(g, d), f"≥ {T_STREAM:.2f}: {verdict(ok)}"))

    gt, dt = f.lat("ttfb", "gateway"), f.lat("ttfb", "direct")
    rows.append(("Time to first byte of a stream, p50 (ms)", _fmt(pct(gt, 50), 2), _fmt(pct(dt, 50), 2),
                 ratio(pct(gt, 50), pct(dt, 50)), ""))
    rows.append(("Time to first byte of a stream, p99 (ms)", _fmt(pct(gt, 99), 2), _fmt(pct(dt, 99), 2),
                 ratio(pct(gt, 99), pct(dt, 99)), ""))


def memory_rows(res: dict[str, Any], plan: Plan, rows: list[Row], checks: list[Check]) -> None:
    held, burst = res["held"], res["burst"]
    n_open = plan.open_streams
    all_open = held["opened"] == n_open and held["still_open"] == n_open
    rows.append(("Gateway RSS at idle, after warm-up (MiB)", _fmt(res["rss_idle_mib"], 1), "", "", ""))
    ok = held["rss_peak"] < T_RSS_MIB and all_open
    checks.append((f"< {T_RSS_MIB:.0f} MiB RSS with {n_open:,} open streams: {held['rss_peak']:.1f} MiB"
                   + ("" if all_open else f" (only {held['opened']:,} opened, {held['still_open']:,} still open)"),
                   ok))
    rows.append((f"**Gateway peak RSS, {n_open:,} open streams** (MiB)", _fmt(held["rss_peak"], 1), "", "",
                 f"< {T_RSS_MIB:.0f} MiB: {verdict(ok)}"))
    rows.append(("Gateway RSS at idle, after the open streams (MiB)", _fmt(res["rss_idle_after_mib"], 1), "", "", ""))
    rows.append((f"Gateway CPU per chunk, {n_open:,} streams at 20 tokens/s (µs)", _fmt(held["chunk_us"], 1), "", "",
                 f"{held['core_share']:.0%} of a core for {held['chunk_rate']:,.0f} chunks/s"))
    burst_txt = (f"{burst['open_s']:.1f}" if burst["opened"] == n_open
                 else f"> {burst['open_s']:.0f} ({burst['opened']:,} of {n_open:,} open)")
    rows.append((f"Time until {n_open:,} streams opened in one burst (new connections) all answer (s)",
                 burst_txt, "", "", ""))


def cpu_table(f: Phases) -> list[str]:
    lines = ["| Run | Path | Gateway | Engine | Load generator | All three | Rate |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for p, label, events in (("c1", "non-streaming, c=1", False), ("c16", "non-streaming, c=16", False),
                             ("c64", "non-streaming, c=64", False), ("s64", "64 streams (per chunk)", True)):
        for who in ("gateway", "direct"):
            runs = f.ph[p][who]
            work = sum(r.events if events else r.n for r in runs) or 1
            secs = sum(r.elapsed for r in runs) or 1
            g = sum(r.cpu for r in runs) if who == "gateway" else 0.0
            e, c = sum(r.cpu_engine for r in runs), sum(r.cpu_client for r in runs)

            def cell(x: float, work: float = work, secs: float = secs, events: bool = events) -> str:
                return f"{x * 1e6 / work:,.{1 if events else 0}f} µs ({x / secs:.0%})"
            lines.append(f"| {label} | {who} | {cell(g) if who == 'gateway' else '–'} | {cell(e)} | "
                         f"{cell(c)} | {cell(g + e + c)} | {work / secs:,.0f}/s |")
    return lines


def others_table(f: Phases, res: dict[str, Any]) -> list[str]:
    """ondemand beside the other proxies in front of the same engine, in the same rounds."""
    names = [n for n in f.ph["c16"] if n != "direct"]
    if len(names) < 2:
        return [f"- {res.get('others_note', 'no other proxy ran')}"]
    lines = ["| Proxy | Requests/s c=16 / direct | CPU per request c=64 (µs) | Added latency p50 c=1 (ms) | "
             "Chunks/s 16 streams / direct | Chunks/s 64 streams / direct |", "|---|---:|---:|---:|---:|---:|"]
    d16, s16d = f.med_rate("c16", "direct"), f.med_rate("s16", "direct", True)
    s64d = f.med_rate("s64", "direct", True)
    dp50 = pct(f.lat("c1", "direct"), 50)
    cpu: dict[str, float] = {}
    for n in names:
        runs = f.ph["c64"][n]
        cpu[n] = cpu_us = sum(r.cpu for r in runs) * 1e6 / (sum(r.n for r in runs) or 1)
        lines.append(f"| {n} | {ratio(f.med_rate('c16', n), d16)} | {cpu_us:,.0f} | "
                     f"{pct(f.lat('c1', n), 50) - dp50:.2f} | {ratio(f.med_rate('s16', n, True), s16d)} | "
                     f"{ratio(f.med_rate('s64', n, True), s64d)} |")
    if res.get("others_note"):
        lines += ["", f"- {res['others_note']}"]
    return lines + ["", "The lean path's targets (the gateway in this run):", "",
                    *lean_targets(f, cpu, d16, s16d, s64d, dp50)]


def lean_targets(f: Phases, cpu: dict[str, float], d16: float, s16d: float, s64d: float, dp50: float) -> list[str]:
    g = "gateway"
    added = pct(f.lat("c1", g), 50) - dp50
    checks = [(f"CPU per request at c=64 ≤ {T_LEAN_CPU_X:g}× nginx's: {cpu[g] / cpu['nginx']:.1f}×"
               if "nginx" in cpu else None, "nginx" in cpu and cpu[g] <= T_LEAN_CPU_X * cpu["nginx"]),
              (f"requests/s at c=16 ≥ {T_LEAN_RPS16:.2f}× direct: {f.med_rate('c16', g) / d16:.2f}×",
               f.med_rate("c16", g) >= T_LEAN_RPS16 * d16),
              (f"added latency p50 at c=1 ≤ {T_LEAN_ADDED_MS:g} ms: {added:.2f} ms", added <= T_LEAN_ADDED_MS),
              (f"streaming ≥ 1.0× direct at 16 and 64 streams: {f.med_rate('s16', g, True) / s16d:.2f}× and "
               f"{f.med_rate('s64', g, True) / s64d:.2f}×",
               f.med_rate("s16", g, True) >= s16d and f.med_rate("s64", g, True) >= s64d)]
    return [f"- {'met' if ok else '**missed**'}: {what}" for what, ok in checks if what is not None]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 0


def header(res: dict[str, Any], plan: Plan, quick: bool, wall_s: float) -> list[str]:
    """The title, and the run's date, machine, versions, command and plan."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    obs_args = (f" --access-log {res['access_log']}" if res["access_log"] != "off" else "") + \
        (f" --scrape {res['scrape_s']:g}" if res["scrape_s"] else "")
    return [
        "# ondemand gateway benchmark",
        "",
        f"- Date: {now}{' (**--quick** run: short rounds, noisy)' if quick else ''}",
        f"- Machine: {cores()} cores (nproc), {_cpu_model()}, {platform.system()} {platform.release()}; "
        f"during the rounds other processes kept {res['others_cores']:.2f} cores busy on average "
        f"(bench processes {res['ours_cores']:.2f})",
        f"- Python {platform.python_version()}, aiohttp {aiohttp.__version__}, uvloop "
        f"{_version('uvloop')}, orjson {orjson.__version__}",
        f"- Command: `.venv/bin/python scripts/bench.py{' --quick' if quick else ''}"
        f"{obs_args}` "
        f"({wall_s:.0f} s wall clock)",
        f"- Plan: {plan.rounds} interleaved rounds, gateway and direct in alternating order (ABBA), "
        f"{plan.rps_s:g} s per non-streaming run, {plan.stream_s:g} s per streaming run, {plan.ttfb_s:g} s "
        "per time-to-first-byte run. Rates: median over the rounds; latencies: every request of every round.",
    ]


def details(f: Phases, res: dict[str, Any], plan: Plan, log_scan: tuple[int, list[tuple[int, str]]]) -> list[str]:
    """The counts behind the table: requests, failures, rates per round, the open streams, the
    burst, the gateway's memory and log, the cold start."""
    held, burst = res["held"], res["burst"]
    n_open = plan.open_streams
    n_err, exc = log_scan
    return [
        "- Requests per run (mean per round, gateway/direct): " + ", ".join(
            f"{p} {sum(r.n for r in f.ph[p]['gateway']) // plan.rounds:,}/"
            f"{sum(r.n for r in f.ph[p]['direct']) // plan.rounds:,}" for p in f.ph) + ".",
        "- Failed requests (non-200 or incomplete streams, gateway/direct): " + ", ".join(
            f"{p} {f.errs(p, 'gateway')}/{f.errs(p, 'direct')}" for p in f.ph) + ".",
        "- Rates per round (gateway/direct): " + "; ".join(
            f"{p}: " + " ".join(
                f"{(g.event_rate if p[0] == 's' else g.rate):,.0f}/{(d.event_rate if p[0] == 's' else d.rate):,.0f}"
                for g, d in zip(f.ph[p]["gateway"], f.ph[p]["direct"]))
            for p in f.ph if p != "ttfb") + ".",
        f"- Open streams: {n_open:,} streams through the gateway, spread over {plan.slow_deployments} on-demand "
        "deployments of the simulator with `--token-delay 0.05 --tokens 400` (one deployment's engine pool "
        f"holds 256 connections). Their {n_open:,} client connections were opened first "
        f"({res['prewarm_s']:.1f} s, batches of 100 concurrent slow non-streaming requests), so that the hold "
        "measures open streams whatever the listen backlog lets through (the burst row measures that). "
        f"{held['opened']:,} streams had their first chunk after {held['open_s']:.1f} s; {held['still_open']:,} "
        f"were still open at the end of the {plan.hold_s:g} s hold (RSS sampled every 50 ms); gateway fds "
        f"{res['fds_idle']} at idle, {held['fds']:,} with the streams open; {len(held['errors'])} failed"
        + (f" (first: {held['errors'][0]})" if held["errors"] else "") + ".",
        f"- Burst (before the hold): {n_open:,} streams started at once over new connections, the gateway's "
        f"engine pools cold: {burst['opened']:,} had their first chunk after {burst['open_s']:.1f} s (waited at "
        f"most {plan.burst_wait_s:g} s, then closed); {len(burst['errors'])} failed"
        + (f" (first: {burst['errors'][0]})" if burst["errors"] else "") + f". The gateway's listen backlog is "
        f"{res['backlog'] if res['backlog'] is not None else 'unknown'} (`ss`; aiohttp's default is 128): while "
        "its accept queue is full the kernel drops further handshakes, which complete only on a retransmission "
        "1, 3, 7 or 15 s later.",
        f"- Gateway RSS: {res['rss_idle_mib']:.1f} MiB idle after warm-up, {res['rss_after_load_mib']:.1f} MiB "
        f"after the rounds, {res['rss_idle_slow_mib']:.1f} MiB with the slow engines started, "
        f"{res['rss_idle_after_mib']:.1f} MiB idle after the open streams; VmHWM {res['hwm_mib']:.1f} MiB over "
        "the whole run.",
        f"- Gateway log: {n_err} ERROR lines" + (": " + "; ".join(f"{n}× `{m}`" for n, m in exc[:4]) if exc else "")
        + ".",
        f"- Cold start of the bench engine through the gateway (first request): {res['cold_start_s']:.2f} s.",
    ]


def setup(res: dict[str, Any]) -> list[str]:
    """How the run was set up: the gateway, the observability, the requests, the load generator."""
    return [
        "- `ondemand serve` (uvloop) with the process backend, a static 100 GiB budget, `log_level = "
        "\"warning\"`, the gateway on 127.0.0.1. The on-demand deployment `bench` runs the engine simulator "
        f"(`ondemand sim-engine --token-delay 0 --tokens {STREAM_TOKENS}`), started by the gateway on the "
        "first request; **direct** is that same engine process at the `base_url` the admin API reports, so "
        "both paths do the same engine work and the difference is the gateway. With zero token delay the "
        "simulator answers at once: the ratios compare the gateway with an engine that does (almost) no work.",
        f"- Observability: `access_log = \"{res['access_log']}\"`"
        + (" (one line per gateway request to the gateway's stderr, a file)" if res["access_log"] != "off" else "")
        + (f"; `GET /metrics` with the admin token every {res['scrape_s']:g} s during the rounds "
           f"({res.get('scrapes', (0, 0))[0]} scrapes, the last {res.get('scrapes', (0, 0))[1]:,} bytes)"
           if res["scrape_s"] else "; `/metrics` not scraped") + ".",
        f"- Requests: non-streaming chat with `max_tokens: {CHAT_SMALL}`; streams with `stream: true, "
        f"max_tokens: {STREAM_TOKENS}, ignore_eos: true` ({STREAM_TOKENS + 2} SSE events each: role, "
        f"{STREAM_TOKENS} tokens, [DONE]); chunks/s counts SSE events received. Time to first byte: streams "
        f"with `max_tokens: {CHAT_SMALL}`, one at a time, from sending the request to the first body bytes.",
        "- Load generator: this process, uvloop, one aiohttp `ClientSession` with `TCPConnector(limit=0)`, "
        "closed loops (each worker sends its next request when its previous one ended). **It shares the "
        f"{cores()} cores with the gateway and the engine** (and with whatever else runs on the machine): "
        "through the gateway three busy processes compete for them, direct only two, so the ratios include "
        "that contention. With a zero-delay engine the simulator writes each SSE event separately, which "
        "the gateway reads in batches and passes on in fewer, larger writes: the load generator then "
        "spends less CPU per chunk through the gateway than direct, which is why streaming through the "
        "gateway can come out faster than direct. Loopback only.",
    ]


def report(res: dict[str, Any], plan: Plan, quick: bool, wall_s: float,
           log_scan: tuple[int, list[tuple[int, str]]]) -> tuple[str, bool]:
    """The report's Markdown, and whether every target was met."""
    f = Phases(res["phases"])
    rows: list[Row] = []
    checks: list[Check] = []
    latency_rows(f, rows, checks)
    rate_rows(f, rows, checks)
    memory_rows(res, plan, rows, checks)
    out = [
        *header(res, plan, quick, wall_s),
        "",
        "| Metric | Gateway | Direct | Gateway / direct | Target |",
        "|---|---:|---:|---:|---|",
        *(f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows),
        "",
        "## Targets",
        "",
        *(f"- {'met' if ok else '**MISSED**'}: {what}" for what, ok in checks),
        "",
        "## Beside nginx, a bare aiohttp proxy and a relay of bytes",
        "",
        "Each in front of the same engine with one worker, in the same interleaved rounds: what a proxy "
        "costs here without ondemand's checks (nginx: `scripts/heavy/nginx.sh`; the bare proxy: "
        "`scripts/bare_proxy.py`, aiohttp's application and client with no middleware), and what moving "
        "the bytes alone costs in Python on uvloop, with no HTTP at all (`scripts/byte_relay.py`: a "
        "connection to the engine for each client connection, bytes across as they come).",
        "",
        *others_table(f, res),
        "",
        "## Where the CPU goes",
        "",
        "CPU time of each process per request (per SSE chunk for streams) and, in brackets, its share of one "
        "core during the runs (/proc/PID/stat, getrusage):",
        "",
        *cpu_table(f),
        "",
        "## Details",
        "",
        *details(f, res, plan, log_scan),
        "",
        "## Set-up",
        "",
        *setup(res),
        "",
    ]
    return "\n".join(out), all(ok for _, ok in checks)
