"""The command line's way to the state: the admin API over the Unix socket
``{state_dir}/admin.sock`` (no token: the socket is 0600), and, when no server
runs, the state file itself, read only.

No ``click`` here: failures are exceptions (``NoServer``) or ``None``; the
commands decide how to tell the user.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from ..config import Config


class NoServer(Exception):
    """No server answers on the admin socket."""


def _session(cfg: Config) -> Any:
    """A client session on the admin socket (no overall timeout: a log may be followed);
    raises NoServer when there is no socket."""
    import aiohttp
    sock = cfg.admin_socket
    if not sock.exists():
        raise NoServer(f"no server: {sock} does not exist")
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))


async def request(cfg: Config, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One admin API call over the Unix socket: (HTTP status, parsed JSON or None)."""
    import aiohttp
    sock = cfg.admin_socket
    try:
        async with _session(cfg) as s:
            async with s.request(method, f"http://ondemand{cfg.base_path}/api{path}",
                                 data=None if body is None else orjson.dumps(body),
                                 headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                return r.status, (orjson.loads(raw) if raw else None)
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise NoServer(f"no server answers on {sock}: {exc}") from None


class Refused(Exception):
    """The server answered with an error: its status and parsed error body."""

    def __init__(self, status: int, body: Any):
        super().__init__(status)
        self.status = status
        self.body = body


async def stream(cfg: Config, path: str, write: Callable[[bytes], None]) -> None:
    """A GET whose text answer is handed to ``write`` chunk by chunk as it arrives (a log
    that is followed), until the server ends it. Raises NoServer, or Refused for an error."""
    import aiohttp
    sock = cfg.admin_socket
    try:
        async with _session(cfg) as s:
            async with s.get(f"http://ondemand{cfg.base_path}/api{path}") as r:
                if r.status >= 400:
                    raw = await r.read()
                    try:
                        body = orjson.loads(raw) if raw else None
                    except orjson.JSONDecodeError:
                        body = None
                    raise Refused(r.status, body)
                async for chunk in r.content.iter_any():
                    write(chunk)
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise NoServer(f"no server answers on {sock}: {exc}") from None


async def stored_deployments(cfg: Config) -> list[dict[str, Any]] | None:
    """The deployment rows of the state file (not migrated), or None without a file."""
    from ..state.store import Store
    if not cfg.db_path.exists():
        return None
    store = await Store.open(cfg.db_path, migrate=False)
    try:
        return await store.deployments()
    finally:
        await store.close()


async def offline_views(cfg: Config) -> list[dict[str, Any]] | None:
    """Deployment views read from the state file when no server runs (no live
    counters: ``offline`` is true), or None without a file."""
    rows = await stored_deployments(cfg)
    if rows is None:
        return None
    for row in rows:
        row["mode"] = row.get("mode") or "always_on"
        phase = "failed" if row["state"] == "failed" else \
            "sleeping" if row["state"] in ("stopped", "asleep", "stopping", "planned") else "idle"
        row["ondemand"] = {"inflight": 0, "queued": 0, "queue_position": None, "last_request_at": None,
                           "phase": phase}
        row["last_start_s"] = row["start_eta_s"] = None  # the history is the server's to read
        row["offline"] = True
    return rows


async def offline_audit(cfg: Config, deployment_id: int | None, limit: int
                        ) -> tuple[list[dict[str, Any]], dict[int, str]] | None:
    """Audit rows read from the state file when no server runs (newest first, as ``GET
    /api/audit``), and the deployments' names by id; None without a file."""
    from ..state.store import Store
    if not cfg.db_path.exists():
        return None
    store = await Store.open(cfg.db_path, migrate=False)
    try:
        rows = await store.audit(deployment_id, limit=limit)
        names = {d["id"]: d["name"] for d in await store.deployments()}
    finally:
        await store.close()
    return rows, names
