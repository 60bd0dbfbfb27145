"""Relocation (control/relocation.py, ``scheduler = "cost"``), on core_doubles' fake clock and
recording effects: a sleeper whose GPUs are full of engines make-room may not take is stopped, so
that its attempt starts it cold on GPUs where it fits (those steps, the start side's:
test_attempts.py); never under ``seed``, never one whose GPUs the administrator pinned, never when
nothing fits elsewhere either. ``stranded`` is such a sleeper, asked for."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, Req, make

from ondemand.control import scheduler as schedulers
from ondemand.control.placement import Fit
from ondemand.errors import InsufficientMemory
from ondemand.model import State


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def stranded(world, sched: str = "cost", free=(2.0, 40.0), **sleeper):
    """1 (10 GiB) sleeps on GPU 0, where 2 (60 GiB) is busy; a request for 1 finds its wake does
    not fit there (``free`` per GPU, what 1 keeps counted as its own)."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler(sched, 5.0))
    fx.add(1, 10, state=State.ASLEEP, sleep_level=1, gpus=(0,), gpu_count=1, idle_action="sleep", **sleeper)
    fx.add(2, 60, state=State.READY, gpus=(0,), gpu_count=1)
    slot = c.try_take(2)  # busy: make-room may not take it
    assert slot is not None
    r = Req(c, 1)
    assert fx.taken("admit")[-1][1] == 1
    fit = Fit(10.0, tuple(free), (80.0, 80.0), 1, (0,), True)
    c.on_refused(1, InsufficientMemory(10, free[0], 80, fit=fit))
    return c, fx, r


def test_no_relocation_under_seed(world):
    c, fx, r = stranded(world, sched="seed")
    assert fx.taken("stop") == [] and r.queued == 1


def test_no_relocation_of_a_sleeper_whose_gpus_are_pinned(world):
    c, fx, r = stranded(world, gpu_ids=(0,))
    assert fx.taken("stop") == [] and r.queued == 1


def test_no_relocation_when_it_fits_nowhere_else(world):
    c, fx, r = stranded(world, free=(2.0, 8.0))
    assert fx.taken("stop") == [] and r.queued == 1
