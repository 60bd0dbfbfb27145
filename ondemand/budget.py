"""The memory budget: how much GPU memory there is, and whether a model fits.

Three sources (``budget.source``):

- ``nvidia-smi``: total and used memory of all GPUs, measured;
- ``meminfo``: unified-memory boxes (DGX Spark, where nvidia-smi says
  "Not Supported" for memory): ``MemTotal`` and ``MemAvailable``;
- ``static``: ``budget.capacity_gib`` minus what deployments holding memory
  declared (``memory_gib``).

Measured sources cannot see an engine that is still loading, so deployments
in ``starting`` count with their declared size on top of the measurement.
The on-demand capacity is usable memory minus what always-on and system
deployments hold: a model bigger than that can never fit by stopping
on-demand models (BEHAVIOUR.md, "Making room": ``does_not_fit``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .errors import BudgetError, InsufficientMemory
from .model import HOLDING, Deployment, Mode, Role, State

log = logging.getLogger("ondemand.budget")

GIB = 1024 ** 3
MIB_PER_GIB = 1024

if TYPE_CHECKING:
    from .config import Config

__all__ = ["Budget", "BudgetError", "Reading", "Snapshot"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    capacity: float  # usable memory, GiB
    used: float  # GiB in use, measured or declared
    free: float  # GiB free for a new engine
    ondemand_capacity: float  # capacity minus always-on and system holdings

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in dataclasses.asdict(self).items()}


def _declared(deps: Iterable[Deployment], counted: Callable[[Deployment], bool], exclude: int | None) -> float:
    return sum(d.memory_gib for d in deps if d.id != exclude and counted(d))


def _always_on_held(deps: Iterable[Deployment]) -> float:
    return sum(d.memory_gib for d in deps
               if d.state in HOLDING and (d.mode is Mode.ALWAYS_ON or d.role is not Role.MODEL))


@dataclasses.dataclass(frozen=True)
class Reading:
    """One measurement, and which deployments were starting when it was taken.

    A loading engine has not allocated yet, so what it declared counts on top
    of the measurement: both for the ones starting at the reading and for the
    ones starting at the decision. One that went from starting to ready in
    between is counted by what it declared (the measurement missed it), so a
    check made with an older reading is never optimistic, and needs no lock."""
    total: float | None  # GiB; None: the static source (nothing measured)
    used: float | None
    starting: frozenset[int] = frozenset()


class Budget:
    def __init__(self, source: str = "nvidia-smi", capacity_gib: float | None = None, *,
                 nvidia_smi: str = "nvidia-smi", meminfo_path: str = "/proc/meminfo"):
        self.source = source
        self.capacity_gib = capacity_gib
        self.nvidia_smi = nvidia_smi
        self.meminfo_path = meminfo_path

    @classmethod
    def from_config(cls, cfg: Config) -> Budget:
        b = cfg.budget
        return cls(b.source, b.capacity_gib, nvidia_smi=b.nvidia_smi, meminfo_path=b.meminfo_path)

    async def measure(self) -> tuple[float, float] | None:
        """(total GiB, used GiB) as measured, or None for the static source."""
        if self.source == "nvidia-smi":
            return await self._nvidia_smi()
        if self.source == "meminfo":
            return self._meminfo()
        return None

    async def _nvidia_smi(self) -> tuple[float, float]:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.nvidia_smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 15)
        except FileNotFoundError:
            raise BudgetError(f"{self.nvidia_smi} not found: install the NVIDIA driver tools, "
                              "or set budget.source to meminfo (unified memory) or static") from None
        except OSError as exc:  # not executable, and the like: unreadable, not a failed start
            raise BudgetError(f"cannot run {self.nvidia_smi}: {exc.strerror or exc}") from None
        except asyncio.TimeoutError:
            proc.kill()
            raise BudgetError(f"{self.nvidia_smi} did not answer within 15 s") from None
        if proc.returncode != 0:
            raise BudgetError(f"{self.nvidia_smi} failed ({proc.returncode}): {err.decode(errors='replace').strip()}")
        total = used = 0.0
        lines = [ln for ln in out.decode().splitlines() if ln.strip()]
        if not lines:
            raise BudgetError(f"{self.nvidia_smi} listed no GPU")
        for line in lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                t, u = float(parts[0]), float(parts[1])
            except (ValueError, IndexError):
                raise BudgetError(f"{self.nvidia_smi} reports memory as {line.strip()!r}: on a unified-memory "
                                  "box (DGX Spark) set budget.source = meminfo") from None
            total += t
            used += u
        return total / MIB_PER_GIB, used / MIB_PER_GIB

    def _meminfo(self) -> tuple[float, float]:
        fields = {}
        try:
            with open(self.meminfo_path) as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    fields[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError) as exc:
            raise BudgetError(f"cannot read {self.meminfo_path}: {exc}") from None
        if "MemTotal" not in fields or "MemAvailable" not in fields:
            raise BudgetError(f"{self.meminfo_path} has no MemTotal/MemAvailable")
        return fields["MemTotal"] / GIB, (fields["MemTotal"] - fields["MemAvailable"]) / GIB

    async def read(self, deps: Iterable[Deployment]) -> Reading:
        """Measure (the only await of the budget); raises BudgetError."""
        starting = frozenset(d.id for d in deps if d.state is State.STARTING)
        measured = await self.measure()
        if measured is None:
            return Reading(None, None, starting)
        return Reading(measured[0], measured[1], starting)

    def snapshot_of(self, reading: Reading, deps: list[Deployment], exclude: int | None = None,
                    held_for_others: float = 0.0) -> Snapshot:
        """The budget from ``reading`` and the deployments as they are now (no await).
        ``exclude``: a deployment whose own holding does not count against itself
        (waking an asleep one); ``held_for_others``: memory the queue reserves for
        its head, not free for anyone else."""
        if reading.total is None or reading.used is None:
            capacity = float(self.capacity_gib or 0)
            used = _declared(deps, lambda d: d.state in HOLDING, exclude)
        else:
            capacity = min(reading.total, self.capacity_gib) if self.capacity_gib else reading.total
            used = reading.used + _declared(
                deps, lambda d: d.state is State.STARTING or d.id in reading.starting, exclude)
        free = max(0.0, capacity - used - held_for_others)
        return Snapshot(capacity, used, free, max(0.0, capacity - _always_on_held(deps)))

    async def snapshot(self, deps: list[Deployment], exclude: int | None = None) -> Snapshot:
        """The budget now (reads it; for views and the wait for freed memory)."""
        return self.snapshot_of(await self.read(deps), deps, exclude)

    def check_fit(self, dep: Deployment, deps: list[Deployment], reading: Reading,
                  held_for_others: float = 0.0) -> Snapshot:
        """Raise InsufficientMemory unless ``dep`` fits (no await: the deployer
        marks it starting in the same step)."""
        snap = self.snapshot_of(reading, deps, exclude=dep.id, held_for_others=held_for_others)
        if dep.memory_gib > snap.free + 1e-9:
            raise InsufficientMemory(dep.memory_gib, snap.free, snap.ondemand_capacity)
        return snap
