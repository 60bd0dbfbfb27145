"""Writing a file whole or not at all: the key file, a replay's report.

``write_atomic`` writes a hidden temporary file beside the target (created with ``O_EXCL``, so
never through a link left at its name), fsyncs it, renames it over the target and fsyncs the
directory: a reader sees the old file or the new one, never part of one, and the rename
survives a crash. Imports nothing of ours.
"""
from __future__ import annotations

import os
import secrets


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *, exact_mode: bool = False) -> None:
    """Replace ``path`` with ``data``. The file is created with ``mode`` less the umask (never
    wider, not even for an instant), or with exactly ``mode`` when ``exact_mode`` (a file's own
    mode kept across the replacement)."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)[:200]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:  # (a read-only or full disk): named as below
        exc.filename, exc.filename2 = path, None
        raise
    try:
        try:
            if exact_mode:
                os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:  # an OSError, or a Ctrl-C between the write and the rename
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename in (None, tmp):
            # os.write's and os.fsync's name no file: the error names the one asked for (a
            # command's one line on a full disk), never the temporary that is gone.
            exc.filename, exc.filename2 = path, None
        raise
    dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
