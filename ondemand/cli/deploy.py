"""deploy: add, set, list, show, rm, start, stop and logs (sleep and wake are in warmth)."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import click

from ..admin import client as adminclient
from ..engines.recipes import ENGINES
from ..model import IdleAction
from .shared import (
    EXIT_NO_SERVER,
    EXIT_USAGE,
    Ctx,
    Whole,
    _ago,
    _call,
    _echo_json,
    _fail,
    _run,
    _table,
    _views,
    cli,
    json_option,
    pass_ctx,
    whole_number,
)
from .views import _DEP_HEADER, _dep_rows, _kept_and_taken, _launch_lines, _state, _warmth_lines, _warn_if_blind

IDLE_ACTIONS = [a.value for a in IdleAction]


def _max_inflight(value: str) -> int | None:
    """--max-inflight: requests at once, or 'none' (no limit); the server checks the range."""
    if value == "none":
        return None
    digits = value.removeprefix("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 9):  # "²" is isdigit() too
        _fail("--max-inflight takes a whole number of requests or 'none'", EXIT_USAGE)
    return int(value)


def _idle_timeout(value: str) -> int | None:
    """--idle-timeout: whole seconds, or 'default' (null: ondemand_idle_timeout_s)."""
    if value == "default":
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 9):  # "²" is isdigit() too
        _fail("--idle-timeout takes whole seconds or 'default'", EXIT_USAGE)
    return int(value)



# --- deployments ---------------------------------------------------------------

@cli.group()
def deploy() -> None:
    """Manage deployments."""


@deploy.command("add")
@click.argument("name")
@click.option("--served-name", help="the model name clients send (default: NAME)")
@click.option("--engine", type=click.Choice(ENGINES), default="vllm", show_default=True,
              help="with --model, its recipe writes the command line; custom: no recipe")
@click.option("--model", help="what the engine loads: a Hugging Face repo id (Qwen/Qwen3-8B) or a path")
@click.option("--image", help="container image (docker backend; default with --model: the engine's)")
@click.option("--arg", "args", multiple=True, help="an engine argument, after the recipe's (it may override "
                                                   "one); repeat")
@click.option("--command", "command", help="the engine's command line, {port} for its port (process backend, "
                                           "without --model)")
@click.option("--port", type=Whole(), default=8000, show_default=True, help="the engine's port in its container")
@click.option("--memory-gib", type=float, default=0, show_default=True, help="GPU memory it needs in all")
@click.option("--gpu-count", type=Whole(), help="how many GPUs (0: none; default: 1 with --model, else every GPU)")
@click.option("--gpu-ids", help="the GPUs it must run on, as indices: 0,3")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="added to the engine's environment; repeat")
@click.option("--volume", "volumes", multiple=True, metavar="HOST:CONTAINER[:ro]",
              help="a host directory under deployer.volume_roots (docker backend); repeat")
@click.option("--role", type=click.Choice(["model", "decision", "system"]), default="model", show_default=True)
@click.option("--mode", type=click.Choice(["on_demand", "always_on"]), default="always_on", show_default=True)
@click.option("--idle-timeout", type=Whole(), help="seconds idle before it is put to sleep (on demand)")
@click.option("--priority", type=click.Choice(["low", "normal", "high"]),
              help="who waits and who is put to sleep for whom (default: normal)")
@click.option("--max-inflight", help="requests it serves at once through the gateway; more get 429 (default: none)")
@click.option("--idle-action", type=click.Choice(IDLE_ACTIONS),
              help="what an idle engine becomes: auto (level-1 sleep for a vLLM or SGLang recipe on discrete "
                   "GPUs, else a stop), stop, sleep (level 1: weights in host memory), sleep2 (level 2: weights "
                   "dropped) (default: auto)")
@click.option("--keep-warm", type=click.Choice(["fixed", "adaptive"]),
              help="how long an idle engine stays awake: fixed (its idle timeout) or adaptive (what its learned "
                   "rhythm says, within that timeout; woken ahead of the next expected request) (default: fixed)")
@click.option("--no-start", is_flag=True, help="leave it planned")
@click.option("--dry-run", is_flag=True, help="check it and print the command line it would run; create nothing")
@json_option
@pass_ctx
def deploy_add(ctx: Ctx, /, name: str, dry_run: bool, as_json: bool, **opts: Any) -> None:
    """Create a deployment. On demand it rests stopped until its first request;
    always on it starts at once.

    With --model the engine's recipe writes its command line (model, served name,
    address, GPUs, memory share); --arg adds to it. --dry-run prints that command
    line and creates nothing."""
    body = _add_body(name, **opts)
    if dry_run:
        _dry_run(ctx, body, as_json)
        return
    view = _call(ctx, "POST", "/deployments", body)
    if as_json:
        _echo_json(view)
    else:
        click.echo(f"created {view['name']} (id {view['id']}, {view['mode']}, {view['state']})")
    _warn_if_blind(view)


def _add_body(name: str, served_name: str | None, engine: str, model: str | None, image: str | None,
              args: tuple[str, ...], command: str | None, port: int, memory_gib: float, gpu_count: int | None,
              gpu_ids: str | None, env: tuple[str, ...], volumes: tuple[str, ...], role: str, mode: str,
              idle_timeout: int | None, priority: str | None, max_inflight: str | None,
              idle_action: str | None, keep_warm: str | None, no_start: bool) -> dict[str, Any]:
    """`deploy add`'s POST body."""
    body: dict[str, Any] = {"name": name, "engine": engine, "port": port, "memory_gib": memory_gib,
                            "role": role, "mode": mode, "args": list(args), "start": not no_start}
    if served_name:
        body["served_name"] = served_name
    if model is not None:
        body["model"] = model
    if image:
        body["image"] = image
    if command:
        body["command"] = _command(command)
    if idle_timeout is not None:
        body["idle_timeout_s"] = idle_timeout
    if env:
        body["env"] = _env_option(env)
    if volumes:
        body["volumes"] = list(volumes)
    if priority is not None:
        body["priority"] = priority
    if max_inflight is not None:
        body["max_inflight"] = _max_inflight(max_inflight)
    if idle_action is not None:
        body["idle_action"] = idle_action
    if keep_warm is not None:
        body["keep_warm"] = keep_warm
    body.update(_gpu_fields(gpu_count, gpu_ids))
    return body


