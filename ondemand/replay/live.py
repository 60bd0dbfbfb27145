"""``replay --live``: the same requests through a real ``ondemand serve`` on loopback, with the
engine simulator as every deployment's vLLM (the process backend, a ``static`` budget of the
box's GPUs), every duration divided by ``speed``: the trace's gaps, the engines' costs (start,
wake, sleep, prefill, decode), the idle and queue timeouts and the reaper's period. It is how the
virtual world (``world.py``) is checked against the real process: where the two disagree, the
virtual model is wrong.

Per policy, a fresh state directory: the configuration, the key, a host memory file of the box's
size (the host reserve reads it), and the deployments written into the state file before
``serve`` starts (an always-on one is started, in order, before the first request). Each request
is a streamed completion of ``input_tokens`` words (the simulator's tokens) asking for exactly
``output_tokens`` tokens, sent at its time; its TTFT is until its first token (``tok0``; the
queued notice is not one). Afterwards, with the server stopped, what happened is read from the
state file's events (each start, from asleep a wake, each sleep and stop) and from the access
log (a request that waited for memory), and the times are multiplied back by ``speed``.

Adaptive warmth's deployments keep their ``keep_warm`` and the gaps they had learned (divided by
``speed``), and the minimum idle timeout, the floor of their plans, is divided too; two of their
constants are seconds that no configuration key sets (a gap under 1 s is not learned, a rest lasts
30 s at least), so above speed 1 they learn and rest by a different rule than the virtual run.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import sqlite3
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import aiohttp
import orjson

from ..engines.backends.ports import free_port
from ..model import Mode, State
from ..state.store import Store
from ..tasks import TaskGroup
from .types import Box, Policy, PolicyResult, Replayed, Request, Tally

BASE = "/dgxmm"
READY_WITHIN_S = 60.0


@dataclasses.dataclass
class Sent:
    """One request as the client saw it (seconds of real time from the trace's start)."""
    req: Request
    status: int = 0
    sent: float = 0.0
    ttft: float | None = None  # real seconds from sending to the first token
    end: float | None = None


def scaled(seconds: float, speed: float, least: float = 1.0) -> int:
    """Whole seconds (the configuration's timeouts are), at least ``least``."""
    return max(int(least), round(seconds / speed))


def sim_args(r: Replayed, speed: float, process_s: float = 0.0) -> list[str]:
    """The simulator's options for ``r``'s engine: its costs divided by ``speed``; its start's delay
    less ``process_s``, the time its process takes to come up at all (a cost is all a start takes)."""
    c = r.costs
    return ["--startup-delay", f"{max(0.0, c.cold_start_s / speed - process_s):g}",
            "--wake-delay", f"{c.wake_s / speed:g}",
            "--sleep-delay", f"{c.sleep_s / speed:g}", "--token-delay", f"{1 / (c.decode_tokens_per_s * speed):g}",
            "--prefill-rate", f"{c.prefill_tokens_per_s * speed:g}", "--max-running", str(c.max_concurrency),
            "--max-model-len", "10000000"]


class Server:
    """One ``ondemand serve`` and its files, for one policy."""

    def __init__(self, workdir: Path, box: Box, speed: float):
        self.dir = workdir
        self.state = workdir / "state"
        self.box = box
        self.speed = speed
        self.port = free_port()
        self.key = "odk-" + secrets.token_urlsafe(32)
        self.token = secrets.token_urlsafe(32)
        self.log = workdir / "serve.log"
        self.proc: asyncio.subprocess.Process | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{BASE}{path}"

    def write_files(self) -> Path:
        self.state.mkdir(parents=True, exist_ok=True)
        for name, secret in (("ondemand.key", self.key), ("admin.token", self.token)):
            path = self.state / name
            path.write_text(secret + "\n")
            path.chmod(0o600)
        host_kib = int(self.box.host_gib * 1024 * 1024)
        (self.dir / "meminfo").write_text(f"MemTotal: {host_kib} kB\nMemAvailable: {host_kib} kB\n")
        b, x = self.box, self.speed
        lines = [f'state_dir = "{self.state}"', f'listen = "127.0.0.1:{self.port}"', f'base_path = "{BASE}"',
                 'ondemand_allowed_cidrs = ["127.0.0.0/8"]', 'access_log = "json"',
                 f"min_idle_timeout_s = {scaled(b.min_idle_timeout_s, x)}",
                 f"ondemand_idle_timeout_s = {scaled(b.idle_timeout_s, x)}",
                 f"ondemand_queue_timeout_s = {scaled(b.queue_timeout_s, x)}",
                 f"ondemand_max_queued = {b.max_queued}", f"reap_interval_s = {max(0.1, b.reap_interval_s / x):g}",
                 "metrics_interval_s = 0.2", "shutdown_grace_s = 1", f'scheduler = "{b.scheduler}"']
        if b.sleep_timeout_s is not None:
            lines.append(f"sleep_timeout_s = {scaled(b.sleep_timeout_s, x)}")
        lines += ["[budget]", 'source = "static"', f"reserve_gib = {b.reserve_gib:g}",
                  f"host_reserve_gib = {b.host_reserve_gib:g}", f"asleep_residue_gib = {b.asleep_residue_gib:g}",
                  f'meminfo_path = "{self.dir / "meminfo"}"']
        lines.append(f"gpu_capacity_gib = [{', '.join(f'{g:g}' for g in b.gpus)}]" if b.per_gpu
                     else f"capacity_gib = {b.gpus[0]:g}")
        lines += ["[deployer]", 'backend = "process"', "start_timeout_s = 600", "[deployer.commands]",
                  f"vllm = {orjson.dumps([*self_command(), 'sim-engine']).decode()}"]
        config = self.dir / "ondemand.toml"
        config.write_text("\n".join(lines) + "\n")
        return config

    async def seed(self, replayed: Sequence[Replayed], process_s: float = 0.0) -> None:
        """The deployments, as the replay begins them: on demand stopped, always on planned (then
        started in order), with the idle gaps they had learned; every engine a vLLM recipe run by
        the simulator."""
        store = await Store.open(self.state / "ondemand.db")
        try:
            for r in replayed:
                d = r.deployment
                timeout = None if d.idle_timeout_s is None else scaled(d.idle_timeout_s, self.speed)
                row = await store.insert_deployment(dict(
                    name=d.name, served_name=d.served_name, engine="vllm", model=d.model or d.served_name,
                    memory_gib=d.footprint_gib, gpu_count=d.gpu_count, gpu_ids=d.gpu_ids, role=d.role.value,
                    mode=d.mode.value, idle_timeout_s=timeout, idle_action=d.idle_action.value,
                    keep_warm=d.keep_warm.value, priority=d.priority.value, max_inflight=d.max_inflight,
                    args=sim_args(r, self.speed, process_s),
                    state=(State.PLANNED if d.mode is Mode.ALWAYS_ON or d.state is State.PLANNED
                           else State.STOPPED).value))
                for gap in r.gaps:  # what adaptive warmth had learned, at the run's speed
                    await store.write_idle_gap(row["id"], at=time.time(), gap_s=gap / self.speed, keep=len(r.gaps))
        finally:
            await store.close()

    def _log_file(self) -> BinaryIO:
        return open(self.log, "wb")  # noqa: SIM115 (the child writes it; closed once it has its copy)

    async def start(self, config: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
        with self._log_file() as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self_command(), "--config", str(config), "serve", stdout=log, stderr=log, env=env,
                start_new_session=True)
        deadline = time.monotonic() + READY_WITHIN_S
        async with aiohttp.ClientSession() as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(self.url("/healthz")) as resp:
                        if resp.status == 200:
                            return
                if self.proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ondemand serve did not come up; its log: {self.log}")
                await asyncio.sleep(0.1)

    async def start_always_on(self, replayed: Sequence[Replayed]) -> None:
        """Each always-on deployment started and waited for, in the file's order; one that does
        not fit stays as it is (its requests are refused)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            for i, r in enumerate(replayed, 1):
                if r.deployment.mode is Mode.ALWAYS_ON and r.deployment.state is not State.PLANNED:
                    async with http.post(self.url(f"/api/deployments/{i}/start?wait=1")) as resp:
                        await resp.read()

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 60)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()


async def engine_start_s(within_s: float = 30.0) -> float:
    """How long an engine simulator asked to start at once takes to answer ``/health``: its
    process's own start (an interpreter and its imports), which each start's delay is given less
    of, so that a live start takes what its cost says. 0 when it never answers."""
    port = free_port()
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*self_command(), "sim-engine", "--port", str(port),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - began < within_s and proc.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                        if resp.status == 200:
                            return time.monotonic() - began
                await asyncio.sleep(0.02)
        return 0.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def self_command() -> list[str]:
    """How to run this ondemand again: the zipapp it runs from, else its package."""
    return [sys.executable, sys.argv[0]] if sys.argv[0].endswith(".pyz") else [sys.executable, "-m", "ondemand"]


async def _send(http: aiohttp.ClientSession, server: Server, dep_id: int, served: str, s: Sent, n: int) -> None:
    """One request, streamed unless the trace says otherwise; its TTFT until its first token."""
    req = s.req
    body = {"model": served, "prompt": "w " * req.input_tokens, "max_tokens": max(1, req.output_tokens),
            "ignore_eos": True, "stream": req.stream}
    headers = {"Authorization": f"Bearer {server.key}", "Content-Type": "application/json",
               "x-request-id": f"replay-{n}"}
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        async with http.post(server.url(f"/ondemand/{dep_id}/v1/completions"), data=orjson.dumps(body),
                             headers=headers) as resp:
            s.status = resp.status
            seen = b""
            async for chunk in resp.content.iter_any():
                if s.ttft is None:
                    seen = seen[-16:] + chunk
                    if b'"tok0' in seen:
                        s.ttft = loop.time() - began
            s.end = loop.time()
    except (aiohttp.ClientError, OSError):
        s.status = 0


async def drive(server: Server, requests: Iterable[Request], ids: dict[str, tuple[int, str]],
                speed: float) -> tuple[list[Sent], float]:
    """Every request at its time (divided by ``speed``); the sent ones and the wall time of the
    trace's start."""
    loop = asyncio.get_running_loop()
    sent: list[Sent] = []
    tasks = []
    group = TaskGroup("replay live")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        start, wall = loop.time() + 0.2, time.time() + 0.2
        for n, req in enumerate(requests):
            due = start + req.at_s / speed - loop.time()
            if due > 0:
                await asyncio.sleep(due)
            s = Sent(req)
            s.sent = loop.time() - start
            sent.append(s)
            dep_id, served = ids[req.model]
            tasks.append(group.spawn(_send(http, server, dep_id, served, s, n), f"request {n}"))
        await asyncio.gather(*tasks)
        for s in sent:
            s.end = (s.end or loop.time()) - start
    return sent, wall


Transition = tuple[float, str, str]  # (wall time, from, to)


def transitions(db: Path) -> dict[int, list[Transition]]:
    """Each deployment's state changes, from the state file's events (read once the server has
    stopped; read only)."""
    out: dict[int, list[Transition]] = {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for at, dep_id, detail in con.execute(
                "SELECT at, deployment_id, detail FROM events WHERE deployment_id IS NOT NULL ORDER BY id"):
            d = orjson.loads(detail or "{}")
            if isinstance(d, dict) and "to" in d:
                out.setdefault(dep_id, []).append((float(at), str(d.get("from")), str(d["to"])))
    finally:
        con.close()
    return out


def waited_in_log(log: Path) -> dict[str, tuple[bool, bool]]:
    """(waited for memory, waited for a start) of each replayed request, from the access log."""
    out = {}
    for line in log.read_bytes().splitlines():
        if not line.startswith(b"{"):
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            rec = orjson.loads(line)
            if isinstance(rec, dict) and str(rec.get("request_id", "")).startswith("replay-"):
                out[rec["request_id"]] = (bool(rec.get("waited_memory")), bool(rec.get("waited_start")))
    return out


def start_kind(changes: Sequence[Transition], at: float) -> str:
    """The start a request arriving at ``at`` waited for: the one under way then, else the next;
    ``wake`` from asleep, else ``cold``."""
    under_way = None
    for when, old, new in changes:
        kind = "wake" if old == "asleep" else "cold"
        if when <= at:
            under_way = kind if new == "starting" else (None if new == "ready" else under_way)
        elif under_way is not None:
            return under_way
        elif new == "starting":
            return kind
    return under_way or "cold"


def tally(policy: Policy, sent: Sequence[Sent], replayed: Sequence[Replayed], server: Server, wall: float,
          speed: float, slo_s: float) -> PolicyResult:
    """What the live run gave, in the virtual replay's terms (times multiplied back by ``speed``;
    GPU-hours are not measured live)."""
    names = {i: r.deployment.name for i, r in enumerate(replayed, 1)}
    ids = {name: i for i, name in names.items()}
    per = {name: Tally() for name in ids}
    total = Tally()
    end = max((s.end or 0.0 for s in sent), default=0.0)
    changes = transitions(server.state / "ondemand.db")
    for dep_id, rows in changes.items():
        t = per[names[dep_id]]
        for when, old, new in rows:
            if wall <= when <= wall + end:
                t.cold_starts += new == "starting" and old != "asleep"
                t.wakes += new == "starting" and old == "asleep"
                t.sleeps += new == "asleep"
                t.stops += new == "stopped"
    log = waited_in_log(server.log)
    for n, s in enumerate(sent):
        memory, start = log.get(f"replay-{n}", (False, False))
        kind = "queue" if memory else start_kind(changes.get(ids[s.req.model], []), wall + s.sent) if start \
            else "ready"
        served = s.status == 200 and s.ttft is not None
        ttft = (s.ttft or 0.0) * speed if s.req.stream else ((s.end or 0.0) - s.sent) * speed
        for t in (per[s.req.model], total):
            t.requests += 1
            t.waited[kind] += 1
            t.served += served
            t.failed += not served
            if served:
                t.add_ttft(ttft)
                t.slo_met += ttft <= slo_s + 1e-9
    for key in ("cold_starts", "wakes", "sleeps", "stops"):
        setattr(total, key, sum(getattr(t, key) for t in per.values()))
    return PolicyResult(policy, total, per, end_s=end * speed)


async def run_live(requests: Iterable[Request], replayed: Sequence[Replayed], box: Box, policy: Policy, *,
                   speed: float, slo_s: float, workdir: Path) -> PolicyResult:
    """One policy through a real server (module doc); ``replayed`` as the policy configured them."""
    server = Server(workdir, box, speed)
    config = server.write_files()
    await server.seed(replayed, await engine_start_s())
    try:
        await server.start(config)
        await server.start_always_on(replayed)
        ids = {r.deployment.name: (i, r.deployment.served_name) for i, r in enumerate(replayed, 1)}
        sent, wall = await drive(server, requests, ids, speed)
    finally:
        await server.stop()
    return tally(policy, sent, replayed, server, wall, speed, slo_s)


def disagreements(virtual: PolicyResult, live: PolicyResult, within: float = 0.2) -> list[str]:
    """Where the live run and the virtual replay of the same requests differ: the counts of cold
    starts, wakes and requests queued for memory must be the same, deployment by deployment, and
    the TTFT p50 within ``within`` (a fraction of the virtual one). Empty when they agree."""
    out = []
    for name, vt in virtual.per_deployment.items():
        xt = live.per_deployment.get(name)
        if xt is None:
            out.append(f"{name}: not in the live run")
            continue
        for what, v, x in (("cold starts", vt.cold_starts, xt.cold_starts), ("wakes", vt.wakes, xt.wakes),
                           ("queued", vt.waited["queue"], xt.waited["queue"])):
            if v != x:
                out.append(f"{name}: {what} {x} live, {v} virtual")
    p50v, p50x = virtual.total.ttft.quantile(0.5), live.total.ttft.quantile(0.5)
    if p50v is None or p50x is None:
        if p50v != p50x:
            out.append("nothing served in one of them")
    elif abs(p50x - p50v) > within * p50v:
        out.append(f"TTFT p50 {p50x:.3f} s live, {p50v:.3f} s virtual ({100 * (p50x - p50v) / p50v:+.0f} %)")
    return out

