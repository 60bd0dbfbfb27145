"""The memory budget: its three sources, one pool per GPU, and the fit check made
from a reading (BEHAVIOUR.md, "Deployer and memory budget", "GPU placement")."""
import pytest

from ondemand.control.budget import Budget, Gpu, Reading
from ondemand.errors import BudgetError, InsufficientMemory
from ondemand.model import Deployment, Mode, Role, State


def dep(i: int, gib: float, state: State, mode: Mode = Mode.ON_DEMAND, role: Role = Role.MODEL,
        **kw) -> Deployment:
    return Deployment(id=i, name=f"d{i}", served_name=f"D{i}", memory_gib=gib, state=state, mode=mode, role=role,
                      **kw)


def gpus(*used: float, total: float = 80.0) -> Reading:
    """A reading of len(used) GPUs of ``total`` GiB each."""
    return Reading(tuple(Gpu(i, f"GPU-{i}", total, u) for i, u in enumerate(used)))


async def test_static_counts_what_holders_declared():
    b = Budget("static", 24)
    deps = [dep(1, 10, State.READY), dep(2, 4, State.STARTING), dep(3, 6, State.STOPPED),
            dep(4, 3, State.ASLEEP, Mode.ALWAYS_ON).replace(asleep_gib=1), dep(5, 1, State.STOPPING, role=Role.SYSTEM)]
    snap = await b.snapshot(deps)
    assert (snap.capacity, snap.used, snap.free) == (24, 16, 8)  # asleep, 4 holds what it kept: 1 of 3
    assert snap.ondemand_capacity == 20  # always-on and system holdings are out of on-demand reach (all 3 of 4's)
    assert (await b.snapshot(deps, exclude=1)).free == 18  # waking 1: its own holding does not count


async def test_nvidia_smi_measures_each_gpu_and_says_why_it_fails(fake_nvidia_smi, monkeypatch):
    b = Budget("nvidia-smi", nvidia_smi=fake_nvidia_smi("81920, 1024", "81920, 0"))
    measured = await b.measure()
    assert [(g.index, g.total, g.used) for g in measured] == [(0, 80.0, 1.0), (1, 80.0, 0.0)]
    assert measured[0].uuid.startswith("GPU-") and measured[0].uuid != measured[1].uuid
    snap = await b.snapshot([])
    assert [p.free for p in snap.pools] == [79.0, 80.0] and snap.per_gpu
    b.capacity_gib = 100  # caps the measured capacity of the box, split over its GPUs
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


async def test_a_cancelled_nvidia_smi_read_kills_and_reaps_its_child(tmp_path):
    """A read cancelled while nvidia-smi runs (a shutdown, a caller's deadline) leaves no child
    running: it is killed and reaped before the cancellation goes on."""
    import asyncio
    import os
    pid_file = tmp_path / "pid"
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 30\n")
    tool.chmod(0o755)
    read = asyncio.ensure_future(Budget("nvidia-smi", nvidia_smi=str(tool)).measure())
    for _ in range(500):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        await asyncio.sleep(0.01)
    pid = int(pid_file.read_text())
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    with pytest.raises(ProcessLookupError):  # gone, and reaped (a zombie would still take signal 0)
        os.kill(pid, 0)


