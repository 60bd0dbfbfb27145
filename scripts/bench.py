#!/usr/bin/env python3
"""Benchmark of the on-demand gateway against the engine it forwards to.

Run from the repository root::

    .venv/bin/python scripts/bench.py            # about 2 minutes on 2 cores
    .venv/bin/python scripts/bench.py --quick    # about 30 seconds (the smoke test)

What it does, loopback only, every loop bounded in time:

1. Writes a temporary configuration (process backend, static budget, the
   gateway on a free loopback port), runs ``ondemand key init`` and starts
   ``python -m ondemand --config CFG serve`` as a subprocess.
2. Creates on-demand deployments through the admin socket: ``bench`` (the
   engine simulator with ``--token-delay 0``, so the proxy's cost dominates)
   and a few ``bench-slow-N`` (``--token-delay 0.05``) for the open-streams
   memory test. The gateway starts their engines itself on the first request.
3. Reads the engine's ``base_url`` from the admin API: the "direct" runs hit
   the very engine the gateway forwards to.
4. Interleaved rounds, gateway and direct in alternating order (ABBA), so
   drift affects both: non-streaming chat at concurrency 1, 16 and 64,
   streams of 200 chunks at 16 and 64 concurrent streams, time to first byte.
5. The gateway's RSS at idle and while 1,000 streams are open through it.
6. Prints a Markdown report and writes it to ``bench/results.md`` (``--out``).

The load generator runs in this process (uvloop, one aiohttp session,
unlimited connector) and shares the machine's cores with the gateway and the
engine, as a LiteLLM on the same host would; the report says so.

Exit status: 0 when the run completed (targets met or not: the report says
which), 1 when it failed or requests failed, 130 when interrupted.

All subprocesses are stopped on exit, on Ctrl-C and on errors; the gateway
also gets SIGTERM if this process dies (PR_SET_PDEATHSIG), and it stops the
engines it started.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results.md"
BASE = "/dgxmm"
PAGE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Targets (the gateway's performance budget).
T_RPS16 = 0.60        # requests/s at concurrency 16: at least 60 % of direct
T_STREAM = 0.80       # streaming chunks/s: at least 80 % of direct
T_ADDED_P50_MS = 1.0  # added latency p50 at concurrency 1
T_RSS_MIB = 150.0     # peak RSS with 1,000 open streams
# The lean path's targets, as ratios in one run (beside nginx and direct).
T_LEAN_CPU_X = 3.0      # gateway CPU per request at c=64: at most 3x nginx's
T_LEAN_RPS16 = 0.70     # requests/s at c=16: at least 0.70x direct
T_LEAN_ADDED_MS = 0.2   # added latency p50 at c=1


@dataclass(frozen=True)
class Plan:
    rounds: int
    rps_s: float          # seconds per non-streaming round
    stream_s: float       # seconds per streaming round
    ttfb_s: float         # seconds per time-to-first-byte round
    warmup_s: float
    open_streams: int     # the RSS test
    slow_deployments: int
    hold_s: float         # how long the open streams are held while RSS is sampled
    burst_wait_s: float   # how long the burst of new connections may take to open


FULL = Plan(rounds=4, rps_s=2.0, stream_s=3.0, ttfb_s=1.0, warmup_s=1.0,
            open_streams=1000, slow_deployments=4, hold_s=4.0, burst_wait_s=15.0)
QUICK = Plan(rounds=2, rps_s=0.5, stream_s=0.6, ttfb_s=0.4, warmup_s=0.3,
             open_streams=1000, slow_deployments=4, hold_s=1.5, burst_wait_s=8.0)

CHAT_SMALL = 16   # max_tokens of the non-streaming and TTFB requests
STREAM_TOKENS = 200


# --- subprocesses ------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench dies (Linux), own session (Ctrl-C is ours)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Procs:
    """The subprocesses of this run; ``cleanup()`` stops every one (idempotent)."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=ROOT, env=env,
                                    preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def cleanup(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # the gateway stops its engines on SIGTERM
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Engines the gateway could not stop (it was killed): their pid files name them.
        for pid_file in (self.state_dir / "logs").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError, ProcessLookupError, PermissionError):
                pid = int(pid_file.read_text().split()[0])
                if b"sim-engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.killpg(pid, signal.SIGKILL)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


