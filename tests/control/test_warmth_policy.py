"""How long an idle engine stays warm (ondemand/control/warmth_policy.py): ``Fixed``, the policy of
``keep_warm = "fixed"`` and of every always-on deployment: idle after the idle timeout it is given
(the deployment's own, else the box's), whatever its rhythm; nothing held awake, no rest in a tier
of its own (the reaper's rule, its idle action's tier, decides), nothing of its record touched.
``Adaptive``: test_keepwarm.py; warmth by value over ``Fixed`` (cost): test_value.py."""
from __future__ import annotations

import pytest
from core_doubles import Clock, Effects, make

from ondemand.control.record import Record
from ondemand.control.warmth_policy import Fixed
from ondemand.model import Deployment, Mode, State


def dep(i: int, **kw) -> Deployment:
    return Deployment(id=i, name=f"d{i}", served_name=f"D{i}", mode=Mode.ON_DEMAND, state=State.READY).replace(**kw)


def test_fixed_is_idle_after_the_timeout_it_is_given_and_holds_rests_and_keeps_nothing():
    fixed = Fixed(lambda d: d.idle_timeout_s or 600)
    own, box = dep(1, idle_timeout_s=120), dep(2)
    rec = Record()
    rec.last_activity, rec.idle_since = 5.0, 5.0
    before = {name: getattr(rec, name) for name in Record.__slots__}
    assert fixed.idle_after(own, rec) == 120 and fixed.idle_after(box, rec) == 600
    for now in (5.0, 500.0, 1e6):  # however long it has been idle
        assert fixed.held_until(own, rec, now) is None and fixed.held_for(own, rec, now) is None
        assert fixed.rest(own, rec, now) is False and fixed.held_until(own, None, now) is None
    fixed.idle_began(own, rec)
    fixed.idle_began(None, rec)  # (gone)
    fixed.idle_ended(own, rec)
    fixed.changed(own, rec)
    assert {name: getattr(rec, name) for name in Record.__slots__} == before


def test_the_cores_fixed_policy_is_the_deployments_idle_timeout_else_the_boxs():
    """The controller's ``Fixed`` (the seed scheduler keeps it as it is) is given the deployment's own
    idle timeout, else the box's; the idle rule asks it."""
    clock = Clock()
    c, fx, clock = make((clock, Effects(clock)), idle_timeout_s=300)
    fx.add(1, state=State.READY, idle_timeout_s=120)
    fx.add(2, state=State.READY)
    assert isinstance(c.fixed, Fixed)
    assert c.fixed.idle_after(fx.deps[1], c.record(1)) == 120 and c.fixed.idle_after(fx.deps[2], c.record(2)) == 300
    clock.advance(200)
    assert c.slots.quiet_for(fx.deps[1]) == (pytest.approx(200), 120) and c.is_idle(fx.deps[1])
    assert c.slots.quiet_for(fx.deps[2]) == (pytest.approx(200), 300) and not c.is_idle(fx.deps[2])
