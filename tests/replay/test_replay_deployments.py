"""The replay's deployments (ondemand/replay/deployments.py): a TOML file checked field by field
with its line, the state file read only (its bytes unchanged, no side file made) with the costs
of its recorded starts and wakes, and the box from the configuration or --gpus."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import sqlite3

import pytest

from ondemand import config as config_mod
from ondemand.model import IdleAction, KeepWarm, Mode, Priority, State
from ondemand.replay.deployments import DeploymentError, box_of, check_fits, from_file, from_state, parse_gpus
from ondemand.replay.types import Box, Costs
from ondemand.state.store import Store

BOX = Box(gpus=(80.0,) * 4, host_gib=512)

GOOD = """\
# a comment
[[deployment]]
name = "small"
memory_gib = 8
weight = 5
cold_start_s = 37.6
wake_s = 0.26

[[deployment]]
name = "giant"
served_name = "Org/Giant"
engine = "sglang"
model = "org/giant-fp8"
memory_gib = 240
gpu_count = 4
mode = "always_on"
idle_timeout_s = 300
idle_action = "sleep2"
priority = "high"
max_inflight = 8
keep_warm = "fixed"
decode_tokens_per_s = 30
max_concurrency = 4
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "deps.toml"
    path.write_text(text)
    return str(path)


def test_a_file_gives_fields_costs_and_weights_with_defaults(tmp_path):
    small, giant = from_file(write(tmp_path, GOOD), BOX)
    d = small.deployment
    assert (d.id, d.name, d.served_name, d.engine, d.model, d.memory_gib, d.gpu_count, d.mode, d.state) == (
        1, "small", "small", "vllm", "small", 8.0, 1, Mode.ON_DEMAND, State.STOPPED)
    assert small.costs == Costs(cold_start_s=37.6, wake_s=0.26) and small.weight == 5
    g = giant.deployment
    assert (g.id, g.served_name, g.engine, g.model, g.gpu_count, g.mode, g.idle_timeout_s, g.idle_action,
            g.priority, g.max_inflight) == (2, "Org/Giant", "sglang", "org/giant-fp8", 4, Mode.ALWAYS_ON, 300,
                                            IdleAction.SLEEP2, Priority.HIGH, 8)
    assert giant.costs == Costs(decode_tokens_per_s=30, max_concurrency=4) and giant.weight == 1


def test_keep_warm_adaptive_is_read(tmp_path):
    _, giant = from_file(write(tmp_path, GOOD.replace('keep_warm = "fixed"', 'keep_warm = "adaptive"')), BOX)
    assert giant.deployment.keep_warm is KeepWarm.ADAPTIVE and giant.gaps == ()  # a file holds no learned gaps


@pytest.mark.parametrize("change,line,says", [
    (('memory_gib = 240', 'memory_gib = "lots"'), 14, "deployment 'giant': memory_gib: 'lots' is not a finite number"),
    (('gpu_count = 4', 'gpu_count = 5'), 15, "gpu_count: 5 is not a whole number from 0 to 4"),
    (('idle_timeout_s = 300', 'idle_timeout_s = 30'), 17, "idle_timeout_s: 30 is not a whole number from 60"),
    (('mode = "always_on"', 'mode = "sometimes"'), 16, "mode: 'sometimes' is not one of on_demand, always_on"),
    (('keep_warm = "fixed"', 'keep_warm = "warm"'), 21, "keep_warm: 'warm' is not one of fixed, adaptive"),
    (('max_concurrency = 4', 'max_concurrency = 0'), 23, "max_concurrency: 0 is not a whole number from 1"),
    (('weight = 5', 'weight = -1'), 5, "deployment 'small': weight: -1 is not a finite number of at least 0"),
    (('wake_s = 0.26', 'wake_s = inf'), 7, "deployment 'small': wake_s: inf is not a finite number of at least 0"),
    (('memory_gib = 240', 'memory_gib = nan'), 14, "memory_gib: nan is not a finite number above 0"),
    (('wake_s = 0.26', 'wake_ss = 0.26'), 7, "deployment 'small': unknown field 'wake_ss'"),
    (('name = "small"', 'name = "Small One"'), 3, "name: 'Small One' is not a name"),
    (('memory_gib = 8\n', ''), 2, "deployment 'small': memory_gib is required"),
    (('name = "giant"', 'name = "small"'), 10, "deployment 'small': name 'small' is another deployment's already"),
    (('gpu_count = 4', 'gpu_count = 4\ngpu_ids = [0, 1]'), 16, "gpu_ids [0, 1]: 4 of the box's GPUs 0 to 3"),
    (('weight = 5', 'weight = = 5'), 5, "not valid TOML"),
    (('[[deployment]]\nname = "giant"', '[[deploymnt]]\nname = "giant"'), 1, "unknown key 'deploymnt'"),
])
def test_a_bad_file_is_named_with_its_line(tmp_path, change, line, says):
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(DeploymentError) as e:
        from_file(path, BOX)
    assert str(e.value).startswith(f"{path}:{line}: "), str(e.value)
    assert says in str(e.value)


