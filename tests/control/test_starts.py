"""Start history (ondemand/control/starts.py): durations from the bus's StartEnded, the
deployment view's last_start_s and start_eta_s, the state file's `starts` table
(migration 4), and the ETA in the queued notice."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from helpers import dep_fields, fill_the_disk, one_line_errors, running_deployer, wait_for

from ondemand.control.starts import ETA_OF, StartHistory, newest
from ondemand.engines.start import Start
from ondemand.engines.startwatch import StartWatch
from ondemand.events import Slept, StartEnded, StopCause
from ondemand.gateway import notice
from ondemand.model import Deployment, State
from ondemand.state import migrations


def dep(state: State, at: float, **kw) -> Deployment:
    return Deployment(id=kw.pop("id", 1), name="d", served_name="D", engine="vllm", state=state, updated_at=at, **kw)


def ended(history: StartHistory, began: float, at: float, result: str = "ready", *, level: int | None = None,
          id: int = 1) -> None:
    """Publish the end of a start (a wake with ``level``) that began at ``began``, as the deployer does."""
    kind = "cold" if level is None else "wake"
    history.on_start_ended(StartEnded(id, "d", kind, level, at - began, result, at, False, None))


async def written(store, dep_id: int, n: int) -> list[tuple[str, float, int | None]]:
    return await wait_for(lambda: _rows(store, dep_id, n), what=f"{n} start rows of {dep_id}")


async def _rows(store, dep_id, n):
    rows = (await store.starts(100)).get(dep_id, [])
    return rows if len(rows) == n else None


async def test_a_start_is_timed_from_starting_to_ready_and_kept(store):
    h = StartHistory(store)
    try:
        assert h.fields(1) == {"last_start_s": None, "start_eta_s": None}
        ended(h, 100.0, 142.0)
        assert h.fields(1) == {"last_start_s": 42.0, "start_eta_s": 42.0}
        assert await written(store, 1, 1) == [("start", 42.0, None)]
    finally:
        await h.close()
    again = StartHistory(store)  # after a restart of ondemand
    await again.load()
    assert again.fields(1) == {"last_start_s": 42.0, "start_eta_s": 42.0}


async def test_eta_is_the_median_of_the_last_five(store):
    h = StartHistory(store)
    try:
        for i, took in enumerate([100, 10, 20, 30, 40, 50, 11]):
            t = 1000.0 * i
            ended(h, t, t + took)
        assert h.last_start_s(1) == 11.0
        assert h.eta_s(1) == 30.0  # median of 20, 30, 40, 50, 11: the 100 s start aged out
        await written(store, 1, 7)
    finally:
        await h.close()


async def test_an_edit_while_starting_does_not_shorten_it(tmp_path, store):
    """The deployer stamps updated_at on every change: an edit during the start (a live field
    here) must not become the start's beginning. A real start, its StartEnded heard."""
    h = StartHistory(store)
    try:
        async with running_deployer(tmp_path, store, publish=lambda e: isinstance(e, StartEnded)
                                    and h.on_start_ended(e)) as d:
            a = (await d.create(dep_fields("a", 10, "on_demand", "--startup-delay", "1.0"))).id
            await d.admit_start(a)
            await wait_for(lambda: d.engine(a) is not None, what="its engine started")
            await asyncio.sleep(0.6)  # well into the start (the engine answers after 1 s of its own)
            await d.edit(a, {"priority": "high"})
            await d.wait_started(a)
        assert h.last_start_s(a) >= 1.0  # from the mark to starting; from the edit it would be about 0.4 s
    finally:
        await h.close()


@pytest.mark.parametrize("end", ["failed", "stopped"])
async def test_failed_or_interrupted_starts_are_not_counted(store, end):
    h = StartHistory(store)
    try:
        ended(h, 0.0, 5.0, end)
        assert h.fields(1) == {"last_start_s": None, "start_eta_s": None}
        ended(h, 10.0, 13.0)
        assert h.last_start_s(1) == 3.0
    finally:
        await h.close()


async def test_a_wake_is_recorded_apart_and_a_start_from_before_a_restart_is_timed_from_its_row(store):
    """(A start taken back after a restart begins at its row's stamp: tests/engines/test_start.py.)"""
    h = StartHistory(store)
    try:
        ended(h, 0.0, 2.0, level=1)
        assert h.last_start_s(1) is None  # a wake says nothing about a cold start
        assert await written(store, 1, 1) == [("wake", 2.0, 1)]  # with the level it woke from
        # A clock that went back gives no entry; a removal forgets the deployment.
        ended(h, 20.0, 50.0, id=2)
        assert h.last_start_s(2) == 30.0
        ended(h, 100.0, 90.0, id=3)
        assert h.last_start_s(3) is None
        h.forget(2)
        assert h.last_start_s(2) is None
    finally:
        await h.close()


