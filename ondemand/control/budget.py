"""The memory budget: how much GPU memory each GPU has, and where a model fits.

Each GPU is a pool of its own: a 60 GiB model does not fit in "640 GiB free"
when no single GPU has 60 GiB free. Sources (``budget.source``):

- ``nvidia-smi``: each GPU measured (index, uuid, total and used memory);
  memory used by processes that are not ours counts as used;
- ``meminfo``: unified-memory boxes (DGX Spark, where nvidia-smi says
  "Not Supported" for memory): one pool, ``MemTotal`` and ``MemAvailable``;
- ``static``: declared sizes, one pool (``budget.capacity_gib``) or one per
  GPU (``budget.gpu_capacity_gib``), minus what deployments holding memory
  declared.

``budget.reserve_gib`` is kept free on every pool. A deployment counts with
its footprint (the larger of declared and measured), split evenly over its
GPUs. Measured sources cannot see an engine that is still loading, so
deployments in ``starting`` count with their footprint on top of the
measurement. The on-demand capacity of a pool is its usable memory minus
what always-on and system deployments hold there: a model that cannot fit
in that on any allowed set of GPUs never will by stopping on-demand models
(``does_not_fit``). Where on the GPUs a model goes is ``placement``'s rule.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import BudgetError, InsufficientMemory
from ..model import HOLDING, Deployment, Mode, Role, State
from . import placement
from .placement import Fit, Sleeper, asleep_held

log = logging.getLogger("ondemand.control.budget")

GIB = 1024 ** 3
MIB_PER_GIB = 1024
NVIDIA_SMI_TIMEOUT_S = 15

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Budget", "BudgetError", "Gpu", "Pool", "Reading", "Snapshot"]


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU (or the one pool) as measured."""
    index: int
    uuid: str | None
    total: float  # GiB
    used: float  # GiB, every process's


@dataclasses.dataclass(frozen=True)
class Reading:
    """One measurement, and which deployments were starting when it was taken.

    A loading engine has not allocated yet, so its footprint counts on top of
    the measurement: both for the ones starting at the reading and for the
    ones starting at the decision. One that went from starting to ready in
    between is counted by its footprint (the measurement missed it), so a
    check made with an older reading is never optimistic, and needs no lock."""
    gpus: tuple[Gpu, ...] | None  # None: the static source (nothing measured)
    starting: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Pool:
    """One pool (a GPU) as the budget counts it now, in GiB."""
    index: int
    uuid: str | None
    capacity: float  # usable: measured or declared, less the reserve
    used: float  # measured (every process's), or declared by the holders (static)
    starting: float  # measured sources: what starts in progress will take on top of ``used``
    free: float  # for a new engine: capacity less used, starting and others' holds
    ondemand_capacity: float  # capacity less what always-on and system deployments hold here
    holders: tuple[str, ...]  # deployments whose engines hold memory here

    def as_dict(self) -> dict[str, object]:
        return {"index": self.index, "uuid": self.uuid, "capacity": round(self.capacity, 3),
                "used": round(self.used, 3), "starting": round(self.starting, 3), "free": round(self.free, 3),
                "ondemand_capacity": round(self.ondemand_capacity, 3), "deployments": list(self.holders)}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    pools: tuple[Pool, ...]
    per_gpu: bool  # each pool is a GPU (else one pool: unified memory or static capacity_gib)

    @property
    def capacity(self) -> float:
        return sum(p.capacity for p in self.pools)

    @property
    def used(self) -> float:
        return sum(p.used for p in self.pools)

    @property
    def starting(self) -> float:
        return sum(p.starting for p in self.pools)

    @property
    def free(self) -> float:
        return sum(p.free for p in self.pools)

    @property
    def ondemand_capacity(self) -> float:
        return sum(p.ondemand_capacity for p in self.pools)

    def as_dict(self) -> dict[str, object]:
        return {"capacity": round(self.capacity, 3), "used": round(self.used, 3),
                "starting": round(self.starting, 3), "free": round(self.free, 3),
                "ondemand_capacity": round(self.ondemand_capacity, 3), "per_gpu": self.per_gpu,
                "gpus": [p.as_dict() for p in self.pools]}