ENGINE_BOUNDS = [
    ("prefill_tokens_per_s", "1e-50", "of at least 1 and at most 10,000,000 (tokens a second)"),
    ("decode_tokens_per_s", "1e-50", "of at least 1 and at most 10,000,000 (tokens a second)"),
    ("decode_batch_tokens_per_s", "1e-50", "of at least 1 and at most 10,000,000 (tokens a second)"),
    ("prefill_tokens_per_s", "0.5", "of at least 1"),
    ("decode_tokens_per_s", "2e7", "at most 10,000,000"),
    ("cold_start_s", "86401", "of at least 0 and at most 86,400 (seconds)"),
    ("wake_s", "1e300", "at most 86,400 (seconds)"),
    ("wake2_s", "1e6", "at most 86,400 (seconds)"),
    ("sleep_s", "1e6", "at most 86,400 (seconds)"),
    ("weights_gib", "1e300", "above 0 and at most 6,400,000 (GiB)"),
    ("kv_bytes_per_token", "1e-300", "of at least 1 and at most 1,073,741,824 (bytes)"),
    ("kv_bytes_per_token", "2e9", "at most 1,073,741,824 (bytes)"),
    ("weight", "1e300", "at most 1,000,000,000"),
]


@pytest.mark.parametrize("key,value,says", ENGINE_BOUNDS, ids=[f"{k}={v}" for k, v, _ in ENGINE_BOUNDS])
def test_engine_numbers_no_real_engine_has_are_named_with_their_line(tmp_path, key, value, says):
    """A prefill of 1e-50 tokens a second ran the replay forever, 1e-20 gave TTFTs of 2e16 s, and
    1e300 GiB of weights was taken: every number has a bound a real engine stays within."""
    path = write(tmp_path, f'[[deployment]]\nname = "a"\nmemory_gib = 10\n{key} = {value}\n')
    with pytest.raises(DeploymentError) as e:
        from_file(path, BOX)
    assert str(e.value).startswith(f"{path}:4: deployment 'a': {key}: {float(value)!r} is not a finite number ") \
        or str(e.value).startswith(f"{path}:4: deployment 'a': {key}: {value} is not a finite number "), str(e.value)
    assert says in str(e.value)


def test_memory_gib_is_at_most_what_any_box_could_hold(tmp_path):
    path = write(tmp_path, '[[deployment]]\nname = "a"\nmemory_gib = 1e300\n')
    with pytest.raises(DeploymentError, match=r":3: deployment 'a': memory_gib: 1e\+300 is not a finite number above 0 "
                                              r"and at most 6,400,000 \(GiB\)"):
        from_file(path, Box(gpus=(1e5,) * 64, host_gib=512))