async def test_meminfo_reads_available_memory(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       131072000 kB\nMemFree:  1 kB\nMemAvailable:   65536000 kB\n")
    (pool,) = await Budget("meminfo", meminfo_path=str(f)).measure()
    total, used = pool.total, pool.used
    assert total == pytest.approx(125, abs=0.01) and used == pytest.approx(62.5, abs=0.01)
    f.write_text("MemTotal: 1 kB\n")
    with pytest.raises(BudgetError, match="MemAvailable"):
        await Budget("meminfo", meminfo_path=str(f)).measure()


def test_a_reading_that_aged_is_never_optimistic():
    """An engine starting at the reading (its memory not yet allocated, so not measured)
    that is ready by the check still counts by what it declared; so does one that started
    after the reading."""
    b = Budget("nvidia-smi")
    reading = Reading((Gpu(0, "GPU-0", 24, 2),), starting=frozenset({1}))
    now = [dep(1, 10, State.READY), dep(2, 4, State.STARTING), dep(3, 6, State.STOPPED)]
    snap = b.snapshot_of(reading, now)
    assert (snap.used, snap.starting, snap.free) == (2, 14, 8)  # measured, and what starts will take
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(dep(3, 9, State.STOPPED), now, reading)
    assert (exc.value.need, exc.value.free) == (9, 8)
    assert b.check_fit(dep(3, 8, State.STOPPED), now, reading) == (0,)


def test_memory_held_for_the_queue_head_is_not_free_for_others():
    b = Budget("static", 24)
    deps = [dep(1, 10, State.READY), dep(2, 6, State.STOPPED)]
    reading = Reading(None)
    assert b.check_fit(deps[1], deps, reading) == ()  # one pool, every GPU: none named
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(deps[1], deps, reading, held_for_others={0: 10})
    assert exc.value.free == 4 and exc.value.capacity == 24


# --- one pool per GPU: an 8 x 80 GiB box -------------------------------------------------


def test_two_60_gib_single_gpu_models_land_on_different_gpus():
    b = Budget("nvidia-smi")
    a = dep(1, 60, State.STOPPED, gpu_count=1)
    first = b.check_fit(a, [a], gpus(*[0] * 8))
    assert first == (0,)
    started = a.replace(state=State.STARTING, gpus=first)
    other = dep(2, 60, State.STOPPED, gpu_count=1)
    assert b.check_fit(other, [started, other], gpus(*[0] * 8)) == (1,)  # GPU 0 has only 20 GiB left


def test_a_two_gpu_model_gets_two_gpus_that_each_have_half_free():
    b = Budget("nvidia-smi")
    d = dep(1, 100, State.STOPPED, gpu_count=2)
    # 70, 40, 55 and 60 free: 50 each is needed; GPUs 2 and 3 leave the least over.
    assert b.check_fit(d, [d], gpus(10, 40, 25, 20)) == (2, 3)
    with pytest.raises(InsufficientMemory):
        b.check_fit(d, [d], gpus(10, 40, 35, 35))  # only GPU 0 has 50 free


def test_best_fit_beside_a_foreign_process():
    """Memory used by a process that is not ours counts as used; of the GPUs that fit,
    the one left with the least free memory wins, so whole GPUs stay whole."""
    b = Budget("nvidia-smi")
    d = dep(1, 30, State.STOPPED, gpu_count=1)
    assert b.check_fit(d, [d], gpus(0, 45, 0, 0)) == (1,)  # 35 free beside the foreign 45 GiB
    assert b.check_fit(d, [d], gpus(0, 55, 0, 0)) == (0,)  # 25 free: too little; ties go low


def test_a_gpu_ids_pin_is_kept_even_when_another_gpu_fits_better():
    b = Budget("nvidia-smi")
    d = dep(1, 20, State.STOPPED, gpu_count=1, gpu_ids=(5,))
    assert b.check_fit(d, [d], gpus(*[0] * 8)) == (5,)
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(d, [d], gpus(0, 0, 0, 0, 0, 70, 0, 0))
    assert exc.value.fit.allowed == (5,) and not exc.value.fit.never_fits()


def test_does_not_fit_on_any_allowed_set():
    b = Budget("nvidia-smi")
    reading = gpus(*[0] * 8)
    for d in (dep(1, 90, State.STOPPED, gpu_count=1),  # no single GPU has 90
              dep(2, 200, State.STOPPED, gpu_count=2),  # 100 each
              dep(3, 10, State.STOPPED, gpu_count=9),  # more GPUs than the box has
              dep(4, 10, State.STOPPED, gpu_count=1, gpu_ids=(8,))):  # no GPU 8
        with pytest.raises(InsufficientMemory) as exc:
            b.check_fit(d, [d], reading)
        assert exc.value.fit.never_fits(), d
    # Always-on holdings are out of reach; on-demand ones could be freed.
    always = dep(5, 60, State.READY, Mode.ALWAYS_ON, gpu_count=1, gpus=(0,))
    on_demand = dep(6, 60, State.READY, gpu_count=1, gpus=(1,))
    want = dep(7, 40, State.STOPPED, gpu_count=2, gpu_ids=(0, 1))
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(want, [always, on_demand, want], gpus(60, 70))  # 20 and 10 free
    assert exc.value.fit.ondemand == (20.0, 80.0) and not exc.value.fit.never_fits()
    want = want.replace(memory_gib=50)
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(want, [always, on_demand, want], gpus(60, 70))
    assert exc.value.fit.never_fits()  # 25 on GPU 0 can never be had


def test_never_fits_asks_ahead_what_a_refused_start_concludes():
    """Budget.never_fits (doctor's question, before any request) gives the Fit a refused start
    gives, for the same deployments: never fits, or None where stopping on-demand models would do."""
    b = Budget("nvidia-smi")
    reading = gpus(60, 70)
    always = dep(5, 60, State.READY, Mode.ALWAYS_ON, gpu_count=1, gpus=(0,))
    on_demand = dep(6, 60, State.READY, gpu_count=1, gpus=(1,))
    for gib, never in ((40, False), (50, True)):
        want = dep(7, gib, State.STOPPED, gpu_count=2, gpu_ids=(0, 1))
        deps = [always, on_demand, want]
        with pytest.raises(InsufficientMemory) as exc:
            b.check_fit(want, deps, reading)
        assert exc.value.fit.never_fits() is never
        fit = b.never_fits(want, deps, reading)
        assert (fit is not None) is never and (fit is None or fit.ondemand == exc.value.fit.ondemand)
    assert b.never_fits(always, [always, on_demand], reading) is None  # its own holding is its own


def test_gpu_count_zero_needs_no_gpu_memory_and_every_gpu_is_the_default():
    b = Budget("nvidia-smi")
    full = gpus(80, 80)
    cpu = dep(1, 10, State.STOPPED, gpu_count=0)
    assert b.check_fit(cpu, [cpu], full) == ()
    every = dep(2, 100, State.STOPPED)  # gpu_count NULL: every GPU, memory split evenly
    assert b.check_fit(every, [every], gpus(20, 20)) == (0, 1)
    with pytest.raises(InsufficientMemory):
        b.check_fit(every, [every], gpus(20, 31))
    held = every.replace(state=State.READY, gpus=(0, 1))
    one_pool = Budget("static", 200)
    assert [p.used for p in one_pool.snapshot_of(Reading(None), [held]).pools] == [100]
    static = Budget("static", gpu_capacity_gib=(80, 80))
    assert [p.used for p in static.snapshot_of(Reading(None), [held]).pools] == [50, 50]


def test_the_reserve_is_kept_free_on_every_gpu():
    b = Budget("static", gpu_capacity_gib=(80, 40), reserve_gib=5)
    assert [p.capacity for p in b.snapshot_of(Reading(None), []).pools] == [75, 35]
    d = dep(1, 76, State.STOPPED, gpu_count=1)
    with pytest.raises(InsufficientMemory):
        b.check_fit(d, [d], Reading(None))
    measured = Budget("nvidia-smi", reserve_gib=5)
    assert [p.free for p in measured.snapshot_of(gpus(10, 0), []).pools] == [65, 75]


def test_a_measured_footprint_larger_than_declared_is_what_the_next_fit_check_counts():
    b = Budget("static", gpu_capacity_gib=(80,))
    d = dep(1, 20, State.STOPPED, gpu_count=1, measured_gib=50)
    other = dep(2, 40, State.READY, gpu_count=1, gpus=(0,))
    with pytest.raises(InsufficientMemory) as exc:
        b.check_fit(d, [d, other], Reading(None))
    assert exc.value.need == 50
    running = d.replace(state=State.READY, gpus=(0,))
    assert b.snapshot_of(Reading(None), [running]).pools[0].used == 50


def test_holds_for_the_head_are_per_gpu():
    b = Budget("nvidia-smi")
    d = dep(1, 60, State.STOPPED, gpu_count=1)
    assert b.check_fit(d, [d], gpus(0, 0), held_for_others={0: 30}) == (1,)
    with pytest.raises(InsufficientMemory):
        b.check_fit(d, [d], gpus(0, 0), held_for_others={0: 30, 1: 30})


def test_waking_keeps_the_gpus_it_holds():
    b = Budget("nvidia-smi")
    asleep = dep(1, 30, State.ASLEEP, gpu_count=1, gpus=(3,))
    assert b.check_fit(asleep, [asleep], gpus(0, 0, 0, 20)) == (3,)


def test_a_sleep_whose_call_is_out_holds_all_its_memory_for_others_and_none_against_its_own_wake():
    """Marked asleep, its call still out (``rules.as_read`` counts it whole): on a static budget
    another start does not fit in its 60 GiB, on a measured one its own wake fits in what the
    GPU still shows it using (its own), as a sleeper's residue does once the call has ended."""
    from ondemand.engines.rules import as_read
    asleep = dep(1, 60, State.ASLEEP, gpu_count=1, gpus=(0,), sleep_level=1)
    other = dep(2, 40, State.STOPPED, gpu_count=1)
    mid_call = as_read([asleep, other], lambda dep_id: dep_id == 1)
    assert [d.state for d in mid_call] == [State.READY, State.STOPPED]
    static = Budget("static", gpu_capacity_gib=[80], asleep_residue_gib=2)
    with pytest.raises(InsufficientMemory):
        static.check_fit(other, mid_call, Reading(None))
    assert static.check_fit(other, as_read([asleep, other], lambda dep_id: False), Reading(None)) == (0,)
    assert static.check_fit(asleep, mid_call, Reading(None)) == (0,)
    measured = Budget("nvidia-smi")
    assert measured.check_fit(asleep, mid_call, gpus(60)) == (0,)  # the GPU still shows its 60 GiB
    with pytest.raises(InsufficientMemory):
        measured.check_fit(other, mid_call, gpus(60))


def test_each_gpu_shows_who_holds_it():
    b = Budget("static", gpu_capacity_gib=(80, 80))
    deps = [dep(1, 60, State.READY, gpu_count=1, gpus=(1,)), dep(2, 40, State.STARTING, gpu_count=2, gpus=(0, 1))]
    pools = b.snapshot_of(Reading(None), deps).pools
    assert [p.holders for p in pools] == [("d2",), ("d1", "d2")]
    assert [p.free for p in pools] == [60, 0]


def test_a_deployment_on_several_gpus_is_placed_on_gpus_of_one_size():
    b = Budget("static", gpu_capacity_gib=[80, 40, 80, 48])
    two = Deployment(id=1, name="tp2", served_name="tp2", memory_gib=60, gpu_count=2, state=State.STOPPED)
    assert b.check_fit(two, [two], Reading(None)) == (0, 2)  # best fit alone would take the 40 and the 48
    measured = Budget("nvidia-smi")
    gpus = (Gpu(0, "a", 79.6, 0), Gpu(1, "b", 39.5, 0), Gpu(2, "c", 79.6, 70))
    with pytest.raises(InsufficientMemory) as err:
        measured.check_fit(two, [two], Reading(gpus))  # 0 and 1 have room, but not of one size
    assert err.value.fit.sizes == (79.6, 39.5, 79.6) and err.value.fit.never_fits() is False


async def test_every_reading_is_new_and_names_what_was_starting(fake_nvidia_smi):
    """Budget.read measures at every call (issue 40: a reading kept for 0.2 s hid a process that
    took a GPU just before a request); a reading names the engines starting when it was taken."""
    b = Budget("nvidia-smi", nvidia_smi=fake_nvidia_smi("81920, 1024"))
    first = await b.read([dep(1, 10, State.STARTING)])
    assert first.starting == frozenset({1}) and first.gpus[0].used == 1.0
    fake_nvidia_smi("81920, 40960")  # 40 GiB used now, at once
    again = await b.read([])
    assert again is not first and again.gpus[0].used == 40.0 and again.starting == frozenset()


# --- issue 29: what a sleeper holds, the static share's divisor, more GPUs than the box has ---


def test_a_sleeper_nothing_was_read_of_holds_the_static_default_residue_per_gpu():
    b = Budget("static", gpu_capacity_gib=[80, 80], asleep_residue_gib=2)
    one = dep(1, 40, State.ASLEEP, gpu_count=1, gpus=(0,))
    two = dep(2, 40, State.ASLEEP, gpu_count=2, gpus=(0, 1))
    snap = b.snapshot_of(Reading(None), [one, two])
    assert [p.used for p in snap.pools] == [4.0, 2.0]  # 2 per GPU each: one on GPU 0, two on both
    assert b.asleep_held(one) == 2 and b.asleep_held(two) == 4
    assert b.asleep_held(two.replace(asleep_gib=0.5)) == 0.5  # as found after its sleep, when it was
    assert b.asleep_held(dep(3, 1, State.ASLEEP, gpu_count=1, gpus=(1,))) == 1  # at most its footprint
    assert Budget("static", 24, asleep_residue_gib=3).asleep_held(dep(4, 10, State.ASLEEP, gpu_count=1)) == 3


async def test_a_static_per_gpu_share_is_of_the_physical_total_when_nvidia_smi_reads_it(fake_nvidia_smi):
    declared = Budget("static", gpu_capacity_gib=[70, 70], nvidia_smi="/nonexistent/nvidia-smi")
    assert await declared.box_sizes() == (70, 70)  # nothing readable: the declared size
    b = Budget("static", gpu_capacity_gib=[70, 70], nvidia_smi=fake_nvidia_smi("81920, 0", "81920, 0"))
    assert await b.box_sizes() == (80.0, 80.0)
    assert [p.capacity for p in b.snapshot_of(await b.read([]), []).pools] == [70, 70]  # what it may use stands
    from ondemand.engines.recipes import share
    assert share(40, 1, b.sizes()[0]) == 0.5  # 40 of the physical 80, not of the declared 70


def test_a_start_that_needs_more_gpus_than_the_box_has_says_both_numbers():
    b = Budget("nvidia-smi")
    big = dep(1, 40, State.STOPPED, gpu_count=4)
    with pytest.raises(InsufficientMemory, match=r"needs 4 GPUs \(gpu_count\), but this box has 2") as exc:
        b.check_fit(big, [big], gpus(0, 0))
    assert exc.value.fit.never_fits()


def test_the_fit_check_keeps_an_asleep_deployments_room_to_wake():
    """Issue 43: a sleeper on GPU 0 (40 GiB booked, its 2 GiB residue kept there) could wake
    alone; a 50 GiB newcomer goes to GPU 1, where best fit alone would have packed it onto GPU 0
    (28 GiB left there: too little for the sleeper's 38)."""
    b = Budget("static", gpu_capacity_gib=[80, 80], asleep_residue_gib=2)
    sleeper = dep(1, 40, State.ASLEEP, gpu_count=1, gpus=(0,), sleep_level=1)
    new = dep(2, 50, State.STOPPED, gpu_count=1)
    assert [(s.id, dict(s.needs)) for s in b.sleepers([sleeper, new], 2)] == [(1, {0: 38.0})]
    assert b.check_fit(new, [sleeper, new], Reading(None)) == (1,)
    other = dep(3, 79, State.READY, gpu_count=1, gpus=(1,))  # GPU 1 taken: GPU 0 it must be
    assert b.check_fit(new, [sleeper, new, other], Reading(None)) == (0,)
