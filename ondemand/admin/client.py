"""The command line's way to the state: the admin API over the Unix socket
``{state_dir}/admin.sock`` (no token: the socket is 0600), and, when no server
runs, the state file itself, read only.

No ``click`` here: failures are exceptions (``NoServer``) or ``None``; the
commands decide how to tell the user.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools
import orjson

from ..config import Config


class NoServer(Exception):
    """No server answers on the admin socket."""


class _Answer:
    """httptools' callbacks for one answer: its status once its head is read, its body handed on
    with it as it comes, and its end."""

    def __init__(self, on_body: Callable[[int, bytes], None]):
        self.deliver = on_body
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.done = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, chunk: bytes) -> None:
        self.deliver(self.status, chunk)

    def on_message_complete(self) -> None:
        self.done = True


async def _exchange(cfg: Config, method: str, path: str, body: Any, on_body: Callable[[int, bytes], None]) -> int:
    """One HTTP/1.1 exchange with the admin API over its Unix socket (``Connection: close``): the
    answer's body goes to ``on_body`` with its status as it arrives (a log that is followed);
    returns the status. No aiohttp: a command starts in half the time without it (the command line
    is run by hand, and by scripts in loops). Raises NoServer when nothing answers there."""
    sock = cfg.admin_socket
    if not sock.exists():
        raise NoServer(f"no server: {sock} does not exist")
    data = b"" if body is None else orjson.dumps(body)
    head = (f"{method} {cfg.base_path}/api{path} HTTP/1.1\r\nHost: ondemand\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(sock)), 5)
    except (OSError, asyncio.TimeoutError) as exc:
        raise NoServer(f"no server answers on {sock}: {exc or 'no connection within 5 s'}") from None
    answer = _Answer(on_body)
    try:
        writer.write(head.encode("ascii") + data)
        while not answer.done:
            chunk = await reader.read(65536)
            if not chunk:
                break  # closed by the server: an answer cut short ends here
            answer.parser.feed_data(chunk)
    except (OSError, httptools.HttpParserError) as exc:
        raise NoServer(f"no server answers on {sock}: {exc}") from None
    finally:
        writer.close()
    if not answer.status:
        raise NoServer(f"no server answers on {sock}: the connection closed before an answer")
    return answer.status


async def request(cfg: Config, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One admin API call over the Unix socket: (HTTP status, parsed JSON or None)."""
    parts: list[bytes] = []
    status = await _exchange(cfg, method, path, body, lambda _status, chunk: parts.append(chunk))
    raw = b"".join(parts)
    return status, (orjson.loads(raw) if raw else None)


class Refused(Exception):
    """The server answered with an error: its status and parsed error body."""

    def __init__(self, status: int, body: Any):
        super().__init__(status)
        self.status = status
        self.body = body


async def stream(cfg: Config, path: str, write: Callable[[bytes], None]) -> None:
    """A GET whose text answer is handed to ``write`` chunk by chunk as it arrives (a log
    that is followed), until the server ends it. Raises NoServer, or Refused for an error."""
    error: list[bytes] = []

    def on_body(status: int, chunk: bytes) -> None:
        if status >= 400:
            error.append(chunk)  # an error's JSON, read whole
        else:
            write(chunk)
    status = await _exchange(cfg, "GET", path, None, on_body)
    if status >= 400:
        raw = b"".join(error)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        raise Refused(status, body)


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