NGINX_CONF = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    upstream engine {{ server {upstream}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        for _ in range(50):
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if kids:
                return [int(k) for k in kids]
            time.sleep(0.02)
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- /proc ---------------------------------------------------------------------------

def proc_status(pid: int, key: str) -> float:
    """A kB field of /proc/PID/status in MiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * PAGE / 2**20


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / CLK_TCK


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def listen_backlog(port: int) -> int | None:
    """The listen backlog of the socket on ``port`` (``ss``'s Send-Q for a listening socket)."""
    try:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
        return int(out.split()[2])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def n_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- statistics ---------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))  # nearest rank
    return s[k]


def median(values: list[float]) -> float:
    return pct(values, 50)


# --- the load ----------------------------------------------------------------------

@dataclass
class Target:
    name: str        # "gateway", "direct", or another proxy beside them ("nginx", "bare aiohttp", "byte relay")
    url: str         # .../v1/chat/completions
    headers: dict[str, str]
    pid: int = 0     # the proxy process whose CPU a run counts (the gateway's for "direct": ~0)


@dataclass
class Run:
    n: int = 0
    errors: int = 0
    elapsed: float = 0.0
    events: int = 0
    lat: list[float] = field(default_factory=list)
    cpu: float = 0.0         # CPU seconds during the run: the gateway's,
    cpu_client: float = 0.0  # the load generator's (this process),
    cpu_engine: float = 0.0  # the engine's

    @property
    def rate(self) -> float:
        return self.n / self.elapsed if self.elapsed else 0.0

    @property
    def event_rate(self) -> float:
        return self.events / self.elapsed if self.elapsed else 0.0


def chat_body(model: str, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Say something."}],
                            "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, ignore_eos=True)
    return orjson.dumps(body)


async def closed_loop(session: aiohttp.ClientSession, t: Target, body: bytes, conc: int, seconds: float) -> Run:
    """``conc`` workers send non-streaming requests back to back until the deadline."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                async with session.post(t.url, data=body, headers=t.headers) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, OSError):
                ok = False
            if ok:
                run.n += 1
                run.lat.append(time.perf_counter() - t0)
            else:
                run.errors += 1

    await asyncio.gather(*(worker() for _ in range(conc)))
    run.elapsed = time.perf_counter() - start
    return run


async def one_stream(session: aiohttp.ClientSession, t: Target, body: bytes,
                     first: Callable[[float], None] | None = None) -> tuple[int, bool]:
    """One SSE stream read to its end: (events, complete with [DONE])."""
    t0 = time.perf_counter()
    events, tail = 0, b""
    async with session.post(t.url, data=body, headers=t.headers) as r:
        if r.status != 200:
            await r.read()
            return 0, False
        async for data in r.content.iter_any():
            if first is not None:
                first(time.perf_counter() - t0)
                first = None
            # SSE events end with a blank line; a separator may straddle two reads.
            events += data.count(b"\n\n") + (tail[-1:] == b"\n" and data[:1] == b"\n")
            tail = (tail + data)[-16:]
    return events, tail.endswith(b"data: [DONE]\n\n")


async def stream_loop(session: aiohttp.ClientSession, t: Target, body: bytes, conc: int, seconds: float) -> Run:
    """``conc`` workers read whole streams back to back until the deadline."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            try:
                events, done = await one_stream(session, t, body)
            except (aiohttp.ClientError, OSError):
                events, done = 0, False
            run.events += events
            if done:
                run.n += 1
            else:
                run.errors += 1

    await asyncio.gather(*(worker() for _ in range(conc)))
    run.elapsed = time.perf_counter() - start
    return run


async def ttfb_loop(session: aiohttp.ClientSession, t: Target, body: bytes, seconds: float) -> Run:
    """Streams one at a time: request sent to first body byte."""
    run = Run()
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        got: list[float] = []
        try:
            _, done = await one_stream(session, t, body, got.append)
        except (aiohttp.ClientError, OSError):
            done = False
        if done and got:
            run.n += 1
            run.lat.append(got[0])
        else:
            run.errors += 1
    run.elapsed = time.perf_counter() - start
    return run


# --- the harness --------------------------------------------------------------------

class Bench:
    def __init__(self, plan: Plan, procs: Procs, tmp: Path, log: Callable[[str], None],
                 access_log: str = "off", scrape_s: float = 0.0):
        self.plan = plan
        self.access_log = access_log  # the gateway's access_log setting
        self.scrape_s = scrape_s      # scrape /metrics this often during the rounds (0: never)
        self.procs = procs
        self.tmp = tmp
        self.state_dir = procs.state_dir
        self.log = log
        self.port = free_port()
        self.cfg_path = tmp / "ondemand.toml"
        self.gw_pid = 0
        self.admin: aiohttp.ClientSession | None = None
        self.http: aiohttp.ClientSession | None = None
        self.key = ""
        self.results: dict[str, Any] = {"phases": {}}

    # setup ---------------------------------------------------------------------------

    def write_config(self) -> None:
        self.cfg_path.write_text(
            f'state_dir = "{self.state_dir}"\n'
            f'listen = "127.0.0.1:{self.port}"\n'
            'ondemand_allowed_cidrs = ["127.0.0.0/8"]\n'
            'log_level = "warning"\n'
            f'access_log = "{self.access_log}"\n'
            "shutdown_grace_s = 2\n"
            '[deployer]\nbackend = "process"\n'
            '[budget]\nsource = "static"\ncapacity_gib = 100\n')
        subprocess.run([sys.executable, "-m", "ondemand", "--config", str(self.cfg_path), "key", "init"],
                       cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
        self.key = (self.state_dir / "ondemand.key").read_text().strip()

    async def start_gateway(self) -> None:
        proc = self.procs.spawn("ondemand serve", [sys.executable, "-m", "ondemand", "--config", str(self.cfg_path),
                                                    "serve"], self.tmp / "serve.log", _env())
        self.gw_pid = proc.pid
        sock = self.state_dir / "admin.sock"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ondemand serve exited with {proc.returncode}:\n{self.serve_log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ondemand serve did not start within 30 s:\n{self.serve_log()}")
            if sock.exists():
                with contextlib.suppress(OSError):
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        break
            await asyncio.sleep(0.05)
        self.admin = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)))

    def serve_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / "serve.log").read_text()[-4000:]
        return ""

    async def api(self, method: str, path: str, body: Any = None) -> Any:
        assert self.admin is not None
        async with self.admin.request(method, f"http://localhost{BASE}/api{path}", json=body) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise RuntimeError(f"{method} {path}: {r.status} {data}")
            return data

    async def create(self, name: str, *sim_args: str) -> int:
        dep = await self.api("POST", "/deployments", {
            "name": name, "served_name": name, "engine": "vllm", "memory_gib": 1, "mode": "on_demand",
            "command": ["ondemand", "sim-engine", "--port", "{port}", "--model", name, *sim_args]})
        return int(dep["id"])

    def gw_target(self, dep_id: int) -> Target:
        return Target("gateway", f"http://127.0.0.1:{self.port}{BASE}/ondemand/{dep_id}/v1/chat/completions",
                      {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})

    async def first_request(self, t: Target, model: str) -> None:
        """Through the gateway: starts the engine (cold start); bounded by the timeout."""
        assert self.http is not None
        async with self.http.post(t.url, data=chat_body(model, 4, False), headers=t.headers,
                                  timeout=aiohttp.ClientTimeout(total=90)) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"first request through the gateway: {r.status} {text[:500]}\n{self.serve_log()}")

    # measurement ----------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        plan = self.plan
        self.write_config()
        await self.start_gateway()
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        try:
            return await self._run(plan)
        finally:
            await self.http.close()
            await self.admin.close()  # type: ignore[union-attr]

    async def _run(self, plan: Plan) -> dict[str, Any]:
        res = self.results
        dep_id = await self.create("bench", "--token-delay", "0", "--tokens", str(STREAM_TOKENS))
        gw = self.gw_target(dep_id)
        t0 = time.perf_counter()
        await self.first_request(gw, "bench")
        res["cold_start_s"] = time.perf_counter() - t0
        dep = await self.api("GET", f"/deployments/{dep_id}")
        if dep["state"] != "ready" or not dep.get("base_url"):
            raise RuntimeError(f"the bench deployment is {dep['state']} without a base_url after the first request")
        direct = Target("direct", dep["base_url"] + "/v1/chat/completions", {"Content-Type": "application/json"})
        gw.pid = direct.pid = self.gw_pid
        res["engine_url"] = dep["base_url"]
        others = await self.start_others(dep["base_url"])
        engine_pid = int((self.state_dir / "logs" / "bench.pid").read_text().split()[0])
        self.log(f"gateway pid {self.gw_pid} on :{self.port}, engine {dep['base_url']} "
                 f"(cold start {res['cold_start_s']:.2f} s)")

        small = chat_body("bench", CHAT_SMALL, False)
        stream = chat_body("bench", STREAM_TOKENS, True)
        first_byte = chat_body("bench", CHAT_SMALL, True)
        http = self.http
        assert http is not None
        phases: list[tuple[str, Callable[[Target], Any]]] = [
            ("c1", lambda t: closed_loop(http, t, small, 1, plan.rps_s)),
            ("c16", lambda t: closed_loop(http, t, small, 16, plan.rps_s)),
            ("c64", lambda t: closed_loop(http, t, small, 64, plan.rps_s)),
            ("s16", lambda t: stream_loop(http, t, stream, 16, plan.stream_s)),
            ("s64", lambda t: stream_loop(http, t, stream, 64, plan.stream_s)),
            ("ttfb", lambda t: ttfb_loop(http, t, first_byte, plan.ttfb_s)),
        ]

        # Warm-up: connection pools, code paths, the engine's caches.
        for t in (gw, direct, *others, gw, direct, *others):
            await closed_loop(http, t, small, 16, plan.warmup_s / 2)
            await stream_loop(http, t, stream, 16, plan.warmup_s / 2)
        await asyncio.sleep(0.5)
        res["rss_idle_mib"] = rss_mib(self.gw_pid)
        res["fds_idle"] = n_fds(self.gw_pid)
        res["backlog"] = listen_backlog(self.port)

        everyone = [gw, direct, *others]
        store: dict[str, dict[str, list[Run]]] = {p: {t.name: [] for t in everyone} for p, _ in phases}
        scraper = asyncio.get_running_loop().create_task(self.scrape_metrics()) if self.scrape_s else None
        t_rounds, busy0 = time.perf_counter(), machine_busy_s()
        ours0 = cpu_s(self.gw_pid) + cpu_s(engine_pid) + self_cpu()
        for rnd in range(plan.rounds):
            # ABBA for the gateway and direct, the other proxies after them in turn.
            order = [gw, direct] if rnd % 2 == 0 else [direct, gw]
            order += others[rnd % len(others):] + others[:rnd % len(others)] if others else []
            for name, fn in phases:
                for t in order:
                    c0, e0, s0 = cpu_s(t.pid), cpu_s(engine_pid), self_cpu()
                    run = await fn(t)
                    run.cpu = cpu_s(t.pid) - c0
                    run.cpu_engine = cpu_s(engine_pid) - e0
                    run.cpu_client = self_cpu() - s0
                    store[name][t.name].append(run)
            self.log(f"round {rnd + 1}/{plan.rounds}: " + ", ".join(
                f"{p} {store[p]['gateway'][-1].rate if p[0] != 's' else store[p]['gateway'][-1].event_rate:,.0f}"
                f"/{store[p]['direct'][-1].rate if p[0] != 's' else store[p]['direct'][-1].event_rate:,.0f}"
                for p, _ in phases if p != "ttfb"))
        res["phases"] = store
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
        span = time.perf_counter() - t_rounds
        ours = cpu_s(self.gw_pid) + cpu_s(engine_pid) + self_cpu() - ours0
        res["others_cores"] = max(0.0, (machine_busy_s() - busy0 - ours) / span)
        res["ours_cores"] = ours / span
        res["rss_after_load_mib"] = rss_mib(self.gw_pid)

        await self.open_streams(plan)
        await asyncio.sleep(1.0)
        res["rss_idle_after_mib"] = rss_mib(self.gw_pid)
        res["hwm_mib"] = proc_status(self.gw_pid, "VmHWM")
        return res

    async def start_others(self, engine_url: str) -> list[Target]:
        """nginx (when installed: ``scripts/heavy/nginx.sh``), a bare aiohttp proxy and a relay of
        bytes, each in front of the same engine, one worker each: what a proxy costs without
        ondemand's checks, and (the relay) without HTTP at all."""
        out: list[Target] = []
        json_h = {"Content-Type": "application/json"}
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if nginx is None:
            self.results["others_note"] = "nginx is not installed (scripts/heavy/nginx.sh): left out"
        else:
            port = free_port()
            conf = self.tmp / "nginx.conf"
            conf.write_text(NGINX_CONF.format(tmp=self.tmp, port=port, upstream=engine_url.split("://", 1)[1]))
            master = self.procs.spawn("nginx", [nginx, "-c", str(conf), "-p", str(self.tmp)],
                                      self.tmp / "nginx.log", _env())
            await self.wait_port(port, master)
            worker = _children(master.pid)
            out.append(Target("nginx", f"http://127.0.0.1:{port}/v1/chat/completions", json_h,
                              worker[0] if worker else master.pid))
        for name, script in (("bare aiohttp", "bare_proxy.py"), ("byte relay", "byte_relay.py")):
            port = free_port()
            proc = self.procs.spawn(name, [sys.executable, str(ROOT / "scripts" / script), "--port", str(port),
                                           "--upstream", engine_url], self.tmp / f"{script[:-3]}.log", _env())
            await self.wait_port(port, proc)
            out.append(Target(name, f"http://127.0.0.1:{port}/v1/chat/completions", json_h, proc.pid))
        return out

    async def wait_port(self, port: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{proc.args!r} did not listen on {port} (exit {proc.poll()})")
            await asyncio.sleep(0.05)

    async def scrape_metrics(self) -> None:
        """GET /metrics over TCP with the admin token every ``scrape_s``, as Prometheus would: on
        a connection of its own (one that carried /metrics is aiohttp's, design.md)."""
        token = (self.state_dir / "admin.token").read_text().strip()
        url = f"http://127.0.0.1:{self.port}{BASE}/metrics"
        n, size = 0, 0
        async with aiohttp.ClientSession() as prometheus:
            while True:
                async with prometheus.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
                    body = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"GET /metrics: {r.status} {body[:200]!r}")
                n, size = n + 1, len(body)
                self.results["scrapes"] = (n, size)
                await asyncio.sleep(self.scrape_s)

    async def prewarm(self, targets: list[Target], n: int, batch: int = 100) -> float:
        """Open ``n`` keep-alive connections to the gateway before the streams start.

        A burst of new connections overflows the gateway's listen backlog (aiohttp's default
        128; the dropped handshakes come back only after SYN-ACK retransmits, 1, 3, 7, 15 s
        later), and under streaming load uvloop accepts about one connection per event-loop
        iteration. So the connections are made first, in batches smaller than the backlog,
        by ``n`` concurrent non-streaming requests that each spend about 0.5 s in a slow
        engine (no bytes flow meanwhile); the streams then reuse them from the pool.
        """
        assert self.http is not None
        http = self.http
        t0 = time.perf_counter()
        failed: list[str] = []

        async def one(i: int) -> None:
            t = targets[i % len(targets)]
            try:
                async with http.post(t.url, data=chat_body(f"bench-slow-{i % len(targets)}", 10, False),
                                     headers=t.headers) as r:
                    await r.read()
                    if r.status != 200:
                        failed.append(str(r.status))
            except (aiohttp.ClientError, OSError) as exc:
                failed.append(repr(exc))

        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(one(i)))
            if i % batch == batch - 1:
                await asyncio.sleep(0.03)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        if failed:
            raise RuntimeError(f"pre-opening {n} connections: {len(failed)} failed, e.g. {failed[0]}")
        return time.perf_counter() - t0

    async def open_streams(self, plan: Plan) -> None:
        """``plan.open_streams`` streams through the gateway, spread over slow deployments (one
        deployment's pool has 256 engine connections): first in one burst over new connections,
        timed; then all open at once over pre-opened connections while RSS is sampled."""
        res = self.results
        ids = await asyncio.gather(*(self.create(f"bench-slow-{i}", "--token-delay", "0.05", "--tokens", "400")
                                     for i in range(plan.slow_deployments)))
        targets = [self.gw_target(i) for i in ids]
        await asyncio.gather(*(self.first_request(t, f"bench-slow-{n}") for n, t in enumerate(targets)))
        await asyncio.sleep(0.5)
        res["rss_idle_slow_mib"] = rss_mib(self.gw_pid)

        # A burst first: every stream at once over new connections, with the gateway's engine pools
        # still cold (what the listen backlog sees when many clients arrive together).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None, sock_connect=60)) as fresh:
            burst = await self.hold_streams(fresh, targets, plan.open_streams, plan.burst_wait_s, 0.0)
        res["burst"] = burst
        self.log(f"burst: {burst['opened']}/{plan.open_streams} streams open after {burst['open_s']:.1f} s")
        await asyncio.sleep(1.0)

        # Then the measured hold, over connections opened beforehand.
        assert self.http is not None
        res["prewarm_s"] = await self.prewarm(targets, plan.open_streams)
        held = await self.hold_streams(self.http, targets, plan.open_streams, 30.0, plan.hold_s)
        res["held"] = held
        self.log(f"{held['opened']}/{plan.open_streams} streams open after {held['open_s']:.1f} s; gateway RSS "
                 f"peak {held['rss_peak']:.1f} MiB, {held['fds']} fds, {held['chunk_us']:.0f} µs CPU per chunk")

    async def hold_streams(self, http: aiohttp.ClientSession, targets: list[Target], want: int,
                           open_wait: float, hold_s: float) -> dict[str, Any]:
        """Open ``want`` streams at once; once all had their first chunk (or after ``open_wait``),
        keep them open ``hold_s`` seconds, reading, while the gateway's RSS, fds and CPU are sampled."""
        opened = 0
        events = 0
        all_open = asyncio.Event()
        errors: list[str] = []

        async def hold(t: Target, model: str) -> None:
            nonlocal opened, events
            body = chat_body(model, 400, True)
            try:
                async with http.post(t.url, data=body, headers=t.headers) as r:
                    if r.status != 200:
                        errors.append(f"{r.status} {(await r.text())[:200]}")
                        return
                    await r.content.readany()
                    opened += 1
                    if opened == want:
                        all_open.set()
                    async for data in r.content.iter_any():  # keep reading, as a client would
                        events += data.count(b"\n\n")
            except (aiohttp.ClientError, OSError) as exc:
                errors.append(repr(exc))

        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(hold(targets[i % len(targets)], f"bench-slow-{i % len(targets)}"))
                 for i in range(want)]
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(all_open.wait(), open_wait)
            out["open_s"] = time.perf_counter() - t0
            out["opened"] = opened
            peak, fds = rss_mib(self.gw_pid), n_fds(self.gw_pid)
            c0, ev0, h0 = cpu_s(self.gw_pid), events, time.perf_counter()
            end = h0 + hold_s
            while time.perf_counter() < end:
                peak = max(peak, rss_mib(self.gw_pid))
                fds = max(fds, n_fds(self.gw_pid))
                await asyncio.sleep(0.05)
            held = time.perf_counter() - h0
            cpu, n_ev = cpu_s(self.gw_pid) - c0, events - ev0
            out.update(rss_peak=peak, fds=fds, still_open=sum(not t.done() for t in tasks),
                       chunk_rate=n_ev / held if held else float("nan"),
                       chunk_us=cpu / n_ev * 1e6 if n_ev else float("nan"),
                       core_share=cpu / held if held else float("nan"))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        out["errors"] = errors
        return out


