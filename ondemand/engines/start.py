"""A start: one start or wake of a deployment, under way, owned by its unit (``unit.start``).

It is cold (an engine is created) or a wake (from its sleep level), and holds when it began (the
deployer's monotonic clock, and the wall clock), the GPUs it was given, and what the start watch
(``startwatch.py``) learns of it: its phases read from its engine's log (a cold start's
``Timeline``), the task following that log, its compile cache's key and whether the directory
was warm, and the read of its weights ahead.

Its life (design.md, "A start's life"): the unit begins one where the deployer marks
``starting`` (``Unit.begin``), and at ondemand's start-up for an engine it takes back while it
starts (``taken_back``: it began before this ondemand, at its row's stamp). It ends when its
deployment leaves ``starting``, in the registry's mark: ``ready``, ``failed``, ``stopped`` (or
``removed``), or ``interrupted`` by ondemand's shutdown; a failed wake ends (``failed`` or
``mismatch``) as the cold start after it begins, in the same ``starting``. Each beginning and
each end is announced (``StartBegan``, ``StartEnded``) before the ``DeploymentChanged`` of its
step, so that whoever hears the change finds the start history, the metrics, the start watch
and the LiteLLM sync told already.
"""
from __future__ import annotations

import asyncio
import time

from ..events import StartBegan, StartEnded, StartKind, StartResult
from ..model import Deployment, State
from .backends import Engine
from .phases import Timeline
from .readahead import Outcome
from .recipes import Launch

# The result of a start whose deployment was marked this state (a removal is marked stopping;
# a start is marked stopped only at ondemand's shutdown).
ENDS: dict[State, StartResult] = {State.READY: "ready", State.FAILED: "failed", State.STOPPING: "stopped",
                                  State.STOPPED: "interrupted"}


def ended_by(state: State, removing: bool) -> StartResult:
    """How a start ends when its deployment is marked ``state`` (``removing``: stopped for removal)."""
    return "removed" if removing and state is State.STOPPING else ENDS.get(state, "interrupted")


class Start:
    """One start or wake under way; see the module's docstring."""

    def __init__(self, dep: Deployment, kind: StartKind, *, began: float, at: float | None = None,
                 taken_back: bool = False):
        """``began``: the deployer's clock now (taken back: when it began, on that clock);
        ``at``: the wall clock when it began (now, unless taken back)."""
        self.dep_id = dep.id
        self.name = dep.name
        self.kind: StartKind = kind
        self.level = dep.sleep_level if kind == "wake" else None
        self.began = began
        self.at = time.time() if at is None else at
        self.gpus = dep.gpus
        self.taken_back = taken_back
        # The start watch's (cold starts only; none for one taken back: its beginning was not seen).
        self.timeline: Timeline | None = None  # its phases, and when each began
        self.follower: asyncio.Task[None] | None = None  # the task reading its engine's log
        self.compile_key: str | None = None  # its configuration's compile cache, once prepared
        self.compile_warm: bool | None = None  # whether that directory held something (None: unknown)
        self.read_ahead: Outcome | None = None  # the read of its weights ahead it made, or found under way
        self.result: StartResult | None = None  # once ended

    @classmethod
    def taken_back_from(cls, dep: Deployment, *, now: float) -> Start:
        """The start of a deployment ondemand finds ``starting`` at its own start-up, its engine
        still there: begun at its row's stamp (the wall clock's distance to it, on the deployer's
        clock ``now``), a wake when the row kept its sleep level."""
        ago = time.time() - dep.updated_at  # negative if the wall clock went back: the history drops it
        return cls(dep, "wake" if dep.sleep_level is not None else "cold", began=now - ago, at=dep.updated_at,
                   taken_back=True)

    def began_event(self) -> StartBegan:
        return StartBegan(self.dep_id, self.name, self.kind, self.level, self.at, self.gpus, self.taken_back, self)

    def end(self, result: StartResult, *, now: float, at: float | None = None) -> StartEnded:
        """End it with ``result`` (``now`` on the deployer's clock, ``at`` the wall clock): its event."""
        self.result = result
        return StartEnded(self.dep_id, self.name, self.kind, self.level, now - self.began, result,
                          time.time() if at is None else at, self.taken_back, self)


class StartHooks:
    """Told of each cold start by the unit (the start watch's: the compile cache, the weights
    read ahead, the phases in its log); this one does nothing."""

    def before(self, start: Start, dep: Deployment, how: Launch) -> None:
        """Past the start-up gates, before the backend's start (no await: never delays it)."""

    def after(self, start: Start, dep: Deployment, engine: Engine) -> None:
        """The backend's start returned: the engine's process is up (no await)."""

    def expected(self, dep: Deployment) -> None:
        """A start is expected soon (an adaptive pre-warm's moment), whether or not one follows."""
