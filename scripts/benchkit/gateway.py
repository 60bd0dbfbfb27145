"""A gateway of the benchmarks' own: one ``ondemand serve`` (process backend, the engine
simulator) with its state directory, configuration and admin socket; a request through it; and
the tests' fake GPU box for a measured budget."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from .load import chat_body
from .procs import ROOT, Procs, free_port

BASE = "/dgxmm"


async def admin_call(admin: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
    """One admin API call over the admin socket's session; its JSON answer, or RuntimeError."""
    async with admin.request(method, f"http://localhost{BASE}/api{path}", json=body) as r:
        data = await r.json(content_type=None)
        if r.status >= 400:
            raise RuntimeError(f"{method} {path}: {r.status} {data}")
        return data
FAKE_SMI = ROOT / "tests" / "fakes" / "nvidia-smi"


class Gateway:
    """One ``ondemand serve`` with its own state directory and configuration."""

    def __init__(self, procs: Procs, tmp: Path, name: str, budget: str, env: dict[str, str]):
        self.procs, self.tmp, self.name, self.env = procs, tmp / name, name, env
        self.tmp.mkdir(parents=True)
        self.port = free_port()
        self.state = self.tmp / "state"
        cfg = self.tmp / "ondemand.toml"
        cfg.write_text(f'state_dir = "{self.state}"\nlisten = "127.0.0.1:{self.port}"\n'
                       'ondemand_allowed_cidrs = ["127.0.0.0/8"]\nlog_level = "warning"\n'
                       'min_idle_timeout_s = 1\nreap_interval_s = 3600\nondemand_max_queued = 4096\n'
                       'metrics_interval_s = 0.2\n[deployer]\nbackend = "process"\n' + budget)
        self.cfg = cfg
        self.admin: aiohttp.ClientSession | None = None
        self.key = ""

    async def start(self) -> None:
        init = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ondemand", "--config", str(self.cfg), "key", "init", cwd=ROOT, env=self.env,
            stdout=asyncio.subprocess.DEVNULL)
        if await init.wait():
            raise RuntimeError(f"ondemand key init failed (exit {init.returncode})")
        self.key = (self.state / "ondemand.key").read_text().strip()
        proc = self.procs.spawn(self.name, [sys.executable, "-m", "ondemand", "--config", str(self.cfg), "serve"],
                                self.tmp / "serve.log", self.env)
        sock = self.state / "admin.sock"
        deadline = time.monotonic() + 30
        while not sock.exists() or proc.poll() is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: ondemand serve did not start")
            await asyncio.sleep(0.05)
        self.admin = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)))

    async def api(self, method: str, path: str, body: Any = None) -> Any:
        assert self.admin is not None
        return await admin_call(self.admin, method, path, body)

    async def create(self, name: str, gib: float, *sim: str, **fields: Any) -> int:
        dep = await self.api("POST", "/deployments", {
            "name": name, "served_name": name, "engine": "vllm", "memory_gib": gib, "mode": "on_demand",
            "command": ["ondemand", "sim-engine", "--port", "{port}", "--model", name, *sim], **fields})
        return int(dep["id"])

    def url(self, dep_id: int) -> str:
        return f"http://127.0.0.1:{self.port}{BASE}/ondemand/{dep_id}/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}

    async def close(self) -> None:
        if self.admin is not None:
            await self.admin.close()


async def ask(http: aiohttp.ClientSession, gw: Gateway, dep_id: int, model: str) -> tuple[int, float]:
    """(status, when its answer's head arrived)."""
    async with http.post(gw.url(dep_id), data=chat_body(model, 4, False), headers=gw.headers(),
                         timeout=aiohttp.ClientTimeout(total=120)) as r:
        head = time.time()
        await r.read()
        return r.status, head



def fake_gpu(tmp: Path, mib: int) -> dict[str, str]:
    """One GPU of ``mib`` MiB for the tests' fake nvidia-smi (FAKE_SMI), nothing on it but what the
    engine simulators' ``--gpu-mib`` claim: the environment ondemand (and so its engines) must get."""
    apps = tmp / "gpu-apps"
    apps.mkdir()
    gpus = tmp / "gpus.csv"
    gpus.write_text(f"{mib}, 0\n")
    return {"FAKE_NVIDIA_SMI_FILE": str(gpus), "FAKE_NVIDIA_SMI_APPS": str(apps)}