# --- the report ---------------------------------------------------------------------

def _fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


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



# The sections that scripts/bench_cold.py and scripts/bench_wake.py write into the same file: a run
# of this script alone rewrites its own part and keeps theirs (one `make bench` writes all three).
KEPT_SECTIONS = ("## Cold path", "## Wake path", "## Start phases", "## Warm compile cache, a real vLLM")


def kept_sections(old: str) -> str:
    """The sections of ``old`` named in KEPT_SECTIONS, each up to the next ``## `` heading."""
    parts = []
    for section in KEPT_SECTIONS:
        if section in old:
            body = old.split(section, 1)[1].split("\n## ", 1)[0]
            parts.append(section + body.rstrip("\n") + "\n")
    return "\n".join(parts)


def write_keeping(text: str, out: Path) -> None:
    """``out`` becomes ``text`` followed by the sections of the other benchmarks it held (KEPT_SECTIONS)."""
    kept = kept_sections(out.read_text()) if out.exists() else ""
    out.write_text(text.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))


def report(res: dict[str, Any], plan: Plan, quick: bool, wall_s: float,
           log_scan: tuple[int, list[tuple[int, str]]]) -> tuple[str, bool]:
    ph = res["phases"]
    obs_args = (f" --access-log {res['access_log']}" if res["access_log"] != "off" else "") + \
        (f" --scrape {res['scrape_s']:g}" if res["scrape_s"] else "")

    def med_rate(p: str, who: str, events: bool = False) -> float:
        return median([r.event_rate if events else r.rate for r in ph[p][who]])

    def lat(p: str, who: str) -> list[float]:
        return [x * 1000 for r in ph[p][who] for x in r.lat]

    def errs(p: str, who: str) -> int:
        return sum(r.errors for r in ph[p][who])

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b and a == a and b == b else "n/a"

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    rows: list[tuple[str, str, str, str, str]] = []
    checks: list[tuple[str, bool]] = []

    g1, d1 = lat("c1", "gateway"), lat("c1", "direct")
    gp50, dp50, gp99, dp99 = pct(g1, 50), pct(d1, 50), pct(g1, 99), pct(d1, 99)
    added50, added99 = gp50 - dp50, gp99 - dp99
    ok = added50 <= T_ADDED_P50_MS
    checks.append((f"adds ≤ {T_ADDED_P50_MS:g} ms p50 at concurrency 1: {added50:.2f} ms", ok))
    rows.append(("Latency p50, concurrency 1 (ms)", _fmt(gp50, 2), _fmt(dp50, 2), ratio(gp50, dp50), ""))
    rows.append(("Latency p99, concurrency 1 (ms)", _fmt(gp99, 2), _fmt(dp99, 2), ratio(gp99, dp99), ""))
    rows.append(("**Added latency p50**, concurrency 1 (gateway − direct, ms)", _fmt(added50, 2), "", "",
                 f"≤ {T_ADDED_P50_MS:g} ms: {verdict(ok)}"))
    rows.append(("Added latency p99, concurrency 1 (gateway − direct, ms)", _fmt(added99, 2), "", "", ""))

    for p, conc in (("c1", 1), ("c16", 16), ("c64", 64)):
        g, d = med_rate(p, "gateway"), med_rate(p, "direct")
        target = ""
        if conc == 16:
            ok = g >= T_RPS16 * d
            checks.append((f"≥ {T_RPS16:.0%} of direct requests/s at concurrency 16: {g / d:.0%}", ok))
            target = f"≥ {T_RPS16:.2f}: {verdict(ok)}"
        rows.append((f"Requests/s, concurrency {conc}" + (" (**target**)" if conc == 16 else ""),
                     _fmt(g), _fmt(d), ratio(g, d), target))

    for p, conc in (("s16", 16), ("s64", 64)):
        g, d = med_rate(p, "gateway", True), med_rate(p, "direct", True)
        ok = g >= T_STREAM * d
        checks.append((f"≥ {T_STREAM:.0%} of direct streaming chunks/s, {conc} streams: {g / d:.0%}", ok))
        rows.append((f"Streaming chunks/s, {conc} streams × {STREAM_TOKENS} tokens", _fmt(g), _fmt(d),
                     ratio(g, d), f"≥ {T_STREAM:.2f}: {verdict(ok)}"))

    gt, dt = lat("ttfb", "gateway"), lat("ttfb", "direct")
    rows.append(("Time to first byte of a stream, p50 (ms)", _fmt(pct(gt, 50), 2), _fmt(pct(dt, 50), 2),
                 ratio(pct(gt, 50), pct(dt, 50)), ""))
    rows.append(("Time to first byte of a stream, p99 (ms)", _fmt(pct(gt, 99), 2), _fmt(pct(dt, 99), 2),
                 ratio(pct(gt, 99), pct(dt, 99)), ""))

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

    def cpu_table() -> list[str]:
        lines = ["| Run | Path | Gateway | Engine | Load generator | All three | Rate |",
                 "|---|---|---:|---:|---:|---:|---:|"]
        for p, label, events in (("c1", "non-streaming, c=1", False), ("c16", "non-streaming, c=16", False),
                                 ("c64", "non-streaming, c=64", False), ("s64", "64 streams (per chunk)", True)):
            for who in ("gateway", "direct"):
                runs = ph[p][who]
                work = sum(r.events if events else r.n for r in runs) or 1
                secs = sum(r.elapsed for r in runs) or 1
                g = sum(r.cpu for r in runs) if who == "gateway" else 0.0
                e, c = sum(r.cpu_engine for r in runs), sum(r.cpu_client for r in runs)

                def cell(x: float, work: float = work, secs: float = secs, events: bool = events) -> str:
                    return f"{x * 1e6 / work:,.{1 if events else 0}f} µs ({x / secs:.0%})"
                lines.append(f"| {label} | {who} | {cell(g) if who == 'gateway' else '–'} | {cell(e)} | "
                             f"{cell(c)} | {cell(g + e + c)} | {work / secs:,.0f}/s |")
        return lines

    def others_table() -> list[str]:
        """ondemand beside the other proxies in front of the same engine, in the same rounds."""
        names = [n for n in ph["c16"] if n != "direct"]
        if len(names) < 2:
            return [f"- {res.get('others_note', 'no other proxy ran')}"]
        lines = ["| Proxy | Requests/s c=16 / direct | CPU per request c=64 (µs) | Added latency p50 c=1 (ms) | "
                 "Chunks/s 16 streams / direct | Chunks/s 64 streams / direct |", "|---|---:|---:|---:|---:|---:|"]
        d16, s16d, s64d = med_rate("c16", "direct"), med_rate("s16", "direct", True), med_rate("s64", "direct", True)
        dp50 = pct(lat("c1", "direct"), 50)
        cpu: dict[str, float] = {}
        for n in names:
            runs = ph["c64"][n]
            cpu[n] = cpu_us = sum(r.cpu for r in runs) * 1e6 / (sum(r.n for r in runs) or 1)
            lines.append(f"| {n} | {ratio(med_rate('c16', n), d16)} | {cpu_us:,.0f} | "
                         f"{pct(lat('c1', n), 50) - dp50:.2f} | {ratio(med_rate('s16', n, True), s16d)} | "
                         f"{ratio(med_rate('s64', n, True), s64d)} |")
        if res.get("others_note"):
            lines += ["", f"- {res['others_note']}"]
        return lines + ["", "The lean path's targets (the gateway in this run):", "",
                        *lean_targets(cpu, d16, s16d, s64d, dp50)]

    def lean_targets(cpu: dict[str, float], d16: float, s16d: float, s64d: float, dp50: float) -> list[str]:
        g = "gateway"
        added = pct(lat("c1", g), 50) - dp50
        checks = [(f"CPU per request at c=64 ≤ {T_LEAN_CPU_X:g}× nginx's: {cpu[g] / cpu['nginx']:.1f}×"
                   if "nginx" in cpu else None, "nginx" in cpu and cpu[g] <= T_LEAN_CPU_X * cpu["nginx"]),
                  (f"requests/s at c=16 ≥ {T_LEAN_RPS16:.2f}× direct: {med_rate('c16', g) / d16:.2f}×",
                   med_rate("c16", g) >= T_LEAN_RPS16 * d16),
                  (f"added latency p50 at c=1 ≤ {T_LEAN_ADDED_MS:g} ms: {added:.2f} ms", added <= T_LEAN_ADDED_MS),
                  (f"streaming ≥ 1.0× direct at 16 and 64 streams: {med_rate('s16', g, True) / s16d:.2f}× and "
                   f"{med_rate('s64', g, True) / s64d:.2f}×",
                   med_rate("s16", g, True) >= s16d and med_rate("s64", g, True) >= s64d)]
        return [f"- {'met' if ok else '**missed**'}: {what}" for what, ok in checks if what is not None]

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count() or 0
    n_err, exc = log_scan
    out = [
        "# ondemand gateway benchmark",
        "",
        f"- Date: {now}{' (**--quick** run: short rounds, noisy)' if quick else ''}",
        f"- Machine: {cores} cores (nproc), {_cpu_model()}, {platform.system()} {platform.release()}; "
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
        *others_table(),
        "",
        "## Where the CPU goes",
        "",
        "CPU time of each process per request (per SSE chunk for streams) and, in brackets, its share of one "
        "core during the runs (/proc/PID/stat, getrusage):",
        "",
        *cpu_table(),
        "",
        "## Details",
        "",
        "- Requests per run (mean per round, gateway/direct): " + ", ".join(
            f"{p} {sum(r.n for r in ph[p]['gateway']) // plan.rounds:,}/"
            f"{sum(r.n for r in ph[p]['direct']) // plan.rounds:,}" for p in ph) + ".",
        "- Failed requests (non-200 or incomplete streams, gateway/direct): " + ", ".join(
            f"{p} {errs(p, 'gateway')}/{errs(p, 'direct')}" for p in ph) + ".",
        "- Rates per round (gateway/direct): " + "; ".join(
            f"{p}: " + " ".join(
                f"{(g.event_rate if p[0] == 's' else g.rate):,.0f}/{(d.event_rate if p[0] == 's' else d.rate):,.0f}"
                for g, d in zip(ph[p]["gateway"], ph[p]["direct"]))
            for p in ph if p != "ttfb") + ".",
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
        "",
        "## Set-up",
        "",
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
        f"{cores} cores with the gateway and the engine** (and with whatever else runs on the machine): "
        "through the gateway three busy processes compete for them, direct only two, so the ratios include "
        "that contention. With a zero-delay engine the simulator writes each SSE event separately, which "
        "the gateway reads in batches and passes on in fewer, larger writes: the load generator then "
        "spends less CPU per chunk through the gateway than direct, which is why streaming through the "
        "gateway can come out faster than direct. Loopback only.",
        "",
    ]
    return "\n".join(out), all(ok for _, ok in checks)


