"""The deployment value: one conversion from plain values, and back."""
import dataclasses

import pytest

from ondemand.model import Deployment, Mode, Role, State


def test_a_row_with_nulls_reads_as_the_defaults():
    dep = Deployment.from_row({"id": 1, "name": "a", "served_name": "A", "mode": None, "args": None,
                               "memory_gib": None, "role": None, "pending_mode": None, "extra": "ignored"})
    assert (dep.mode, dep.args, dep.memory_gib, dep.role, dep.pending_mode, dep.state) == \
        (Mode.ALWAYS_ON, (), 0.0, Role.MODEL, None, State.PLANNED)


def test_replace_takes_plain_values_and_as_dict_gives_them_back():
    dep = Deployment(id=1, name="a", served_name="A")
    edited = dep.replace(mode="on_demand", args=["--x"], memory_gib=3, pending_mode="always_on", state="ready")
    assert (edited.mode, edited.args, edited.memory_gib, edited.pending_mode, edited.state) == \
        (Mode.ON_DEMAND, ("--x",), 3.0, Mode.ALWAYS_ON, State.READY)
    assert Deployment.from_row(edited.as_dict()) == edited
    assert edited.as_dict()["args"] == ["--x"] and edited.as_dict()["mode"] == "on_demand"
    with pytest.raises(dataclasses.FrozenInstanceError):
        edited.state = State.STOPPED  # type: ignore[misc]
    with pytest.raises(ValueError):
        dep.replace(mode="sometimes")


def test_a_measurement_is_no_change_of_the_deployment():
    """``measured_since``: what was measured of its engine (memory awake or asleep, host memory,
    its log's tail, its booking) changed and nothing else (the controller then only offers the
    memory that may read free, ``Attempts.offer``)."""
    d = Deployment(id=1, name="a", served_name="A", state=State.ASLEEP, sleep_level=1)
    measured = d.replace(asleep_gib=1.5, host_gib=20.0, updated_at=5.0, log_tail="x")
    assert measured.measured_since(d) and d.measured_since(d)
    assert not d.replace(state=State.READY).measured_since(d)
    assert not measured.replace(memory_gib=30).measured_since(d)
