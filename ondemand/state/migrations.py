"""Schema migrations of the state file, in order, each described.

Each migration runs once, in one transaction together with its bump of
``schema_version`` (mautrix's async_db pattern), so a crash leaves the file at
the old version or the new one, never between. A database newer than this
code is refused with an explanation. After the numbered migrations,
``add_missing_columns`` adds nullable columns that later code expects
(``pending_mode``), which is safe to run on every start.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import aiosqlite


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    description: str
    apply: Callable[[aiosqlite.Connection], Awaitable[None]]


async def _columns(db: aiosqlite.Connection, table: str) -> set[str]:
    async with db.execute(f"PRAGMA table_info({table})") as cur:
        return {row[1] for row in await cur.fetchall()}


async def _add_columns(db: aiosqlite.Connection, table: str, columns: Iterable[tuple[str, str]]) -> list[str]:
    """Adds those of ``columns`` (name, SQL type) that ``table`` lacks; the names it added."""
    have = await _columns(db, table)
    added = []
    for column, sqltype in columns:
        if column not in have:
            await db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sqltype}")
            added.append(column)
    return added


@contextlib.asynccontextmanager
async def _immediate(db: aiosqlite.Connection) -> AsyncIterator[None]:
    """One write transaction (BEGIN IMMEDIATE: a second process opening the file waits for it),
    committed when the block ends, rolled back when it raises (a cancellation too)."""
    await db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    await db.execute("COMMIT")


async def _v1_initial(db: aiosqlite.Connection) -> None:
    await db.execute("""
        CREATE TABLE deployments (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            name TEXT NOT NULL UNIQUE,
            served_name TEXT NOT NULL,
            engine TEXT NOT NULL CHECK (engine IN ('vllm', 'llamacpp')),
            image TEXT,
            args TEXT NOT NULL DEFAULT '[]',
            command TEXT NOT NULL DEFAULT '[]',
            port INTEGER NOT NULL DEFAULT 8000,
            memory_gib REAL NOT NULL DEFAULT 0,
            role TEXT NOT NULL DEFAULT 'model' CHECK (role IN ('model', 'decision', 'system')),
            state TEXT NOT NULL DEFAULT 'planned',
            state_reason TEXT,
            log_tail TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""")
    await db.execute("""
        CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            actor TEXT NOT NULL,
            user TEXT,
            deployment_id INTEGER,
            text TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '{}'
        )""")
    await db.execute("CREATE INDEX events_deployment ON events (deployment_id, id)")
    await db.execute("""
        CREATE TABLE audit (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            action TEXT NOT NULL,
            actor TEXT NOT NULL,
            user TEXT,
            deployment_id INTEGER,
            text TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '{}'
        )""")


async def _v2_ondemand_mode(db: aiosqlite.Connection) -> None:
    # The on-demand mode migration: existing deployments keep their
    # behaviour, so every existing row becomes always_on.
    await _add_columns(db, "deployments", (
        ("mode", "TEXT CHECK (mode IS NULL OR mode IN ('on_demand', 'always_on'))"),
        ("idle_timeout_s", "INTEGER")))
    await db.execute("UPDATE deployments SET mode = 'always_on'")


async def _v3_gpu_placement(db: aiosqlite.Connection) -> None:
    # GPU placement: existing rows keep running on every GPU (gpu_count NULL).
    await _add_columns(db, "deployments", (
        ("gpu_count", "INTEGER CHECK (gpu_count IS NULL OR gpu_count >= 0)"),
        ("gpu_ids", "TEXT"),  # JSON list of GPU indices, or NULL
        ("gpus", "TEXT NOT NULL DEFAULT '[]'"),  # the GPUs its engine holds
        ("measured_gib", "REAL")))


async def _v4_starts_and_retention(db: aiosqlite.Connection) -> None:
    # How long each successful start took (starting -> ready), a few per deployment;
    # and indexes on `at`, so that retention's hourly delete finds old rows without a scan.
    await db.execute("""
        CREATE TABLE IF NOT EXISTS starts (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            deployment_id INTEGER NOT NULL,
            at REAL NOT NULL,
            duration_s REAL NOT NULL,
            kind TEXT NOT NULL DEFAULT 'start' CHECK (kind IN ('start', 'wake'))
        )""")
    await db.execute("CREATE INDEX IF NOT EXISTS starts_deployment ON starts (deployment_id, id)")
    await db.execute("CREATE INDEX IF NOT EXISTS events_at ON events (at)")
    await db.execute("CREATE INDEX IF NOT EXISTS audit_at ON audit (at)")


_OLD_ENGINES = "CHECK (engine IN ('vllm', 'llamacpp'))"
_ENGINES = "CHECK (engine IN ('vllm', 'sglang', 'llamacpp', 'custom'))"


async def _table_sql(db: aiosqlite.Connection, table: str) -> str:
    """The statement that made ``table``, as SQLite keeps it ("" when there is none)."""
    async with db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)) as cur:
        row = await cur.fetchone()
    return row[0] if row else ""


async def _widen_check(db: aiosqlite.Connection, table: str, sql: str, old: str, new: str) -> None:
    """``table`` (made by ``sql``) made anew with its CHECK ``old`` as ``new`` and its rows copied,
    when ``old`` is in it: SQLite cannot alter a CHECK (its "other kinds of table schema
    changes"). AUTOINCREMENT's high-water mark is kept; its indexes go with the old table, and the
    caller makes them again. The name is matched quoted or not: SQLite quotes a renamed table's."""
    if old not in sql:
        return
    async with db.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)) as cur:
        seq = await cur.fetchone()
    await db.execute(re.sub(rf'^CREATE TABLE\s+"?{table}"?', f"CREATE TABLE {table}_new", sql.replace(old, new)))
    await db.execute(f"INSERT INTO {table}_new SELECT * FROM {table}")
    await db.execute(f"DROP TABLE {table}")
    await db.execute(f"ALTER TABLE {table}_new RENAME TO {table}")
    if seq is not None:
        await db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = ?", (seq[0], table))


