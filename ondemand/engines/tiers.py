"""The rest tiers of an idle engine, one object each: everything ondemand knows of a tier.

    awake ──sleep──▶ asleep_1 ──────────▶ asleep_2 ──────────────▶ stopped
                     (weights in host     (weights dropped;          (nothing held)
                      memory)              process and graphs kept)

A ``Tier`` says:

- its ``name`` (the plan's ``rest``, the views' and the command line's word for it) and its
  sleep ``level`` (the sleep API's, the ``sleep_level`` column's, the metrics' label; None when
  stopped), and the ``idle_action`` that asks for it;
- how it is entered and left: the engine calls a sleeper makes (``enter``, ``leave``: vLLM's and
  SGLang's, in the engines' documented order); stopped has none, its way in is the backend's stop
  and its way out a cold start;
- what it holds: the weights in host memory (``host``: the host reserve watches a sleep into it),
  a residue on its GPUs (``gpus``: CUDA context and graphs, on the GPUs it keeps), or nothing;
- which start brings it back (``start``, as ``Start.kind`` says it: a wake from its level, or a
  cold start), and so which start history prices it (``control/starts.py``), its cost until one
  was measured (``default_s``), and the name of that cost in a replay (``cost_key``: the
  deployments file's key and ``replay.types.Costs``' field).

``TIERS`` orders them shallow to deep; ``asleep(level)`` and ``BY_NAME`` find one. A new tier is
one more object here, and the places that act on tiers follow it. Pure: no I/O.

The engines' routes (vLLM's sleep mode with ``VLLM_SERVER_DEV_MODE=1``; SGLang's memory saver):

- sleep: vLLM ``POST /sleep?level=N``; SGLang ``POST /release_memory_occupation`` (level 1
  when started with ``--enable-weights-cpu-backup``, else level 2: its start flags choose);
- wake from level 1: vLLM ``POST /wake_up``; SGLang ``POST /resume_memory_occupation``;
- wake from level 2: vLLM ``/wake_up?tags=weights``, ``/collective_rpc`` ``reload_weights``,
  ``/wake_up?tags=kv_cache``, ``/reset_prefix_cache``; SGLang ``/resume_memory_occupation``,
  ``/update_weights_from_disk``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..model import Deployment, IdleAction

Step = tuple[str, Mapping[str, str] | None, Mapping[str, Any] | None]  # (path, query, JSON body)
Calls = Callable[[Deployment], list[Step]]


@dataclass(frozen=True)
class Tier:
    """One rest tier (the module's docstring says each field)."""

    name: str
    level: int | None
    idle_action: IdleAction
    host: bool
    gpus: bool
    start: Literal["wake", "cold"]
    default_s: float
    cost_key: str
    words: str  # the command line's: "asleep at level 1"
    enter: Calls = field(repr=False, compare=False)
    leave: Calls = field(repr=False, compare=False)


def _none(dep: Deployment) -> list[Step]:
    """No engine call: the backend stops the engine, and a cold start makes a new one."""
    return []


def _sleep_at(level: int) -> Calls:
    """The sleep call: one for either engine (SGLang's level is its start flags', not the call's)."""
    def calls(dep: Deployment) -> list[Step]:
        if dep.engine == "sglang":
            return [("/release_memory_occupation", None, {})]
        return [("/sleep", {"level": str(level)}, None)]
    return calls


def _wake_from_1(dep: Deployment) -> list[Step]:
    if dep.engine == "sglang":
        return [("/resume_memory_occupation", None, {})]
    return [("/wake_up", None, None)]


def _wake_from_2(dep: Deployment) -> list[Step]:
    """The memory back, then the weights read again from disk (they were dropped)."""
    if dep.engine == "sglang":
        return [("/resume_memory_occupation", None, {}),
                ("/update_weights_from_disk", None, {"model_path": dep.model or ""})]
    return [("/wake_up", {"tags": "weights"}, None),
            ("/collective_rpc", None, {"method": "reload_weights"}),
            ("/wake_up", {"tags": "kv_cache"}, None),
            ("/reset_prefix_cache", None, None)]


ASLEEP_1 = Tier("asleep_1", 1, IdleAction.SLEEP, host=True, gpus=True, start="wake", default_s=3.0,
                cost_key="wake_s", words="asleep at level 1", enter=_sleep_at(1), leave=_wake_from_1)
ASLEEP_2 = Tier("asleep_2", 2, IdleAction.SLEEP2, host=False, gpus=True, start="wake", default_s=10.0,
                cost_key="wake2_s", words="asleep at level 2", enter=_sleep_at(2), leave=_wake_from_2)
STOPPED = Tier("stopped", None, IdleAction.STOP, host=False, gpus=False, start="cold", default_s=60.0,
               cost_key="cold_start_s", words="stopped", enter=_none, leave=_none)

# Shallow to deep: each deeper tier holds less and costs more to come back from.
TIERS = (ASLEEP_1, ASLEEP_2, STOPPED)
NAMES = tuple(tier.name for tier in TIERS)
BY_NAME: Mapping[str, Tier] = {tier.name: tier for tier in TIERS}
_BY_LEVEL = {tier.level: tier for tier in TIERS if tier.level is not None}
# The sleep levels, shallow to deep (an administrator's sleep asks one of them).
LEVELS = tuple(_BY_LEVEL)


def asleep(level: int) -> Tier:
    """The tier of sleep ``level``; ValueError for a level no tier sleeps at."""
    tier = _BY_LEVEL.get(level)
    if tier is None:
        raise ValueError(f"no sleep level {level!r}: one of {', '.join(map(str, LEVELS))}")
    return tier
