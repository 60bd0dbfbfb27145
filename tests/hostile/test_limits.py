"""Limits of a real `ondemand serve` process (slow: make test-all):

- 10,000 connections queued at once (each one complete request, raw asyncio sockets, for a
  deployment that starts slowly) cost at most 200 MiB of the gateway's RSS (/proc), and the
  queue still holds: the deadline answers 503 ondemand_queue_timeout on time, in arrival order,
  and once the engine is ready the requests that queued first are served first.
- At its open-file limit (a low RLIMIT_NOFILE for the server process) the gateway answers or
  refuses, never crashes or spins (CPU time from /proc/PID/stat stays low while it is held
  there), and once the clients are gone it serves again without a restart.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import statistics
import sys
import time

import aiohttp
import orjson
import pytest
from helpers import ROOT, admin_ok, free_port, serving, sim_command, terminate, wait_for

from ondemand import config
from ondemand.gateway import keys

pytestmark = pytest.mark.slow

CLK_TCK = os.sysconf("SC_CLK_TCK")


class Serve:
    """One `ondemand serve` process on loopback, its log in a file."""

    def __init__(self, tmp, *, nofile: int | None = None, **settings):
        self.port = free_port()
        self.tmp = tmp
        state = tmp / "state"
        state.mkdir(mode=0o700)
        base = {"state_dir": str(state), "listen": f"127.0.0.1:{self.port}", "ondemand_allowed_cidrs": ["127.0.0.0/8"],
                "min_idle_timeout_s": 1, "shutdown_grace_s": 1, "log_level": "warning"}
        base.update(settings)
        lines = [f"{k} = {json.dumps(v)}" for k, v in base.items()]
        lines += ["[budget]", 'source = "static"', "capacity_gib = 24", "[deployer]", 'backend = "process"']
        path = tmp / "ondemand.toml"
        path.write_text("\n".join(lines) + "\n")
        self.path = path
        self.cfg = config.load(path, env={})
        self.key = keys.generate_key()
        keys.write_key_file(self.cfg.key_file, self.key)
        self.nofile = nofile
        self.proc: asyncio.subprocess.Process | None = None
        self.log = tmp / "serve.log"

    def _limits(self) -> None:  # in the child, before exec
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))
        else:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def __aenter__(self) -> Serve:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
        with open(self.log, "wb") as log:  # a pipe nobody reads would fill and stall the server
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ondemand", "--config", str(self.path), "serve", cwd=ROOT, env=env,
                stdout=log, stderr=log, preexec_fn=self._limits)

        await serving(self.proc, self.cfg, "ondemand serving", self.log)
        return self

    async def __aexit__(self, *exc) -> None:
        await terminate(self.proc, 20)

    async def api(self, method: str, path: str, body=None):
        return await admin_ok(self.cfg, method, path, body)

    async def add(self, name: str, *sim_args: str) -> int:
        view = await self.api("POST", "/deployments", {
            "name": name, "served_name": name.upper(), "mode": "on_demand", "memory_gib": 4, "engine": "vllm",
            "command": sim_command(name.upper(), *sim_args)})
        return int(view["id"])

    def rss_mib(self) -> float:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def cpu_s(self) -> float:
        fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime

    def request(self, dep: int, close: bool = True, model: str = "A") -> bytes:
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}]})
        return (f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{'Connection: close' if close else ''}\r\n\r\n").encode() + body


def _raise_own_nofile(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard < n:
            pytest.skip(f"needs {n} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


async def _client(port: int, data: bytes, sent: list, answered: list, i: int, connect: asyncio.Semaphore):
    """One raw connection: one complete request, then the whole answer (the server closes)."""
    async with connect:  # no more handshakes in flight than the listen backlog takes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        sent[i] = time.monotonic()
    try:
        out = await reader.read()
        answered[i] = (time.monotonic(), out)
    finally:
        writer.close()


def _status_code(out: bytes) -> tuple[int, str | None]:
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    try:
        return status, orjson.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return status, None


N = 10_000


async def _flood(srv: Serve, dep: int, rss: list[float], model: str) -> tuple[list, list]:
    """N clients queue for ``dep``; the gateway's RSS is sampled while they wait."""
    sent: list = [None] * N
    answered: list = [None] * N
    connect = asyncio.Semaphore(1000)
    data = srv.request(dep, model=model)
    tasks = [asyncio.ensure_future(_client(srv.port, data, sent, answered, i, connect)) for i in range(N)]

    async def all_queued():
        host = await srv.api("GET", "/host")
        rss.append(srv.rss_mib())
        return host["ondemand"]["queued"] >= N
    await wait_for(all_queued, timeout=120, interval=0.5, what=f"{N} requests queued")
    for _ in range(3):
        rss.append(srv.rss_mib())
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks)
    return sent, answered


