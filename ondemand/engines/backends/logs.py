"""A process engine's log: the rotating file its copier writes, the tail read back, and the
live followers of ``logs(follow=True)``. The copier (the process backend's) is the file's only
writer, so a rotation can lose no line of a running engine."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ...http.limits import READ_SIZE
from ...ratelog import OnceAMinute

log = logging.getLogger("ondemand.engines.backends.process")  # the copier's lines, under the backend's name

# The first line of each run in an engine's log file.
RUN_MARKER = "--- ondemand started this engine at"
LOG_MAX_BYTES = 10 * 2**20
LOG_KEEP = 3
# A line longer than this past the size limit rotates the file mid-line.
LONG_LINE = 2**20
# A follower that falls this far behind (bytes not yet sent) is ended.
FOLLOW_BACKLOG = 8 * 2**20
# At most this much is read back for a tail.
TAIL_MAX_BYTES = 4 * 2**20


class RotatingLog:
    """An engine's log file, written by one writer (the copier), rotated by size:
    ``path`` is the newest, ``path.1`` … ``path.{keep}`` the older ones."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP):
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._fh = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        self.size = self._fh.tell()
        self._at_line_start = True
        if self.size >= max_bytes:  # a new run never begins in a full file
            self.rotate()

    def rotated(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def rotate(self) -> None:
        self._fh.close()
        self.rotated(self.keep).unlink(missing_ok=True)
        for n in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                self.rotated(n).rename(self.rotated(n + 1))
        if self.keep:
            self.path.rename(self.rotated(1))
        else:
            self.path.unlink(missing_ok=True)
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self.size = 0

    def write(self, data: bytes) -> None:
        """Append ``data`` (unbuffered: a reader sees it at once). The file is rotated at the
        first line end at or past ``max_bytes``, so no line is cut in two unless it runs on
        past the limit by LONG_LINE."""
        while data:
            if self.size >= self.max_bytes and (self._at_line_start or self.size >= self.max_bytes + LONG_LINE):
                self.rotate()
            room = self.max_bytes - self.size
            if len(data) > room:
                end = data.find(b"\n", max(0, room - 1))  # the line that reaches the limit ends here
                if end >= 0:
                    self._append(data[:end + 1])
                    data = data[end + 1:]
                    continue
            self._append(data)
            return

    def _append(self, data: bytes) -> None:
        self._fh.write(data)
        self.size += len(data)
        self._at_line_start = data.endswith(b"\n")

    def close(self) -> None:
        self._fh.close()


def read_tail(paths: list[Path], lines: int, max_bytes: int = TAIL_MAX_BYTES) -> bytes:
    """The last ``lines`` lines of the files ``paths`` (newest first) taken as one log,
    reading back at most ``max_bytes``."""
    if lines <= 0:
        return b""
    data = b""
    for path in paths:
        try:
            fh = open(path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            continue
        with fh:
            pos = fh.seek(0, os.SEEK_END)
            while pos > 0 and data.count(b"\n") <= lines and len(data) < max_bytes:
                step = min(READ_SIZE, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
        if data.count(b"\n") > lines or len(data) >= max_bytes:
            break
    return b"".join(data.splitlines(keepends=True)[-lines:])


class Follower:
    """One reader of a run's live output: chunks in order, then the end."""

    def __init__(self) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._backlog = 0
        self._wake = asyncio.Event()
        self.ended = False
        self.overrun = False

    def push(self, chunk: bytes) -> None:
        if self.ended:
            return
        if self._backlog + len(chunk) > FOLLOW_BACKLOG:  # never hold the copier (nor the engine) up
            self.overrun = True
            self.end()
            return
        self._chunks.append(chunk)
        self._backlog += len(chunk)
        self._wake.set()

    def end(self) -> None:
        self.ended = True
        self._wake.set()

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._backlog -= len(chunk)
                yield chunk
            if self.ended:
                if self.overrun:
                    yield b"\n[ondemand: this reader fell too far behind the engine's log; follow again]\n"
                return
            self._wake.clear()
            await self._wake.wait()


class LogRun:
    """One engine run's output: the rotating file and the live followers."""

    def __init__(self, log_file: RotatingLog, *, clock: Callable[[], float] = time.monotonic):
        self.file = log_file
        self.followers: set[Follower] = set()
        self.ended = False
        self.copier: asyncio.Task[None] | None = None
        # A file that cannot be written (a full disk) is said once a minute, with the count: a
        # line per chunk put 11,500 lines of one chatty engine into ondemand's own log.
        self._dropped = OnceAMinute(clock=clock)

    def write(self, data: bytes) -> None:
        """``data`` to the file and the followers. A failed write of the file loses that output
        from the file only: the copier drains on (or the engine blocks on its pipe) and the
        followers still get it."""
        try:
            self.file.write(data)
        except OSError as exc:
            more = self._dropped.due()
            if more is not None:
                log.warning("cannot write the log %s: %s; the engine's output is dropped from it%s",
                            self.file.path, exc.strerror or exc, more)
        for f in self.followers:
            f.push(data)

    def follow(self) -> Follower:
        f = Follower()
        self.followers.add(f)
        return f

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.file.close()
            for f in self.followers:
                f.end()
