import asyncio

import pytest

from ondemand.errors import StateFileError
from ondemand.state import migrations
from ondemand.state.store import Store


async def test_fresh_file_is_wal_at_latest_version(tmp_path):
    store = await Store.open(tmp_path / "s" / "ondemand.db")
    try:
        assert await store.version() == migrations.LATEST
        async with store.db.execute("PRAGMA journal_mode") as cur:
            assert (await cur.fetchone())[0] == "wal"
        async with store.db.execute("PRAGMA foreign_keys") as cur:
            assert (await cur.fetchone())[0] == 1
        dep = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm", mode="on_demand",
                                                 args=["--x"], state="stopped"))
        assert dep["args"] == ["--x"] and dep["mode"] == "on_demand" and dep["pending_mode"] is None
    finally:
        await store.close()


async def test_a_file_where_the_directory_should_be_is_a_state_file_error(tmp_path):
    """A file in the state directory's place (or above it) is a StateFileError naming it, which
    `migrate` says in one line; not mkdir's FileExistsError or NotADirectoryError."""
    (tmp_path / "f").write_text("")
    with pytest.raises(StateFileError, match=f"{tmp_path / 'f'} is a file, not a directory"):
        await Store.open(tmp_path / "f" / "ondemand.db")
    with pytest.raises(StateFileError, match=f"{tmp_path / 'f' / 's'} cannot be made: {tmp_path / 'f'} is a file"):
        await Store.open(tmp_path / "f" / "s" / "ondemand.db")


async def test_transactions_nest_and_roll_back_together(tmp_path):
    store = await Store.open(tmp_path / "ondemand.db")
    try:
        dep = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm"))
        with pytest.raises(RuntimeError):
            async with store.transaction():
                await store.update_deployment(dep["id"], state="ready")
                await store.write_event(actor="deployer", deployment_id=dep["id"], text="ready")
                raise RuntimeError("boom")
        assert (await store.deployment(dep["id"]))["state"] == "planned"
        assert await store.events() == []

        async with store.transaction():
            await store.update_deployment(dep["id"], state="ready")
            await store.write_event(actor="ondemand", deployment_id=dep["id"], text="ready", detail={"a": 1})
            await store.write_audit(action="ondemand_start", actor="ondemand", deployment_id=dep["id"],
                                    text="started for a request")
        ev = (await store.events())[0]
        assert ev["actor"] == "ondemand" and ev["user"] is None and ev["detail"] == {"a": 1}
        au = (await store.audit())[0]
        assert au["action"] == "ondemand_start" and au["user"] is None and au["deployment_id"] == dep["id"]
    finally:
        await store.close()


async def test_concurrent_transactions_do_not_join(tmp_path):
    store = await Store.open(tmp_path / "ondemand.db")
    try:
        dep = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm"))

        async def good():
            async with store.transaction():
                await store.write_event(actor="x", text="kept")
                await asyncio.sleep(0.01)

        async def bad():
            with pytest.raises(RuntimeError):
                async with store.transaction():
                    await store.write_event(actor="x", text="dropped")
                    await asyncio.sleep(0.01)
                    raise RuntimeError

        await asyncio.gather(good(), bad(), good())
        assert sorted(e["text"] for e in await store.events()) == ["kept", "kept"]
        assert dep["id"] == 1
    finally:
        await store.close()


async def test_reads_see_only_committed_transactions(tmp_path):
    # On the one shared connection, a read in the middle of another task's
    # transaction would see its rows before COMMIT: half of a change, or one
    # that is then rolled back. Reads wait for the transaction instead.
    store = await Store.open(tmp_path / "ondemand.db")
    try:
        dep = await store.insert_deployment(dict(name="a", served_name="A", engine="vllm"))
        midway = asyncio.Event()

        async def change(state: str, fail: bool):
            async with store.transaction():
                await store.update_deployment(dep["id"], state=state)
                midway.set()
                await asyncio.sleep(0.05)  # stays: the transaction is held open while a reader runs
                if fail:
                    raise RuntimeError("rolled back")
                await store.write_event(actor="deployer", deployment_id=dep["id"], text=state)

        for state, fail in (("failed", True), ("ready", False)):
            midway.clear()
            writer = asyncio.ensure_future(change(state, fail))
            await midway.wait()
            row, rows, events = await asyncio.gather(
                store.deployment(dep["id"]), store.deployments(), store.events(dep["id"]))
            assert writer.done()  # the reads waited for the end of the transaction
            if fail:
                with pytest.raises(RuntimeError):
                    await writer
                assert row["state"] == rows[0]["state"] == "planned" and events == []
            else:
                await writer
                assert row["state"] == rows[0]["state"] == "ready"
                assert [e["text"] for e in events] == ["ready"]

        # Reads inside a transaction join it (no deadlock) and see its own rows.
        async with store.transaction():
            await store.update_deployment(dep["id"], state="stopped")
            assert (await store.deployment(dep["id"]))["state"] == "stopped"
    finally:
        await store.close()
