"""The proxy benchmark's harness (scripts/bench.py): a gateway of its own with the engine
simulator behind it, the engine direct, and the other proxies, measured in interleaved rounds
(ABBA), then many streams held open through the gateway."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from . import others, streams
from .gateway import BASE, admin_call
from .load import Run, Target, chat_body, closed_loop, stream_loop, ttfb_loop
from .measure import cpu_s, listen_backlog, machine_busy_s, n_fds, proc_status, rss_mib, self_cpu
from .procs import ROOT, Procs, child_env, free_port


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


class Bench:
    """One run of the proxy benchmark: its gateway, its deployments, its measures (``results``)."""

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
                       cwd=ROOT, env=child_env(), check=True, stdout=subprocess.DEVNULL)
        self.key = (self.state_dir / "ondemand.key").read_text().strip()

    async def start_gateway(self) -> None:
        proc = self.procs.spawn("ondemand serve", [sys.executable, "-m", "ondemand", "--config", str(self.cfg_path),
                                                    "serve"], self.tmp / "serve.log", child_env())
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
        return await admin_call(self.admin, method, path, body)

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
        gw, direct, beside, engine_pid = await self.targets()
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
        for t in (gw, direct, *beside, gw, direct, *beside):
            await closed_loop(http, t, small, 16, plan.warmup_s / 2)
            await stream_loop(http, t, stream, 16, plan.warmup_s / 2)
        await asyncio.sleep(0.5)
        res["rss_idle_mib"] = rss_mib(self.gw_pid)
        res["fds_idle"] = n_fds(self.gw_pid)
        res["backlog"] = listen_backlog(self.port)

        await self.rounds(plan, phases, gw, direct, beside, engine_pid)
        res["rss_after_load_mib"] = rss_mib(self.gw_pid)

        await self.open_streams(plan)
        await asyncio.sleep(1.0)
        res["rss_idle_after_mib"] = rss_mib(self.gw_pid)
        res["hwm_mib"] = proc_status(self.gw_pid, "VmHWM")
        return res

    async def targets(self) -> tuple[Target, Target, list[Target], int]:
        """The bench deployment started through the gateway (its cold start timed); the gateway,
        its engine direct, the other proxies in front of that engine, and the engine's pid."""
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
        beside = await others.start_others(self.procs, self.tmp, dep["base_url"], self.results)
        engine_pid = int((self.state_dir / "logs" / "bench.pid").read_text().split()[0])
        self.log(f"gateway pid {self.gw_pid} on :{self.port}, engine {dep['base_url']} "
                 f"(cold start {res['cold_start_s']:.2f} s)")
        return gw, direct, beside, engine_pid

    async def rounds(self, plan: Plan, phases: list[tuple[str, Callable[[Target], Any]]], gw: Target,
                     direct: Target, beside: list[Target], engine_pid: int) -> None:
        """The interleaved rounds, each process's CPU counted per run, and how busy the machine's
        other processes kept its cores meanwhile."""
        res = self.results
        everyone = [gw, direct, *beside]
        store: dict[str, dict[str, list[Run]]] = {p: {t.name: [] for t in everyone} for p, _ in phases}
        scraper = asyncio.get_running_loop().create_task(self.scrape_metrics()) if self.scrape_s else None
        t_rounds, busy0 = time.perf_counter(), machine_busy_s()
        ours0 = cpu_s(self.gw_pid) + cpu_s(engine_pid) + self_cpu()
        for rnd in range(plan.rounds):
            # ABBA for the gateway and direct, the other proxies after them in turn.
            order = [gw, direct] if rnd % 2 == 0 else [direct, gw]
            order += beside[rnd % len(beside):] + beside[:rnd % len(beside)] if beside else []
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
            burst = await streams.hold_streams(fresh, self.gw_pid, targets, plan.open_streams, plan.burst_wait_s, 0.0)
        res["burst"] = burst
        self.log(f"burst: {burst['opened']}/{plan.open_streams} streams open after {burst['open_s']:.1f} s")
        await asyncio.sleep(1.0)

        # Then the measured hold, over connections opened beforehand.
        assert self.http is not None
        res["prewarm_s"] = await streams.prewarm(self.http, targets, plan.open_streams)
        held = await streams.hold_streams(self.http, self.gw_pid, targets, plan.open_streams, 30.0, plan.hold_s)
        res["held"] = held
        self.log(f"{held['opened']}/{plan.open_streams} streams open after {held['open_s']:.1f} s; gateway RSS "
                 f"peak {held['rss_peak']:.1f} MiB, {held['fds']} fds, {held['chunk_us']:.0f} µs CPU per chunk")