def test_the_bounds_hold_the_benchmark_mix_and_their_edges(tmp_path):
    """bench/box-mix.toml's published figures are all within the bounds, and so are the edges."""
    from helpers import ROOT
    assert len(from_file(str(ROOT / "bench" / "box-mix.toml"), Box(gpus=(80.0,) * 8, host_gib=2048))) == 16
    edges = ('[[deployment]]\nname = "a"\nmemory_gib = 10\nprefill_tokens_per_s = 1\ndecode_tokens_per_s = 1e7\n'
             'decode_batch_tokens_per_s = 1\ncold_start_s = 86400\nwake_s = 0\nweights_gib = 9\n'
             'kv_bytes_per_token = 1\nweight = 1e9\n')
    (a,) = from_file(write(tmp_path, edges), BOX)
    assert (a.costs.prefill_tokens_per_s, a.costs.decode_tokens_per_s, a.costs.kv_tokens) == (1, 1e7, 2**30)


def test_a_file_without_tables_or_not_there(tmp_path):
    with pytest.raises(DeploymentError, match=r":1: no \[\[deployment\]\] table"):
        from_file(write(tmp_path, "# nothing\n"), BOX)
    with pytest.raises(DeploymentError, match="cannot read it"):
        from_file(str(tmp_path / "none.toml"), BOX)


def test_a_deployment_that_cannot_fit_on_the_box_at_all_is_named(tmp_path):
    path = write(tmp_path, GOOD)
    deps = from_file(path, BOX)
    check_fits(deps, BOX, str)  # 4 x 60 GiB on 4 x 80: it fits
    small_box = Box(gpus=(80.0, 80.0, 40.0, 40.0), host_gib=512)
    with pytest.raises(DeploymentError) as e:
        from_file(path, small_box)
    assert str(e.value) == (f"{path}:9: deployment 'giant' cannot fit on this box at all: it needs 4 GPUs with "
                            "60 GiB each, the box's GPUs offer 80, 80, 40, 40 GiB")


def test_gpus_and_the_box_from_the_configuration(tmp_path):
    assert parse_gpus("8x80") == (80.0,) * 8
    assert parse_gpus("2x80, 1x40.5") == (80.0, 80.0, 40.5)
    for bad in ("8", "0x80", "8x0", "8x80,x", "1x" + "9" * 400, "1x100001"):
        with pytest.raises(ValueError, match="as NxGIB"):
            parse_gpus(bad)
    for many in ("65x80", "60x80,5x40", "999999x80", "9" * 4000 + "x80"):  # counted before a list is made
        with pytest.raises(ValueError, match="at most 64 GPUs|as NxGIB"):
            parse_gpus(many)
    cfg = config_mod.load(None, env={}, overrides={
        "budget.source": "static", "budget.gpu_capacity_gib": [80, 40], "budget.reserve_gib": 2,
        "ondemand_queue_timeout_s": 120, "reap_interval_s": 5, "min_idle_timeout_s": 30,
        "ondemand_idle_timeout_s": 300, "budget.host_reserve_gib": 8, "sleep_timeout_s": 3600})
    box = box_of(cfg, host_gib=256)
    assert box == Box((80.0, 40.0), 256, True, reserve_gib=2, queue_timeout_s=120, reap_interval_s=5,
                      idle_timeout_s=300, min_idle_timeout_s=30, sleep_timeout_s=3600, host_reserve_gib=8)
    assert box_of(cfg, host_gib=256, gpus=(10.0,)).gpus == (10.0,)
    one_pool = config_mod.load(None, env={}, overrides={"budget.source": "static", "budget.capacity_gib": 100})
    assert (box_of(one_pool, 64).gpus, box_of(one_pool, 64).per_gpu) == ((100.0,), False)
    smi = config_mod.load(None, env={}, overrides={})
    assert box_of(smi, 64, measured=(79.6, 79.6)).gpus == (79.6, 79.6)
    with pytest.raises(ValueError, match="give --gpus NxGIB"):
        box_of(smi, 64)