async def _v5_engine_recipes(db: aiosqlite.Connection) -> None:
    # Engine recipes: two more engines, and what a recipe needs (the model, env, volumes). Rows
    # keep model NULL: they run their image/args or command exactly as before. The table is made
    # anew, keeping its id mark: no removed deployment's id is handed out again (LiteLLM's entries
    # name ids).
    await _widen_check(db, "deployments", await _table_sql(db, "deployments"), _OLD_ENGINES, _ENGINES)
    await _add_columns(db, "deployments", (
        ("model", "TEXT"),
        ("env", "TEXT NOT NULL DEFAULT '{}'"),  # JSON object
        ("volumes", "TEXT NOT NULL DEFAULT '[]'")))  # JSON list


async def _v6_priorities_and_limits(db: aiosqlite.Connection) -> None:
    # Priorities and limits: every existing row stays normal with no limit (the column
    # defaults), so nothing behaves differently until an administrator sets them. Version 5
    # is the engine recipes' (model, env, volumes); the runner applies whatever is
    # missing in order and skips a number it does not know, so the two may land in either order.
    await _add_columns(db, "deployments", (
        ("priority", "TEXT NOT NULL DEFAULT 'normal' CHECK (priority IN ('low', 'normal', 'high'))"),
        ("max_inflight", "INTEGER CHECK (max_inflight IS NULL OR max_inflight BETWEEN 1 AND 10000)")))


async def _v7_tiered_warmth(db: aiosqlite.Connection) -> None:
    # Tiered warmth: every existing row reads idle_action 'auto' (a vLLM or SGLang recipe on
    # discrete GPUs then sleeps where it was stopped before; anything else still stops). The
    # rest is the engine's life, NULL until it first sleeps: its level and host memory while
    # asleep, what it still holds on its GPUs asleep, the last host memory a level-1 sleep was
    # measured at (the next one's prediction), and the one-token answer its wakes must match.
    await _add_columns(db, "deployments", (
        ("idle_action", "TEXT NOT NULL DEFAULT 'auto' CHECK (idle_action IN ('auto', 'stop', 'sleep', 'sleep2'))"),
        ("sleep_level", "INTEGER CHECK (sleep_level IS NULL OR sleep_level IN (1, 2))"),
        ("host_gib", "REAL"),
        ("asleep_gib", "REAL"),
        ("sleep_host_gib", "REAL"),
        ("wake_check", "TEXT")))


async def _v8_adaptive_warmth(db: aiosqlite.Connection) -> None:
    # Adaptive warmth: every existing row keeps its fixed idle timeout; the idle gaps (from the
    # moment its engine became idle to the next request's arrival) of each deployment, the newest
    # few hundred (write_idle_gap's keep), so that a restart keeps what was learned.
    await _add_columns(db, "deployments", (
        ("keep_warm", "TEXT NOT NULL DEFAULT 'fixed' CHECK (keep_warm IN ('fixed', 'adaptive'))"),))
    await db.execute("""
        CREATE TABLE IF NOT EXISTS idle_gaps (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            deployment_id INTEGER NOT NULL,
            at REAL NOT NULL,
            gap_s REAL NOT NULL CHECK (gap_s >= 0)
        )""")
    await db.execute("CREATE INDEX IF NOT EXISTS idle_gaps_deployment ON idle_gaps (deployment_id, id)")