def _dry_run(ctx: Ctx, body: dict[str, Any], as_json: bool) -> None:
    """The would-be view (validated by the server, nothing written): its argv on stdout."""
    import shlex
    view = _call(ctx, "POST", "/deployments?dry_run=1", body)
    if as_json:
        _echo_json(view)
    elif view.get("argv") is None:
        _fail(f"no command line: {view.get('argv_error') or 'the server did not derive one'}")
    else:
        click.echo(shlex.join(view["argv"]))
        image = f"image {view['engine_image']}; " if view.get("engine_image") else ""
        click.echo(f"dry run, nothing created: {image}environment {', '.join(view.get('env_names') or ()) or '-'}",
                   err=True)
        if "memory_source" in view:
            click.echo(f"booked {view.get('memory_gib') or 0:.1f} GiB ({view['memory_source']})", err=True)
    _warn_if_blind(view)


def _env_option(items: tuple[str, ...]) -> dict[str, str]:
    """--env NAME=VALUE ...: split at the first '='; the server checks the names."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            _fail(f"--env takes NAME=VALUE, not {item!r}", EXIT_USAGE)
        out[name] = value
    return out


def _command(value: str) -> list[str]:
    """--command, split as a shell splits a line; one it cannot split (an unbalanced quote, a
    last backslash) is one line and exit 2, not shlex's traceback."""
    import shlex
    try:
        return shlex.split(value)
    except ValueError as exc:
        _fail(f"--command: {str(exc).lower()} (it is split as a shell splits a line)", EXIT_USAGE)


def _gpu_list(value: str) -> list[int]:
    return [whole_number("--gpu-ids", v.strip()) for v in value.split(",") if v.strip()]


def _gpu_fields(gpu_count: int | None, gpu_ids: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if gpu_count is not None:
        out["gpu_count"] = gpu_count
    if gpu_ids is not None:
        out["gpu_ids"] = _gpu_list(gpu_ids)
    return out


@deploy.command("set")
@click.argument("dep_id", type=int)
@click.option("--name", help="a new unique name")
@click.option("--served-name", help="the model name clients send")
@click.option("--engine", type=click.Choice(ENGINES))
@click.option("--model", help="what the engine loads (its recipe writes the command line)")
@click.option("--no-model", is_flag=True, help="no recipe: run image and args, or command, as given")
@click.option("--image", help="container image (docker backend)")
@click.option("--arg", "args", multiple=True, help="an engine argument; repeat; replaces them all")
@click.option("--no-args", is_flag=True, help="no engine arguments")
@click.option("--command", "command", help="the engine's command line, {port} for its port (process backend)")
@click.option("--port", type=Whole(), help="the engine's port in its container")
@click.option("--memory-gib", type=float, help="GPU memory it needs in all")
@click.option("--gpu-count", help="how many GPUs (0: none), or 'all' for every GPU")
@click.option("--gpu-ids", help="the GPUs it must run on, as indices (0,3), or 'any' to drop the pin")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="the engine's environment; repeat; replaces it all (a secret given as *** keeps its value)")
@click.option("--no-env", is_flag=True, help="no environment of its own")
@click.option("--volume", "volumes", multiple=True, metavar="HOST:CONTAINER[:ro]",
              help="a host directory to mount (docker backend); repeat; replaces them all")
