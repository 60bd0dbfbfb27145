"""The decision core's test world: a fake clock (and the timers it fires), a recording fake of
``Effects`` the test plays the deployer through, a request's waiter as the async edge holds it, and
``make``, a ``Controller`` on them. No event loop, no sleeps: time moves when a test moves it.
Imported by name by the tests of ``ondemand/control/`` (tests/conftest.py puts this folder on
``sys.path``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from ondemand.control.controller import Controller
from ondemand.engines import warmth
from ondemand.errors import OndemandError
from ondemand.model import Deployment, Mode, State


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.timers: list[FakeTimer] = []

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        """Move time on, firing the timers that fall due, in order."""
        end = self.t + dt
        while True:
            due = sorted((t for t in self.timers if not t.cancelled and t.when <= end), key=lambda t: t.when)
            if not due:
                break
            timer = due[0]
            self.t = max(self.t, timer.when)
            self.timers.remove(timer)
            timer.callback()
        self.t = end


@dataclasses.dataclass
class FakeTimer:
    when: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class Effects:
    """Records what the core asks for; the test plays the deployer and reports back."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.deps: dict[int, Deployment] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.busy_engines: set[int] = set()
        self.controller: Controller | None = None
        self.rest_costs: dict[str, float] = {"asleep_1": 1.0, "asleep_2": 6.0, "stopped": 60.0}
        self.sleep_costs: dict[int, float] = {}  # a sleep's call, by deployment (none: 0 s)
        self.sleep_calls_out: set[int] = set()  # marked asleep, the call still out
        self.audits: list[tuple[str, int, str, dict[str, Any]]] = []  # every audit row, its detail too

    # reads
    def deployment(self, dep_id: int) -> Deployment | None:
        return self.deps.get(dep_id)

    def deployments(self) -> list[Deployment]:
        return list(self.deps.values())

    def engine_idle(self, dep_id: int) -> bool:
        return dep_id not in self.busy_engines

    def sleeping(self, dep_id: int) -> bool:
        return dep_id in self.sleep_calls_out  # the test says whose sleep's call is out

    def idle_level(self, dep: Deployment) -> int:
        return warmth.idle_level(dep, per_gpu=True)  # discrete GPUs: a vLLM recipe sleeps at level 1

    def tiers(self, dep: Deployment) -> dict[str, float]:
        return dict(self.rest_costs)  # what the test says the tiers cost (test_keepwarm sets them)

    def sleep_s(self, dep: Deployment) -> float:
        return self.sleep_costs.get(dep.id, 0.0)

    # actions
    def admit(self, dep_id: int, *, text: str) -> None:
        assert self.controller is not None  # what the deployer would hold back, as of now
        # What the queue holds for others, summed over the GPUs (these tests use one pool).
        self.calls.append(("admit", dep_id, sum(self.controller.held_for_others(dep_id).values()), text))

    def stop(self, dep_id: int, *, text: str, for_dep: int | None) -> None:
        self.calls.append(("stop", dep_id, for_dep, text))

    def sleep(self, dep_id: int, *, text: str, for_dep: int | None, level: int | None = None) -> None:
        self.calls.append(("sleep", dep_id, for_dep, text) if level is None else ("sleep", dep_id, for_dep, text, level))

    def prewarm(self, dep_id: int, *, text: str) -> None:
        assert self.controller is not None  # what the deployer would hold back, as of now
        self.calls.append(("prewarm", dep_id, sum(self.controller.held_for_others(dep_id).values()), text))

    def settle(self, dep_id: int, within_s: float) -> None:
        self.calls.append(("settle", dep_id))

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        self.calls.append(("audit", action, dep_id, text))
        self.audits.append((action, dep_id, text, detail))

    def counters_changed(self, dep_id: int) -> None:
        self.calls.append(("counters", dep_id, self.clock.t))

    def idle_gap(self, dep_id: int, gap_s: float) -> None:
        self.calls.append(("idle_gap", dep_id, gap_s))

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(self.clock.t + delay, callback)
        self.clock.timers.append(timer)
        return timer

    # the test's side of the deployer
    def add(self, dep_id: int, memory_gib: float = 10, *, state: State = State.STOPPED,
            mode: Mode = Mode.ON_DEMAND, **kw: Any) -> int:
        dep = Deployment(id=dep_id, name=f"d{dep_id}", served_name=f"D{dep_id}", memory_gib=memory_gib,
                         state=state, mode=mode).replace(**kw)  # plain values (strings) as typed ones
        self.deps[dep_id] = dep
        if self.controller is not None:
            self.controller.on_deployment(dep_id, dep, None)
        return dep_id

    def set(self, dep_id: int, **changes: Any) -> None:
        old = self.deps[dep_id]
        new = old.replace(**changes)
        self.deps[dep_id] = new
        assert self.controller is not None
        self.controller.on_deployment(dep_id, new, old)

    def remove(self, dep_id: int) -> None:
        old = self.deps.pop(dep_id)
        assert self.controller is not None
        self.controller.on_deployment(dep_id, None, old)

    def taken(self, kind: str) -> list[tuple[Any, ...]]:
        """The calls of ``kind`` since the last look, and forget them."""
        out = [c for c in self.calls if c[0] == kind]
        self.calls = [c for c in self.calls if c[0] != kind]
        return out


class Req:
    """A request's waiter as the async edge would hold it."""

    def __init__(self, c: Controller, dep_id: int, arrival: float | None = None):
        self.wakes = 0
        self.queued = 0
        self.waiter = c.join(dep_id, arrival=c.clock() if arrival is None else arrival,
                             notify=self._wake, on_queued=self._queued)
        self.c = c

    def _wake(self) -> None:
        self.wakes += 1

    def _queued(self) -> None:
        self.queued += 1

    def take(self):
        return self.c.take(self.waiter)

    def code(self) -> str:
        with pytest.raises(OndemandError) as exc:
            self.take()
        self.c.leave(self.waiter)
        return exc.value.code

    def leave(self) -> None:
        self.c.leave(self.waiter)


def make(world, **kw: Any) -> tuple[Controller, Effects, Clock]:
    clock, fx = world
    c = Controller(fx, clock=clock, wall=lambda: 1.7e9 + clock.t, idle_timeout_s=kw.pop("idle_timeout_s", 60),
                   min_idle_timeout_s=kw.pop("min_idle_timeout_s", 1), **kw)
    fx.controller = c
    return c, fx, clock


def start(fx: Effects, c: Controller, dep_id: int) -> None:
    """Play the deployer: the admit effect started it, and it became ready."""
    assert fx.taken("admit")[-1][1] == dep_id
    fx.set(dep_id, state=State.STARTING)
    c.on_admitted(dep_id, True)
    fx.set(dep_id, state=State.READY)


def idle_ready(fx: Effects, c: Controller, clock: Clock, *ids: int) -> None:
    """Make deployments ready and idle for their full timeout."""
    for i in ids:
        fx.set(i, state=State.READY)
    clock.advance(61)
