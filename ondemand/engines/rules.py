"""The deployer's rules: what it decides in the step that marks a change, and nothing else.

Pure: no I/O, no await, no state of its own. The deployer (``deployer.py``, ``registry.py``)
calls them with its units' fields, and the replay's world (``replay/world.py``) with its
simulated engines', so the replay follows the real rules, and a change of one changes what the
replay says (design.md, "The replay").

- ``may_start``, ``admit``: may this start (or wake) begin; the start step in its order (may
  it, is it still wanted, the queue's holds, the fit check: the control side's, handed in);
- ``as_read``: the deployments as a fit check counts them (a sleep whose call is out holds all);
- ``gate_keys``: the start-up gates a start takes, in index order;
- ``may_stop``: approve this stop;
- ``asked_level``, ``may_sleep``, ``sleep_level``: which sleep level, after the host reserve
  and the level-1 sleeps still under way;
- ``marked``: how a mark to a state changes a deployment's fields.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import DeployerError
from ..model import ADMIN_STARTABLE, HOLDING, Deployment, State
from . import tiers, warmth
from .recipes import may_sleep as sleep_flags

# The fit check of a start (``control/budget.Budget.check_fit`` on a reading): the GPUs ``dep``
# starts on, given what the queue holds for others; raises InsufficientMemory.
Fit = Callable[[Deployment, Mapping[int, float] | None], tuple[int, ...]]
Precheck = Callable[[Deployment], bool]


def may_start(dep: Deployment, removing: bool) -> bool:
    """Whether ``dep`` may start (or wake) now: False when it is starting, ready or being
    removed (nothing to do: wait for it); raises DeployerError for a state that cannot start."""
    if dep.state in (State.STARTING, State.READY) or removing:
        return False
    if dep.state is State.ASLEEP:
        if not warmth.has_sleep_api(dep):
            raise DeployerError(f"{dep.name} is asleep but {dep.engine} has no sleep mode")
    elif dep.state not in ADMIN_STARTABLE:
        raise DeployerError(f"{dep.name} is {dep.state}: it cannot be started now")
    return True


def admit(dep: Deployment, removing: bool, wanted: Callable[[], bool] | None,
          held_for_others: Callable[[], Mapping[int, float]] | None, fit: Fit) -> tuple[int, ...] | None:
    """The start step, in its order, with no await (the caller marks ``starting`` in the same
    step): None when there is nothing to start (``may_start`` says wait, or ``wanted`` says
    nobody needs it any more), else the GPUs the fit check chose, the queue's holds for others
    out of reach. Raises DeployerError (``may_start``) or InsufficientMemory (``fit``)."""
    if not may_start(dep, removing) or (wanted is not None and not wanted()):
        return None
    return fit(dep, held_for_others() if held_for_others is not None else None)


def as_read(deps: Iterable[Deployment], sleeping: Callable[[int], bool]) -> list[Deployment]:
    """The deployments as a fit check counts them: one marked asleep whose sleep's engine call is
    still out (``sleeping``) holds its whole footprint until the call ends, as it does on the GPUs
    (nvidia-smi shows the memory used until the engine has freed it). So no start takes that
    memory mid-sleep on a budget that measures nothing either (the ``static`` one), and the start
    make-room freed it for is not overtaken before its hold begins, when the call reports; the
    sleeper's own wake may still use it (its own holding never counts against itself)."""
    return [d.replace(state=State.READY, sleep_level=None) if d.state is State.ASLEEP and sleeping(d.id) else d
            for d in deps]


def gate_keys(gpus: Iterable[int], per_gpu: bool) -> list[int | None]:
    """The start-up gates a start takes, in index order (two starts that share GPUs never hold
    one each and wait for the other's): one per GPU it was given (none for an engine with no
    GPU), or the one gate (None) of a one-pool budget."""
    return [*sorted(gpus)] if per_gpu else [None]