async def test_wakes_have_an_eta_of_their_own_which_an_asleep_notice_gives(store):
    """Issue 29: wake_eta_s is the median of the last five wakes (an asleep deployment's view
    adds it); the queued notice of an asleep or waking deployment gives it, else the start's
    (the start watch's ``notice_eta_s``, reading the deployment's unit). A failed wake ends,
    and a cold start begins in the same starting: it counts as a start."""
    h = StartHistory(store)
    unit = SimpleNamespace(dep=dep(State.READY, 0.0), start=None)
    watch = StartWatch(lambda d: None, publish=lambda e: None, estimates=h, units=lambda i: unit, clock=lambda: 0.0)
    try:
        ended(h, 0.0, 60.0)
        for i, took in enumerate([9.0, 1.0, 2.0, 3.0, 4.0, 5.0]):
            t = 1000.0 * (i + 1)
            ended(h, t, t + took, level=1)
        assert h.fields(1) == {"last_start_s": 60.0, "start_eta_s": 60.0}
        assert h.fields(1, asleep=True) == {"last_start_s": 60.0, "start_eta_s": 60.0, "wake_eta_s": 3.0}
        assert watch.notice_eta_s(1) == 60.0  # ready: a start's
        unit.dep = dep(State.ASLEEP, 9000.0, sleep_level=1)
        assert watch.notice_eta_s(1) == 3.0
        unit.dep = dep(State.STARTING, 9001.0, sleep_level=1)
        unit.start = Start(unit.dep, "wake", began=0.0)
        assert watch.notice_eta_s(1) == 3.0  # waking
        # The wake failed: its cold start begins (its phases followed: what is left of the single ETA).
        ended(h, 9001.0, 9002.0, "mismatch", level=1)
        unit.dep, unit.start = dep(State.STARTING, 9002.0), Start(unit.dep, "cold", began=0.0)
        watch.on_start_began(unit.start.began_event())
        assert watch.notice_eta_s(1) == 60.0
        ended(h, 9002.0, 9041.0)
        assert h.last_start_s(1) == 39.0 and h.wake_eta_s(1) == 3.0
        assert (await written(store, 1, 8))[-1] == ("start", 39.0, None)  # a cold start: no level
    finally:
        await watch.close()
        await h.close()
    again = StartHistory(store)
    await again.load()
    assert again.wake_eta_s(1) == 3.0 and again.eta_s(1) == 49.5


async def test_a_wakes_eta_by_the_level_it_woke_from(store):
    """Adaptive warmth's rest tiers cost what their wakes took, by the level each woke from; the
    state file keeps the level, so a restart keeps each level's median."""
    h = StartHistory(store)
    try:
        for i, (level, took) in enumerate([(1, 0.5), (2, 8.0), (1, 0.7), (2, 12.0), (1, 0.6)]):
            t = 100.0 * i
            ended(h, t, t + took, level=level)
        assert h.wake_eta_s(1, 1) == 0.6 and h.wake_eta_s(1, 2) == 10.0 and h.wake_eta_s(1) == 0.7
        ended(h, 0.0, 1.0, level=1, id=2)
        assert h.wake_eta_s(2, 1) == 1.0 and h.wake_eta_s(2, 2) is None  # never woken from level 2
        await written(store, 1, 5)
        await written(store, 2, 1)
    finally:
        await h.close()
    again = StartHistory(store)
    await again.load()
    assert again.wake_eta_s(1, 1) == 0.6 and again.wake_eta_s(1, 2) == 10.0 and again.wake_eta_s(1) == 0.7
    assert again.wake_eta_s(2, 1) == 1.0 and again.wake_eta_s(2, 2) is None


async def test_wakes_of_unknown_level_serve_every_level_until_one_is_known(store):
    """Wakes written before the state file kept levels (schema 9) have none: all wakes' median
    stands for both levels until a wake of known level is timed."""
    for took in (2.0, 4.0, 3.0):
        await store.write_start(1, at=0.0, duration_s=took, kind="wake", keep=20)
    h = StartHistory(store)
    try:
        await h.load()
        assert h.wake_eta_s(1, 1) == h.wake_eta_s(1, 2) == h.wake_eta_s(1) == 3.0
        ended(h, 10.0, 18.0, level=2)
        assert h.wake_eta_s(1, 2) == 8.0 and h.wake_eta_s(1, 1) is None and h.wake_eta_s(1) == 3.5
        await written(store, 1, 4)
    finally:
        await h.close()