class Budget:
    def __init__(self, source: str = "nvidia-smi", capacity_gib: float | None = None, *,
                 gpu_capacity_gib: Sequence[float] | None = None, reserve_gib: float = 0.0,
                 nvidia_smi: str = "nvidia-smi", meminfo_path: str = "/proc/meminfo",
                 host_reserve_gib: float = 16.0, asleep_residue_gib: float = 2.0):
        self.source = source
        self.capacity_gib = capacity_gib
        self.gpu_capacity_gib = tuple(gpu_capacity_gib) if gpu_capacity_gib else None
        self.reserve_gib = reserve_gib
        self.nvidia_smi = nvidia_smi
        self.meminfo_path = meminfo_path
        self.host_reserve_gib = host_reserve_gib
        self.asleep_residue_gib = asleep_residue_gib  # per GPU, for a sleeper nothing was read of
        self._physical: tuple[float, ...] | None = None  # static per GPU: the totals nvidia-smi gave
        self._physical_tried = False
        self._sizes: tuple[float, ...] | None = None  # each pool's total, as last measured

    @classmethod
    def from_config(cls, cfg: Config) -> Budget:
        b = cfg.budget
        return cls(b.source, b.capacity_gib, gpu_capacity_gib=b.gpu_capacity_gib, reserve_gib=b.reserve_gib,
                   nvidia_smi=b.nvidia_smi, meminfo_path=b.meminfo_path, host_reserve_gib=b.host_reserve_gib,
                   asleep_residue_gib=b.asleep_residue_gib)

    @property
    def per_gpu(self) -> bool:
        return self.source == "nvidia-smi" or (self.source == "static" and self.gpu_capacity_gib is not None)

    # --- measuring (the only awaits) -----------------------------------------------------

    async def measure(self) -> tuple[Gpu, ...] | None:
        """Each GPU (or the one pool) as measured, or None for the static source."""
        if self.source == "nvidia-smi":
            gpus = await self._nvidia_smi()
        elif self.source == "meminfo":
            gpus = (self.meminfo(),)
        else:
            await self._read_physical()
            return None
        self._sizes = tuple(g.total for g in gpus)
        return gpus

    async def _read_physical(self) -> None:
        """Static per GPU: the GPUs' physical totals, once, when nvidia-smi can read them (for
        the engines' memory shares); declared sizes stand otherwise."""
        if self._physical_tried or self.gpu_capacity_gib is None:
            return
        self._physical_tried = True
        try:
            gpus = await self._nvidia_smi()
        except BudgetError as exc:
            log.debug("static budget: the GPUs' physical sizes cannot be read (%s): declared sizes stand", exc)
            return
        if len(gpus) == len(self.gpu_capacity_gib):
            self._physical = tuple(g.total for g in gpus)

    def sizes(self) -> tuple[float, ...] | None:
        """Each pool's total GiB (a GPU's, or the one pool's): declared for the static source
        (per GPU: the physical totals when nvidia-smi could read them), else as last measured;
        None before the first reading. Recipes derive memory shares from it, and new
        deployments are checked against it."""
        if self.source == "static":
            return self._physical or self.gpu_capacity_gib or (float(self.capacity_gib or 0),)
        return self._sizes

    async def box_sizes(self) -> tuple[float, ...]:
        """``sizes()``, measured first when nothing was yet; raises BudgetError."""
        if self.source == "static":
            await self._read_physical()
        sizes = self.sizes()
        if sizes is None:
            await self.measure()
            sizes = self.sizes()
        return sizes or ()

    async def _run_nvidia_smi(self, *args: str) -> list[list[str]]:
        """The tool's CSV lines, split ("noheader,nounits"); raises BudgetError."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.nvidia_smi, *args, "--format=csv,noheader,nounits",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except FileNotFoundError:
            raise BudgetError(f"{self.nvidia_smi} not found: install the NVIDIA driver tools, "
                              "or set budget.source to meminfo (unified memory) or static") from None
        except OSError as exc:  # not executable, and the like: unreadable, not a failed start
            raise BudgetError(f"cannot run {self.nvidia_smi}: {exc.strerror or exc}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), NVIDIA_SMI_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise BudgetError(f"{self.nvidia_smi} did not answer within {NVIDIA_SMI_TIMEOUT_S} s") from None
        except BaseException:  # cancelled (a shutdown, a deadline): the child is killed and reaped, not left running
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise BudgetError(f"{self.nvidia_smi} failed ({proc.returncode}): {err.decode(errors='replace').strip()}")
        return [[p.strip() for p in ln.split(",")] for ln in out.decode(errors="replace").splitlines() if ln.strip()]

    async def _nvidia_smi(self) -> tuple[Gpu, ...]:
        rows = await self._run_nvidia_smi("--query-gpu=index,uuid,memory.total,memory.used")
        if not rows:
            raise BudgetError(f"{self.nvidia_smi} listed no GPU")
        gpus = []
        for row in rows:
            try:
                gpus.append(Gpu(int(row[0]), row[1], float(row[2]) / MIB_PER_GIB, float(row[3]) / MIB_PER_GIB))
            except (ValueError, IndexError):
                raise BudgetError(f"{self.nvidia_smi} reports memory as {', '.join(row)!r}: on a unified-memory "
                                  "box (DGX Spark) set budget.source = meminfo") from None
        return tuple(sorted(gpus, key=lambda g: g.index))

    async def compute_apps(self) -> list[tuple[int, str, float]]:
        """(pid, GPU uuid, GiB) of every process using GPU memory (nvidia-smi
        ``--query-compute-apps``); [] for other sources. Raises BudgetError."""
        if self.source != "nvidia-smi":
            return []
        apps = []
        for row in await self._run_nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory"):
            try:
                apps.append((int(row[0]), row[1], float(row[2]) / MIB_PER_GIB))
            except (ValueError, IndexError):
                continue  # "[N/A]" (no permission to see that process): not ours to count
        return apps

    def host_available_gib(self) -> float | None:
        """The host memory available now (``MemAvailable``), for a level-1 sleep's host
        reserve; None when it cannot be read (then nothing is held back). A read of a small
        file, no await: it is asked in the step that decides the sleep's level."""
        try:
            host = self.meminfo()
        except BudgetError:
            return None
        return host.total - host.used

    def meminfo(self) -> Gpu:
        """The host's memory as one pool (``MemTotal``, used = total − ``MemAvailable``), read
        from ``meminfo_path``; raises BudgetError when it cannot be read."""
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
        return Gpu(0, None, fields["MemTotal"] / GIB, (fields["MemTotal"] - fields["MemAvailable"]) / GIB)

    async def read(self, deps: Iterable[Deployment]) -> Reading:
        """Measure (the only await of a reading); raises BudgetError. Every call reads the GPUs
        anew: a fit check on an older reading would miss a process that took memory a moment
        ago (issue 40). The reading names the engines starting now, counted by their footprint."""
        starting = frozenset(d.id for d in deps if d.state is State.STARTING)
        return Reading(await self.measure(), starting)

    # --- counting (no await) -------------------------------------------------------------

    def _capacities(self, reading: Reading) -> list[tuple[int, str | None, float]]:
        """(index, uuid, usable GiB) of each pool."""
        if reading.gpus is None:
            sizes = self.gpu_capacity_gib or (float(self.capacity_gib or 0),)
            return [(i, None, max(0.0, size - self.reserve_gib)) for i, size in enumerate(sizes)]
        cap = self.capacity_gib / len(reading.gpus) if self.capacity_gib else None  # a cap on the box, split
        return [(g.index, g.uuid, max(0.0, (min(g.total, cap) if cap else g.total) - self.reserve_gib))
                for g in reading.gpus]

    def _sizes_of(self, reading: Reading) -> tuple[float, ...] | None:
        """Each GPU's total, for placement (several GPUs are of one size); None for one pool."""
        if not self.per_gpu:
            return None
        return tuple(g.total for g in reading.gpus) if reading.gpus is not None else self.gpu_capacity_gib

    def holdings(self, dep: Deployment, pools: int) -> dict[int, float]:
        """GiB per pool that ``dep``'s engine holds (or will, once started); asleep, what it
        keeps there (``asleep_held``)."""
        gib = self.asleep_held(dep, pools) if dep.state is State.ASLEEP else dep.footprint_gib
        return placement.holdings(gib, dep.gpu_count, dep.gpus, pools, self.per_gpu)

    def asleep_held(self, dep: Deployment, pools: int | None = None) -> float:
        """GiB an asleep engine keeps on its GPUs, in all: as found after its sleep
        (``asleep_gib``: nvidia-smi's per-process figure, else what it held before less the drop
        across the sleep call), else ``asleep_residue_gib`` per GPU (nothing readable), at most
        its footprint."""
        return asleep_held(dep, self.asleep_residue_gib, pools if pools is not None else len(self.sizes() or ()),
                           self.per_gpu)

    def snapshot_of(self, reading: Reading, deps: list[Deployment], exclude: int | None = None,
                    held_for_others: Mapping[int, float] | None = None) -> Snapshot:
        """The budget from ``reading`` and the deployments as they are now (no await).
        ``exclude``: a deployment whose own holding does not count against itself
        (waking an asleep one); ``held_for_others``: GiB per pool the queue reserves for
        its head, not free for anyone else."""
        caps = self._capacities(reading)
        n = len(caps)
        used = [0.0] * n if reading.gpus is None else [g.used for g in reading.gpus]
        starting = [0.0] * n  # measured: starts in progress, on top of the measurement
        always_on = [0.0] * n
        holders: list[list[str]] = [[] for _ in range(n)]
        for d in deps:
            if d.state not in HOLDING:
                continue
            held = self.holdings(d, n)
            declared = reading.gpus is None
            pending = not declared and (d.state is State.STARTING or d.id in reading.starting)
            for i, gib in held.items():
                holders[i].append(d.name)
                if d.id != exclude and declared:
                    used[i] += gib
                elif d.id != exclude and pending:
                    starting[i] += gib
                elif d.id == exclude and not declared:
                    # What a sleeper keeps is its own to wake into: its residue, or all of it while
                    # its sleep's call is out (``rules.as_read`` counts it so).
                    used[i] = max(0.0, used[i] - gib)
            if d.mode is Mode.ALWAYS_ON or d.role is not Role.MODEL:
                # Nothing on demand frees it, and asleep it wakes into its whole footprint.
                for i, gib in placement.holdings(d.footprint_gib, d.gpu_count, d.gpus, n, self.per_gpu).items():
                    always_on[i] += gib
        held_out = held_for_others or {}
        return Snapshot(tuple(
            Pool(idx, uuid, cap, used[i], starting[i],
                 max(0.0, cap - used[i] - starting[i] - held_out.get(i, 0.0)),
                 max(0.0, cap - always_on[i]), tuple(holders[i]))
            for i, (idx, uuid, cap) in enumerate(caps)), self.per_gpu)

    async def snapshot(self, deps: list[Deployment], exclude: int | None = None) -> Snapshot:
        """The budget now (reads it; for views)."""
        return self.snapshot_of(await self.read(deps), deps, exclude)

    def sleepers(self, deps: Iterable[Deployment], pools: int, but: int | None = None) -> tuple[Sleeper, ...]:
        """The asleep deployments (but ``but``) and what each one's wake needs on its GPUs: its
        footprint there less what it still holds (placement keeps that room when it can)."""
        out = []
        for d in deps:
            if d.state is not State.ASLEEP or d.id == but:
                continue
            # Both its footprint and what it keeps are split evenly over its GPUs.
            needs = placement.holdings(max(0.0, d.footprint_gib - self.asleep_held(d, pools)), d.gpu_count,
                                       d.gpus, pools, self.per_gpu)
            if any(needs.values()):
                out.append(Sleeper(d.id, needs))
        return tuple(out)

    def never_fits(self, dep: Deployment, deps: Iterable[Deployment], reading: Reading) -> Fit | None:
        """``dep``'s Fit when it can never fit here, not even with every on-demand model stopped
        (a request for it gets 503 ``does_not_fit``: ``verdicts.does_not_fit`` words it); None when
        it can. The controller reaches the same verdict from a refused start's Fit; ``doctor`` asks
        it ahead of any request. Its own holding is left out: what it could ever have."""
        snap = self.snapshot_of(reading, [d for d in deps if d.id != dep.id])
        count, allowed = placement.demand(dep.gpu_count, dep.gpu_ids, len(snap.pools), self.per_gpu)
        ondemand = tuple(p.ondemand_capacity for p in snap.pools)
        fit = Fit(dep.footprint_gib, ondemand, ondemand, count, allowed, self.per_gpu, self._sizes_of(reading))
        return fit if fit.never_fits() else None

    def check_fit(self, dep: Deployment, deps: list[Deployment], reading: Reading,
                  held_for_others: Mapping[int, float] | None = None) -> tuple[int, ...]:
        """The GPUs ``dep`` starts on (its view's ``gpus``); raises InsufficientMemory
        unless it fits (no await: the deployer marks it starting in the same step).
        Waking an asleep engine keeps the GPUs it holds."""
        snap = self.snapshot_of(reading, deps, exclude=dep.id, held_for_others=held_for_others)
        n = len(snap.pools)
        count, allowed = placement.demand(dep.gpu_count, dep.gpu_ids, n, self.per_gpu)
        if self.per_gpu and dep.state is State.ASLEEP and dep.gpus:
            allowed = dep.gpus
        free = [p.free for p in snap.pools]
        sizes = self._sizes_of(reading)
        sleepers = self.sleepers(deps, n, but=dep.id)
        chosen = placement.choose(free, dep.footprint_gib, count, allowed, sizes, sleepers)
        if chosen is None:
            fit = Fit(dep.footprint_gib, tuple(free), tuple(p.ondemand_capacity for p in snap.pools), count,
                      allowed, self.per_gpu, sizes, sleepers)
            message = None
            if self.per_gpu and count > n:
                message = f"needs {count} GPUs (gpu_count), but this box has {n}"
            elif self.per_gpu:
                where = f"GPUs {', '.join(map(str, allowed))}" if allowed is not None else f"{n} GPUs"
                message = (f"needs {fit.describe()}; free on the {where}: "
                           + ", ".join(f"{free[i]:.1f}" for i in (allowed or range(n)) if 0 <= i < n) + " GiB")
            raise InsufficientMemory(dep.footprint_gib, snap.free, snap.ondemand_capacity, fit=fit, message=message)
        return placement.devices(dep.gpu_count, dep.gpu_ids, chosen, self.per_gpu)

