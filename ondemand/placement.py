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

Not wired in yet: the budget and the deployer will call it when GPU
placement lands (it is built and tested first, on its own).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

EPS = 1e-9


def share(memory_gib: float, count: int) -> float:
    """What each of ``count`` GPUs must have free for a deployment of ``memory_gib``."""
    return memory_gib / count if count else 0.0


def choose(free: Sequence[float], memory_gib: float, gpu_count: int | None,
           gpu_ids: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The GPU indices to use, or None when no allowed set fits now.

    ``free[i]`` is GPU i's free memory in GiB. ``gpu_count`` None means every
    GPU; 0 means none (always fits, with no GPU). ``gpu_ids`` limits the
    choice to those indices (with ``gpu_count`` of them, it is the set)."""
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
    # Best fit: the least left over on the chosen GPUs; combinations come in
    # lexicographic order, so min() keeps the lowest indices among equals.
    return min(itertools.combinations(fitting, count),
               key=lambda chosen: sum(free[i] - need for i in chosen))


def can_ever_fit(capacity: Sequence[float], memory_gib: float, gpu_count: int | None,
                 gpu_ids: Sequence[int] | None = None) -> bool:
    """Would it fit with every GPU as free as it can be (``capacity``: usable memory per
    GPU less what nothing on demand can free)? If not, it is ``does_not_fit`` at once."""
    return choose(capacity, memory_gib, gpu_count, gpu_ids) is not None
