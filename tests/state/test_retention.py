"""Retention: events and audit rows older than retention_days are deleted once an hour
(state.retention.prune_old_rows, Store.prune), the queue-timeout audit rows with them."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers import fill_the_disk, one_line_errors, wait_for

from ondemand import config
from ondemand.errors import ConfigError
from ondemand.state import retention

DAY = 86400.0


async def add_rows(store, at: float, n: int = 1, action: str = "ondemand_queue_timeout") -> None:
    async with store.transaction() as db:
        for _ in range(n):
            await db.execute("INSERT INTO events (at, actor, text) VALUES (?, 'deployer', 'e')", (at,))
            await db.execute("INSERT INTO audit (at, action, actor, deployment_id, text) "
                             "VALUES (?, ?, 'ondemand', 1, 'a')", (at, action))


async def count(store, table: str) -> int:
    async with store.db.execute(f"SELECT count(*) FROM {table}") as cur:
        return (await cur.fetchone())[0]


async def test_prune_deletes_only_rows_older_than_the_cut_in_batches(store):
    now = 1_000_000_000.0
    await add_rows(store, now - 40 * DAY, 5)
    await add_rows(store, now - 29 * DAY, 2)
    assert await store.prune(now - 30 * DAY, limit=3) == {"events": 3, "audit": 3, "starts": 0, "idle_gaps": 0}
    assert await store.prune(now - 30 * DAY, limit=3) == {"events": 2, "audit": 2, "starts": 0, "idle_gaps": 0}
    assert await store.prune(now - 30 * DAY, limit=3) == {"events": 0, "audit": 0, "starts": 0, "idle_gaps": 0}
    assert await count(store, "events") == await count(store, "audit") == 2


async def test_prune_forgets_the_start_history_of_removed_deployments(store):
    dep = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm", state="stopped"))
    await store.write_start(dep["id"], at=1.0, duration_s=3.0, kind="start", keep=20)
    await store.write_start(dep["id"] + 1, at=1.0, duration_s=3.0, kind="start", keep=20)  # removed
    assert (await store.prune(0.0, 10))["starts"] == 1
    assert list(await store.starts(5)) == [dep["id"]]


async def test_the_background_task_runs_soon_then_every_interval(store):
    clock = [1_000_000_000.0]
    passes = []  # each pass reads the clock once

    def now() -> float:
        passes.append(clock[0])
        return clock[0]
    await add_rows(store, clock[0] - 31 * DAY, 3)
    await store.write_audit(action="ondemand_queue_timeout", actor="ondemand", deployment_id=1, text="now")
    task = asyncio.ensure_future(retention.prune_old_rows(store, 30, clock=now, first_s=0.01, interval_s=0.05))
    try:
        await wait_for(lambda: count_is(store, "audit", 1), what="the old audit rows gone at the first pass")
        assert await count(store, "events") == 0
        # Time passes (the fake clock): rows written "now" age past the cut and go at a later pass.
        await add_rows(store, clock[0] - DAY, 2)
        seen = len(passes)
        await wait_for(lambda: len(passes) >= seen + 2, what="two more passes")  # each begun after the rows
        assert await count(store, "events") == 2
        clock[0] += 30 * DAY
        await wait_for(lambda: count_is(store, "events", 0), what="the aged rows gone at a later pass")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_pass_the_disk_refuses_is_one_line_and_the_next_pass_tries_again(store, monkeypatch, caplog):
    """interfaces.md: a full disk is a one-line error, not a traceback an hour."""
    fill_the_disk(store, monkeypatch)
    task = asyncio.ensure_future(retention.prune_old_rows(store, 30, first_s=0, interval_s=0.01))
    try:
        await wait_for(lambda: len(caplog.records) >= 2, what="two passes refused")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lines = one_line_errors(caplog, "ondemand.state.retention")
    assert lines[0].startswith("ERROR ondemand.state.retention: retention: cannot delete old rows: the state file ")
    assert "database or disk is full" in lines[0]


async def count_is(store, table, n):
    return await count(store, table) == n


async def test_a_backlog_is_deleted_in_several_short_passes(store, monkeypatch):
    monkeypatch.setattr(retention, "RETENTION_BATCH", 10)
    monkeypatch.setattr(retention, "RETENTION_AGAIN_S", 0.01)
    await add_rows(store, time.time() - 100 * DAY, 35)
    task = asyncio.ensure_future(retention.prune_old_rows(store, 30, first_s=0, interval_s=3600))
    try:
        await wait_for(lambda: count_is(store, "audit", 0), what="the backlog gone without the hourly wait")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_server_runs_retention(tmp_path, monkeypatch):
    from helpers import run_app

    from ondemand.admin.components import STORE
    monkeypatch.setattr(retention, "RETENTION_FIRST_S", 0.05)
    async with run_app(tmp_path, retention_days=2) as server:
        store = server.app[STORE]
        await add_rows(store, time.time() - 3 * DAY, 2)
        await add_rows(store, time.time() - 1 * DAY, 1)
        await wait_for(lambda: count_is(store, "audit", 1), what="the server's first retention pass")


@pytest.mark.parametrize("value", [0, 3651, "x", 1.5])
def test_retention_days_is_validated(value):
    with pytest.raises(ConfigError, match="retention_days"):
        config.load(env={}, overrides={"retention_days": value})


def test_retention_days_default_and_environment():
    assert config.load(env={}).retention_days == 30
    assert config.load(env={"ONDEMAND_RETENTION_DAYS": "3650"}).retention_days == 3650
