"""A deployment's warmth: its mode (on_demand or always_on), and putting it to sleep and waking it."""
from __future__ import annotations

from typing import Any

import click

from ..engines.tiers import LEVELS
from .deploy import _action, _idle_timeout, deploy
from .shared import Ctx, _call, _echo_json, _views, cli, json_option, pass_ctx
from .views import _warn_if_blind

# --- mode ----------------------------------------------------------------------

@cli.group()
def mode() -> None:
    """A deployment's mode: on_demand or always_on."""


@mode.command("get")
@click.argument("dep_id", type=int)
@json_option
@pass_ctx
def mode_get(ctx: Ctx, dep_id: int, as_json: bool) -> None:
    """Show a deployment's mode, pending mode and idle timeout."""
    view, _ = _views(ctx, f"/deployments/{dep_id}")
    data = {"id": view["id"], "mode": view["mode"], "pending_mode": view.get("pending_mode"),
            "idle_timeout_s": view.get("idle_timeout_s")}
    if as_json:
        _echo_json(data)
    else:
        extra = f" (switching to {data['pending_mode']})" if data["pending_mode"] else ""
        idle = f", idle timeout {data['idle_timeout_s']} s" if data["idle_timeout_s"] else ""
        click.echo(f"{data['mode']}{extra}{idle}")


@mode.command("set")
@click.argument("dep_id", type=int)
@click.argument("new_mode", type=click.Choice(["on_demand", "always_on"]))
@click.option("--idle-timeout", help="seconds, or 'default' for ondemand_idle_timeout_s")
@json_option
@pass_ctx
def mode_set(ctx: Ctx, dep_id: int, new_mode: str, idle_timeout: str | None, as_json: bool) -> None:
    """Switch a deployment's mode (audited as ondemand_mode)."""
    body: dict[str, Any] = {"mode": new_mode}
    if idle_timeout is not None:
        body["idle_timeout_s"] = _idle_timeout(idle_timeout)
    view = _call(ctx, "PATCH", f"/deployments/{dep_id}/mode", body)
    if as_json:
        _echo_json(view)
    else:
        pending = f"; it stays {view['mode']} until it has started" if view.get("pending_mode") else ""
        click.echo(f"{view['name']}: {view['mode']}{pending}")
    _warn_if_blind(view)


@deploy.command("sleep")
@click.argument("dep_id", type=int)
@click.option("--level", type=click.IntRange(min(LEVELS), max(LEVELS)),
              help="1: weights kept in host memory; 2: weights dropped (default: its idle_action's level, else 1)")
@click.option("--drain", "drain_s", type=click.FloatRange(0, 3600), default=None,
              help="seconds to wait for its requests in flight before it sleeps (default 30)")
@click.option("--force", is_flag=True, help="sleep at once: the engine aborts the requests it runs")
@json_option
@pass_ctx
def deploy_sleep(ctx: Ctx, dep_id: int, level: int | None, drain_s: float | None, force: bool,
                 as_json: bool) -> None:
    """Put a ready vLLM or SGLang engine to sleep. It drains first: no new request is given to
    it, those in flight end (at most --drain seconds), then it sleeps, and requests that came
    meanwhile wake it. Still busy at the deadline: nothing sleeps (409 deployment_busy) and it
    serves on; --force sleeps at once. A level-1 sleep that would leave less than
    budget.host_reserve_gib of host memory sleeps at level 2: the answer says the level it got."""
    body: dict[str, object] = {}
    if level is not None:
        body["level"] = level
    if drain_s is not None:
        body["drain_s"] = drain_s
    if force:
        body["force"] = True
    _action(ctx, dep_id, "sleep", as_json, body=body or None)


@deploy.command("wake")
@click.argument("dep_id", type=int)
@click.option("--wait", is_flag=True, help="return when it is ready (or failed)")
@json_option
@pass_ctx
def deploy_wake(ctx: Ctx, dep_id: int, wait: bool, as_json: bool) -> None:
    """Wake an asleep engine (a wake that fails or answers wrong starts it cold)."""
    _action(ctx, dep_id, "wake", as_json, wait)
