"""What an engine holds, as measured (ondemand/engines/memory.py): nvidia-smi's per-process rows
matched to its processes (``apps_gib``: a ready engine's footprint, a sleeper's residue), else,
for a sleeper none of whose processes is listed, what it held less what its sleep call freed on
its GPUs (``residue_after_drop``). Pure arithmetic, asked directly; the budget that reads
nvidia-smi is tests/control/test_budget.py's, the deployer that measures a sleeper with these,
tests/e2e/test_tiered_warmth.py's."""
from __future__ import annotations

import pytest

from ondemand.engines.memory import apps_gib, residue_after_drop

# nvidia-smi's compute apps as the budget reads them: (pid, GPU uuid, GiB).
APPS = [(100, "GPU-0", 30.0), (101, "GPU-1", 30.0), (200, "GPU-0", 12.5), (300, "GPU-1", 0.0)]


def test_an_engines_holding_is_the_sum_of_its_own_processes_rows_and_none_when_none_is_listed():
    """Its processes' rows on every GPU together, nobody else's; None (nothing measured, not 0,
    which would claim the engine uses nothing) when none of its processes is listed, and 0 when
    one is listed with nothing."""
    assert apps_gib(APPS, [100, 101]) == 60.0  # a tensor-parallel engine: a process per GPU
    assert apps_gib(APPS, [200, 999]) == 12.5  # a process nvidia-smi does not list adds nothing
    assert apps_gib(APPS, [300]) == 0.0  # listed, holding nothing: measured as 0
    assert apps_gib(APPS, [999]) is None and apps_gib([], [100]) is None and apps_gib(APPS, []) is None


def test_a_sleepers_residue_is_its_share_per_gpu_less_the_drop_its_sleep_call_made_there():
    """What it held, split evenly over its GPUs, less on each of them the drop of used memory
    across its sleep call; a drop larger than its share (someone else freed memory too) leaves
    nothing, never less; a GPU whose use grew (someone else took memory) freed nothing of its."""
    # 30 on GPU 1: its sleep freed 28 there, so it keeps 2; GPU 0 is not its own.
    assert residue_after_drop(30, [1], (5.0, 40.0), (1.0, 12.0)) == pytest.approx(2)
    # 20 on each of two GPUs: 25 dropped on one (more than its share: 0 left), 5 on the other (15).
    assert residue_after_drop(40, [0, 1], (50.0, 50.0), (25.0, 45.0)) == pytest.approx(15)
    # Used grew on its GPU across the call (another engine loaded meanwhile): all of its share is left.
    assert residue_after_drop(16, [0], (20.0,), (35.0,)) == pytest.approx(16)


@pytest.mark.parametrize("gpus, before, after", [
    ([], (10.0,), (1.0,)),  # no GPU of its own: nothing to measure it on
    ([1], (10.0,), (1.0,)),  # its GPU read in neither reading
    ([0, 1], (10.0, 10.0), (1.0,)),  # its second GPU missing from the reading after the call
    ([-1], (10.0,), (1.0,)),  # not a GPU index: no wrap-around to the last GPU
])
def test_a_sleepers_residue_is_unknown_when_the_readings_do_not_cover_its_gpus(gpus, before, after):
    assert residue_after_drop(8, gpus, before, after) is None


def test_the_residue_after_the_drop_across_the_sleep_call():
    # Held 40 on GPU 0 (booked); the sleep freed 37 there: it keeps 3. Another GPU's change is not its own.
    assert residue_after_drop(40, [0], (50.0, 10.0), (13.0, 30.0)) == pytest.approx(3)
    # Two GPUs, 20 each: one freed 18, the other all (and more, someone else's too): 2 + 0.
    assert residue_after_drop(40, [0, 1], (30.0, 30.0), (12.0, 5.0)) == pytest.approx(2)
    assert residue_after_drop(40, [2], (30.0,), (1.0,)) is None  # no reading of its GPU
