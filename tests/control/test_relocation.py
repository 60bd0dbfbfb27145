"""Relocation (control/relocation.py, ``scheduler = "cost"``), on test_controller's fake clock and
recording effects: a sleeper whose GPUs are full of engines make-room may not take is stopped, so
that its attempt starts it cold on GPUs where it fits; never under ``seed``, never one whose GPUs
the administrator pinned, never when nothing fits elsewhere either."""
from __future__ import annotations

import pytest
from test_controller import Clock, Effects, Req, make

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


def test_a_stranded_sleeper_is_stopped_to_start_where_it_fits(world):
    c, fx, r = stranded(world)
    assert [s[1:3] for s in fx.taken("stop")] == [(1, 1)]  # its own stop, for itself
    assert r.queued == 0  # it never waited in the memory queue
    assert c.precheck(1)(fx.deps[1])  # the stop's precheck: still asleep
    fx.set(1, state=State.STOPPED, sleep_level=None, gpus=())
    c.on_stopped(1, True, 1)
    assert fx.taken("settle")[-1][1] == 1
    c.on_settled(1)
    assert fx.taken("admit")[-1][1] == 1  # asked again: a cold start, anywhere


def test_a_relocation_stop_is_refused_once_it_woke(world):
    c, fx, r = stranded(world)
    fx.set(1, state=State.READY)
    assert not c.precheck(1)(fx.deps[1])


def test_no_relocation_under_seed(world):
    c, fx, r = stranded(world, sched="seed")
    assert fx.taken("stop") == [] and r.queued == 1


def test_no_relocation_of_a_sleeper_whose_gpus_are_pinned(world):
    c, fx, r = stranded(world, gpu_ids=(0,))
    assert fx.taken("stop") == [] and r.queued == 1


def test_no_relocation_when_it_fits_nowhere_else(world):
    c, fx, r = stranded(world, free=(2.0, 8.0))
    assert fx.taken("stop") == [] and r.queued == 1


def test_no_relocation_while_its_own_sleep_for_another_is_under_way(world):
    """1 is being put to sleep for 3 (marked asleep, its sleep call not yet reported): a request
    for 1 waits for that sleep, and is no reason to stop it."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler("cost", 5.0))
    fx.add(1, 10, state=State.READY, gpus=(0,), gpu_count=1, idle_action="sleep", idle_timeout_s=1)
    fx.add(3, 10)
    c.try_take(1).release()
    clock.advance(2)  # past its idle timeout: make-room's to take
    Req(c, 3)
    c.on_refused(3, InsufficientMemory(10, 4, 24))
    assert [s[1:3] for s in fx.taken("sleep")] == [(1, 3)]
    fx.set(1, state=State.ASLEEP, sleep_level=1)  # the deployer's mark, before its call ends
    r = Req(c, 1)
    fit = Fit(10.0, (2.0, 40.0), (80.0, 80.0), 1, (0,), True)
    c.on_refused(1, InsufficientMemory(10, 2, 80, fit=fit))
    assert fx.taken("stop") == [] and r.queued == 1
