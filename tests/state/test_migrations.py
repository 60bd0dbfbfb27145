"""The state file's schema migrations (ondemand/state/migrations.py), on real SQLite files in a
temporary directory: each numbered migration upgrades a file written at the version before it
and keeps its rows (filled as the old code wrote them, straight through aiosqlite), the runner
applies what is missing in order, once, each in one transaction, even with another process at
the same file, and refuses a file newer than the code; ``Store.open`` then reads the rows."""
import sqlite3

import aiosqlite
import pytest

from ondemand.state import migrations
from ondemand.state.store import Store


async def columns(db: aiosqlite.Connection, table: str) -> set[str]:
    """The table's column names, as SQLite tells them."""
    return {row[1] for row in await db.execute_fetchall(f"PRAGMA table_info({table})")}


async def test_ondemand_mode_migration_upgrades_old_rows(tmp_path):
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=1)
        cols = await columns(db, "deployments")
        assert "mode" not in cols and "idle_timeout_s" not in cols
        for i in range(3):
            await db.execute(
                "INSERT INTO deployments (name, served_name, engine, state, created_at, updated_at) "
                "VALUES (?, ?, 'vllm', 'ready', 0, 0)", (f"d{i}", f"D{i}"))

    store = await Store.open(path)
    try:
        assert await store.version() == migrations.LATEST
        deps = await store.deployments()
        assert [d["mode"] for d in deps] == ["always_on"] * 3
        assert all(d["idle_timeout_s"] is None and d["pending_mode"] is None for d in deps)
        cols = await columns(store.db, "deployments")
        assert {"mode", "idle_timeout_s", "pending_mode"} <= cols
        # A deployment made on demand after the upgrade stays so on the next start.
        await store.update_deployment(deps[0]["id"], mode="on_demand")
    finally:
        await store.close()

    store = await Store.open(path)  # the upgrade again changes nothing
    try:
        assert [d["mode"] for d in await store.deployments()] == ["on_demand", "always_on", "always_on"]
        assert await migrations.upgrade(store.db) == (migrations.LATEST, migrations.LATEST)
    finally:
        await store.close()


async def test_priorities_migration_skips_the_gap_and_keeps_old_rows_normal_without_a_limit(tmp_path):
    """Version 6 follows 4 here: 5 is the engine recipes' (another branch). The runner applies
    what is missing in order and skips a number it does not know."""
    assert [m.version for m in migrations.MIGRATIONS if m.version > 4][:1] in ([5], [6])
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        assert await migrations.upgrade(db, target=4) == (0, 4)
        assert "priority" not in await columns(db, "deployments")
        await db.execute("INSERT INTO deployments (name, served_name, engine, state, created_at, updated_at) "
                         "VALUES ('old', 'Old', 'vllm', 'ready', 0, 0)")
        assert await migrations.upgrade(db) == (4, migrations.LATEST)
        assert await migrations.schema_version(db) == migrations.LATEST >= 6
    store = await Store.open(path)
    try:
        [old] = await store.deployments()
        assert old["priority"] == "normal" and old["max_inflight"] is None
        new = await store.insert_deployment(dict(name="b", served_name="B", engine="vllm", priority="high",
                                                 max_inflight=4))
        assert new["priority"] == "high" and new["max_inflight"] == 4
        for bad in ({"priority": "urgent"}, {"max_inflight": 0}, {"max_inflight": 10001}):
            with pytest.raises(sqlite3.IntegrityError):  # the column's CHECK, below the API's own
                await store.update_deployment(new["id"], **bad)
    finally:
        await store.close()


