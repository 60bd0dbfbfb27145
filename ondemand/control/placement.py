"""Which GPUs an engine gets: a pure rule, no I/O, no logging.

A DGX box has several GPUs, and each is a memory pool of its own: a 60 GiB
model does not fit in "640 GiB free" when no single GPU has 60 GiB free. A
deployment asks for ``gpu_count`` GPUs (``None``: every GPU, the behaviour
before placement; 0: none) and may pin ``gpu_ids``; its ``memory_gib`` is
split evenly over them. A set fits when every GPU in it has the share free.
Of the sets that fit, the one that leaves the least memory free on the
chosen GPUs wins (best fit, so large free GPUs stay whole for large models),
ties to lower indices.

The free memory given here is what the caller already reduced by the
reserve, the starts in progress and the queue head's hold on each GPU.

A budget of one pool (unified memory, or a static ``capacity_gib``) does
not know the GPUs apart: there a deployment with any GPU at all needs its
whole footprint in pool 0, and one with ``gpu_count`` 0 needs nothing.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model import Deployment

EPS = 1e-9
# GPUs whose totals differ by no more than this are of one size (nvidia-smi rounds to MiB).
SAME_SIZE_GIB = 0.5


def demand(gpu_count: int | None, gpu_ids: Sequence[int] | None, pools: int,
           per_gpu: bool) -> tuple[int, tuple[int, ...] | None]:
    """(how many pools, which pools are allowed) a deployment asks for."""
    if not per_gpu:
        return (0 if gpu_count == 0 else 1), None
    count = pools if gpu_count is None else gpu_count
    return count, (tuple(gpu_ids) if gpu_ids is not None else None)


def holdings(footprint: float, gpu_count: int | None, gpus: Sequence[int], pools: int,
             per_gpu: bool) -> dict[int, float]:
    """GiB per pool that an engine holding ``gpus`` uses (``footprint`` split evenly)."""
    if gpu_count == 0 or pools == 0:
        return {}
    if not per_gpu:
        return {0: footprint}
    held = [g for g in gpus if 0 <= g < pools] or list(range(pools))  # none recorded: every GPU
    return {g: footprint / len(held) for g in held}


def devices(gpu_count: int | None, gpu_ids: Sequence[int] | None, chosen: Sequence[int],
            per_gpu: bool) -> tuple[int, ...]:
    """The GPU indices the engine is given (and its view's ``gpus``): the chosen set on a
    budget per GPU; on one pool, the pin, else the first ``gpu_count``, else none named
    (every GPU, as before placement)."""
    if per_gpu:
        return tuple(chosen)
    if not gpu_count:
        return ()
    return tuple(gpu_ids) if gpu_ids is not None else tuple(range(gpu_count))


def share(memory_gib: float, count: int) -> float:
    """What each of ``count`` GPUs must have free for a deployment of ``memory_gib``."""
    return memory_gib / count if count else 0.0


@dataclasses.dataclass(frozen=True)
class Sleeper:
    """An asleep deployment as placement sees it: what its wake needs on each of its GPUs (its
    footprint there, the larger of booked and measured, less what it still holds). It wakes only
    there: a start that takes that room leaves it nowhere to wake but after a stop."""
    id: int
    needs: Mapping[int, float]

    def wakes_with(self, free: Sequence[float], taken: Mapping[int, float] | None = None) -> bool:
        """Could it wake alone (no victim) with ``free`` per GPU, less ``taken`` on some?"""
        taken = taken or {}
        return all(0 <= g < len(free) and free[g] - taken.get(g, 0.0) + EPS >= need
                   for g, need in self.needs.items())


def keeps_sleepers_room(chosen: Sequence[int], need: float, free: Sequence[float],
                        sleepers: Iterable[Sleeper]) -> bool:
    """Is ``chosen`` a preferred set (the scheduling rule that keeps sleepers' room): no sleeper on
    it that could wake alone before the start could no longer wake alone after it."""
    taken = {g: need for g in chosen}
    return not any(s.wakes_with(free) and not s.wakes_with(free, taken)
                   for s in sleepers if any(g in taken for g in s.needs))


def choose(free: Sequence[float], memory_gib: float, gpu_count: int | None,
           gpu_ids: Sequence[int] | None = None, sizes: Sequence[float] | None = None,
           sleepers: Sequence[Sleeper] = ()) -> tuple[int, ...] | None:
    """The GPU indices to use, or None when no allowed set fits now.

    ``free[i]`` is GPU i's free memory in GiB. ``gpu_count`` None means every
    GPU; 0 means none (always fits, with no GPU). ``gpu_ids`` limits the
    choice to those indices (with ``gpu_count`` of them, it is the set).
    ``sizes[i]``: GPU i's total; when given, a set of several GPUs is of one size
    only (an engine's memory share is one fraction for every GPU it sees, and
    tensor parallelism splits the model evenly). ``sleepers``: the asleep deployments
    (``Sleeper``); a set that keeps the room each needs to wake alone is preferred, and best
    fit decides among the preferred sets, among all of them only when none is (issue 43: best
    fit alone packed newcomers onto sleepers' GPUs, whose next requests then queued)."""
    n = len(free)
    count = n if gpu_count is None else gpu_count
    if count == 0:
        return ()
    allowed = sorted(set(range(n) if gpu_ids is None else gpu_ids))
    if count > len(allowed) or any(not 0 <= i < n for i in allowed):
        return None
    need = share(memory_gib, count)
    fitting = [i for i in allowed if free[i] + EPS >= need]
    if len(fitting) < count:
        return None
    sets: Iterable[tuple[int, ...]] = itertools.combinations(fitting, count)
    if sizes is not None and count > 1:
        sets = (c for c in sets if max(sizes[i] for i in c) - min(sizes[i] for i in c) <= SAME_SIZE_GIB)
    # Preferred first, then best fit: the least left over on the chosen GPUs; combinations come in
    # lexicographic order, so min() keeps the lowest indices among equals.
    return min(sets, key=lambda chosen: (not keeps_sleepers_room(chosen, need, free, sleepers),
                                         sum(free[i] - need for i in chosen)), default=None)


def can_ever_fit(capacity: Sequence[float], memory_gib: float, gpu_count: int | None,
                 gpu_ids: Sequence[int] | None = None, sizes: Sequence[float] | None = None) -> bool:
    """Would it fit with every GPU as free as it can be (``capacity``: usable memory per
    GPU less what nothing on demand can free)? If not, it is ``does_not_fit`` at once."""
    return choose(capacity, memory_gib, gpu_count, gpu_ids, sizes) is not None


@dataclasses.dataclass(frozen=True)
class Fit:
    """Why a fit check said no, in what make-room needs: each pool's free memory (less
    others' holds) and on-demand capacity, and what the deployment asks for."""
    need: float  # GiB in all (its footprint)
    free: tuple[float, ...]
    ondemand: tuple[float, ...]
    count: int  # pools it needs
    allowed: tuple[int, ...] | None  # the pools it may use (None: any)
    per_gpu: bool
    sizes: tuple[float, ...] | None = None  # each pool's total: several GPUs are of one size
    sleepers: tuple[Sleeper, ...] = ()  # the asleep deployments whose room to wake it keeps if it can

    def choose(self, free: Sequence[float], victims: Collection[int] = ()) -> tuple[int, ...] | None:
        """The set it would get with ``free`` per pool, or None; ``victims``: the make-room's own,
        which are no sleepers for the rule (they are put away for it)."""
        sleepers = tuple(s for s in self.sleepers if s.id not in victims)
        return choose(free, self.need, self.count, self.allowed, self.sizes, sleepers)

    def never_fits(self) -> bool:
        """Not even with every on-demand model stopped (``does_not_fit``)."""
        return self.choose(self.ondemand) is None

    def describe(self) -> str:
        """What it asks for, in words: "40 GiB" or "2 GPUs with 20 GiB each"."""
        if not self.per_gpu or self.count <= 1:
            return f"{self.need:g} GiB" + (" on one GPU" if self.per_gpu and self.count == 1 else "")
        return f"{self.count} GPUs with {share(self.need, self.count):g} GiB each"


def asleep_held(dep: Deployment, residue_gib: float, pools: int, per_gpu: bool) -> float:
    """What an asleep ``dep`` keeps on its GPUs in all (``Budget.asleep_held``); ``residue_gib``
    per GPU when nothing was read after its sleep."""
    if dep.asleep_gib is not None:
        return dep.residue_gib
    if dep.gpu_count == 0:
        return 0.0
    gpus = len(holdings(1.0, dep.gpu_count, dep.gpus, max(pools, 1), per_gpu)) or 1
    return min(dep.footprint_gib, residue_gib * gpus)
