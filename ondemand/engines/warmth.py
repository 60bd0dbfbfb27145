"""Tiered warmth: how deep an idle engine sleeps, and whether its wake brought it back.

A pure room beside the deployer, as ``recipes`` is: no I/O, no logging, no state.
The tiers themselves (their levels, what each holds, the engine calls in and out, what
coming back costs) are ``tiers.py``'s; the rules here choose among them (BEHAVIOUR.md,
"Tiered warmth").

A deployment's ``idle_action`` says which tier an idle engine goes to:
``auto`` is level 1 for a vLLM or SGLang recipe (a ``model``) on discrete GPUs
and a stop otherwise (on unified memory a wake is not reliable: vLLM #50011;
llama.cpp and custom engines have no sleep API; a row without a model runs an
argv that may lack the sleep flags). ``sleep``/``sleep2`` name the level, and an
administrator may set them on a vLLM or SGLang row without a model.

A level-1 sleep moves the weights to host memory. Before it, the host memory it
will take is predicted (the last level-1 sleep of that deployment as measured,
else its booked size, an upper bound; the level-1 sleeps already under way are reserved
against it); one that would leave less than
``budget.host_reserve_gib`` available sleeps at level 2 instead, or stops where
level 2 is not possible (``host_level``): nothing may push the box into swap.

After every wake one greedy one-token completion must match, as text, the one
recorded after the engine's cold start (``check_body``, ``check_text``): a wake
that silently answers garbage (torch_memory_saver #71) is caught and the
engine started cold instead.
"""
from __future__ import annotations

from typing import Any

from ..model import Deployment, IdleAction
from . import tiers

SLEEP_ENGINES = frozenset({"vllm", "sglang"})
# The wake check's prompt: any fixed text does; a greedy (temperature 0) one-token answer of the
# same weights is the same token, so a different one means the weights did not come back whole.
CHECK_PROMPT = "The capital of France is"


def has_sleep_api(dep: Deployment) -> bool:
    """vLLM and SGLang can sleep; llama.cpp and custom engines cannot."""
    return dep.engine in SLEEP_ENGINES


def idle_level(dep: Deployment, per_gpu: bool) -> int:
    """The tier an idle engine goes to: 1 or 2 (asleep at that level), or 0 (stopped).
    ``per_gpu``: the budget tells discrete GPUs apart (``nvidia-smi``, or ``static`` per GPU);
    unified memory and one pool are not."""
    if not has_sleep_api(dep):
        return 0
    action = dep.idle_action
    if action is IdleAction.AUTO:
        return tiers.LEVELS[0] if dep.model is not None and per_gpu else 0
    return next((tier.level or 0 for tier in tiers.TIERS if tier.idle_action is action), 0)


def deepest_level(dep: Deployment, per_gpu: bool) -> int:
    """The deepest level its engine can sleep at, as it was started: vLLM 2; SGLang the one its
    flags chose (with the CPU backup of the weights, level 1 only); no sleep API, 0."""
    if not has_sleep_api(dep):
        return 0
    idle = idle_level(dep, per_gpu)
    if dep.engine == "sglang" and idle and tiers.asleep(idle).host:
        return idle  # started with the CPU backup of its weights: that level only
    return tiers.LEVELS[-1]


def predicted_host_gib(dep: Deployment) -> float:
    """Host memory a level-1 sleep will take: the last one as measured, else its booked size
    (``footprint_gib``: the booking, or what it was measured to use if more; an upper bound)."""
    return dep.sleep_host_gib if dep.sleep_host_gib is not None else dep.footprint_gib


def host_level(dep: Deployment, level: int, available_gib: float | None, reserve_gib: float,
               per_gpu: bool) -> int:
    """The level to sleep at, given the host memory available now: ``level``, or the next deeper
    one that holds nothing in host memory (level 2; or 0, a stop, when its engine cannot sleep
    that deep) when a sleep at ``level`` would leave less than ``reserve_gib`` available.
    ``available_gib`` None: not known (nothing is read on this box): ``level`` stands."""
    if level not in tiers.LEVELS or not tiers.asleep(level).host or available_gib is None \
            or available_gib - predicted_host_gib(dep) >= reserve_gib:
        return level
    deepest = deepest_level(dep, per_gpu)
    return next((deeper for deeper in tiers.LEVELS
                 if level < deeper <= deepest and not tiers.asleep(deeper).host), 0)


def check_body(dep: Deployment) -> dict[str, Any]:
    """The wake check's request: ``POST /v1/completions``, greedy, one token."""
    return {"model": dep.served_name, "prompt": CHECK_PROMPT, "max_tokens": 1, "temperature": 0}


def check_text(body: object) -> str | None:
    """The answer's text (``choices[0].text``), or None when the body is not a completion."""
    if not isinstance(body, dict):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    text = choices[0].get("text")
    return text if isinstance(text, str) else None
