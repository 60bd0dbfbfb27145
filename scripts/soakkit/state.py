"""What one soak run holds: its ondemand, its deployments, the clients' answers, the faults made,
what was watched, and the invariants checked (scripts/soak.py; the parts act on it: traffic,
watch, faults, checks, audit, warmth)."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import soaklib
from soaklib import Ondemand, sim_command

from .plan import ENGINE_ARGS, GPU_MIB, NAMES, QUEUE_TIMEOUT_S, SIM_ARGS, Done


@dataclass
class Soak:
    seed: int
    requests: int
    clients: int
    work: Path
    scheduler: str = "seed"  # the box's scheduler key: the invariants hold under each
    od: Ondemand = field(init=False)
    journal: Path = field(init=False)
    ids: list[int] = field(default_factory=list)
    key: str = ""
    keys: list[str] = field(default_factory=list)
    next_i: int = 0
    done: list[Done] = field(default_factory=list)
    views: dict[int, dict[str, Any]] = field(default_factory=dict)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    fault_times: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    start_faults: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    always_on: dict[int, list[list[float]]] = field(default_factory=lambda: collections.defaultdict(list))
    rotations: list[float] = field(default_factory=list)
    down: list[tuple[float, float]] = field(default_factory=list)  # ondemand not there
    left_behind: set[int] = field(default_factory=set)  # engine pids the killed ondemand left
    killed_starting: set[int] = field(default_factory=set)  # engine pids SIGKILLed while starting (or waking)
    killed_asleep: dict[int, tuple[int, float]] = field(default_factory=dict)  # pid: (deployment, when)
    audit_rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # the state file's, once ondemand stopped
    probes: list[tuple[str, Done]] = field(default_factory=list)  # (start | wake, the request)
    beats: list[Done] = field(default_factory=list)  # india's metronome's requests
    queue_samples: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # the views' queue, 0.2 s
    warmth: list[tuple[str, int, str]] = field(default_factory=list)
    broken: dict[int, float] = field(default_factory=dict)
    switched: dict[int, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks: list[tuple[str, str, str]] = field(default_factory=list)
    baseline: dict[str, int] = field(default_factory=dict)
    two_at_once: list[str] = field(default_factory=list)
    old_key_answers: list[str] = field(default_factory=list)
    inflight_peak: collections.Counter[int] = field(default_factory=collections.Counter)  # per deployment
    gpu_peak: int = 0  # MiB the live engines held on the GPU at most (the fake's processes, every 0.2 s)
    overfilled: list[str] = field(default_factory=list)
    state_peak: collections.Counter[str] = field(default_factory=collections.Counter)  # most at once, by state
    up: asyncio.Event = field(default_factory=asyncio.Event)  # clear while ondemand restarts
    gpu_apps: Path = field(init=False)  # the fake nvidia-smi's processes
    elapsed: float = 0.0  # seconds from the first client to the last beat
    rss: tuple[int, int] = (0, 0)  # KiB after the restart, at the end
    boots: int = 0  # engine processes started (the journal)
    engine_requests: int = 0  # requests that reached engines (the journal)

    def __post_init__(self) -> None:
        self.journal = self.work / "journal.jsonl"
        self.gpu_apps = self.work / "gpu-apps"
        box = soaklib.fake_gpu_box(self.work, [GPU_MIB])
        # The reaper looks every 2 s: an idle model is often still there when a queued request
        # looks (just after an idle timeout runs out), so make-room, and its priority rule, runs.
        self.od = Ondemand(self.work, {
            "min_idle_timeout_s": 1, "ondemand_idle_timeout_s": 2, "ondemand_queue_timeout_s": QUEUE_TIMEOUT_S,
            "reap_interval_s": 2, "metrics_interval_s": 0.5, "shutdown_grace_s": 2, "log_level": "info",
            "scheduler": self.scheduler},
            {"budget": {"source": "nvidia-smi", "nvidia_smi": str(soaklib.FAKE_NVIDIA_SMI), "host_reserve_gib": 0,
                        # plenty of host memory: each engine sleeps at its own level whatever is free
                        "meminfo_path": str(soaklib.FAKE_NVIDIA_SMI.parent / "meminfo")},
             "deployer": {"backend": "process", "start_timeout_s": 10, "stop_timeout_s": 3, "wake_timeout_s": 10}},
            env=box)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, "ok" if ok else "FAILED", detail))
        if not ok:
            self.failures.append(f"{name}: {detail}")

    def command(self, dep: int, *extra: str) -> list[str]:
        return sim_command(NAMES[dep].upper(), self.journal, *SIM_ARGS, *ENGINE_ARGS[dep], *extra)

    def mark(self, **fields: Any) -> None:
        """A line of ours in the simulators' journal (an administrator's stop, for the check of stops)."""
        with open(self.journal, "a") as fh:
            fh.write(json.dumps({"ev": "soak", "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
