"""A mode switch (BEHAVIOUR.md, "Switch to always on"), decided in one step: what it
changes of the deployment, and whether it starts it. Pure: the controller asks it and
resets the start backoff; the admission stores it."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import OndemandError
from ..model import REQUEST_STARTABLE, Deployment, Mode, Role, State


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """What a mode switch changes, decided in one step (``plan_mode``)."""
    fields: dict[str, Any]
    start: bool
    text: str
    detail: dict[str, Any]


def check(mode: str, idle_timeout_s: int | None, set_idle_timeout: bool, min_idle_timeout_s: int) -> None:
    """The switch's own fields, before the deployment is looked up."""
    if mode not in (Mode.ON_DEMAND.value, Mode.ALWAYS_ON.value):
        raise OndemandError(400, "invalid_mode", "mode must be on_demand or always_on")
    if set_idle_timeout and idle_timeout_s is not None and not min_idle_timeout_s <= idle_timeout_s <= 86400:
        raise OndemandError(400, "invalid_idle_timeout",
                            f"idle_timeout_s must be {min_idle_timeout_s} to 86400 seconds, or null")


def plan(dep: Deployment, mode: str, idle_timeout_s: int | None, set_idle_timeout: bool) -> ModePlan:
    if dep.role is not Role.MODEL and mode == Mode.ON_DEMAND:
        raise OndemandError(400, "invalid_mode", f"a {dep.role} deployment is always always_on")
    old = {"mode": dep.mode.value, "idle_timeout_s": dep.idle_timeout_s,
           "pending_mode": dep.pending_mode.value if dep.pending_mode else None}
    fields: dict[str, Any] = {}
    if set_idle_timeout:
        fields["idle_timeout_s"] = idle_timeout_s
    start = False
    if mode == Mode.ON_DEMAND:
        fields.update(mode=Mode.ON_DEMAND, pending_mode=None)
    elif dep.mode is Mode.ALWAYS_ON:
        fields["pending_mode"] = None
    elif dep.state in REQUEST_STARTABLE:
        fields["pending_mode"] = Mode.ALWAYS_ON
        start = True
    elif dep.state is State.STARTING:
        fields["pending_mode"] = Mode.ALWAYS_ON  # applied when the start ends
    else:
        fields.update(mode=Mode.ALWAYS_ON, pending_mode=None)
    new = {**old, **{k: getattr(v, "value", v) for k, v in fields.items() if k in old}}
    text = f"mode {old['mode']} → {mode}" + (" (pending the start)" if start else "")
    return ModePlan(fields, start, text, {"old": old, "new": new})
