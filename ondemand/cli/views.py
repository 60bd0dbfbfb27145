"""How a deployment's view reads: its row in the tables, its state, memory and warmth, the
command line it runs, and when a start is expected."""
from __future__ import annotations

from typing import Any

import click

from ..model import Deployment
from .shared import Ctx, _ago


def _dep_rows(views: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for v in views:
        od = v.get("ondemand") or {}
        pending = v.get("pending_mode")
        # pending = mode: an always-on deployment being started again after a restart of ondemand.
        mode = v["mode"] + ("" if not pending else " (starting again)" if pending == v["mode"] else " → " + pending)
        limit = v.get("max_inflight")
        inflight = f"{od.get('inflight')}/{limit}" if limit else od.get("inflight")
        queued = f"{od.get('queued')} (#{od['queue_position']})" if od.get("queue_position") else od.get("queued")
        rows.append([v["id"], v["name"], v["served_name"], mode, v.get("priority", "normal"),
                     _state(v), od.get("phase"), inflight, queued,
                     _ago(od.get("last_request_at")), _memory(v), ",".join(map(str, v.get("gpus") or ())) or "-",
                     f"~{v['start_eta_s']:g}s" if v.get("start_eta_s") is not None else None])
    return rows


def _state(v: dict[str, Any]) -> str:
    """The state, with the tier of an asleep engine: "asleep (level N, X GiB host)"."""
    if v.get("state") != "asleep":
        return str(v.get("state"))
    parts = [f"level {v['sleep_level']}"] if v.get("sleep_level") else []
    if v.get("host_gib") is not None:
        parts.append(f"{v['host_gib']:.1f} GiB host")
    return "asleep" + (f" ({', '.join(parts)})" if parts else "")


def _idle_level(ctx: Ctx, view: dict[str, Any]) -> int:
    """The tier an idle engine goes to (0: stopped, 1 or 2: asleep at that level): the view's
    ``idle_level``, else derived as the server does (``warmth.idle_level``) from this
    configuration's budget (a view read from the state file has none)."""
    level = view.get("idle_level")
    if isinstance(level, int):
        return level
    from ..control.budget import Budget
    from ..engines import warmth
    return warmth.idle_level(Deployment.from_row(view), Budget.from_config(ctx.cfg).per_gpu)


def _tier(level: int) -> str:
    return f"sleeps at level {level}" if level else "is stopped"


def _memory(v: dict[str, Any]) -> str:
    """Declared, and measured when known; "!" marks more than 10 % over what was declared."""
    declared = v.get("memory_gib") or 0
    measured = v.get("measured_gib")
    if measured is None:
        return f"{declared:g} GiB"
    flag = " !" if Deployment.from_row(v).over_declared else ""
    return f"{declared:g} GiB (measured {measured:.1f}{flag})"


_DEP_HEADER = ["ID", "NAME", "SERVED", "MODE", "PRIORITY", "STATE", "PHASE", "IN-FLIGHT", "QUEUED", "LAST REQUEST",
               "MEMORY", "GPUS", "START"]


def _expected(views: list[dict[str, Any]], now: float) -> list[str]:
    """For each deployment starting or queued with a start history: when it is expected."""
    lines = []
    for v in views:
        eta = v.get("start_eta_s")
        if eta is None:
            continue
        if v["state"] == "starting":
            # A cold start's phase: start_eta_s is then what is left of it, counted down already.
            phase = v.get("start_phase")
            left = max(1, round(eta if phase else eta - (now - v["updated_at"])))
            lines.append(f"{v['name']}: starting{f' ({phase})' if phase else ''}, expected in about {left} s")
        elif (v.get("ondemand") or {}).get("phase") == "queued":
            lines.append(f"{v['name']}: queued for GPU memory; once it starts, expected in about {round(eta)} s")
    return lines


# Why an idle deployment is kept awake past where the seed's rule would rest it (``ondemand.held_for``).
HELD_WORDS = {"slo": "kept awake: its wake would miss the SLO"}


def _kept_and_taken(views: list[dict[str, Any]]) -> list[str]:
    """For each deployment its warmth policy keeps awake (``held_for``), why; and for each that
    rests because make-room put it away before its idle timeout (``put_away_early``), for whom."""
    lines = []
    for v in views:
        od = v.get("ondemand") or {}
        held = od.get("held_for")
        if held:
            lines.append(f"{v['name']}: {HELD_WORDS.get(held, f'kept awake ({held})')}")
        early = od.get("put_away_early")
        if early:
            said = f"{v['name']}: put away early for {early.get('for')} by {early.get('rule')}"
            if early.get("idle_for_s") is not None and early.get("idle_after_s") is not None:
                said += f" ({early['idle_for_s']:.0f} s idle of its {early['idle_after_s']:.0f} s idle timeout"
                if early.get("wait_s") is not None and early.get("loss_s") is not None:
                    said += f": wait {early['wait_s']:g} s > expected loss {early['loss_s']:g} s"
                said += ")"
            lines.append(said)
    return lines


def _warmth_lines(ctx: Ctx, view: dict[str, Any]) -> list[str]:
    """Its ``idle_action`` and the tier it gives (the effective level), and while asleep what
    the sleep holds."""
    lines = [f"{'idle_action:':16} {view.get('idle_action') or 'auto'} (idle, it {_tier(_idle_level(ctx, view))})"]
    if view.get("state") == "asleep":
        def gib(key: str) -> str:
            return "-" if view.get(key) is None else f"{view[key]:.1f} GiB"
        lines.append(f"{'sleep:':16} level {view.get('sleep_level') or '-'}; host memory {gib('host_gib')}, "
                     f"GPU memory kept {gib('asleep_gib')}")
    if view.get("sleep_host_gib") is not None:
        lines.append(f"{'sleep_host_gib:':16} {view['sleep_host_gib']:.1f} (the last level-1 sleep's host memory)")
    lines.append(f"{'keep_warm:':16} {_keep_warm(view)}")
    return lines


def _keep_warm(view: dict[str, Any]) -> str:
    """``fixed``, or ``adaptive`` with what its plan says (as fixed while it has none)."""
    if view.get("keep_warm") != "adaptive":
        return "fixed"
    plan = view.get("adaptive")
    if not plan:
        return "adaptive (as fixed: too few idle gaps learned yet)"
    if plan.get("awake_for_s") is None:
        return f"adaptive (as fixed: no pattern in its {plan['gaps']} idle gaps)"
    from ..engines.tiers import BY_NAME
    tier = BY_NAME.get(plan.get("rest") or "")
    rest = tier.words if tier is not None else "its idle action's tier"
    said = f"adaptive ({plan['gaps']} gaps: awake {plan['awake_for_s']:g} s idle, then {rest}"
    if plan.get("prewarm_in_s") is not None:
        said += f"; woken again {plan['prewarm_in_s']:g} s after its last request"
    return said + ")"


def _launch_lines(view: dict[str, Any]) -> list[str]:
    """The command line as it will run and the environment's names (secrets' values as the
    API shows them: ***)."""
    import shlex
    lines = []
    if view.get("argv") is not None:
        lines.append(f"{'argv:':16} {shlex.join(view['argv'])}")
    elif view.get("argv_error"):
        lines.append(f"{'argv:':16} - ({view['argv_error']})")
    elif view.get("offline") and view.get("model"):
        lines.append(f"{'argv:':16} - (derived by the running server from the box's GPUs: ondemand serve)")
    env = view.get("env") or {}
    if env:
        lines.append(f"{'env:':16} {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(env.items()))}")
    if view.get("env_names"):
        lines.append(f"{'env_names:':16} {', '.join(view['env_names'])}")
    return lines


def _warn_if_blind(view: dict[str, Any]) -> None:
    from ..engines.metrics import BLIND_WARNING, blind
    if blind(Deployment.from_row(view)):
        click.echo(f"warning: {view['name']}: {BLIND_WARNING}", err=True)