async def test_ten_thousand_queued_connections(tmp_path):
    _raise_own_nofile(N + 1000)
    timeout_s = 40
    # The caps on open connections (4,096, 1,024 a peer) sized above the 10,000 this one peer holds.
    async with Serve(tmp_path, ondemand_max_queued=N + 100, ondemand_queue_timeout_s=timeout_s,
                     max_connections=N + 200, max_connections_per_peer=N + 200) as srv:
        base_rss = srv.rss_mib()
        # Deadlines: the engine never gets ready in time; every request gets 503
        # ondemand_queue_timeout at its own deadline, in the order the requests came.
        slow = await srv.add("slow", "--startup-delay", "3600")
        rss: list[float] = []
        sent, answered = await _flood(srv, slow, rss, "SLOW")
        codes = {_status_code(a[1]) for a in answered}
        assert codes == {(503, "ondemand_queue_timeout")}, codes
        late = [answered[i][0] - sent[i] for i in range(N)]
        assert min(late) >= timeout_s - 1.5 and max(late) <= timeout_s + 5, (min(late), max(late))
        firsts = [answered[i][0] for i in range(N)]
        assert statistics.median(firsts[: N // 10]) < statistics.median(firsts[-N // 10:])
        assert max(rss) - base_rss <= 200, (base_rss, max(rss))
        # Order: once the engine is ready, those that queued first are served first. The slow
        # engine is stopped first: engines start one at a time (the deployer's start-up gate).
        await srv.api("POST", f"/deployments/{slow}/stop")

        async def stopped():
            return (await srv.api("GET", f"/deployments/{slow}"))["state"] == "stopped"
        await wait_for(stopped, timeout=30, interval=0.2, what="the slow engine stopped")
        quick = await srv.add("quick", "--startup-delay", "15")
        rss2: list[float] = []
        sent, answered = await _flood(srv, quick, rss2, "QUICK")
        codes = {_status_code(a[1]) for a in answered}
        assert {c[0] for c in codes} == {200}, codes
        done = [answered[i][0] for i in range(N)]
        assert statistics.median(done[: N // 10]) <= statistics.median(done[-N // 10:])
        assert max(rss2) - base_rss <= 200, (base_rss, max(rss2))
        print(f"RSS: {base_rss:.0f} MiB idle, {max(rss):.0f} MiB with {N} queued (deadline), "
              f"{max(rss2):.0f} MiB with {N} queued (start)")


async def test_at_the_open_file_limit_it_refuses_then_recovers(tmp_path):
    """256 open files for the server; 600 clients hold connections open (each sends half a
    head, then waits): the server cannot accept them all. It must not die or spin, and once
    they are gone it serves again."""
    _raise_own_nofile(2000)
    async with Serve(tmp_path, nofile=256) as srv:
        dep = await srv.add("a")
        await srv.api("POST", f"/deployments/{dep}/start?wait=1")
        writers = []
        for _ in range(600):
            try:
                _r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", srv.port), 2)
            except (OSError, asyncio.TimeoutError):
                continue
            w.write(b"POST /dgxmm/ondemand/1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            writers.append(w)
        await asyncio.sleep(1)
        # Held at the limit for 5 s: alive, and using little CPU (no accept loop spinning on EMFILE).
        cpu0, t0 = srv.cpu_s(), time.monotonic()
        await asyncio.sleep(5)
        cpu = (srv.cpu_s() - cpu0) / (time.monotonic() - t0)
        assert srv.proc.returncode is None
        assert cpu < 0.3, f"{cpu:.0%} of a core while at the open-file limit"
        # A request now gets an answer or a refusal (a closed or refused connection), never a hang.
        with contextlib.suppress(OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", srv.port), 2)
            w.write(srv.request(dep))
            await asyncio.wait_for(r.read(), 15)
        for w in writers:
            w.close()
        # Recovered without a restart.

        async def served():
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", srv.port), 2)
                w.write(srv.request(dep))
                out = await asyncio.wait_for(r.read(), 10)
                w.close()
                return _status_code(out)[0] == 200
            except (OSError, asyncio.TimeoutError):
                return False
        await wait_for(served, timeout=30, interval=0.5, what="a request served after the clients left")
        assert srv.proc.returncode is None


def test_serve_raises_a_low_open_files_limit_toward_the_hard_one():
    """A service started with systemd's soft limit (1,024) would fail its accepts long before
    max_connections: serve raises the soft limit (2 x max_connections + 1,024, at most the hard)."""
    import subprocess
    import sys
    code = (
        "import resource\n"
        "from ondemand.http import server\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "server.raise_open_files(1000)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    soft, hard = int(out[0]), int(out[1])
    assert soft == (3024 if hard == -1 or hard >= 3024 else hard), out


async def test_the_http_bounds_come_from_the_configuration(tmp_path):
    """head_timeout_s, keepalive_timeout_s, max_head_kib and max_body_mib are keys (validated as
    every key), and the server keeps them: a silent connection is closed after the configured
    head timeout, a body over max_body_mib is a 413 that names the size, on the gateway's path."""
    from helpers import run_app

    from ondemand.errors import ConfigError
    from ondemand.http.limits import Limits
    with pytest.raises(ConfigError, match="head_timeout_s = 0.1 .*0.5 to 300"):
        config.load(env={}, overrides={"head_timeout_s": 0.1})
    cfg = config.load(env={}, overrides={"head_timeout_s": 0.5, "body_timeout_s": 5, "keepalive_timeout_s": 2,
                                         "max_head_kib": 64, "max_body_mib": 1})
    limits = Limits.of(cfg)
    assert (limits.head_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s) == (0.5, 5, 2)
    assert (limits.max_head_bytes, limits.gateway_max_body, limits.admin_max_body) == (64 * 1024, 2**20, 2**20)
    assert Limits.of(config.load(env={}, overrides={})) == Limits()  # the defaults are today's bounds
    async with run_app(tmp_path, head_timeout_s=0.5, max_body_mib=1) as server:
        port = int(server.url.rpartition(":")[2].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert 0.4 <= time.monotonic() - t0 < 3
        finally:
            writer.close()
        body = b'{"model": "x", "pad": "' + b"x" * (2**20) + b'"}'
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /dgxmm/ondemand/1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer " + server.key.encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 413 "), head
            assert b"larger than 1 MiB" in await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        async with aiohttp.ClientSession() as http:  # the admin side keeps the same bound, and says it
            async with http.post(f"{server.url}/api/deployments", data=body, headers={
                    "Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}) as r:
                assert r.status == 413 and "larger than 1 MiB" in (await r.json())["error"]["message"]
