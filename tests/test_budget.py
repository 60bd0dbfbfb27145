"""The memory budget: its three sources, and the fit check made from a reading
(BEHAVIOUR.md, "Deployer and memory budget")."""
import pytest

from ondemand.budget import Budget, Reading
from ondemand.errors import BudgetError, InsufficientMemory
from ondemand.model import Deployment, Mode, Role, State


def dep(i: int, gib: float, state: State, mode: Mode = Mode.ON_DEMAND, role: Role = Role.MODEL) -> Deployment:
    return Deployment(id=i, name=f"d{i}", served_name=f"D{i}", memory_gib=gib, state=state, mode=mode, role=role)


async def test_static_counts_what_holders_declared():
    b = Budget("static", 24)
    deps = [dep(1, 10, State.READY), dep(2, 4, State.STARTING), dep(3, 6, State.STOPPED),
            dep(4, 3, State.ASLEEP, Mode.ALWAYS_ON), dep(5, 1, State.STOPPING, role=Role.SYSTEM)]
    snap = await b.snapshot(deps)
    assert (snap.capacity, snap.used, snap.free) == (24, 18, 6)
    assert snap.ondemand_capacity == 20  # always-on and system holdings are out of on-demand reach
    assert (await b.snapshot(deps, exclude=1)).free == 16  # waking 1: its own holding does not count


async def test_nvidia_smi_sums_the_gpus_and_says_why_it_fails(fake_nvidia_smi, monkeypatch):
    b = Budget("nvidia-smi", nvidia_smi=fake_nvidia_smi("81920, 1024", "81920, 0"))
    assert await b.measure() == (160.0, 1.0)
    b.capacity_gib = 100  # caps the measured capacity
    assert (await b.snapshot([])).capacity == 100
    fake_nvidia_smi("[N/A], [N/A]")  # DGX Spark: unified memory
    with pytest.raises(BudgetError, match="budget.source = meminfo"):
        await b.measure()
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FAIL", "1")
    with pytest.raises(BudgetError, match="failed"):
        await b.measure()
    with pytest.raises(BudgetError, match="not found"):
        await Budget("nvidia-smi", nvidia_smi="/nonexistent/nvidia-smi").measure()


async def test_an_nvidia_smi_that_cannot_run_is_a_budget_error(tmp_path):
    """Not executable (and the like): the budget is unreadable, which is no failed start."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o644)
    with pytest.raises(BudgetError, match="cannot run"):
        await Budget("nvidia-smi", nvidia_smi=str(tool)).measure()


async def test_meminfo_reads_available_memory(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemFree:  1 kB\nMemAvailable:   65536000 kB\n")
    total, used = await Budget("meminfo", meminfo_path=str(f)).measure()
    assert total == pytest.approx(125, abs=0.01) and used == pytest.approx(62.5, abs=0.01)
    f.write_text("MemTotal: 1 kB\n")
    with pytest.raises(BudgetError, match="MemAvailable"):
        await Budget("meminfo", meminfo_path=str(f)).measure()


def test_a_reading_that_aged_is_never_optimistic():
    """An engine starting at the reading (its memory not yet allocated, so not measured)
    that is ready by the check still counts by what it declared; so does one that started
    after the reading."""
    b = Budget("nvidia-smi")
    reading = Reading(total=24, used=2, starting=frozenset({1}))
    now = [dep(1, 10, State.READY), dep(2, 4, State.STARTING), dep(3, 6, State.STOPPED)]
    snap = b.snapshot_of(reading, now)
    assert snap.used == 16 and snap.free == 8
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(dep(3, 9, State.STOPPED), now, reading)
    assert (exc.value.need, exc.value.free) == (9, 8)
    assert b.check_fit(dep(3, 8, State.STOPPED), now, reading).free == 8


def test_memory_held_for_the_queue_head_is_not_free_for_others():
    b = Budget("static", 24)
    deps = [dep(1, 10, State.READY), dep(2, 6, State.STOPPED)]
    reading = Reading(None, None)
    assert b.check_fit(deps[1], deps, reading).free == 14
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(deps[1], deps, reading, held_for_others=10)
    assert exc.value.free == 4 and exc.value.capacity == 24
