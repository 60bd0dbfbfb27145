"""What the deployer asks of the GPU memory budget, and what an engine holds as measured.

The budget is the control side's (``control/budget.py``: the readings, the fit check, the host
reserve); ``app.py`` gives it to the deployer, which sees it through ``Memory``: the GPUs'
sizes (booking, launching), the fit check of a start (``Fit``: a reading, the one await, then
the check with none, in the step that marks ``starting``), the host memory a level-1 sleep
needs, and nvidia-smi's readings for what a sleeper still holds (``Gauge``).

What an engine holds, measured: nvidia-smi's per-process rows matched to its processes
(``apps_gib``: a ready engine's footprint, ``control/footprint.py``; a sleeper's residue, the
deployer), else, for a sleeper none of whose processes is listed, what it held less what its
sleep call freed on its GPUs (``residue_after_drop``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from ..model import Deployment


class Sizes(Protocol):
    """What booking and launching read: the GPUs' sizes, and whether GPUs are told apart."""

    @property
    def per_gpu(self) -> bool: ...
    def sizes(self) -> tuple[float, ...] | None: ...


class Fit(Protocol):
    """A start's fit check (``Budget.read``, ``Budget.check_fit``): ``read`` measures the GPUs
    (the one await of a start; raises BudgetError); ``check_fit`` picks the GPUs on that reading,
    with no await, or raises InsufficientMemory. The reading is the budget's own: the deployer
    only hands it back."""

    async def read(self, deps: Iterable[Deployment]) -> object: ...
    def check_fit(self, dep: Deployment, deps: list[Deployment], reading: Any,
                  held_for_others: Mapping[int, float] | None = None) -> tuple[int, ...]: ...


class Used(Protocol):
    """One GPU as measured: the memory every process uses on it (GiB)."""

    @property
    def used(self) -> float: ...


class Gauge(Protocol):
    """nvidia-smi's readings (``Budget.measure``, ``Budget.compute_apps``; other sources read
    nothing per process)."""

    @property
    def source(self) -> str: ...
    async def measure(self) -> Sequence[Used] | None: ...
    async def compute_apps(self) -> list[tuple[int, str, float]]: ...


class Memory(Sizes, Fit, Gauge, Protocol):
    """The budget as the deployer sees it; also the host memory a level-1 sleep must leave."""

    @property
    def host_reserve_gib(self) -> float: ...
    async def box_sizes(self) -> tuple[float, ...]: ...
    def host_available_gib(self) -> float | None: ...


def apps_gib(apps: list[tuple[int, str, float]], pids: list[int]) -> float | None:
    """GiB the processes ``pids`` hold on every GPU together (nvidia-smi's compute apps);
    None when none of them is listed (nothing measured: not 0, which would claim the engine
    uses nothing)."""
    mine = set(pids)
    used = [gib for pid, _uuid, gib in apps if pid in mine]
    return sum(used) if used else None


def residue_after_drop(held_gib: float, gpus: Sequence[int], before: Sequence[float],
                       after: Sequence[float]) -> float | None:
    """What a sleeper still holds when nvidia-smi lists none of its processes: what it held
    before the sleep (``held_gib``, split evenly over ``gpus``) less, on each of its GPUs, the
    drop of used memory across the sleep call (what the sleep did not free). None when the
    GPUs' readings do not cover its GPUs."""
    if not gpus or any(not 0 <= g < min(len(before), len(after)) for g in gpus):
        return None
    each = held_gib / len(gpus)
    return sum(max(0.0, each - max(0.0, before[g] - after[g])) for g in gpus)
