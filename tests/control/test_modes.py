"""A mode switch (ondemand/control/modes.py, BEHAVIOUR.md "Switch to always on"), decided in one
step: what it changes of the deployment, whether it starts it, and the words and detail of its
audit row; the switch's own fields checked before the deployment is looked up. Through the
controller (``plan_mode``, on core_doubles' fake clock and recording effects), then the pure rule on
its own. The switch stored and its start against a real deployer: test_controller_races.py."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, make

from ondemand.control import modes
from ondemand.errors import OndemandError
from ondemand.model import Deployment, Mode, Role, State


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def test_switch_to_always_on_plans(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.STOPPED)
    fx.add(2, state=State.READY)
    fx.add(3, state=State.STARTING)
    fx.add(4, state=State.READY, mode=Mode.ALWAYS_ON, role=Role.SYSTEM)
    p = c.plan_mode(1, "always_on")
    assert p.start and p.fields == {"pending_mode": Mode.ALWAYS_ON} and "(pending the start)" in p.text
    p = c.plan_mode(2, "always_on")
    assert not p.start and p.fields == {"mode": Mode.ALWAYS_ON, "pending_mode": None}
    p = c.plan_mode(3, "always_on")
    assert not p.start and p.fields == {"pending_mode": Mode.ALWAYS_ON}
    p = c.plan_mode(2, "on_demand", idle_timeout_s=300, set_idle_timeout=True)
    assert p.detail == {"old": {"mode": "on_demand", "idle_timeout_s": None, "pending_mode": None},
                        "new": {"mode": "on_demand", "idle_timeout_s": 300, "pending_mode": None}}
    for bad, code in (({"mode": "sometimes"}, "invalid_mode"),
                      ({"mode": "on_demand", "idle_timeout_s": 0, "set_idle_timeout": True}, "invalid_idle_timeout")):
        with pytest.raises(OndemandError) as exc:
            c.plan_mode(1, **bad)
        assert exc.value.code == code
    with pytest.raises(OndemandError) as exc:
        c.plan_mode(4, "on_demand")
    assert exc.value.code == "invalid_mode"


def dep(**kw) -> Deployment:
    return Deployment(id=1, name="d1", served_name="D1", memory_gib=10, mode=Mode.ON_DEMAND).replace(**kw)


def test_a_switch_starts_only_what_a_request_could_start_and_stores_the_rest():
    """Always on: a sleeper is woken for it (as a request would), a stopping one is stored always on
    at once (its stop ends as it ends), one always on already only loses a pending switch; back to on
    demand, a pending switch is undone and the audit's detail says what it was."""
    asleep = modes.plan(dep(state=State.ASLEEP), "always_on", None, False)
    assert asleep.start and asleep.fields == {"pending_mode": Mode.ALWAYS_ON}
    stopping = modes.plan(dep(state=State.STOPPING), "always_on", None, False)
    assert not stopping.start and stopping.fields == {"mode": Mode.ALWAYS_ON, "pending_mode": None}
    again = modes.plan(dep(state=State.READY, mode=Mode.ALWAYS_ON), "always_on", None, False)
    assert not again.start and again.fields == {"pending_mode": None} and again.text == "mode always_on → always_on"
    undone = modes.plan(dep(state=State.STARTING, pending_mode=Mode.ALWAYS_ON), "on_demand", None, False)
    assert not undone.start and undone.fields == {"mode": Mode.ON_DEMAND, "pending_mode": None}
    assert undone.detail["old"]["pending_mode"] == "always_on" and undone.detail["new"]["pending_mode"] is None
    with pytest.raises(OndemandError) as exc:
        modes.plan(dep(state=State.READY, mode=Mode.ALWAYS_ON, role=Role.SYSTEM), "on_demand", None, False)
    assert exc.value.code == "invalid_mode" and "system" in exc.value.message


def test_an_idle_timeout_is_checked_only_when_set_from_the_minimum_to_a_day():
    for seconds in (None, 60, 86400):
        modes.check("on_demand", seconds, True, 60)
    modes.check("on_demand", 0, False, 60)  # not set by this switch: not its to check
    for seconds in (59, 86401):
        with pytest.raises(OndemandError) as exc:
            modes.check("on_demand", seconds, True, 60)
        assert exc.value.code == "invalid_idle_timeout" and "60 to 86400 seconds" in exc.value.message
    with pytest.raises(OndemandError) as exc:
        modes.check("always", None, False, 60)
    assert exc.value.code == "invalid_mode"