def _version(mod: str) -> str:
    with contextlib.suppress(Exception):
        return str(__import__(mod).__version__)
    return "?"


# --- main -------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (about 30 s), e.g. for a smoke test")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the Markdown report (default {DEFAULT_OUT})")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    ap.add_argument("--keep", action="store_true", help="keep the temporary state directory (logs)")
    ap.add_argument("--access-log", choices=("off", "text", "json"), default="off",
                    help="the gateway's access_log setting (default off)")
    ap.add_argument("--scrape", type=float, default=0.0, metavar="S",
                    help="GET /metrics every S seconds during the rounds, as Prometheus would (default: never)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    # Client + gateway inbound + gateway to engine + engines: about 3 fds per open stream.
    nofile = raise_nofile(max(8192, plan.open_streams * 4 + 1024))
    if nofile < plan.open_streams * 3 + 256:
        print(f"bench: RLIMIT_NOFILE is {nofile}, too low for {plan.open_streams} open streams", file=sys.stderr)
        return 2

    # SIGTERM is handled as Ctrl-C: the event loop's SIGINT handler cancels the run, and the
    # finally below stops the subprocesses. SIGINT also when started with it ignored (nohup, &).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))

    tmp = Path(tempfile.mkdtemp(prefix="ondemand-bench-"))
    procs = Procs(tmp / "state")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    bench = Bench(plan, procs, tmp, log, access_log=args.access_log, scrape_s=args.scrape)
    bench.results.update(access_log=args.access_log, scrape_s=args.scrape)
    log_scan: tuple[int, list[tuple[int, str]]] = (0, [])
    try:
        try:
            import uvloop
            res = uvloop.run(bench.run())
        except ImportError:  # pragma: no cover - uvloop is a pinned dependency
            res = asyncio.run(bench.run())
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"bench: failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        procs.cleanup()
        log_scan = scan_log(tmp / "serve.log")
        if args.keep:
            print(f"bench: state and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    text, all_met = report(res, plan, args.quick, time.perf_counter() - started, log_scan)
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_keeping(text, args.out)
        log(f"wrote {args.out}")
    failed = sum(r.errors for runs in res["phases"].values() for side in runs.values() for r in side)
    failed += len(res["held"]["errors"])
    if failed:
        log(f"{failed} requests failed: the numbers are not valid")
        return 1
    log("all targets met" if all_met else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
