"""Weights read ahead: a recipe's checkpoint files read into the page cache before its cold start.

A cold start whose weights are not in the page cache reads them from disk at the engine's pace
(safetensors shard by shard, a GGUF by mmap faults); read ahead, the engine's own load finds them
in memory. Only when the host can spare it: ``MemAvailable`` less ``budget.host_reserve_gib``
at least the files' size (``decide``), else the read is skipped and says why. A start never
waits for it: the read runs in a thread beside the engine's start (both read the same files, so
neither reads a byte twice from disk), and one still running when the engine is up is left to
go on. One read per deployment at a time: a read's ``Outcome`` is its handle, which the caller
keeps (the start watch, on the deployment's unit and its start) and hands back to the next
``warm``; ``close`` stops them all between two chunks.

``warm`` is what an expected next start (the adaptive keep-warm) calls too, without a start.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..model import Deployment
from ..tasks import TaskGroup
from . import checkpoint

log = logging.getLogger("ondemand.engines.readahead")

GIB = 2**30
CHUNK = 8 * 2**20  # read in steps of this; a stop is seen between two


def weight_files(model: str, model_cache: Path | None) -> list[Path]:
    """The weight files of ``model`` on this host: a ``.gguf`` file itself, a local directory's or
    the model cache's snapshot's safetensors; [] when none is here (a download at start)."""
    if model.endswith(".gguf") and os.path.isabs(model):
        return [Path(model)] if os.path.isfile(model) else []
    directory = checkpoint.snapshot(model, model_cache)
    if directory is None:
        return []
    try:
        return [f for f in checkpoint.weight_files(directory) if f.is_file()]
    except (checkpoint.Unreadable, OSError):
        return []


def decide(size_bytes: int, available_gib: float | None, reserve_gib: float) -> str | None:
    """Why the read is skipped (None: read it): nothing to read, the memory unknown, or short."""
    if size_bytes <= 0:
        return "no weight files on this host"
    if available_gib is None:
        return "the host's available memory cannot be read"
    spare = available_gib - reserve_gib
    if spare < size_bytes / GIB:
        return (f"memory is short: {size_bytes / GIB:.1f} GiB of weights, {max(spare, 0.0):.1f} GiB to spare "
                f"({available_gib:.1f} GiB available less the {reserve_gib:g} GiB host reserve)")
    return None


def read_files(files: list[Path], stop: threading.Event, chunk: int = CHUNK) -> int:
    """Read ``files`` through the page cache (and ask the kernel to read ahead); the bytes read.
    Returns early once ``stop`` is set; a file that cannot be read is skipped."""
    done = 0
    buf = bytearray(chunk)
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            log.debug("read-ahead: cannot open %s: %s", path, exc)
            continue
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as fh:
                while not stop.is_set():
                    n = fh.readinto(buf)
                    if not n:
                        break
                    done += n
        except OSError as exc:
            log.debug("read-ahead: reading %s: %s", path, exc)
        finally:
            os.close(fd)
        if stop.is_set():
            break
    return done


@dataclasses.dataclass
class Outcome:
    """A read-ahead of a deployment: ``reading``, ``done`` or ``skipped`` (``why``); ``task``
    while it reads."""
    state: str
    bytes: int = 0
    why: str | None = None
    seconds: float | None = None
    task: asyncio.Task[None] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state, "gib": round(self.bytes / GIB, 3), "why": self.why,
                "seconds": None if self.seconds is None else round(self.seconds, 1)}


class ReadAhead:
    """The reads under way (in its task group); what each read came to is its ``Outcome``."""

    def __init__(self, *, model_cache: Path | None, available_gib: Callable[[], float | None],
                 reserve_gib: float, reader: Callable[[list[Path], threading.Event], int] = read_files):
        self.model_cache = model_cache
        self.available_gib = available_gib
        self.reserve_gib = reserve_gib
        self.reader = reader
        self.tasks = TaskGroup("read-ahead")
        self._stop = threading.Event()

    def warm(self, dep: Deployment, last: Outcome | None = None) -> Outcome:
        """Read ``dep``'s weights ahead in the background if the host can spare the memory;
        returns at once (no await), with what it does. ``last``: ``dep``'s last read, which is
        returned while it still reads (it goes on)."""
        if last is not None and last.running:
            return last
        if dep.model is None:
            return Outcome("skipped", why="no model")
        files = weight_files(dep.model, self.model_cache)
        size = sum(_size(f) for f in files)
        why = decide(size, self.available_gib(), self.reserve_gib)
        if why is not None:
            log.info("%s: weights not read ahead: %s", dep.name, why)
            return Outcome("skipped", size, why)
        outcome = Outcome("reading", size)
        outcome.task = self.tasks.spawn(self._read(dep, files, outcome), f"read {dep.name}")
        return outcome

    async def _read(self, dep: Deployment, files: list[Path], outcome: Outcome) -> None:
        began = time.monotonic()
        # In a thread: the disk is slow, the event loop serves requests meanwhile. Cancelled
        # (shutdown), the thread sees the stop flag within one chunk.
        read = await asyncio.to_thread(self.reader, files, self._stop)
        outcome.state, outcome.bytes, outcome.seconds = "done", read, time.monotonic() - began
        log.info("%s: read %.2f GiB of weights ahead in %.1f s", dep.name, read / GIB, outcome.seconds)

    async def close(self) -> None:
        self._stop.set()
        await self.tasks.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
