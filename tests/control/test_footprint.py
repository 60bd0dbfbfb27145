"""Measured footprints (ondemand/control/footprint.py): what the processes of each ready engine hold
on the GPUs, as nvidia-smi's compute apps list them, recorded with the deployer; only the nvidia-smi
budget measures, a reading that fails measures nothing, and an engine none of whose processes is
listed is not measured (never 0); a ready engine is measured at once, not at the next period, and a
measurement that fails never ends the loop. Against fakes of the deployer and the budget. What the
deployer keeps of it: tests/engines/test_registry.py; end to end: tests/e2e/test_gpu_placement.py."""
from __future__ import annotations

import asyncio
import contextlib

from helpers import wait_for

from ondemand.control.footprint import FootprintSampler
from ondemand.errors import BudgetError
from ondemand.model import State


class Budget:
    def __init__(self, apps=(), *, source: str = "nvidia-smi", error: Exception | None = None) -> None:
        self.source = source
        self.apps = list(apps)  # (pid, GPU uuid, GiB), as nvidia-smi --query-compute-apps
        self.error = error
        self.reads = 0

    async def compute_apps(self) -> list[tuple[int, str, float]]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.apps


class Backend:
    def __init__(self, pids: dict[int, list[int]]) -> None:
        self.of = pids  # an engine (here its deployment's id) → the host pids of its tree
        self.asked = 0
        self.fail_first = False

    async def pids(self, engine: int) -> list[int]:
        self.asked += 1
        if self.fail_first and self.asked == 1:
            raise RuntimeError("the backend failed")
        return self.of[engine]


class Deployer:
    def __init__(self, ready: list[int], pids: dict[int, list[int]]) -> None:
        self.ready = ready
        self.backend = Backend(pids)
        self.recorded: list[tuple[int, float]] = []

    def engines_in(self, states: tuple[State, ...]) -> list[tuple[int, str]]:
        assert states == (State.READY,)
        return [(dep_id, f"http://127.0.0.1:{8000 + dep_id}") for dep_id in self.ready]

    def engine(self, dep_id: int) -> int | None:
        return dep_id if dep_id in self.backend.of else None  # None: its engine went meanwhile

    async def record_footprint(self, dep_id: int, gib: float) -> None:
        self.recorded.append((dep_id, gib))


APPS = [(10, "GPU-a", 6.0), (11, "GPU-b", 6.5), (99, "GPU-a", 30.0)]  # 99: a process not ours


async def test_a_sample_records_what_each_ready_engines_processes_hold():
    """1's two processes hold 12.5 GiB on two GPUs; none of 2's is listed (not measured, not 0);
    3's engine is gone."""
    d = Deployer(ready=[1, 2, 3], pids={1: [10, 11], 2: [20]})
    assert await FootprintSampler(d, Budget(APPS)).sample() == {1: 12.5}
    assert d.recorded == [(1, 12.5)]


async def test_only_the_nvidia_smi_budget_measures_and_a_failed_reading_measures_nothing():
    for budget in (Budget(APPS, source="static"), Budget(APPS, error=BudgetError("nvidia-smi timed out"))):
        d = Deployer(ready=[1], pids={1: [10, 11]})
        assert await FootprintSampler(d, budget).sample() == {} and d.recorded == []
    idle = Budget(APPS)
    assert await FootprintSampler(Deployer(ready=[], pids={}), idle).sample() == {} and idle.reads == 0


async def test_a_ready_engine_is_measured_at_once_and_a_failed_measurement_ends_no_loop():
    d = Deployer(ready=[1], pids={1: [10, 11]})
    d.backend.fail_first = True
    sampler = FootprintSampler(d, Budget(APPS), interval_s=3600.0)  # the next period: an hour away
    task = asyncio.ensure_future(sampler.run())
    try:
        sampler.engine_ready()
        await wait_for(lambda: d.backend.asked == 1, timeout=5, what="the first measurement")
        assert d.recorded == []  # it failed
        sampler.engine_ready()
        await wait_for(lambda: d.recorded, timeout=5, what="the second measurement")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert d.recorded == [(1, 12.5)]
