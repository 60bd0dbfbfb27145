"""Engine backends: how an engine is run. The deployer decides when.

A backend knows nothing of states, budgets or requests. It starts an engine
for a deployment row and hands back an ``Engine`` handle (base URL, a way to
wait for its exit, its log tail), stops it, finds engines of ours that
outlived a restart of ondemand (adoption), and reads or follows an engine's log.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ...model import Deployment
from ..recipes import Box, Launch, launch


@dataclasses.dataclass
class Engine:
    """A running engine as the deployer sees it."""
    deployment_id: int
    name: str
    base_url: str
    ref: Any = None  # the backend's own handle (process, container id)
    adopted: bool = False


def visible_gpus(dep: Deployment) -> tuple[int, ...] | None:
    """The GPU indices the engine may see: None for every GPU (``gpu_count`` NULL, as
    before GPU placement), () for none, else the GPUs its start was given."""
    if dep.gpu_count is None:
        return None
    if dep.gpu_count == 0:
        return ()
    return dep.gpus or dep.gpu_ids or tuple(range(dep.gpu_count))


def rss_gib(pids: list[int]) -> float | None:
    """GiB of host memory the processes ``pids`` hold (``VmRSS``), or None when none is readable."""
    total, seen = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        seen = True
                        break
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return total / 1024 ** 3 if seen else None


class BackendError(Exception):
    """The backend could not do it (docker error, command not found ...)."""


class Backend(abc.ABC):
    kind: str

    @abc.abstractmethod
    async def start(self, dep: Deployment, launch: Launch | None = None) -> Engine:
        """Create and start the engine as ``launch`` says (``recipes.launch``: image,
        command line, environment, mounts; None: the deployment's own, as given);
        returns at once, before it is ready."""

    def as_given(self, dep: Deployment) -> Launch:
        """The deployment's image and args (or command) as given, with its env: no recipe, no box."""
        return launch(dep.replace(model=None), Box(backend=self.kind))

    @abc.abstractmethod
    async def wait_exit(self, engine: Engine) -> int | None:
        """Return when the engine has exited, with its exit code."""

    @abc.abstractmethod
    async def stop(self, engine: Engine, timeout: float) -> None:
        """Ask it to end (SIGTERM / docker stop), kill it after ``timeout``; idempotent."""

    @abc.abstractmethod
    async def remove(self, dep: Deployment) -> None:
        """Remove what is left of the deployment's engine (stopped container)."""

    @abc.abstractmethod
    async def adopt(self, dep: Deployment, launch: Launch | None = None, *, compare: bool = True) -> Engine | None:
        """An engine of ours for ``dep`` still running from before our restart, made as
        ``launch`` says (None: as given); ``compare`` False: how it runs now cannot be told,
        so any engine of ``dep``'s is its own."""

    async def pids(self, engine: Engine) -> list[int]:
        """The host pids of the engine's processes (for its measured GPU footprint);
        [] when they cannot be known."""
        return []

    async def host_memory(self, engine: Engine) -> float | None:
        """GiB of host memory the engine holds (a level-1 sleeper's weights are there): the
        resident memory of its process tree; None when it cannot be known."""
        pids = await self.pids(engine)
        return await asyncio.to_thread(rss_gib, pids) if pids else None  # reads of /proc: off the loop

    @abc.abstractmethod
    async def log_tail(self, engine: Engine | None, dep: Deployment, lines: int = 40) -> str:
        """The last lines the engine wrote, for the failure reason."""

    @abc.abstractmethod
    def logs(self, dep: Deployment, *, tail: int, follow: bool) -> AsyncIterator[bytes]:
        """The engine's log, as bytes: its last ``tail`` lines (of every run), then, with
        ``follow``, what its running engine writes until that engine's log ends. Nothing
        when it never ran. An async generator: close it (``contextlib.aclosing``) to stop
        following; raises BackendError when the log cannot be read."""

    async def close(self) -> None:  # noqa: B027 (optional hook: a backend that holds nothing keeps it)
        pass
