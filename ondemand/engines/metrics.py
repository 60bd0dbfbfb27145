"""The engine-metrics sampler: is an engine really idle?

Every ``metrics_interval_s`` each ready engine's ``/metrics`` is read.
vLLM's ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` and
llama.cpp's ``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``
give a sample (running, waiting, taken at). The controller asks
``idle(id)``: a sample under 60 s old with nothing running or waiting. A
request that reached the engine some other way (an always-on client, a
direct curl) therefore keeps an on-demand model from being stopped.

It reads through the engine client (``client.py``), on the pools the gateway forwards on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from ..http.pool import Upstreams
from ..model import Deployment, Mode
from .client import CallFailed, EngineClient

log = logging.getLogger("ondemand.engines.metrics")

_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
    "sglang:num_running_reqs": "running",  # SGLang, with --enable-metrics (its recipe adds it)
    "sglang:num_queue_reqs": "waiting",
}


@dataclasses.dataclass(frozen=True)
class Sample:
    running: float
    waiting: float
    at: float  # monotonic clock


def parse(text: str) -> tuple[float, float] | None:
    """(running, waiting) summed over label sets, or None when neither gauge is there."""
    totals = {"running": 0.0, "waiting": 0.0}
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        kind = _GAUGES.get(line[:name_end])
        if kind is None:
            continue
        try:
            totals[kind] += float(line.rsplit(None, 1)[-1]) if "}" not in line else \
                float(line.rsplit("}", 1)[1].split()[0])
            seen = True
        except (ValueError, IndexError):
            continue
    return (totals["running"], totals["waiting"]) if seen else None


BLIND_WARNING = ("llama.cpp without --metrics has no request gauges: unless it turns them on another way "
                 "(LLAMA_ARG_ENDPOINT_METRICS), it is never seen idle, so it is never put to sleep; add --metrics")


def blind(dep: Deployment) -> bool:
    """An on-demand llama.cpp deployment started without ``--metrics``: the sampler
    cannot read its load, and the idle rule needs it (BEHAVIOUR.md, "The reaper and idle timers")."""
    return (dep.engine == "llamacpp" and dep.mode is Mode.ON_DEMAND and dep.pending_mode is None
            and dep.model is None  # the llama.cpp recipe adds --metrics
            and "--metrics" not in (*dep.command, *dep.args))


# How long one reading of an engine's /metrics may take.
READ_TIMEOUT_S = 5.0


class MetricsSampler:
    def __init__(self, targets: Callable[[], list[tuple[int, str]]], *, interval_s: float = 10.0,
                 max_age_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 client: EngineClient | None = None):
        """``targets()`` lists (deployment id, engine base URL) of the ready engines. ``client``:
        the deployer's engine client (the app's); without one, its own (closed with it)."""
        self._targets = targets
        self._own_client = client is None
        self.client = client or EngineClient(Upstreams())
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._samples: dict[int, Sample] = {}
        self._warned: set[int] = set()

    def sample(self, dep_id: int) -> Sample | None:
        return self._samples.get(dep_id)

    def idle(self, dep_id: int) -> bool:
        """A sample under ``max_age_s`` old shows nothing running or waiting."""
        s = self._samples.get(dep_id)
        return (s is not None and self._clock() - s.at < self.max_age_s
                and s.running == 0 and s.waiting == 0)

    def forget(self, dep_id: int) -> None:
        self._samples.pop(dep_id, None)

    async def sample_once(self) -> None:
        targets = self._targets()
        live = {dep_id for dep_id, _ in targets}
        for dep_id in list(self._samples):
            if dep_id not in live:
                del self._samples[dep_id]
        await asyncio.gather(*(self._read(dep_id, url) for dep_id, url in targets))

    async def _read(self, dep_id: int, base_url: str) -> None:
        try:
            text = await self.client.metrics(dep_id, base_url, READ_TIMEOUT_S)
        except CallFailed as exc:
            log.debug("metrics of deployment %d unreadable: %s", dep_id, exc)
            return
        parsed = parse(text)
        if parsed is None:
            if dep_id not in self._warned:
                self._warned.add(dep_id)
                # Without a sample the deployment is never idle: never reaped, never a victim.
                log.warning("deployment %d: its engine's /metrics has no request gauges (vllm:num_requests_* or "
                            "llamacpp:requests_*; llama-server needs --metrics): it will never be put to sleep",
                            dep_id)
            return
        self._samples[dep_id] = Sample(parsed[0], parsed[1], self._clock())

    async def run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:
                log.exception("metrics sampling failed")
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._own_client:
            await self.client.upstreams.close()

    def as_dict(self, dep_id: int) -> dict[str, Any] | None:
        s = self._samples.get(dep_id)
        if s is None:
            return None
        return {"running": s.running, "waiting": s.waiting, "age_s": round(self._clock() - s.at, 1)}