async def _v9_wake_levels(db: aiosqlite.Connection) -> None:
    # A wake's sleep level beside its duration, so that each level's wakes have their own median
    # after a restart (adaptive warmth's rest tiers, a replay's wake_s and wake2_s). Rows written
    # before stay NULL: a wake of an unknown level, and every cold start.
    await _add_columns(db, "starts", (("level", "INTEGER CHECK (level IS NULL OR level IN (1, 2))"),))


_OLD_KINDS = "CHECK (kind IN ('start', 'wake'))"
_KINDS = "CHECK (kind IN ('start', 'wake', 'sleep'))"


async def _v10_sleeps(db: aiosqlite.Connection) -> None:
    # A sleep's call beside the starts and wakes (kind 'sleep', with its level), so that a restart
    # keeps how long each level's sleep holds the memory (warmth by value weighs it).
    # The table is made anew (``_widen_check``, as in version 5), then its index again.
    sql = await _table_sql(db, "starts")
    if _KINDS in sql or "CHECK (kind IN" not in sql:
        return  # made so already, or nothing holds the kinds back
    if _OLD_KINDS not in sql:
        # Only migration 4 made this table; anything else would pass this version and then
        # refuse every sleep's row: say so now, in the transaction that rolls back.
        raise RuntimeError(f"the state file's starts table is not as migration 4 made it: {sql!r}")
    await _widen_check(db, "starts", sql, _OLD_KINDS, _KINDS)
    await db.execute("CREATE INDEX IF NOT EXISTS starts_deployment ON starts (deployment_id, id)")


MIGRATIONS: list[Migration] = [
    Migration(1, "deployments, events and audit", _v1_initial),
    Migration(2, "deployments: on-demand mode", _v2_ondemand_mode),
    Migration(3, "deployments: GPU placement (gpu_count, gpu_ids, gpus, measured_gib)", _v3_gpu_placement),
    Migration(4, "starts (start durations); events and audit indexed by time", _v4_starts_and_retention),
    Migration(5, "deployments: engine recipes (sglang and custom engines; model, env, volumes)", _v5_engine_recipes),
    Migration(6, "deployments: priority and max_inflight", _v6_priorities_and_limits),
    Migration(7, "deployments: tiered warmth (idle_action; sleep level, host memory, wake check)", _v7_tiered_warmth),
    Migration(8, "deployments: adaptive warmth (keep_warm); idle_gaps", _v8_adaptive_warmth),
    Migration(9, "starts: the level a wake woke from", _v9_wake_levels),
    Migration(10, "starts: sleeps (how long each level's sleep call took)", _v10_sleeps),
]

LATEST = MIGRATIONS[-1].version

# Nullable columns added outside the numbered migrations: (table, column, SQL type).
MISSING_COLUMNS = [
    ("deployments", "pending_mode", "TEXT CHECK (pending_mode IS NULL OR pending_mode = 'always_on')"),
]


class SchemaTooNew(Exception):
    pass


async def schema_version(db: aiosqlite.Connection) -> int:
    await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    async with db.execute("SELECT version FROM schema_version") as cur:
        row = await cur.fetchone()
    return row[0] if row else 0


async def add_missing_columns(db: aiosqlite.Connection) -> list[str]:
    added = []
    for table, column, sqltype in MISSING_COLUMNS:
        added += [f"{table}.{c}" for c in await _add_columns(db, table, ((column, sqltype),))]
    return added


async def upgrade(db: aiosqlite.Connection, target: int = LATEST) -> tuple[int, int]:
    """Apply the migrations up to ``target``; returns (from, to).

    The connection must be in autocommit mode (isolation_level=None): each
    migration opens its own BEGIN IMMEDIATE so that two processes opening the
    same file cannot both apply it.
    """
    start = await schema_version(db)
    if start > LATEST:
        raise SchemaTooNew(
            f"the state file is at schema version {start}, newer than this ondemand "
            f"({LATEST}): it was written by a newer release; run that release or restore a backup")
    current = start
    for migration in MIGRATIONS:
        if migration.version <= current or migration.version > target:
            continue
        async with _immediate(db):
            # Re-read under the write lock: another process may have got here first.
            current = await schema_version(db)
            if current < migration.version:
                await migration.apply(db)
                await db.execute("DELETE FROM schema_version")
                await db.execute("INSERT INTO schema_version (version) VALUES (?)", (migration.version,))
                current = migration.version
    if current >= 1:
        async with _immediate(db):
            await add_missing_columns(db)
    return start, current