async def test_priorities_migration_is_idempotent_on_a_file_that_has_the_columns(tmp_path):
    """A file whose columns came another way (a branch's build) migrates without an error."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=4)
        await db.execute("ALTER TABLE deployments ADD COLUMN priority TEXT NOT NULL DEFAULT 'normal'")
        assert await migrations.upgrade(db) == (4, migrations.LATEST)
        assert {"priority", "max_inflight"} <= await columns(db, "deployments")


async def test_migration_is_one_transaction(tmp_path, monkeypatch):
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=1)

        async def broken(db):
            await db.execute("ALTER TABLE deployments ADD COLUMN mode TEXT")
            raise RuntimeError("power cut")

        monkeypatch.setattr(migrations, "MIGRATIONS",
                            [migrations.MIGRATIONS[0], migrations.Migration(2, "broken", broken)])
        with pytest.raises(RuntimeError):
            await migrations.upgrade(db)
        assert await migrations.schema_version(db) == 1
        assert "mode" not in await columns(db, "deployments")


async def test_a_migration_another_process_applied_first_is_not_applied_again(tmp_path, monkeypatch):
    """Two processes open one file at version 0: the second read the version before the first
    applied everything; under the write lock it reads it again and applies nothing twice."""
    path = tmp_path / "ondemand.db"
    first = await aiosqlite.connect(path, isolation_level=None)
    second = await aiosqlite.connect(path, isolation_level=None)
    applied: list[int] = []

    def counted(m: migrations.Migration) -> migrations.Migration:
        async def apply(db):
            applied.append(m.version)
            await m.apply(db)
        return migrations.Migration(m.version, m.description, apply)

    monkeypatch.setattr(migrations, "MIGRATIONS", [counted(m) for m in migrations.MIGRATIONS])
    read = migrations.schema_version
    upgrade = migrations.upgrade

    async def read_then_the_other_upgrades(db):
        version = await read(db)
        if db is second and not applied:
            assert await upgrade(first) == (0, migrations.LATEST)
        return version

    monkeypatch.setattr(migrations, "schema_version", read_then_the_other_upgrades)
    try:
        assert await migrations.upgrade(second) == (0, migrations.LATEST)
        assert applied == [m.version for m in migrations.MIGRATIONS]  # each once, by the first
        assert await read(second) == migrations.LATEST
        assert "pending_mode" in await columns(second, "deployments")
    finally:
        await first.close()
        await second.close()


async def test_newer_database_is_refused(tmp_path):
    path = tmp_path / "ondemand.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    con.execute("INSERT INTO schema_version VALUES (999)")
    con.commit()
    con.close()
    with pytest.raises(migrations.SchemaTooNew, match="newer"):
        await Store.open(path)


async def test_recipes_migration_widens_engines_and_keeps_rows_and_ids(tmp_path):
    """Migration 5 makes the deployments table anew (SQLite cannot alter a CHECK): every row and
    column survives, a removed deployment's id is never handed out again, and the new engines
    and fields are accepted."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=4)
        await migrations.add_missing_columns(db)
        for i in range(3):
            await db.execute(
                "INSERT INTO deployments (name, served_name, engine, state, mode, args, gpu_count, pending_mode, "
                "created_at, updated_at) VALUES (?, ?, 'llamacpp', 'ready', 'on_demand', '[\"--x\"]', 2, ?, 0, 0)",
                (f"d{i}", f"D{i}", "always_on" if i == 1 else None))
        await db.execute("DELETE FROM deployments WHERE name = 'd2'")  # id 3 is gone
        with pytest.raises(sqlite3.IntegrityError):
            await db.execute("INSERT INTO deployments (name, served_name, engine, state, created_at, updated_at) "
                             "VALUES ('s', 'S', 'sglang', 'stopped', 0, 0)")

    store = await Store.open(path)
    try:
        assert await store.version() == migrations.LATEST
        deps = await store.deployments()
        assert [(d["id"], d["name"], d["engine"], d["args"], d["gpu_count"], d["pending_mode"]) for d in deps] == [
            (1, "d0", "llamacpp", ["--x"], 2, None), (2, "d1", "llamacpp", ["--x"], 2, "always_on")]
        assert all(d["model"] is None and d["env"] == {} and d["volumes"] == [] for d in deps)
        new = await store.insert_deployment(dict(name="s", served_name="S", engine="sglang", model="org/m",
                                                 env={"A": "1"}, volumes=["/m:/m:ro"], state="stopped"))
        assert new["id"] == 4 and (new["model"], new["env"], new["volumes"]) == ("org/m", {"A": "1"}, ["/m:/m:ro"])
        await store.insert_deployment(dict(name="c", served_name="C", engine="custom", state="stopped"))
        with pytest.raises(sqlite3.IntegrityError):
            await store.insert_deployment(dict(name="t", served_name="T", engine="tgi", state="stopped"))
    finally:
        await store.close()


async def test_adaptive_warmth_migration_keeps_rows_fixed_and_the_idle_gaps_their_newest(tmp_path):
    """Migration 8: old rows read keep_warm 'fixed'; a deployment's idle gaps are kept, the newest
    ``keep``, across a reopen (a restart keeps what was learned), and go with the deployment."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=7)
        await db.execute("INSERT INTO deployments (name, served_name, engine, state, created_at, updated_at) "
                         "VALUES ('a', 'A', 'vllm', 'stopped', 0, 0)")

    store = await Store.open(path)
    try:
        assert await store.version() == migrations.LATEST >= 8
        (old,) = await store.deployments()
        assert old["keep_warm"] == "fixed"
        with pytest.raises(sqlite3.IntegrityError):
            await store.update_deployment(old["id"], keep_warm="sometimes")
        other = await store.insert_deployment(dict(name="b", served_name="B", engine="vllm", state="stopped"))
        for i in range(7):
            await store.write_idle_gap(old["id"], at=100.0 + i, gap_s=float(i), keep=5)
        await store.write_idle_gap(other["id"], at=200.0, gap_s=-1.0, keep=5)  # a clock's step back: nil
    finally:
        await store.close()

    store = await Store.open(path)
    try:
        assert await store.idle_gaps() == {old["id"]: [2.0, 3.0, 4.0, 5.0, 6.0], other["id"]: [0.0]}
        await store.delete_deployment(other["id"])
        assert (await store.prune(0.0, 10))["idle_gaps"] == 1
        assert await store.idle_gaps() == {old["id"]: [2.0, 3.0, 4.0, 5.0, 6.0]}
    finally:
        await store.close()


async def test_wake_levels_migration_keeps_old_rows_without_a_level(tmp_path):
    """Migration 9: ``starts`` gains a wake's level; the rows written before keep none (a wake of
    unknown level, a cold start), the rows after carry theirs, and no other level is taken."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=8)
        assert "level" not in await columns(db, "starts")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (1, 0, 40, 'start')")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (1, 1, 2.5, 'wake')")

    store = await Store.open(path)
    try:
        assert await store.version() == migrations.LATEST >= 9
        await store.write_start(1, at=2.0, duration_s=9.0, kind="wake", keep=20, level=2)
        assert await store.starts(20) == {1: [("start", 40.0, None), ("wake", 2.5, None), ("wake", 9.0, 2)]}
        with pytest.raises(sqlite3.IntegrityError):
            await store.write_start(1, at=3.0, duration_s=1.0, kind="wake", keep=20, level=3)
        assert len((await store.starts(20))[1]) == 3  # the refused row left nothing behind
    finally:
        await store.close()