def may_stop(dep: Deployment, precheck: Precheck | None, owed: bool, has_engine: bool) -> bool:
    """Approve a stop: the precheck (the core's: the reaper's ``is_idle``, or make-room's rule for
    its requester), then the state. A stop of a
    deployment owed a start is one (it cancels the debt); a failed one is stopped while its
    engine is still there; otherwise nothing is to stop once stopped, planned or stopping."""
    if precheck is not None and not precheck(dep):
        return False
    if dep.state is State.STOPPED and owed:
        return True
    return not (dep.state in (State.STOPPED, State.PLANNED, State.STOPPING)
                or (dep.state is State.FAILED and not has_engine))


def asked_level(dep: Deployment, level: int | None, per_gpu: bool) -> int:
    """The level ``dep`` is to sleep at when ``level`` is asked (None: its idle level, else 1),
    before the host reserve; raises DeployerError when its engine cannot sleep so."""
    if not warmth.has_sleep_api(dep):
        raise DeployerError(f"{dep.engine} has no sleep mode; stop it instead")
    if dep.model is not None and not sleep_flags(dep, per_gpu):
        # Its recipe left the sleep flags out (idle_action stop, or auto where a wake is not
        # reliable): the engine would refuse, and a failed sleep stops it.
        raise DeployerError(f"{dep.name} was started without the sleep flags (idle_action "
                            f"{dep.idle_action}): set idle_action sleep or sleep2, or stop it instead")
    want = level or warmth.idle_level(dep, per_gpu) or 1
    deepest = warmth.deepest_level(dep, per_gpu)
    if dep.engine == "sglang":
        if level is not None and level != deepest:  # its start flags chose the level, not the call
            raise DeployerError(f"{dep.name} sleeps at level {deepest} only: SGLang's level is set by its "
                                "start flags (idle_action sleep: level 1, sleep2: level 2)")
        want = deepest
    if want not in tiers.LEVELS or want > deepest:
        raise DeployerError(f"{dep.name} cannot sleep at level {want}: its engine was started with SGLang's "
                            "--enable-weights-cpu-backup (level 1); set idle_action sleep2 for level 2")
    return want


def may_sleep(dep: Deployment, has_engine: bool, removing: bool, precheck: Precheck | None) -> bool:
    """Whether it may be put to sleep now: ready, its engine there, not being removed, and the
    precheck (the core's: the reaper's ``is_idle``, or make-room's rule) approves."""
    return (dep.state is State.READY and has_engine and not removing
            and (precheck is None or precheck(dep)))


def sleep_level(dep: Deployment, want: int, available_gib: float | None, under_way: Iterable[float],
                reserve_gib: float, per_gpu: bool) -> int:
    """The level the host reserve lets it sleep at (``warmth.host_level``; 0: neither level
    fits it): the host memory available now (None: not known) less what the other level-1
    sleeps still under way will take (``under_way``: they have not moved their weights yet)."""
    if available_gib is not None:
        available_gib -= sum(under_way)
    return warmth.host_level(dep, want, available_gib, reserve_gib, per_gpu)


def marked(dep: Deployment, state: State, reason: str | None = None, log_tail: str | None = None,
           gpus: tuple[int, ...] | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fields a mark of ``dep`` to ``state`` changes. ``gpus``: the GPUs a start was given;
    an engine that holds nothing any more holds no GPU either. A sleep's level stays through its
    wake (``starting``: a restart mid-wake wakes it again); the wake check belongs to the engine
    (the next one records its own). A switch of mode under way is applied in the same change as
    the state it waited for (ready, failed, stopped)."""
    changes: dict[str, Any] = {"state": state, "state_reason": reason}
    if state not in (State.ASLEEP, State.STARTING):
        changes["sleep_level"] = changes["host_gib"] = None
    if state not in HOLDING:
        changes["wake_check"] = None
    changes.update(extra or {})
    if gpus is not None:
        changes["gpus"] = gpus
    elif state not in HOLDING:
        changes["gpus"] = ()
    if log_tail is not None or state in (State.STARTING, State.READY):
        changes["log_tail"] = log_tail
    if state in (State.READY, State.FAILED, State.STOPPED) and dep.pending_mode is not None:
        changes["mode"], changes["pending_mode"] = dep.pending_mode, None
    return changes