def test_the_box_runs_the_configured_scheduler():
    """The replay's box takes the configuration's ``scheduler`` (the run makes one per policy)."""
    cfg = config_mod.load(None, env={}, overrides={"budget.source": "static", "budget.capacity_gib": 100})
    assert box_of(cfg, 64).scheduler == "seed"
    assert box_of(dataclasses.replace(cfg, scheduler="another"), 64).scheduler == "another"

async def state_file(tmp_path) -> str:
    path = tmp_path / "state" / "ondemand.db"
    store = await Store.open(path)
    try:
        a = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm", model="org/a",
                                               memory_gib=20, gpu_count=1, mode="on_demand", state="ready",
                                               gpus=[2], role="model", priority="high", idle_timeout_s=120))
        b = await store.insert_deployment(dict(name="b", served_name="B", engine="vllm", model="org/b",
                                               memory_gib=0, measured_gib=30.5, gpu_count=2, mode="on_demand",
                                               state="asleep", sleep_level=1, role="model"))
        await store.insert_deployment(dict(name="c", served_name="C", engine="vllm", model="org/c", memory_gib=0,
                                           gpu_count=1, state="planned", role="model"))
        await store.insert_deployment(dict(name="decider", served_name="decider", engine="llamacpp", memory_gib=4,
                                           gpu_count=1, role="decision", state="ready"))
        for kind, seconds in [("start", 50), ("start", 70), ("start", 55), ("wake", 2), ("wake", 4)]:
            await store.write_start(a["id"], at=1.0, duration_s=seconds, kind=kind, keep=20)
        await store.write_start(b["id"], at=1.0, duration_s=90, kind="start", keep=20)
        for level, seconds in [(1, 1.0), (2, 9.0), (1, 2.0), (2, 11.0), (2, 14.0)]:  # b's wakes, by level
            await store.write_start(b["id"], at=1.0, duration_s=seconds, kind="wake", keep=20, level=level)
        for level, seconds in [(1, 20.0), (2, 3.0), (1, 22.0)]:  # b's sleeps' calls, by level
            await store.write_start(b["id"], at=1.0, duration_s=seconds, kind="sleep", keep=20, level=level)
        for gap in (1800.0, 1790.5, 1812.25):  # what adaptive warmth learned of a, oldest first
            await store.write_idle_gap(a["id"], at=1.0, gap_s=gap, keep=500)
    finally:
        await store.close()
    return str(path)


def files(path: str) -> dict[str, str]:
    """Each file beside the state file (itself included), by its bytes' digest."""
    where = os.path.dirname(path)
    return {p: hashlib.sha256(open(os.path.join(where, p), "rb").read()).hexdigest() for p in os.listdir(where)}


def test_the_state_file_is_read_without_a_write(tmp_path):
    path = asyncio.run(state_file(tmp_path))
    before = files(path)
    a, b, c, decider = from_state(path, BOX)
    assert files(path) == before  # the same files, byte for byte: nothing written, no side file made
    assert (a.deployment.state, a.deployment.gpus, a.deployment.priority, a.deployment.idle_timeout_s) == (
        State.STOPPED, (), Priority.HIGH, 120)  # at rest as the replay begins
    # The medians of its starts and of its wakes, whose level is unknown: they stand for both levels.
    assert a.costs == Costs(cold_start_s=55, wake_s=3, wake2_s=3)
    assert (b.deployment.state, b.deployment.sleep_level, b.deployment.footprint_gib) == (State.STOPPED, None, 30.5)
    # Each level's wakes apart; its sleeps' calls at level 1, the level an idle one sleeps at.
    assert b.costs == Costs(cold_start_s=90, wake_s=1.5, wake2_s=11, sleep_s=21)
    assert c.deployment.state is State.PLANNED and c.deployment.memory_gib == 72.0  # 0.9 of a GPU: nothing to read
    assert c.costs == Costs()  # no history: the defaults
    assert a.gaps == (1800.0, 1790.5, 1812.25) and b.gaps == c.gaps == ()  # the idle gaps the box learned
    assert decider.deployment.mode is Mode.ALWAYS_ON and not decider.deployment.on_demand