async def test_sleeps_are_timed_by_level_and_forgotten_with_the_deployment(store):
    """How long a sleep's call holds the memory (warmth by value's window): the median of the
    last five at that level."""
    h = StartHistory(store, wall=lambda: 1000.0)
    try:
        assert h.sleep_eta_s(1, 1) is None
        for took in (20.0, 1.0, 22.0, 21.0, 30.0, 19.0):  # the first falls out of the five
            h.on_slept(Slept(1, "d", 1, StopCause.IDLE, took))
        h.on_slept(Slept(1, "d", 2, StopCause.MAKE_ROOM, 3.0))
        assert h.sleep_eta_s(1, 1) == 21.0 and h.sleep_eta_s(1, 2) == 3.0 and h.sleep_eta_s(2, 1) is None
        h.forget(1)
        assert h.sleep_eta_s(1, 1) is None and h.sleep_eta_s(1, 2) is None
    finally:
        await h.close()


async def test_sleeps_are_written_and_a_restart_keeps_them(store):
    """Each sleep's call is a row of its own (kind ``sleep``, its level, stamped on the wall
    clock), so a restart of ondemand keeps each level's median, as it keeps the starts and
    wakes; six at one level keep the last five in memory, and all six in the file (its bound is
    ``KEEP``)."""
    h = StartHistory(store, wall=lambda: 1234.5)
    try:
        for took in (20.0, 1.0, 22.0, 21.0, 30.0, 19.0):
            h.on_slept(Slept(1, "d", 1, StopCause.IDLE, took))
        h.on_slept(Slept(1, "d", 2, StopCause.ADMIN, 3.0))
        h.on_slept(Slept(1, "d", 1, StopCause.IDLE, -0.5))  # a clock that went back: none, not less
        rows = await written(store, 1, 8)
        assert [r for r in rows if r[2] == 2] == [("sleep", 3.0, 2)]
        assert [d for k, d, lv in rows if lv == 1] == [20.0, 1.0, 22.0, 21.0, 30.0, 19.0, 0.0]
        assert {k for k, _, _ in rows} == {"sleep"}
    finally:
        await h.close()
    async with store._reading() as db, db.execute("SELECT DISTINCT at FROM starts") as cur:
        assert [tuple(r) for r in await cur.fetchall()] == [(1234.5,)]
    again = StartHistory(store)
    await again.load()
    assert again.sleep_eta_s(1, 1) == 21.0 and again.sleep_eta_s(1, 2) == 3.0
    assert again.fields(1) == {"last_start_s": None, "start_eta_s": None}  # a sleep is no start


async def test_a_sleep_or_start_that_ends_as_ondemand_shuts_down_keeps_its_row(store):
    """The rows are written by tasks; ``close`` (shutdown) lets the ones out finish instead of
    cancelling them, so the last sleep and start before a restart are in the file."""
    h = StartHistory(store, wall=lambda: 50.0)
    h.on_slept(Slept(1, "d", 1, StopCause.IDLE, 21.0))
    ended(h, began=10.0, at=70.0)
    await h.close()  # in the same step: no write has begun yet
    assert sorted((await store.starts(100))[1]) == [("sleep", 21.0, 1), ("start", 60.0, None)]


