"""The decision core's whole window onto the world (``Effects``): reads of the deployer's
state, and actions that run in the background and report back through the controller's
``on_*`` methods. The real one is ``effects.DeployerEffects``; the tests' is a recording fake."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..model import Deployment


class Timer(Protocol):
    def cancel(self) -> None: ...


class Effects(Protocol):
    """The core's whole window onto the world: reads of the deployer's state, and
    actions that run in the background and report back through ``on_*``."""

    def deployment(self, dep_id: int) -> Deployment | None: ...

    def deployments(self) -> list[Deployment]: ...

    def engine_idle(self, dep_id: int) -> bool:
        """The engine's last metrics sample (< 60 s old) shows no running or waiting request."""

    def sleeping(self, dep_id: int) -> bool:
        """Its sleep's engine call is out: marked asleep, its memory not yet free (``rules.as_read``)."""

    def idle_level(self, dep: Deployment) -> int:
        """The tier ``dep``'s idle engine goes to: 1 or 2 (asleep at that level), 0 (stopped)."""

    def tiers(self, dep: Deployment) -> Mapping[str, float]:
        """The tiers ``dep``'s idle engine may rest in now (``engines.tiers``' names: its sleep
        levels as far as its engine, its ``idle_action`` and the host reserve allow, and
        stopped), each with its cost to come back in seconds (the median of its measured wakes
        from that level, or cold starts, else the tier's default): adaptive warmth's plan."""

    def sleep_s(self, dep: Deployment) -> float:
        """How long ``dep``'s memory stays held once its idle engine is put to sleep at its idle
        level (the median of its measured sleep calls at that level; 0 while none is known, and
        for an engine that stops when idle): a request that comes meanwhile waits for it."""

    def admit(self, dep_id: int, *, text: str) -> None:
        """Fit check and start, keeping ``held_for_others(dep_id)`` out of reach (asked in the
        step of the check); reports ``on_admitted``, ``on_refused``, ``on_budget_error`` or
        ``on_start_error``."""

    def stop(self, dep_id: int, *, text: str, for_dep: int | None) -> None:
        """Stop ``dep_id`` if the core's precheck for it (``Controller.precheck(for_dep)``) still
        approves it; reports ``on_stopped``."""

    def sleep(self, dep_id: int, *, text: str, for_dep: int | None, level: int | None = None) -> None:
        """Put ``dep_id`` to sleep at ``level`` (None: its idle level; adaptive warmth's plan
        names one of ``tiers``') if the core's precheck for it still approves it (the host reserve may make it
        level 2, or a stop); reports ``on_stopped``."""

    def prewarm(self, dep_id: int, *, text: str) -> None:
        """Adaptive warmth's pre-warm: wake or start ``dep_id`` (asleep or stopped, nobody
        waiting) only with memory free now: the fit check keeps ``held_for_others(dep_id)`` out
        of reach, and nothing is put to sleep or stopped for it (no make-room). Asks
        ``prewarm_wanted(dep_id)`` in the step that would mark it starting (False: nothing
        starts). Reports ``on_prewarmed(dep_id, started)`` once, whatever happens: ``started``
        True when it was marked starting (a wake or a cold start runs, whose end arrives as a
        change like any start's), False when it did not fit, the budget could not be read, it
        was not wanted any more or its state could not start."""

    def settle(self, dep_id: int, within_s: float) -> None:
        """Wait until ``dep_id`` fits (the freed memory reads as free on its GPUs), or
        ``within_s``; reports ``on_settled``."""

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None: ...

    def counters_changed(self, dep_id: int) -> None: ...

    def idle_gap(self, dep_id: int, gap_s: float) -> None:
        """One idle gap learned (adaptive warmth): kept in the state file, the newest KEEP."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer: ...
