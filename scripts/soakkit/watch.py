"""What the soak watches while it runs: the views every 0.2 s (the hang-up stages, the faults'
targets, the queue, the peaks), what the engines hold on the fake GPU, and whether two engines of
one deployment ever run at once."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import soaklib
from soaklib import sim_processes

from .plan import GPU_MIB
from .state import Soak


async def poll(soak: Soak) -> None:
    """The views every 0.2 s (for the hang-up stages and the faults' targets), what the
    engines hold on the GPU (the fake nvidia-smi's processes) as often, and every second
    whether two engines of one deployment ever run at once."""
    n = 0
    while True:
        with contextlib.suppress(Exception):
            status, views = await soak.od.api("GET", "/deployments")
            if status == 200:
                soak.views = {v["id"]: v for v in views}
                soak.queue_samples.append((time.time(), frozenset(
                    v["id"] for v in views if v["ondemand"].get("queue_position"))))
                for d, i in enumerate(soak.ids):
                    if i in soak.views:
                        soak.inflight_peak[d] = max(soak.inflight_peak[d], soak.views[i]["ondemand"]["inflight"])
                for state, count in collections.Counter(v["state"] for v in views).items():
                    soak.state_peak[state] = max(soak.state_peak[state], count)
        look_at_gpus(soak)
        n += 1
        if n % 5 == 0:
            per_model = collections.Counter(p["model"] for p in sim_processes(soak.journal).values())
            soak.two_at_once += [f"{m} x{c} at {time.time():.1f}" for m, c in per_model.items() if c > 1]
        await asyncio.sleep(0.2)


def look_at_gpus(soak: Soak) -> None:
    """The GPU is never overfilled: what the live engines hold (as the fake nvidia-smi
    counts it) never exceeds its memory."""
    for gpu, held in soaklib.gpu_claims(soak.gpu_apps).items():
        used = sum(held.values())
        soak.gpu_peak = max(soak.gpu_peak, used)
        if used > GPU_MIB:
            models = {p: info["model"] for p, info in sim_processes(soak.journal).items()}
            soak.overfilled.append(f"GPU {gpu}: {used} MiB at {time.time():.1f} ("
                                   + ", ".join(f"{models.get(p, p)} {m}" for p, m in sorted(held.items())) + ")")