def test_a_state_file_from_before_wake_levels_is_read_as_it_is(tmp_path):
    """A state file at schema 8 (no ``starts.level``: a box not yet upgraded) is read without a
    migration, its wakes as level 1's."""
    path = asyncio.run(state_file(tmp_path))
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE starts DROP COLUMN level")
    con.execute("UPDATE schema_version SET version = 8")
    con.commit()
    con.close()
    before = files(path)
    a, b, _c, _decider = from_state(path, BOX)
    assert files(path) == before
    assert a.costs == Costs(cold_start_s=55, wake_s=3, wake2_s=3)
    # All five wakes' median and all three sleeps', level unknown.
    assert b.costs == Costs(cold_start_s=90, wake_s=9, wake2_s=9, sleep_s=20)


def one_deployment(tmp_path, rows: list[tuple[str, float, int | None]]) -> str:
    """A state file of one stopped deployment ``d`` with these rows of its history (kind,
    duration, level), oldest first."""
    async def make() -> str:
        path = tmp_path / "ondemand.db"
        store = await Store.open(path)
        try:
            d = await store.insert_deployment(dict(name="d", served_name="D", engine="vllm", model="org/d",
                                                   memory_gib=10, gpu_count=1, state="stopped", role="model"))
            for kind, seconds, level in rows:
                await store.write_start(d["id"], at=1.0, duration_s=seconds, kind=kind, keep=20, level=level)
        finally:
            await store.close()
        return str(path)
    return asyncio.run(make())


def test_wakes_of_unknown_level_are_left_out_once_a_level_is_known(tmp_path):
    """A box upgraded to schema 9 holds old wakes (no level) beside new ones: a level with wakes
    of its own costs their median, the other its default, the old wakes neither (as the box
    itself prices them, control.starts.wake_median)."""
    rows = [("wake", 2.0, None), ("wake", 4.0, None), ("wake", 10.0, None), ("wake", 20.0, 2)]
    (d,) = from_state(one_deployment(tmp_path, rows), BOX)
    assert d.costs == Costs(wake2_s=20.0)  # wake_s: the default


def test_the_newest_five_of_each_kind_and_level_price_it_as_the_box_does(tmp_path):
    """The state file keeps 20 of each kind and level; the box prices a start, a wake or a sleep
    by the median of its newest five (control.starts.ETA_OF), and so does a replay of the file."""
    rows = []
    for seconds in (100.0, 100.0, 10.0, 20.0, 30.0, 40.0, 50.0):  # all seven: 40; the newest five: 30
        rows += [("start", seconds, None), ("wake", seconds / 10, 1), ("sleep", seconds / 5, 1)]
    (d,) = from_state(one_deployment(tmp_path, rows), BOX)
    assert d.costs == Costs(cold_start_s=30.0, wake_s=3.0, sleep_s=6.0)


async def test_the_state_file_is_read_while_a_server_has_it_open(tmp_path):
    """With the write-ahead log there (a server runs), its rows are read too."""
    path = await state_file(tmp_path)
    store = await Store.open(path)
    try:
        await store.insert_deployment(dict(name="late", served_name="L", engine="vllm", memory_gib=5, gpu_count=1,
                                           mode="on_demand", state="stopped", role="model"))
        assert path + "-wal" in [os.path.join(os.path.dirname(path), p) for p in files(path)]
        assert [r.deployment.name for r in from_state(path, BOX)] == ["a", "b", "c", "decider", "late"]
    finally:
        await store.close()


def test_no_state_file(tmp_path):
    with pytest.raises(DeploymentError, match="no state file here"):
        from_state(tmp_path / "ondemand.db", BOX)
