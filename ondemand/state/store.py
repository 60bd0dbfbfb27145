"""The state file: one SQLite database, ``{state_dir}/ondemand.db``.

Owns the connection (aiosqlite, WAL, foreign keys, ``synchronous=NORMAL``,
a busy timeout), the transaction discipline and the typed reads and writes of
``deployments``, ``events``, ``audit``, ``starts`` and ``idle_gaps``. Every write runs in a transaction;
nested ``transaction()`` blocks join the outer one. One asyncio lock orders
the transactions of this process, because aiosqlite runs one connection on a
thread and two interleaved BEGINs on it would join each other's work. Reads
take the same lock (unless they are part of a transaction): on the one shared
connection a read in the middle of another task's transaction would see its
uncommitted rows, half of a change or one about to be rolled back.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

from ..errors import StateFileError
from . import migrations
from .lock import not_a_directory

DEPLOYMENT_FIELDS = (
    "id", "name", "served_name", "engine", "image", "args", "command", "port", "memory_gib",
    "gpu_count", "gpu_ids", "role", "state", "state_reason", "log_tail", "mode", "idle_timeout_s",
    "pending_mode", "gpus", "measured_gib", "created_at", "updated_at",
    "model", "env", "volumes",
    "priority", "max_inflight",
    "idle_action", "sleep_level", "host_gib", "asleep_gib", "sleep_host_gib", "wake_check",
    "keep_warm",
)
_JSON_FIELDS = ("args", "command", "gpus", "volumes")  # lists, stored as JSON ([] when empty)
_NULLABLE_JSON = ("gpu_ids",)  # lists or NULL

# Set while this task is inside a transaction, so nested blocks join it.
_in_tx: contextvars.ContextVar[bool] = contextvars.ContextVar("ondemand_in_tx", default=False)


def deployment_fields(row: aiosqlite.Row | sqlite3.Row) -> dict[str, Any]:
    """A ``deployments`` row as a deployment's fields (its lists decoded), for
    ``Deployment.from_row``; a replay reads the file read only with ``sqlite3`` and the same rule."""
    # Row.keys(), not the Row: iterating a sqlite3.Row gives its values.
    dep = {k: row[k] for k in row.keys() if k in DEPLOYMENT_FIELDS}  # noqa: SIM118
    for k in _JSON_FIELDS:
        dep[k] = orjson.loads(dep[k]) if dep.get(k) else []
    for k in _NULLABLE_JSON:
        dep[k] = orjson.loads(dep[k]) if dep.get(k) is not None else None
    if "env" in dep:
        dep["env"] = orjson.loads(dep["env"]) if dep["env"] else {}
    return dep


def _to_columns(values: dict[str, Any]) -> dict[str, Any]:
    """Lists as the JSON text their columns hold."""
    for k in _JSON_FIELDS:
        if k in values:
            values[k] = orjson.dumps(list(values[k] or [])).decode()
    for k in _NULLABLE_JSON:
        if values.get(k) is not None:
            values[k] = orjson.dumps(list(values[k])).decode()
    if "env" in values:  # {NAME: value}, from a mapping or the deployment's sorted pairs
        values["env"] = orjson.dumps(dict(values["env"] or {})).decode()
    return values


def _try_open(path: Path) -> None:
    sqlite3.connect(path).close()


class Store:
    def __init__(self, db: aiosqlite.Connection, path: Path):
        self.db = db
        self.path = path
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: str | os.PathLike[str], *, migrate: bool = True) -> Store:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file in the directory's place: one line (migrate)
            raise StateFileError(f"the state file {path} cannot be opened: {path.parent} "
                                 f"{not_a_directory(path.parent)}; give state_dir a directory's path") from None
        # A file that cannot be opened (a read-only disk, a directory not ours) fails here, in a
        # plain thread: aiosqlite's failed connect leaves its worker thread to call the loop
        # after a command's loop has closed ("Exception in thread ...": a traceback after the
        # command's one line; as in aiosqlite issue 241).
        await asyncio.to_thread(_try_open, path)
        db = await aiosqlite.connect(path, isolation_level=None)
        try:
            db.row_factory = aiosqlite.Row
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA foreign_keys=ON")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.execute("PRAGMA busy_timeout=5000")
            if migrate:
                await migrations.upgrade(db)
        except BaseException:
            await db.close()
            raise
        return cls(db, path)

    async def close(self) -> None:
        await self.db.close()

    async def version(self) -> int:
        return await migrations.schema_version(self.db)

    async def ping(self) -> None:
        """One trivial read, as any read waits: behind a running transaction."""
        async with self._reading() as db, db.execute("SELECT 1") as cur:
            await cur.fetchone()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        if _in_tx.get():
            yield self.db
            return
        async with self._lock:
            token = _in_tx.set(True)
            try:
                await self.db.execute("BEGIN IMMEDIATE")
                try:
                    yield self.db
                    await self.db.execute("COMMIT")
                except BaseException as exc:
                    # SQLite rolls some failures back itself (a full disk, an I/O error): then
                    # this ROLLBACK fails, harmlessly. Either way nothing of it was written.
                    with contextlib.suppress(sqlite3.Error):
                        await self.db.execute("ROLLBACK")
                    if isinstance(exc, sqlite3.OperationalError) and not isinstance(exc, sqlite3.IntegrityError):
                        raise StateFileError(f"the state file {self.path} cannot be written: {exc}; "
                                             "nothing of this change was written (free space there?)") from exc
                    raise
            finally:
                _in_tx.reset(token)

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[aiosqlite.Connection]:
        """Read committed rows only: wait for another task's transaction to end."""
        if _in_tx.get():
            yield self.db
            return
        async with self._lock:
            yield self.db

    # --- deployments ---------------------------------------------------------

    async def deployments(self) -> list[dict[str, Any]]:
        async with self._reading() as db, db.execute("SELECT * FROM deployments ORDER BY id") as cur:
            return [deployment_fields(r) for r in await cur.fetchall()]

    async def deployment(self, dep_id: int) -> dict[str, Any] | None:
        async with self._reading() as db, db.execute("SELECT * FROM deployments WHERE id = ?", (dep_id,)) as cur:
            row = await cur.fetchone()
        return deployment_fields(row) if row else None

    async def insert_deployment(self, fields: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        values = {k: v for k, v in fields.items() if k in DEPLOYMENT_FIELDS and k != "id"}
        values.setdefault("created_at", now)
        values["updated_at"] = now
        values = _to_columns(values)
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        async with self.transaction() as db:
            cur = await db.execute(f"INSERT INTO deployments ({cols}) VALUES ({marks})", tuple(values.values()))
            dep_id = cur.lastrowid
        assert dep_id is not None  # an INSERT sets it
        dep = await self.deployment(dep_id)
        assert dep is not None
        return dep

    async def update_deployment(self, dep_id: int, **fields: Any) -> None:
        """Update some fields; call inside ``transaction()`` to join other writes."""
        fields = {k: v for k, v in fields.items() if k in DEPLOYMENT_FIELDS and k != "id"}
        fields.setdefault("updated_at", time.time())
        fields = _to_columns(fields)
        sets = ", ".join(f"{k} = ?" for k in fields)
        async with self.transaction() as db:
            await db.execute(f"UPDATE deployments SET {sets} WHERE id = ?", (*fields.values(), dep_id))

    async def delete_deployment(self, dep_id: int) -> None:
        async with self.transaction() as db:
            await db.execute("DELETE FROM deployments WHERE id = ?", (dep_id,))

    # --- events and audit ----------------------------------------------------

    async def write_event(self, *, actor: str, text: str, deployment_id: int | None = None,
                          user: str | None = None, detail: dict[str, Any] | None = None) -> None:
        async with self.transaction() as db:
            await db.execute(
                "INSERT INTO events (at, actor, user, deployment_id, text, detail) VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), actor, user, deployment_id, text, orjson.dumps(detail or {}).decode()))

    async def write_audit(self, *, action: str, actor: str, text: str, deployment_id: int | None = None,
                          user: str | None = None, detail: dict[str, Any] | None = None) -> None:
        async with self.transaction() as db:
            await db.execute(
                "INSERT INTO audit (at, action, actor, user, deployment_id, text, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), action, actor, user, deployment_id, text, orjson.dumps(detail or {}).decode()))

    async def events(self, deployment_id: int | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return await self._rows("events", deployment_id, limit)

    async def audit(self, deployment_id: int | None = None, limit: int = 100,
                    before: int | None = None) -> list[dict[str, Any]]:
        """Newest first; ``before``: only rows older than that id (the next page)."""
        return await self._rows("audit", deployment_id, limit, before)

    async def _rows(self, table: str, deployment_id: int | None, limit: int,
                    before: int | None = None) -> list[dict[str, Any]]:
        conds, args = [], []
        if deployment_id is not None:
            conds.append("deployment_id = ?")
            args.append(deployment_id)
        if before is not None:
            conds.append("id < ?")
            args.append(before)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        async with self._reading() as db, db.execute(
                f"SELECT * FROM {table} {where} ORDER BY id DESC LIMIT ?", (*args, limit)) as cur:
            rows = await cur.fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["detail"] = orjson.loads(d["detail"])
            out.append(d)
        return out

    # --- start history -------------------------------------------------------

    async def write_start(self, deployment_id: int, *, at: float, duration_s: float, kind: str,
                          keep: int, level: int | None = None) -> None:
        """One successful start (a wake: ``level``, the sleep level it woke from), or a sleep's
        call (``kind`` "sleep", at ``level``). Only the last ``keep`` of each kind and level are
        kept per deployment, so that frequent cold starts or level-1 wakes do not push out its
        rare level-2 wakes."""
        async with self.transaction() as db:
            await db.execute("INSERT INTO starts (deployment_id, at, duration_s, kind, level) VALUES (?, ?, ?, ?, ?)",
                             (deployment_id, at, duration_s, kind, level))
            await db.execute(
                "DELETE FROM starts WHERE deployment_id = ? AND kind = ? AND level IS ? AND id NOT IN "
                "(SELECT id FROM starts WHERE deployment_id = ? AND kind = ? AND level IS ? ORDER BY id DESC LIMIT ?)",
                (deployment_id, kind, level, deployment_id, kind, level, keep))

    async def starts(self, limit: int) -> dict[int, list[tuple[str, float, int | None]]]:
        """Each deployment's starts, oldest first: (kind, duration_s, level), the level a wake woke
        from or a sleep went to (None for a cold start, and for a wake recorded before schema 9;
        sleeps are recorded since schema 10); the last ``limit`` of each kind and level."""
        out: dict[int, list[tuple[str, float, int | None]]] = {}
        # The table holds a few rows per deployment (write_start's keep): read them all.
        async with self._reading() as db, db.execute(
                "SELECT deployment_id, kind, duration_s, level FROM starts ORDER BY id DESC") as cur:
            seen: dict[tuple[int, str, int | None], int] = {}
            for dep_id, kind, duration, level in await cur.fetchall():
                key = (dep_id, kind, level)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] <= limit:
                    out.setdefault(dep_id, []).append((kind, duration, level))
        return {dep_id: rows[::-1] for dep_id, rows in out.items()}

    # --- idle gaps (adaptive warmth) -------------------------------------------

    async def write_idle_gap(self, deployment_id: int, *, at: float, gap_s: float, keep: int) -> None:
        """One idle gap that ended at ``at``; only the deployment's last ``keep`` are kept."""
        async with self.transaction() as db:
            await db.execute("INSERT INTO idle_gaps (deployment_id, at, gap_s) VALUES (?, ?, ?)",
                             (deployment_id, at, max(0.0, gap_s)))
            await db.execute(
                "DELETE FROM idle_gaps WHERE deployment_id = ? AND id NOT IN "
                "(SELECT id FROM idle_gaps WHERE deployment_id = ? ORDER BY id DESC LIMIT ?)",
                (deployment_id, deployment_id, keep))

    async def idle_gaps(self) -> dict[int, list[float]]:
        """Each deployment's kept idle gaps, oldest first."""
        out: dict[int, list[float]] = {}
        async with self._reading() as db, db.execute(
                "SELECT deployment_id, gap_s FROM idle_gaps ORDER BY id") as cur:
            for row in await cur.fetchall():
                out.setdefault(row[0], []).append(row[1])
        return out

    # --- retention -------------------------------------------------------------

    async def prune(self, before: float, limit: int) -> dict[str, int]:
        """Delete up to ``limit`` events and up to ``limit`` audit rows older than ``before``
        (oldest first), and the start history of deployments that are gone, in one
        transaction. Returns how many rows went from each table."""
        counts = {}
        async with self.transaction() as db:
            for table in ("events", "audit"):
                cur = await db.execute(
                    f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE at < ? ORDER BY at LIMIT ?)",
                    (before, limit))
                counts[table] = cur.rowcount
            for table in ("starts", "idle_gaps"):  # the histories of deployments that are gone
                cur = await db.execute(f"DELETE FROM {table} WHERE deployment_id NOT IN (SELECT id FROM deployments)")
                counts[table] = cur.rowcount
        return counts