@click.option("--no-volumes", is_flag=True, help="no volumes")
@click.option("--role", type=click.Choice(["model", "decision", "system"]))
@click.option("--idle-timeout", help="seconds idle before it is put to sleep, or 'default' for ondemand_idle_timeout_s")
@click.option("--priority", type=click.Choice(["low", "normal", "high"]), help="editable while it runs")
@click.option("--max-inflight", help="requests at once, or 'none' for no limit; editable while it runs")
@click.option("--idle-action", type=click.Choice(IDLE_ACTIONS),
              help="what an idle engine becomes: auto, stop, sleep (level 1) or sleep2 (level 2)")
@click.option("--keep-warm", type=click.Choice(["fixed", "adaptive"]),
              help="fixed (idle after its idle timeout) or adaptive (its learned rhythm); editable while it runs")
@json_option
@pass_ctx
def deploy_set(ctx: Ctx, /, dep_id: int, as_json: bool, **opts: Any) -> None:
    """Edit a stopped, failed or planned deployment in place (same id; audited
    deployment_update). A start afterwards uses the new values. The mode is switched
    with `mode set`. --priority, --max-inflight and --keep-warm alone may change in any state."""
    body = _set_body(**opts)
    if not body:
        _fail("nothing to change: give at least one --FIELD VALUE (see deploy set --help)", EXIT_USAGE)
    view = _call(ctx, "PATCH", f"/deployments/{dep_id}", body)
    _echo_json(view) if as_json else click.echo(f"updated {view['name']} (id {view['id']}, {view['state']})")
    _warn_if_blind(view)


def _set_body(name: str | None, served_name: str | None, engine: str | None, model: str | None, no_model: bool,
              image: str | None, args: tuple[str, ...], no_args: bool, command: str | None, port: int | None,
              memory_gib: float | None, gpu_count: str | None, gpu_ids: str | None, env: tuple[str, ...],
              no_env: bool, volumes: tuple[str, ...], no_volumes: bool, role: str | None,
              idle_timeout: str | None, priority: str | None, max_inflight: str | None,
              idle_action: str | None, keep_warm: str | None) -> dict[str, Any]:
    """`deploy set`'s PATCH body: only the fields given."""
    for given, none, flags in ((args, no_args, "--arg and --no-args"), (model, no_model, "--model and --no-model"),
                               (env, no_env, "--env and --no-env"), (volumes, no_volumes, "--volume and --no-volumes")):
        if given and none:
            _fail(f"{flags} exclude each other", EXIT_USAGE)
    body: dict[str, Any] = {k: v for k, v in (("name", name), ("served_name", served_name), ("engine", engine),
                                              ("model", model), ("image", image), ("port", port),
                                              ("memory_gib", memory_gib), ("role", role)) if v is not None}
    if no_model:
        body["model"] = None
    if args or no_args:
        body["args"] = list(args)
    if env or no_env:
        body["env"] = _env_option(env)
    if volumes or no_volumes:
        body["volumes"] = list(volumes)
    if command is not None:
        body["command"] = _command(command)
    if idle_timeout is not None:
        body["idle_timeout_s"] = _idle_timeout(idle_timeout)
    if priority is not None:
        body["priority"] = priority
    if max_inflight is not None:
        body["max_inflight"] = _max_inflight(max_inflight)
    if gpu_count is not None:
        body["gpu_count"] = None if gpu_count == "all" else whole_number("--gpu-count", gpu_count)
    if gpu_ids is not None:
        body["gpu_ids"] = None if gpu_ids == "any" else _gpu_list(gpu_ids)
    if idle_action is not None:
        body["idle_action"] = idle_action
    if keep_warm is not None:
        body["keep_warm"] = keep_warm
    return body


@deploy.command("list")
@json_option
@pass_ctx
def deploy_list(ctx: Ctx, as_json: bool) -> None:
    """List deployments."""
    views, _ = _views(ctx)
    _echo_json(views) if as_json else click.echo(_table(_dep_rows(views), _DEP_HEADER) if views else "no deployments")


