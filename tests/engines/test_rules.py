"""The deployer's rules (ondemand/engines/rules.py): pure, so each is asked directly here; the
deployer's tests (test_deployer.py, test_sleep_drain.py, test_restart_lost.py, test_warmth*.py)
hold them in place with real engines."""
from __future__ import annotations

import pytest

from ondemand.engines import rules
from ondemand.errors import DeployerError, InsufficientMemory
from ondemand.model import Deployment, IdleAction, Mode, State


def dep(state: State = State.STOPPED, **kw) -> Deployment:
    fields = {"id": 1, "name": "a", "served_name": "A", "engine": "vllm", "model": "m", "memory_gib": 10.0, **kw}
    return Deployment(state=state, **fields)


def refuse(d: Deployment, held: object) -> tuple[int, ...]:
    raise InsufficientMemory(10, 0, 80)


def test_may_start_waits_for_a_start_under_way_and_refuses_a_state_that_cannot_start():
    assert rules.may_start(dep(State.STOPPED), False) and rules.may_start(dep(State.FAILED), False)
    assert rules.may_start(dep(State.ASLEEP), False)
    assert not rules.may_start(dep(State.STARTING), False) and not rules.may_start(dep(State.READY), False)
    assert not rules.may_start(dep(State.STOPPED), True)  # being removed: nothing starts it
    with pytest.raises(DeployerError, match="cannot be started now"):
        rules.may_start(dep(State.STOPPING), False)
    with pytest.raises(DeployerError, match="no sleep mode"):
        rules.may_start(dep(State.ASLEEP, engine="llamacpp"), False)


def test_the_start_step_asks_wanted_then_the_holds_then_the_fit():
    asked = []

    def wanted() -> bool:
        asked.append("wanted")
        return True

    def held() -> dict[int, float]:
        asked.append("held")
        return {0: 5.0}

    def fit(d: Deployment, holds: object) -> tuple[int, ...]:
        asked.append(("fit", holds))
        return (1,)
    assert rules.admit(dep(), False, wanted, held, fit) == (1,)
    assert asked == ["wanted", "held", ("fit", {0: 5.0})]
    assert rules.admit(dep(), False, lambda: False, held, refuse) is None  # nobody wants it: no fit check
    assert rules.admit(dep(State.READY), False, None, None, refuse) is None
    with pytest.raises(InsufficientMemory):
        rules.admit(dep(), False, None, None, refuse)


def test_the_gates_are_the_gpus_in_index_order_or_the_one_pool():
    assert rules.gate_keys((3, 1), True) == [1, 3]
    assert rules.gate_keys((), True) == []  # no GPU: no gate
    assert rules.gate_keys((3, 1), False) == [None]


def test_a_stop_is_approved_for_a_failed_one_whose_engine_is_still_there_and_an_owed_start():
    assert rules.may_stop(dep(State.READY), None, False, True)
    assert not rules.may_stop(dep(State.READY), lambda d: False, False, True)  # the precheck first
    assert rules.may_stop(dep(State.FAILED), None, False, True)
    assert not rules.may_stop(dep(State.FAILED), None, False, False)
    assert rules.may_stop(dep(State.STOPPED), None, True, False)  # the stop cancels the start owed
    for state in (State.STOPPED, State.PLANNED, State.STOPPING):
        assert not rules.may_stop(dep(state), None, False, True)


def test_the_sleep_level_leaves_the_host_reserve_counting_the_level_one_sleeps_under_way():
    d = dep(State.READY, memory_gib=40.0)
    assert rules.asked_level(d, None, True) == 1  # auto on discrete GPUs
    assert rules.sleep_level(d, 1, 100.0, [], 16, True) == 1
    assert rules.sleep_level(d, 1, 100.0, [50.0], 16, True) == 2  # 100 - 50 - 40 < 16
    assert rules.sleep_level(d, 1, None, [50.0], 16, True) == 1  # nothing read: the level stands
    # SGLang with the CPU backup sleeps at level 1 only: a stop instead
    assert rules.sleep_level(d.replace(engine="sglang", idle_action=IdleAction.SLEEP), 1, 50.0, [], 16, True) == 0
    with pytest.raises(DeployerError, match="no sleep mode"):
        rules.asked_level(d.replace(engine="llamacpp"), None, True)
    assert rules.may_sleep(d, True, False, None) and not rules.may_sleep(d, False, False, None)
    assert not rules.may_sleep(d, True, False, lambda x: False)