async def test_sleeps_migration_rebuilds_starts_keeping_rows_ids_and_the_index(tmp_path):
    """Migration 10: ``starts`` is made anew so that ``kind`` may be ``sleep``; every row keeps
    its id, the next id follows the highest ever handed out (a deleted last row's too), the
    index on (deployment, id) is made again, and a kind outside the three is still refused."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=9)
        with pytest.raises(sqlite3.IntegrityError):
            await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (1, 0, 3, 'sleep')")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (1, 0, 40, 'start')")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind, level) VALUES (1, 1, 2.5, 'wake', 1)")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (2, 2, 50, 'start')")
        await db.execute("DELETE FROM starts WHERE deployment_id = 2")  # id 3 was handed out

    store = await Store.open(path)
    try:
        assert await store.version() == migrations.LATEST >= 10
        await store.write_start(1, at=3.0, duration_s=21.0, kind="sleep", keep=20, level=1)
        assert await store.starts(20) == {1: [("start", 40.0, None), ("wake", 2.5, 1), ("sleep", 21.0, 1)]}
        async with store._reading() as db:
            assert [r[0] for r in await db.execute_fetchall("SELECT id FROM starts ORDER BY id")] == [1, 2, 4]
            assert [tuple(r) for r in await db.execute_fetchall(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'starts'")] == [("starts_deployment",)]
        with pytest.raises(sqlite3.IntegrityError):
            await store.write_start(1, at=4.0, duration_s=1.0, kind="nap", keep=20)
    finally:
        await store.close()


async def test_sleeps_migration_refuses_a_starts_table_it_did_not_make(tmp_path):
    """A ``starts`` whose kinds are held back by a CHECK other than migration 4's is not passed
    over (every sleep's row would be refused later): the migration says so, and the file stays at
    version 9 with its rows."""
    path = tmp_path / "ondemand.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        await migrations.upgrade(db, target=9)
        await db.execute("DROP TABLE starts")
        await db.execute("CREATE TABLE starts (id INTEGER PRIMARY KEY AUTOINCREMENT, deployment_id INTEGER NOT NULL, "
                         "at REAL NOT NULL, duration_s REAL NOT NULL, kind TEXT NOT NULL CHECK (kind IN ('start')), "
                         "level INTEGER)")
        await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (1, 0, 40, 'start')")
        with pytest.raises(RuntimeError, match="not as migration 4 made it"):
            await migrations.upgrade(db)
        assert await migrations.schema_version(db) == 9
        assert await db.execute_fetchall("SELECT COUNT(*) FROM starts") == [(1,)]


def test_the_migrations_are_numbered_from_one_in_order_each_described():
    """The runner applies them in the list's order and stores the last one's number: a number
    repeated or out of order would skip a migration on some files."""
    versions = [m.version for m in migrations.MIGRATIONS]
    assert versions == sorted(set(versions)) and versions[0] == 1 and versions[-1] == migrations.LATEST
    assert all(m.description for m in migrations.MIGRATIONS)


async def test_the_missing_columns_are_added_once_and_a_fresh_upgrade_has_them(tmp_path):
    """``add_missing_columns`` adds what a table lacks, names it, and adds nothing the next time
    (it runs at every start); an upgrade from nothing ends with them too."""
    db = await aiosqlite.connect(tmp_path / "ondemand.db", isolation_level=None)
    try:
        await db.execute("CREATE TABLE deployments (id INTEGER PRIMARY KEY)")
        assert await migrations.add_missing_columns(db) == ["deployments.pending_mode"]
        assert await migrations.add_missing_columns(db) == []
        assert await columns(db, "deployments") == {"id", "pending_mode"}
    finally:
        await db.close()
    db = await aiosqlite.connect(tmp_path / "fresh.db", isolation_level=None)
    try:
        assert await migrations.upgrade(db) == (0, migrations.LATEST)
        assert "pending_mode" in await columns(db, "deployments")
        assert await migrations.add_missing_columns(db) == []
    finally:
        await db.close()