@deploy.command("show")
@click.argument("dep_id", type=int)
@json_option
@pass_ctx
def deploy_show(ctx: Ctx, dep_id: int, as_json: bool) -> None:
    """Show one deployment's view."""
    view, _ = _views(ctx, f"/deployments/{dep_id}")
    if as_json:
        _echo_json(view)
        return
    for key in ("id", "name", "served_name", "engine", "model", "role", "mode", "pending_mode", "state",
                "state_reason", "memory_gib", "gpu_count", "gpu_ids", "gpus", "measured_gib", "idle_timeout_s",
                "priority", "max_inflight", "last_start_s", "start_eta_s", "base_url", "image", "engine_image",
                "args", "command", "volumes"):
        if key == "state":
            click.echo(f"{'state:':16} {_state(view)}")
        elif key in view:
            click.echo(f"{key + ':':16} {view[key] if view[key] not in (None, []) else '-'}")
        if key == "idle_timeout_s":
            for line in _warmth_lines(ctx, view):
                click.echo(line)
    for line in _launch_lines(view):
        click.echo(line)
    od = view.get("ondemand") or {}
    place = f" (place {od['queue_position']} in the memory queue)" if od.get("queue_position") else ""
    click.echo(f"{'ondemand:':16} phase {od.get('phase')}, in-flight {od.get('inflight')}, queued {od.get('queued')}"
               f"{place}, last request {_ago(od.get('last_request_at'))}")
    for line in _kept_and_taken([view]):  # why it is kept awake, or was put away early (as status says)
        click.echo(line)
    if view.get("litellm"):
        click.echo(f"{'litellm:':16} {view['litellm'].get('status')} {view['litellm'].get('code') or ''}".rstrip())
    if view.get("log_tail") and view["state"] == "failed":
        click.echo("log tail:\n" + view["log_tail"])



def _action(ctx: Ctx, dep_id: int, verb: str, as_json: bool, wait: bool = False, body: Any = None) -> None:
    view = _call(ctx, "POST" if verb != "rm" else "DELETE",
                 f"/deployments/{dep_id}" + ("" if verb == "rm" else f"/{verb}" + ("?wait=1" if wait else "")), body)
    if as_json:
        _echo_json(view)
    elif verb == "rm":
        click.echo(f"removed deployment {dep_id}")
    else:
        click.echo(f"{view['name']}: {_state(view)}")


@deploy.command("rm")
@click.argument("dep_id", type=int)
@json_option
@pass_ctx
def deploy_rm(ctx: Ctx, dep_id: int, as_json: bool) -> None:
    """Stop and remove a deployment."""
    _action(ctx, dep_id, "rm", as_json)


@deploy.command("start")
@click.argument("dep_id", type=int)
@click.option("--wait", is_flag=True, help="return when it is ready (or failed)")
@json_option
@pass_ctx
def deploy_start(ctx: Ctx, dep_id: int, wait: bool, as_json: bool) -> None:
    """Start a deployment now (an administrator's start)."""
    _action(ctx, dep_id, "start", as_json, wait)


@deploy.command("stop")
@click.argument("dep_id", type=int)
@json_option
@pass_ctx
def deploy_stop(ctx: Ctx, dep_id: int, as_json: bool) -> None:
    """Stop a deployment's engine."""
    _action(ctx, dep_id, "stop", as_json)


async def _until_ctrl_c(coro: Coroutine[Any, Any, None]) -> None:
    """``coro`` until it ends or Ctrl-C, which ends it cleanly. The loop's own signal handler,
    not the runner's Python one: uvloop, idle in its C loop (a followed log that says nothing),
    may never run the Python handler, and Ctrl-C went unheard (uvloop #295, #335)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGINT, task.cancel)
    try:
        await coro
    except asyncio.CancelledError:  # Ctrl-C (this handler's, or the runner's): nothing else cancels it
        return
    finally:
        loop.remove_signal_handler(signal.SIGINT)


@deploy.command("logs")
@click.argument("dep_id", type=int)
@click.option("-n", "--tail", default=100, show_default=True, type=click.IntRange(0, 10000),
              help="how many of the last lines")
@click.option("-f", "--follow", is_flag=True, help="then print new lines as the engine writes them, until it "
                                                   "stops or Ctrl-C")
@pass_ctx
def deploy_logs(ctx: Ctx, dep_id: int, tail: int, follow: bool) -> None:
    """Print a deployment's engine log (stdout and stderr)."""
    out = sys.stdout.buffer

    def write(chunk: bytes) -> None:
        out.write(chunk)
        out.flush()
    path = f"/deployments/{dep_id}/logs?tail={tail}" + ("&follow=1" if follow else "")
    try:
        _run(_until_ctrl_c(adminclient.stream(ctx.cfg, path, write)))
    except KeyboardInterrupt:  # Ctrl-C ends a follow: that is how it is meant to end
        pass
    except BrokenPipeError:  # | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit
    except adminclient.NoServer as exc:
        _fail(f"{exc}; start it with `ondemand serve`", EXIT_NO_SERVER)
    except adminclient.Refused as exc:
        err = (exc.body or {}).get("error", {}) if isinstance(exc.body, dict) else {}
        _fail(f"{err.get('message', exc.status)} ({err.get('code', exc.status)})")
