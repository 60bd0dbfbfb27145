"""Relocation (``scheduler = "cost"``): a sleeper that cannot wake where it is.

An asleep engine wakes only on the GPUs it sleeps on. When a request comes for it and those GPUs
are full of engines make-room may not take (busy, of higher priority, always on), its requests
would wait in the memory queue until one of them rests, however empty the rest of the box is. A
scheduler that relocates stops such a sleeper (its residue goes) so that its attempt starts it
cold on a set that fits: a cold start (tens of seconds) is sooner than a wait with no end in sight.

This first form relocates only to a set that fits now without a victim, and only a sleeper whose
GPUs were not pinned by the administrator (``gpu_ids``) and whose own sleep has ended; the decision
is the start side's (``Attempts``), this module says where it would go. Pure: no clock, no I/O.
"""
from __future__ import annotations

import dataclasses

from ..model import Deployment, State
from .placement import Fit


def may_relocate(dep: Deployment, fit: Fit) -> bool:
    """Is ``dep`` a sleeper that may move: asleep, its GPUs chosen by placement (not pinned),
    on a box placed per GPU?"""
    return dep.state is State.ASLEEP and dep.gpu_ids is None and fit.per_gpu and bool(dep.gpus)


def elsewhere(fit: Fit) -> tuple[int, ...] | None:
    """The GPU set a cold start would get now, without a victim, on GPUs that are not all its own
    (its wake's ``fit``: what is free per GPU counts what it keeps as its own); None when none
    fits (or only where it sleeps, where the wake did not)."""
    cold = dataclasses.replace(fit, allowed=None)
    chosen = cold.choose(fit.free)
    if chosen is None or set(chosen) <= set(fit.allowed or ()):
        return None
    return chosen