def test_a_mark_applies_a_switch_under_way_and_drops_what_the_engine_held():
    d = dep(State.ASLEEP, gpus=(2,), sleep_level=1, wake_check="Paris", pending_mode=Mode.ALWAYS_ON)
    waking = rules.marked(d, State.STARTING, gpus=(2,))
    assert waking["gpus"] == (2,) and "sleep_level" not in waking and "wake_check" not in waking
    assert "mode" not in waking  # a switch waits for its start to end
    stopped = rules.marked(d, State.STOPPED, "why")
    assert stopped["gpus"] == () and stopped["sleep_level"] is None and stopped["wake_check"] is None
    assert (stopped["mode"], stopped["pending_mode"]) == (Mode.ALWAYS_ON, None)
    assert stopped["state_reason"] == "why"
    assert rules.marked(d, State.ASLEEP, extra={"sleep_level": 2})["sleep_level"] == 2


# --- the replay's world calls these rules (issue 41: it kept copies of them, which had drifted) ---

def test_the_replay_follows_a_change_of_the_deployers_rules(monkeypatch):
    """The world (ondemand/replay/world.py) asks engines/rules.py, as the deployer does: a rule
    changed there changes what the replay says (a copy in the world would not change)."""
    from test_replay_run import THREE, dep, run
    t = run([dep(1, "a", 40)], THREE).total
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (1, 1, 1, 0)
    with monkeypatch.context() as m:
        m.setattr(rules, "sleep_level", lambda *a: 0)  # as if the host reserve never left room
        t = run([dep(1, "a", 40)], THREE).total
        assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (2, 0, 0, 1)
    with monkeypatch.context() as m:
        m.setattr(rules, "sleep_level", lambda *a: 0)
        m.setattr(rules, "may_stop", lambda *a: False)  # and no stop approved either: it stays awake
        t = run([dep(1, "a", 40)], THREE).total
        assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (1, 0, 0, 0)
    with monkeypatch.context() as m:
        m.setattr(rules, "may_start", lambda dep, removing: False)  # nothing may start: every request waits
        t = run([dep(1, "a", 40)], THREE).total
        assert (t.cold_starts, t.served) == (0, 0)
    with monkeypatch.context() as m:
        real = rules.marked
        m.setattr(rules, "marked", lambda dep, state, *a: {**real(dep, state, *a), "sleep_level": 2})
        t = run([dep(1, "a", 40)], THREE).total  # marked asleep at level 2: the wake is level 2's
        assert t.ttfts == pytest.approx([60.4, 50.4, 10.2])


def test_level_one_sleeps_under_way_are_reserved_against_the_host_reserve_in_the_replay():
    """Two 50 GiB engines, a GPU each, put to sleep in the same reaper step on a box with 100 GiB
    of host memory and a 16 GiB reserve: the first sleeps at level 1 (100 - 50 leaves 50); the
    second sees the first's 50 GiB reserved while its call is out (100 - 50 - 50 leaves 0): level
    2, whose wake takes 10 s, not 3 s (the deployer's rule: rules.sleep_level)."""
    from test_replay_run import dep, req, run

    from ondemand.replay.types import Box
    box = Box(gpus=(80.0, 80.0), host_gib=100, host_reserve_gib=16)
    reqs = [req(0), req(0, "b"), req(1000), req(1000, "b")]
    r = run([dep(1, "a", 50), dep(2, "b", 50)], reqs, box=box)
    assert r.total.sleeps == 2
    assert sorted(round(x, 1) for x in r.total.ttfts[2:]) == [3.2, 10.2]
