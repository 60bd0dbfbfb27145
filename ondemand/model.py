"""The deployment as a value: its states, modes and roles, and each set of
states that the rest of the code asks about, defined once.

A ``Deployment`` is frozen. The deployer owns the live one and replaces the
object on every transition or change (``dep.replace(...)``), so a reader that
holds a deployment holds a consistent snapshot, and nobody can change a
deployment behind its owner's back. Views (admin API, events, LiteLLM sync)
are built from it with ``as_dict()``. Imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from typing import Any


class State(str, enum.Enum):
    PLANNED = "planned"
    STARTING = "starting"
    READY = "ready"
    ASLEEP = "asleep"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class Mode(str, enum.Enum):
    ON_DEMAND = "on_demand"
    ALWAYS_ON = "always_on"

    def __str__(self) -> str:
        return self.value


class Priority(str, enum.Enum):
    """Who waits and who is put to sleep (BEHAVIOUR.md, "Priorities and limits")."""
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"

    def __str__(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        """Higher goes first in the queue; make-room takes victims of this rank or lower."""
        return _RANK[self]


_RANK = {Priority.LOW: 0, Priority.NORMAL: 1, Priority.HIGH: 2}
# max_inflight: NULL (no limit) or 1..MAX_INFLIGHT.
MAX_INFLIGHT = 10000


class KeepWarm(str, enum.Enum):
    """How long an idle engine stays awake: ``fixed``, its idle timeout; ``adaptive``, what its
    learned rhythm says (control/rhythm.py), within that timeout."""
    FIXED = "fixed"
    ADAPTIVE = "adaptive"

    def __str__(self) -> str:
        return self.value


class IdleAction(str, enum.Enum):
    """What an idle engine becomes (BEHAVIOUR.md, "Tiered warmth"): ``auto`` is ``sleep`` for a
    vLLM or SGLang recipe on discrete GPUs and ``stop`` otherwise (``warmth.idle_level``)."""
    AUTO = "auto"
    STOP = "stop"
    SLEEP = "sleep"  # level 1: weights kept in host memory
    SLEEP2 = "sleep2"  # level 2: weights dropped, the process and its compiled graphs kept

    def __str__(self) -> str:
        return self.value


class Role(str, enum.Enum):
    MODEL = "model"
    DECISION = "decision"  # always on, never through the gateway
    SYSTEM = "system"

    def __str__(self) -> str:
        return self.value


# An engine holds (or is about to hold) its memory.
HOLDING = frozenset({State.STARTING, State.READY, State.ASLEEP, State.STOPPING})
# An administrator may start it (the deployer's start); asleep is woken instead.
ADMIN_STARTABLE = frozenset({State.PLANNED, State.STOPPED, State.FAILED})
# A request may start or wake it (never a planned one: it answers 503 ondemand_planned).
REQUEST_STARTABLE = frozenset({State.STOPPED, State.FAILED, State.ASLEEP})
# The reaper and make-room may stop it when it is idle.
STOPPABLE_WHEN_IDLE = frozenset({State.READY, State.ASLEEP})
# Nothing runs (a stop would have nothing to do).
AT_REST = frozenset({State.PLANNED, State.STOPPED, State.STOPPING})
# Its phase reads "sleeping" in views.
SLEEPING = frozenset({State.STOPPED, State.ASLEEP, State.STOPPING, State.PLANNED})
# Its fields may be edited in place (no engine depends on them).
EDITABLE = frozenset({State.STOPPED, State.FAILED, State.PLANNED})
# Entering or leaving one of these changes what LiteLLM should list.
SYNC_STATES = frozenset({State.READY, State.ASLEEP, State.FAILED, State.PLANNED})

# A deployment id as a path writes it: canonical decimal, ASCII digits, no sign, no leading zero,
# at most 18 digits (SQLite's integers are 64-bit). "03", "٣" (an Arabic-Indic three) named
# deployment 3, and "¹" or 5,000 digits made int() raise (a 500).
_ID = re.compile(r"(?:0|[1-9][0-9]{0,17})\Z")


def parse_id(text: str) -> int | None:
    """The deployment id ``text`` spells canonically, else None (for the caller's 404)."""
    return int(text) if _ID.match(text) else None


# A measured footprint this much over what was declared is flagged (log, status, doctor).
OVER_DECLARED = 1.10

# Fields that are not the deployment's configuration: its life, not its make-up.
_LIFE_FIELDS = frozenset({"id", "state", "state_reason", "log_tail", "pending_mode", "gpus", "measured_gib",
                          "created_at", "updated_at", "sleep_level", "host_gib", "asleep_gib", "sleep_host_gib",
                          "wake_check", "booking"})
_MEASURED = ("measured_gib", "host_gib", "asleep_gib", "sleep_host_gib", "log_tail", "booking", "updated_at")


# How a plain value (a stored row, a JSON body) becomes the field's type.
_COERCE: dict[str, Callable[[Any], Any]] = {
    "args": lambda v: tuple(v or ()),
    "command": lambda v: tuple(v or ()),
    "memory_gib": lambda v: float(v or 0),
    "gpu_count": lambda v: None if v is None else int(v),
    "gpu_ids": lambda v: None if v is None else tuple(int(i) for i in v),
    "gpus": lambda v: tuple(int(i) for i in v or ()),
    "measured_gib": lambda v: None if v is None else float(v),
    "role": lambda v: Role(v or Role.MODEL),
    "state": lambda v: State(v or State.PLANNED),
    "mode": lambda v: Mode(v or Mode.ALWAYS_ON),
    "pending_mode": lambda v: Mode(v) if v else None,
    # Sorted pairs: a frozen value that compares equal whatever order it was given in.
    "env": lambda v: tuple(sorted((str(k), str(x)) for k, x in (v.items() if isinstance(v, Mapping) else v or ()))),
    "volumes": lambda v: tuple(v or ()),
    "priority": lambda v: Priority(v or Priority.NORMAL),
    "max_inflight": lambda v: None if v is None else int(v),
    "idle_action": lambda v: IdleAction(v or IdleAction.AUTO),
    "keep_warm": lambda v: KeepWarm(v or KeepWarm.FIXED),
    "sleep_level": lambda v: None if v is None else int(v),
    "host_gib": lambda v: None if v is None else float(v),
    "asleep_gib": lambda v: None if v is None else float(v),
    "sleep_host_gib": lambda v: None if v is None else float(v),
}


def _coerced(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _COERCE[k](v) if k in _COERCE else v for k, v in values.items()}


def plain(value: Any, field: str | None = None) -> Any:
    """A field's value as JSON has it: an enum's string, a list for a tuple (an object for ``env``)."""
    if field == "env":
        return dict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Booking:
    """What a recipe without ``memory_gib`` is booked (``recipes.booking``; not stored): ``gib``
    in all, from ``source`` (``checkpoint`` or ``engine_default``), and the context length the
    recipe passes its engine when it capped the model's (None: the model's own)."""
    gib: float
    source: str
    max_model_len: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Deployment:
    id: int
    name: str
    served_name: str
    engine: str = "vllm"  # vllm, sglang, llamacpp or custom (recipes.ENGINES)
    model: str | None = None  # what the engine loads; None: no recipe, image/args or command as given
    image: str | None = None
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    port: int = 8000
    memory_gib: float = 0.0  # in all; split evenly over its GPUs
    gpu_count: int | None = None  # None: every GPU (as before GPU placement); 0: no GPU
    gpu_ids: tuple[int, ...] | None = None  # the GPUs it must run on (gpu_count of them)
    env: tuple[tuple[str, str], ...] = ()  # added to the engine's environment, sorted by name
    volumes: tuple[str, ...] = ()  # "/host:/container[:ro]" (docker backend)
    role: Role = Role.MODEL
    state: State = State.PLANNED
    state_reason: str | None = None
    log_tail: str | None = None
    mode: Mode = Mode.ALWAYS_ON
    idle_timeout_s: int | None = None
    pending_mode: Mode | None = None
    priority: Priority = Priority.NORMAL
    max_inflight: int | None = None  # requests served at once through the gateway; None: no limit
    idle_action: IdleAction = IdleAction.AUTO
    keep_warm: KeepWarm = KeepWarm.FIXED
    gpus: tuple[int, ...] = ()  # the GPUs its engine holds (set at the start, cleared when it stops)
    measured_gib: float | None = None  # what its engine was last measured to use
    sleep_level: int | None = None  # 1 or 2 while asleep
    host_gib: float | None = None  # host memory its engine was measured to hold asleep (while asleep)
    asleep_gib: float | None = None  # GPU memory its engine was last measured to keep asleep (in all)
    sleep_host_gib: float | None = None  # host memory its last level-1 sleep held: the next one's prediction
    wake_check: str | None = None  # the greedy one-token answer recorded after its engine's cold start
    created_at: float = 0.0
    updated_at: float = 0.0
    booking: Booking | None = None  # derived when memory_gib is 0 (the deployer's; not stored)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Deployment:
        """From a stored row or a view (NULL mode reads as always on; unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**_coerced({k: v for k, v in row.items() if k in known}))

    def replace(self, **changes: Any) -> Deployment:
        """A copy with ``changes``, given as plain values (strings, lists) or typed ones."""
        return dataclasses.replace(self, **_coerced(changes))

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums as their strings, sequences as lists)."""
        return {f.name: plain(getattr(self, f.name), f.name) for f in dataclasses.fields(self) if f.name != "booking"}

    def config(self) -> tuple[Any, ...]:
        """Everything an administrator sets (not its state): a change of it (an edit,
        a mode switch) resets the start backoff."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _LIFE_FIELDS)

    def measured_since(self, old: Deployment) -> bool:
        """Is ``old`` this deployment but for what was measured of its engine (its memory awake or
        asleep, its host memory, its log's tail, its booking)? A measurement's update, not a change."""
        return dataclasses.replace(old, **{f: getattr(self, f) for f in _MEASURED}) == self

    @property
    def booked_gib(self) -> float:
        """What it is booked before any measurement: ``memory_gib``, else its derived booking."""
        if self.memory_gib > 0 or self.booking is None:
            return self.memory_gib
        return self.booking.gib

    @property
    def memory_source(self) -> str:
        """Where ``footprint_gib`` comes from: ``declared``, ``checkpoint``, ``engine_default``
        or ``measured`` (more than the booking)."""
        if self.measured_gib is not None and self.measured_gib > self.booked_gib:
            return "measured"
        return "declared" if self.memory_gib > 0 or self.booking is None else self.booking.source

    @property
    def footprint_gib(self) -> float:
        """What a fit check counts for it: the larger of booked and measured."""
        return max(self.booked_gib, self.measured_gib or 0.0)

    @property
    def residue_gib(self) -> float:
        """What its engine keeps on its GPUs asleep: as last measured, else nothing known (0)."""
        return min(self.asleep_gib or 0.0, self.footprint_gib)

    @property
    def over_declared(self) -> bool:
        """Its engine was measured to use more than 10 % beyond what it declared."""
        return self.measured_gib is not None and self.measured_gib > self.booked_gib * OVER_DECLARED + 1e-9

    @property
    def on_demand(self) -> bool:
        return self.mode is Mode.ON_DEMAND and self.role is Role.MODEL
