"""The scheduler, a part of the decision core (ondemand/control/scheduler.py): the seed scheduler's
answers on a queue of its own, and the box's ``scheduler`` key choosing the one the running
controller owns. Its rules inside the whole core, on the fake clock: test_queue.py (order, priorities, holds),
test_attempts.py (make-room); in the replay: test_replay_run.py."""
from __future__ import annotations

import pytest
from helpers import run_app

from ondemand.control import scheduler as schedulers
from ondemand.control.eviction import Candidate
from ondemand.control.placement import Fit
from ondemand.control.scheduler import SeedScheduler
from ondemand.model import Deployment, Priority


def dep(i: int, priority: Priority = Priority.NORMAL) -> Deployment:
    return Deployment(id=i, name=f"d{i}", served_name=f"D{i}", memory_gib=10, priority=priority)


def test_the_head_of_higher_priority_takes_the_place_and_the_hold():
    """1 (normal) is the head and has 10 GiB held for it; 2 (high) arrives and takes its place:
    what is freed for 1 from now on is held for 2, 1 asks only once 2's admit has answered, and
    1's settle waits for 2's fit. 3 (normal, later) is behind nobody but the queue's order."""
    s = SeedScheduler()
    s.queue.add(1, first_arrival=10, rank=Priority.NORMAL.rank)
    s.queue.reserve(1, {0: 10.0})
    s.queue.add(2, first_arrival=20, rank=Priority.HIGH.rank)
    s.queue.add(3, first_arrival=30, rank=Priority.HIGH.rank)
    assert s.queue.ids() == [2, 3, 1]
    assert s.behind(1, 2) and not s.behind(2, 2) and not s.behind(3, 2)
    assert s.asks_first(1, admitting=lambda head: head == 2) and not s.asks_first(1, admitting=lambda head: False)
    assert not s.asks_first(3, admitting=lambda head: True)  # same priority: the queue's order, no hold
    assert (s.settle_target(1), s.settle_target(3)) == (2, 3)
    assert s.held_for_others(1) == {0: 10.0} and s.held_for_others(2) == {}  # the hold went with the place
    assert s.room_coming(2, [1]) and not s.room_coming(2, [3]) and not s.room_coming(2, [])


def test_victims_are_of_the_requesters_priority_or_lower_and_make_it_fit():
    """Make-room may take a normal or low model for a normal request, never a high one; of the
    idle candidates, the lowest priority goes first, and only as many as make it fit."""
    s = SeedScheduler()
    normal = dep(9)
    assert s.may_take(normal, dep(1, Priority.LOW)) and s.may_take(normal, dep(2))
    assert not s.may_take(normal, dep(3, Priority.HIGH))
    fit = Fit(need=10, free=(4.0,), ondemand=(40.0,), count=1, allowed=None, per_gpu=True)
    low, other = Candidate(1, {0: 6.0}, last_used=50, rank=0), Candidate(2, {0: 10.0}, last_used=10, rank=1)
    assert s.victims([other, low], fit) == ([low], (0,))
    assert s.victims([Candidate(1, {0: 1.0}, last_used=50, rank=0)], fit) == ([], ())  # not enough: none


async def test_the_running_core_owns_the_scheduler_the_configuration_names(tmp_path, monkeypatch):
    """app.py makes the controller's scheduler by the ``scheduler`` key's name."""
    made: list[SeedScheduler] = []

    def seed(slo_s: float) -> SeedScheduler:
        made.append(SeedScheduler())
        return made[-1]

    monkeypatch.setitem(schedulers.SCHEDULERS, "seed", seed)
    async with run_app(tmp_path, scheduler="seed") as server:
        assert len(made) == 1 and server.controller.scheduler is made[0]
        assert server.controller.queue is made[0].queue


# --- which quiet deployments make-room may take: the scheduler's rule -------------------------

@pytest.fixture
def world():
    """core_doubles' fake clock and recording effects."""
    from core_doubles import Clock, Effects
    clock = Clock()
    return clock, Effects(clock)


def _lull(world, take):
    """2 (10 GiB) was used 5 s ago, of its 60 s idle timeout: quiet (nothing in flight), not idle by
    the reaper's rule. 1 (10 GiB) is refused for 6 GiB."""
    from core_doubles import Req, make

    from ondemand.errors import InsufficientMemory
    from ondemand.model import State
    c, fx, clock = make(world, scheduler=SeedScheduler(take))
    fx.add(1, 10)
    fx.add(2, 10)
    fx.set(2, state=State.READY)
    clock.advance(61)
    c.try_take(2).release()
    clock.advance(5)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    return c, fx, r


def test_the_seed_rule_takes_only_a_victim_idle_for_its_whole_timeout(world):
    c, fx, r = _lull(world, schedulers.after_idle_timeout)
    assert fx.taken("stop") == [] and r.queued == 1  # 2 is in a lull: the request queues
    assert not c.precheck(1)(fx.deps[2])


def test_ollamas_rule_takes_any_quiet_model_and_its_precheck_asks_the_same(world):
    """lru (a peer's rule, for the replay): any model with nothing in flight, least recently used
    first; the deployer's precheck of that stop asks the same rule again, so a model that took a
    request meanwhile is left (the reaper's precheck would refuse the lull either way)."""
    c, fx, r = _lull(world, schedulers.any_quiet)
    assert [s[1:3] for s in fx.taken("stop")] == [(2, 1)] and r.queued == 0
    assert c.precheck(1)(fx.deps[2]) and not c.precheck(None)(fx.deps[2])
    slot = c.try_take(2)  # a request for 2 arrives before the deployer's step
    assert slot is not None and not c.precheck(1)(fx.deps[2])
    slot.release()


def test_the_rules_say_why_they_took():
    """Each take rule's reason: ``idle_timeout`` once idle for the whole timeout, whatever the rule;
    before it, the rule's own name (the cost rule with its figures: test_attempts.py, make-room's
    account of its victims)."""
    from ondemand.model import Deployment
    a, b = Deployment(id=1, name="a", served_name="A"), Deployment(id=2, name="b", served_name="B")
    assert schedulers.SeedScheduler().reason(a, b, 600, 600) == {"rule": "idle_timeout"}
    assert schedulers.SeedScheduler(schedulers.any_quiet).reason(a, b, 5, 600) == {"rule": "any_quiet"}
    assert schedulers.SeedScheduler(schedulers.any_quiet).reason(a, b, 700, 600) == {"rule": "idle_timeout"}
    assert schedulers.scheduler("cost").reason(a, b, 600, 600) == {"rule": "idle_timeout"}
    # The take rules decide only early takes: the seed's takes none, Ollama's any quiet one.
    assert not schedulers.after_idle_timeout(a, b, 5, 600) and schedulers.any_quiet(a, b, 5, 600)
    assert schedulers.SeedScheduler().takes(a, b, 600, 600) and not schedulers.SeedScheduler().takes(a, b, 5, 600)