async def test_a_full_disk_is_one_line_in_the_log_and_a_defect_keeps_its_traceback(store, monkeypatch, caplog):
    """interfaces.md: a full disk is a one-line error. A start's row the disk refused logged the
    StateFileError's whole traceback; now its message, in one line. A defect of ours keeps its traceback."""
    fill_the_disk(store, monkeypatch)
    h = StartHistory(store)
    ended(h, 100.0, 142.0)
    h.on_slept(Slept(1, "d", 1, StopCause.IDLE, 3.0))
    await h.close()
    assert h.fields(1)["last_start_s"] == 42.0  # memory keeps it
    lines = one_line_errors(caplog, "ondemand.control.starts")
    assert len(lines) == 2 and all(line.startswith("ERROR ") for line in lines), lines
    assert lines[0].startswith("ERROR ondemand.control.starts: cannot record the start of deployment 1: the state "
                               "file ") and "database or disk is full" in lines[0]
    assert "cannot record the sleep of deployment 1" in lines[1]
    caplog.clear()

    async def defect(*args, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(store, "write_start", defect)
    h = StartHistory(store)
    ended(h, 100.0, 142.0)
    await h.close()
    (record,) = [r for r in caplog.records if r.name == "ondemand.control.starts"]
    assert record.exc_info is not None and record.getMessage() == "cannot record the start of deployment 1"


def test_the_rows_kept_by_kind_and_by_level_the_newest_five_each():
    """``newest``, which the box at start-up and a replay of its state file both price by: each
    kind's newest five, and each kind's at a known level apart (a wake of unknown level counts
    only in its kind's)."""
    rows = [("start", float(i), None) for i in range(7)] + [("wake", 1.0, None), ("wake", 2.0, 1)]
    rows += [("sleep", float(i), 2) for i in range(6)]
    assert newest(rows) == {"start": [2.0, 3.0, 4.0, 5.0, 6.0], "wake": [1.0, 2.0], ("wake", 1): [2.0],
                            "sleep": [1.0, 2.0, 3.0, 4.0, 5.0], ("sleep", 2): [1.0, 2.0, 3.0, 4.0, 5.0]}
    assert newest([]) == {}


async def test_the_state_file_keeps_a_bounded_history(store):
    for i in range(30):
        await store.write_start(7, at=float(i), duration_s=float(i), kind="start", keep=20)
    rows = (await store.starts(100))[7]
    assert [d for _, d, _ in rows] == [float(i) for i in range(10, 30)]
    assert [d for _, d, _ in (await store.starts(ETA_OF))[7]] == [25.0, 26.0, 27.0, 28.0, 29.0]


async def test_rare_level_2_wakes_outlast_many_starts_and_level_1_wakes(store):
    """The bound is per kind and level: a deployment that wakes from level 2 now and then keeps
    those wakes however many cold starts and level-1 wakes come after, and a restart keeps their
    median."""
    for took in (9.0, 11.0):
        await store.write_start(7, at=0.0, duration_s=took, kind="wake", keep=20, level=2)
    for i in range(30):
        await store.write_start(7, at=float(i), duration_s=40.0 + i, kind="start", keep=20)
        await store.write_start(7, at=float(i), duration_s=0.5, kind="wake", keep=20, level=1)
    rows = (await store.starts(20))[7]
    assert rows[:2] == [("wake", 9.0, 2), ("wake", 11.0, 2)] and len(rows) == 42
    assert [d for k, d, _ in rows if k == "start"] == [40.0 + i for i in range(10, 30)]
    h = StartHistory(store)
    await h.load()
    assert (h.wake_eta_s(7, 2), h.wake_eta_s(7, 1), h.eta_s(7)) == (10.0, 0.5, 67.0)
    assert migrations.LATEST >= 4


def test_the_notice_says_when_the_model_is_expected():
    assert notice.notice_text("M", 41.6) == "[ondemand] M is waiting for GPU memory (about 42 s); your answer follows.\n\n"
    assert notice.notice_text("M", 41.6, (2, 3)).startswith("[ondemand] M is waiting for GPU memory "
                                                            "(place 2 of 3, about 42 s);")
    assert notice.notice_text("M", None, (1, 1)).startswith("[ondemand] M is waiting for GPU memory (place 1 of 1);")
    assert "about" not in notice.notice_text("M") and "place" not in notice.notice_text("M")
    chunk = notice.queued_chunk("chat/completions", "M", notice.Wait(3.0, (1, 2)))
    assert b"(place 1 of 2, about 3 s)" in chunk


async def test_views_carry_the_history_of_real_starts(server, http):
    """End to end: two real starts of an engine-simulator deployment, through the deployer and
    the bus, show in its view; the gateway's notice gets the same ETA."""
    dep_id = await server.add("h", 10, "--startup-delay", "0.3")
    for _ in range(2):
        await server.deployer.restart(dep_id)
        await server.deployer.stop(dep_id)
    async with http.get(f"{server.url}/api/deployments/{dep_id}", headers=server.admin_headers()) as r:
        view = await r.json()
    assert 0.3 <= view["last_start_s"] < 10 and 0.3 <= view["start_eta_s"] < 10
    from ondemand import app as app_mod
    gateway = server.app[app_mod.GATEWAY]
    assert gateway.start_eta(dep_id) == view["start_eta_s"]
    assert gateway.start_eta(dep_id + 1) is None


async def test_the_queued_notice_of_the_gateway_carries_the_eta(server, http):
    import time

    import orjson

    from ondemand import app as app_mod
    big = await server.add("big", 15)
    x = await server.add("x", 12)
    await server.deployer.restart(big)
    slot = await server.admission.acquire(big)  # busy: x must queue for its memory
    server.app[app_mod.STARTS].record(x, 7.2, at=time.time())
    body = {"model": "X", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(server.gw(x, "chat/completions"), json=body, headers=server.auth()) as r:
        chunk = orjson.loads((await r.content.readuntil(b"\n\n"))[6:])
        assert chunk["id"] == "ondemand-queued"
        assert "(place 1 of 1, about 7 s)" in chunk["choices"][0]["delta"]["content"]
        slot.release()
        server.controller.record(big).last_activity = 0  # idle for its full timeout: x gets its memory
        await server.app[app_mod.SAMPLER].sample_once()
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
