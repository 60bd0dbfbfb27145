"""The replay reports an admin keeps beside the box's state: the pages ``ondemand replay
--html`` wrote into ``{state_dir}/replays/``, listed newest first and served for download, so
that the admin page can link the latest.

A report is read as it is and never trusted as a page of ondemand's: it is served as an
attachment, sandboxed, under the admin token like the rest of the API. Only plain files with a
plain name are served (no dot first, no path; no symlink, neither the file nor the folder, and no
second name of another file), so nothing else in the state directory can be fetched through it.

A report is sent from the file as the client reads it, ``CHUNK`` at a time, never held whole:
eight unread downloads of 64 MiB held 1.1 GB. It is the size it was when looked at (its
``Content-Length``), however it grows meanwhile; one cut short meanwhile ends the connection
before the length it promised, so the client sees a broken download, not a whole one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from aiohttp import web

from ..errors import OndemandError
from .wire import app_parts, json_answer

log = logging.getLogger("ondemand.admin")

REPLAYS_DIR = "replays"  # under state_dir
LISTED = 20  # the newest reports listed
MAX_BYTES = 64 << 20  # a report larger than this is not served (the box mix's page of two traces is 0.7 MiB)
CHUNK = 256 << 10  # read from the file as the client takes it
# A client that takes nothing of a download for this long is let go: its connection and the
# report's descriptor would otherwise be held for as long as it stays connected.
SEND_TIMEOUT_S = 60.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\.html")


def folder(state_dir: Path) -> Path:
    return state_dir / REPLAYS_DIR


def _unreadable(state_dir: Path, why: str) -> OndemandError:
    """The folder cannot be listed or read from (both routes answer it)."""
    return OndemandError(503, "replays_unreadable", f"{folder(state_dir)} {why}")


def _open_folder(state_dir: Path) -> int | None:
    """The replays folder, opened without following a link (None: there is none)."""
    try:
        return os.open(folder(state_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # a file, or a link (O_NOFOLLOW with O_DIRECTORY says ENOTDIR)
        if os.path.islink(folder(state_dir)):
            raise _unreadable(state_dir, "is a symbolic link, which is not followed: make it a folder of the "
                                         "state directory") from None
        return None
    except OSError as exc:  # a link (ELOOP), unreadable
        raise _unreadable(state_dir, f"cannot be read: {exc.strerror}") from None


def _plain(st: os.stat_result) -> bool:
    """A report: a regular file with no other name (a hard link to a key file is not one)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def listing(state_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The LISTED newest reports first (ties by name): ``{"name", "bytes", "modified"}`` (Unix
    time); and how many there are in all."""
    dir_fd = _open_folder(state_dir)
    if dir_fd is None:
        return [], 0
    found: list[tuple[float, str, int]] = []
    try:
        for name in os.listdir(dir_fd):
            if not _NAME.fullmatch(name):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:  # removed since the listing
                continue
            if _plain(st):
                found.append((st.st_mtime, name, st.st_size))
    except OSError as exc:
        raise _unreadable(state_dir, f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    found.sort(key=lambda f: (-f[0], f[1]))
    return [{"name": name, "bytes": size, "modified": mtime} for mtime, name, size in found[:LISTED]], len(found)


def open_report(state_dir: Path, name: str) -> tuple[int, int]:
    """One report opened, and its size as it is now: (its descriptor, which the caller closes,
    its size). OndemandError 404 when there is no such plain file, 409 past MAX_BYTES."""
    missing = OndemandError(404, "not_found", f"no replay report {name!r} in {folder(state_dir)}")
    if not _NAME.fullmatch(name):
        raise missing
    dir_fd = _open_folder(state_dir)
    if dir_fd is None:
        raise missing
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise missing from None
    except OSError as exc:  # a link (ELOOP), unreadable
        raise OndemandError(404, "not_found", f"replay report {name!r}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not _plain(st):  # a folder, a pipe, a device, a second name of another file
            raise missing
        if st.st_size > MAX_BYTES:
            raise OndemandError(409, "replay_report_too_large",
                                f"replay report {name!r} is {st.st_size} bytes, more than {MAX_BYTES} served")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


async def _read_at(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, read in a thread (a slow disk does not stall the loop).
    A hang-up cancels the handler here; the read is waited for all the same, because the
    descriptor is closed after it and, closed under it, its number could be another file's."""
    read = asyncio.get_running_loop().run_in_executor(None, os.pread, fd, size, offset)  # a future, no task
    try:
        return await asyncio.shield(read)
    except asyncio.CancelledError:
        await asyncio.wait({read})
        raise


async def list_replays(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    state_dir = app[app_mod.CONFIG].state_dir
    reports, count = await asyncio.to_thread(listing, state_dir)  # a directory scan: off the loop
    return json_answer({"dir": str(folder(state_dir)), "count": count, "reports": reports})


async def get_replay(request: web.Request) -> web.StreamResponse:
    app_mod, app = app_parts(request)
    name = request.match_info["name"]
    fd, size = await asyncio.to_thread(open_report, app[app_mod.CONFIG].state_dir, name)
    try:
        resp = web.StreamResponse(headers={
            "Content-Type": "text/html; charset=utf-8",
            "Content-Disposition": f'attachment; filename="{name}"',  # the name is [A-Za-z0-9._-]: no quoting needed
            "Content-Security-Policy": "sandbox",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store"})
        resp.content_length = size  # what it held when looked at, however it grows meanwhile
        await resp.prepare(request)
        sent = 0
        while sent < size:
            chunk = await _read_at(fd, min(CHUNK, size - sent), sent)
            if not chunk:  # cut short since: the connection ends before the promised length
                resp.force_close()
                break
            try:  # waits while the client has not taken what went before
                await asyncio.wait_for(resp.write(chunk), SEND_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.info("replay report %s: the client took nothing for %g s; its connection is closed",
                         name, SEND_TIMEOUT_S)
                if request.transport is not None:
                    request.transport.abort()
                return resp
            sent += len(chunk)
        await resp.write_eof()
    except ConnectionResetError:  # the client hung up
        pass
    finally:
        os.close(fd)
    return resp
