"""The command line: ``python3 ondemand.pyz [--config FILE] COMMAND``.

The click commands, and nothing else. The configuration is read here, once,
and passed down. Commands that read or change state talk to the running
server over its admin socket (``adminclient``); read-only ones open the state
file themselves when no server runs. ``doctor``'s checks live in ``doctor``.
``--json`` prints machine-readable output; errors go to stderr with a non-zero
exit: 1 for a refused or failed action, 2 for bad usage or configuration, 3 when
the server is needed but not running.
"""
from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

import click
import orjson

from . import __version__
from . import config as config_mod
from .admin import client as adminclient
from .engines.recipes import ENGINES, MASK, is_secret
from .errors import ConfigError
from .model import Deployment, IdleAction

EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 1, 2, 3
T = TypeVar("T")
IDLE_ACTIONS = [a.value for a in IdleAction]


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(coro)


def _echo_json(data: Any) -> None:
    click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    click.echo(f"ondemand: {message}", err=True)
    sys.exit(code)


def _max_inflight(value: str) -> int | None:
    """--max-inflight: requests at once, or 'none' (no limit); the server checks the range."""
    if value == "none":
        return None
    if not value.lstrip("-").isdigit():
        _fail("--max-inflight takes a whole number of requests or 'none'", EXIT_USAGE)
    return int(value)


def _idle_timeout(value: str) -> int | None:
    """--idle-timeout: whole seconds, or 'default' (null: ondemand_idle_timeout_s)."""
    if value == "default":
        return None
    if not value.isdigit():
        _fail("--idle-timeout takes whole seconds or 'default'", EXIT_USAGE)
    return int(value)


class Ctx:
    def __init__(self, config_path: str | None):
        self.config_path = config_path
        self._cfg: config_mod.Config | None = None

    @property
    def cfg(self) -> config_mod.Config:
        if self._cfg is None:
            try:
                self._cfg = config_mod.load(self.config_path)
            except ConfigError as exc:
                _fail(str(exc), EXIT_USAGE)
        return self._cfg


pass_ctx = click.make_pass_decorator(Ctx)
json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="FILE", envvar=None,
              help="TOML configuration (default: $ONDEMAND_CONFIG, else built-in defaults)")
@click.version_option(__version__, prog_name="ondemand")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None) -> None:
    """ondemand: the on-demand gateway for LLM deployments.

    The first request for a stopped model starts its engine, requests wait in
    a fair queue while it starts or while memory is freed, and idle models are
    put to sleep.
    """
    ctx.obj = Ctx(config_path)


# --- serve -----------------------------------------------------------------

DEMO_DEPLOYMENTS = [
    # (name, GiB, simulator arguments): both do not fit in the demo's 24 GiB.
    # A cold start of 3 or 5 s; asleep, a wake of half a second (the simulator's sleep mode; its
    # weights "kept" in 64 MiB of host memory, really held).
    ("demo-small", 10, ["--startup-delay", "3", "--wake-delay", "0.5", "--host-mib", "64",
                        "--token-delay", "0.05", "--tokens", "40"]),
    ("demo-large", 16, ["--startup-delay", "5", "--wake-delay", "0.5", "--host-mib", "64",
                        "--token-delay", "0.05", "--tokens", "40"]),
]


async def _seed_demo(cfg: config_mod.Config) -> list[str]:
    """The two on-demand demo deployments, unless they exist; and a key."""
    from .gateway import keys
    from .state.store import Store
    made = []
    if keys.read_key_file(cfg.key_file) is None:
        cfg.key_file.parent.mkdir(parents=True, exist_ok=True)
        keys.write_key_file(cfg.key_file, keys.generate_key())
        made.append(f"key {cfg.key_file}")
    store = await Store.open(cfg.db_path)
    try:
        names = {d["name"] for d in await store.deployments()}
        for name, gib, sim in DEMO_DEPLOYMENTS:
            if name not in names:
                # A recipe, as an admin would write one: the demo's config runs the simulator as
                # its vLLM (deployer.commands.vllm), and the simulator's own options come last.
                await store.insert_deployment(dict(
                    name=name, served_name=name, engine="vllm", model=f"demo/{name}", memory_gib=gib,
                    gpu_count=1, mode="on_demand", state="stopped", role="model", args=sim))
                made.append(f"deployment {name}")
    finally:
        await store.close()
    return made


@cli.command()
@click.option("--demo", is_flag=True, help="first make a key and two on-demand demo deployments backed by "
                                           "the engine simulator (the embedded default of `make run`)")
@pass_ctx
def serve(ctx: Ctx, demo: bool) -> None:
    """Run the gateway, the admin API, the controller and the deployer."""
    from . import app
    cfg = ctx.cfg
    if demo:
        if cfg.deployer.backend != "process":
            _fail("--demo runs the engine simulator as child processes: set deployer.backend = process", EXIT_USAGE)
        try:  # not behind the back of a server that owns this state directory
            lock = app.lock_state_dir(cfg.state_dir)
        except app.StartupError as exc:
            _fail(str(exc))
        try:
            for item in _run(_seed_demo(cfg)):
                click.echo(f"demo: made {item}", err=True)
        finally:
            os.close(lock)
    try:
        _run(app.serve(cfg))
    except KeyboardInterrupt:
        pass
    except app.StartupError as exc:
        _fail(str(exc))


# --- key -------------------------------------------------------------------

@cli.group()
def key() -> None:
    """The on-demand key LiteLLM sends to the gateway."""


def _write_new_key(cfg: config_mod.Config, must_exist: bool | None) -> str:
    from .gateway import keys
    path = cfg.key_file
    exists = keys.read_key_file(path) is not None
    if must_exist is False and exists:
        _fail(f"{path} already holds a key; use `key rotate` to replace it")
    if must_exist is True and not exists:
        _fail(f"{path} holds no key; use `key init` first")
    new = keys.generate_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    keys.write_key_file(path, new)
    return keys.fingerprint(new)


@key.command("init")
@json_option
@pass_ctx
def key_init(ctx: Ctx, as_json: bool) -> None:
    """Write a new random key to ondemand_key_file (mode 0600)."""
    fp = _write_new_key(ctx.cfg, must_exist=False)
    _echo_json({"file": str(ctx.cfg.key_file), "fingerprint": fp}) if as_json else \
        click.echo(f"wrote a new key to {ctx.cfg.key_file} (fingerprint {fp})")


@key.command("rotate")
@json_option
@pass_ctx
def key_rotate(ctx: Ctx, as_json: bool) -> None:
    """Replace the key; a running server picks it up within a second and
    re-registers the LiteLLM entries."""
    fp = _write_new_key(ctx.cfg, must_exist=True)
    _echo_json({"file": str(ctx.cfg.key_file), "fingerprint": fp}) if as_json else \
        click.echo(f"rotated the key in {ctx.cfg.key_file} (fingerprint {fp}); "
                   "the previous key is refused without counting as a failure for 300 s")


@key.command("show")
@json_option
@pass_ctx
def key_show(ctx: Ctx, as_json: bool) -> None:
    """Print the key's fingerprint (never the key)."""
    from .gateway import keys
    k = keys.read_key_file(ctx.cfg.key_file)
    if k is None:
        _fail(f"no key in {ctx.cfg.key_file}: run `ondemand key init`")
    fp = keys.fingerprint(k)
    _echo_json({"file": str(ctx.cfg.key_file), "fingerprint": fp}) if as_json else click.echo(fp)


# --- migrate ---------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def migrate(ctx: Ctx, as_json: bool) -> None:
    """Apply the state file's migrations and print its schema version."""
    from .state.migrations import SchemaTooNew
    from .state.store import Store

    async def go() -> int:
        store = await Store.open(ctx.cfg.db_path)
        try:
            return await store.version()
        finally:
            await store.close()
    try:
        version = _run(go())
    except SchemaTooNew as exc:
        _fail(str(exc))
    _echo_json({"db": str(ctx.cfg.db_path), "schema_version": version}) if as_json else \
        click.echo(f"{ctx.cfg.db_path}: schema version {version}")


# --- talking to the server ----------------------------------------------------

def _call(ctx: Ctx, method: str, path: str, body: Any = None) -> Any:
    """An admin call whose failure ends the command with the API's message."""
    try:
        status, data = _run(adminclient.request(ctx.cfg, method, path, body))
    except adminclient.NoServer as exc:
        _fail(f"{exc}; start it with `ondemand serve`", EXIT_NO_SERVER)
    if status >= 400:
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        _fail(f"{err.get('message', status)} ({err.get('code', status)})")
    return data


def _views(ctx: Ctx, path: str = "/deployments") -> tuple[Any, bool]:
    try:
        status, data = _run(adminclient.request(ctx.cfg, "GET", path))
    except adminclient.NoServer:
        rows = _run(adminclient.offline_views(ctx.cfg))
        if rows is None:
            _fail(f"no server runs and there is no state file at {ctx.cfg.db_path}", EXIT_NO_SERVER)
        for row in rows:  # as a view shows them: no secret's value
            if isinstance(row.get("env"), dict):
                row["env"] = {k: MASK if is_secret(k) else v for k, v in row["env"].items()}
        if path == "/deployments":
            return rows, True
        dep_id = int(path.rsplit("/", 1)[1])
        for row in rows:
            if row["id"] == dep_id:
                return row, True
        _fail(f"no deployment {dep_id}")
    if status >= 400:
        _fail(f"{data['error']['message']} ({data['error']['code']})")
    return data, False


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells)


def _ago(ts: float | None) -> str:
    if not ts:
        return "never"
    import time
    s = max(0, int(time.time() - ts))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


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
    from .control.budget import Budget
    from .engines import warmth
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
            left = max(1, round(eta - (now - v["updated_at"])))
            lines.append(f"{v['name']}: starting, expected in about {left} s")
        elif (v.get("ondemand") or {}).get("phase") == "queued":
            lines.append(f"{v['name']}: queued for GPU memory; once it starts, expected in about {round(eta)} s")
    return lines


# --- status ------------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def status(ctx: Ctx, as_json: bool) -> None:
    """Host, budget, and each deployment's phase, in-flight and queued counts."""
    views, offline = _views(ctx)
    host: Any = None if offline else _call(ctx, "GET", "/host")  # JSON
    names = _litellm_names(ctx, host)
    if as_json:
        _echo_json({"host": host, "deployments": views, "offline": offline, "litellm_names": names})
        return
    if offline:
        click.echo(f"no server runs: read from {ctx.cfg.db_path} (no live counters)")
    else:
        b = host["budget"]
        budget = (f"{b['free']:g} GiB free of {b['capacity']:g} GiB ({b['source']}), "
                  f"{b['ondemand_capacity']:g} GiB for on-demand models"
                  ) if "free" in b else f"unreadable: {b['error']}"
        od = host["ondemand"]
        click.echo(f"ondemand {host['version']} on {host['listen']} ({host['backend']} backend)")
        click.echo(f"budget: {budget}")
        for g in b.get("gpus") or () if b.get("per_gpu") else ():
            holders = ", ".join(g["deployments"]) or "-"
            click.echo(f"  GPU {g['index']}: {g['used']:.1f} of {g['capacity']:g} GiB used, {g['free']:.1f} free; "
                       f"held by {holders}")
        key = "fingerprint " + od["key_fingerprint"] if od["configured"] else "NOT CONFIGURED (ondemand key init)"
        litellm = ("ready" if od["litellm_ready"] else ("not ready: " + str(od["litellm_error"]))
                   ) if od["litellm_enabled"] else "disabled"
        click.echo(f"key: {key}; LiteLLM: {litellm}; waiting requests: {od['queued']}")
        if host.get("host_memory"):
            click.echo(_host_memory_line(host["host_memory"]))
        click.echo("")
    click.echo(_table(_dep_rows(views), _DEP_HEADER) if views else "no deployments")
    import time
    for line in _expected(views, time.time()):
        click.echo(line)
    _echo_names(names)
    over = [v["name"] for v in views if Deployment.from_row(v).over_declared]
    if over:
        click.echo(f"! {', '.join(over)}: measured more than 10 % over the declared memory_gib; "
                   "fit checks count the measured size (raise memory_gib)")


def _host_memory_line(hm: dict[str, Any]) -> str:
    """What tiered warmth watches on the host: available memory, what asleep engines hold,
    the reserve a level-1 sleep must leave."""
    if hm.get("available_gib") is None:
        mem = "unreadable"
    else:
        mem = f"{hm['available_gib']:.1f} GiB available of {hm['total_gib']:.1f} GiB"
    return (f"host memory: {mem}; asleep engines hold {hm.get('asleep_gib') or 0:.1f} GiB; "
            f"a level-1 sleep leaves {hm.get('reserve_gib', 0):g} GiB")


def _litellm_names(ctx: Ctx, host: Any) -> Any:
    """GET /api/litellm/names when LiteLLM is on: the names, or {"error": message}; else None."""
    if not host or not host["ondemand"]["litellm_enabled"]:
        return None
    status, data = _run(adminclient.request(ctx.cfg, "GET", "/litellm/names"))
    if status >= 400:
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        return {"error": f"{err.get('message', status)} ({err.get('code', status)})"}
    return data


def _echo_names(names: Any) -> None:
    """Which instances serve each name in LiteLLM (several boxes), ready ones first."""
    if names is None:
        return
    click.echo("")
    if "error" in names:
        click.echo(f"LiteLLM names: unreadable: {names['error']}")
        return
    rows = [[n["name"], ",".join(n["ready"]) or "none",
             ", ".join(f"{e['instance'] or '(not ondemand)'}{'*' if e['this'] else ''} {e['state']}"
                       for e in n["entries"])] for n in names["names"]]
    click.echo(f"LiteLLM names (* this instance, {names['instance']}):")
    click.echo(_table(rows, ["NAME", "READY ON", "ENTRIES"]) if rows else "none")


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
@click.option("--port", type=int, default=8000, show_default=True, help="the engine's port in its container")
@click.option("--memory-gib", type=float, default=0, show_default=True, help="GPU memory it needs in all")
@click.option("--gpu-count", type=int, help="how many GPUs (0: none; default: 1 with --model, else every GPU)")
@click.option("--gpu-ids", help="the GPUs it must run on, as indices: 0,3")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="added to the engine's environment; repeat")
@click.option("--volume", "volumes", multiple=True, metavar="HOST:CONTAINER[:ro]",
              help="a host directory under deployer.volume_roots (docker backend); repeat")
@click.option("--role", type=click.Choice(["model", "decision", "system"]), default="model", show_default=True)
@click.option("--mode", type=click.Choice(["on_demand", "always_on"]), default="always_on", show_default=True)
@click.option("--idle-timeout", type=int, help="seconds idle before it is put to sleep (on demand)")
@click.option("--priority", type=click.Choice(["low", "normal", "high"]),
              help="who waits and who is put to sleep for whom (default: normal)")
@click.option("--max-inflight", help="requests it serves at once through the gateway; more get 429 (default: none)")
@click.option("--idle-action", type=click.Choice(IDLE_ACTIONS),
              help="what an idle engine becomes: auto (level-1 sleep for a vLLM or SGLang recipe on discrete "
                   "GPUs, else a stop), stop, sleep (level 1: weights in host memory), sleep2 (level 2: weights "
                   "dropped) (default: auto)")
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
              idle_action: str | None, no_start: bool) -> dict[str, Any]:
    """`deploy add`'s POST body."""
    import shlex
    body: dict[str, Any] = {"name": name, "engine": engine, "port": port, "memory_gib": memory_gib,
                            "role": role, "mode": mode, "args": list(args), "start": not no_start}
    if served_name:
        body["served_name"] = served_name
    if model is not None:
        body["model"] = model
    if image:
        body["image"] = image
    if command:
        body["command"] = shlex.split(command)
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


def _int_option(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        _fail(f"{flag}: a whole number, not {value!r}", EXIT_USAGE)


def _gpu_list(value: str) -> list[int]:
    return [_int_option("--gpu-ids", v.strip()) for v in value.split(",") if v.strip()]


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
@click.option("--port", type=int, help="the engine's port in its container")
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
@json_option
@pass_ctx
def deploy_set(ctx: Ctx, /, dep_id: int, as_json: bool, **opts: Any) -> None:
    """Edit a stopped, failed or planned deployment in place (same id; audited
    deployment_update). A start afterwards uses the new values. The mode is switched
    with `mode set`. --priority and --max-inflight alone may change in any state."""
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
              idle_action: str | None) -> dict[str, Any]:
    """`deploy set`'s PATCH body: only the fields given."""
    import shlex
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
        body["command"] = shlex.split(command)
    if idle_timeout is not None:
        body["idle_timeout_s"] = _idle_timeout(idle_timeout)
    if priority is not None:
        body["priority"] = priority
    if max_inflight is not None:
        body["max_inflight"] = _max_inflight(max_inflight)
    if gpu_count is not None:
        body["gpu_count"] = None if gpu_count == "all" else _int_option("--gpu-count", gpu_count)
    if gpu_ids is not None:
        body["gpu_ids"] = None if gpu_ids == "any" else _gpu_list(gpu_ids)
    if idle_action is not None:
        body["idle_action"] = idle_action
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
    if view.get("litellm"):
        click.echo(f"{'litellm:':16} {view['litellm'].get('status')} {view['litellm'].get('code') or ''}".rstrip())
    if view.get("log_tail") and view["state"] == "failed":
        click.echo("log tail:\n" + view["log_tail"])


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
    return lines


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


@deploy.command("sleep")
@click.argument("dep_id", type=int)
@click.option("--level", type=click.IntRange(1, 2), help="1: weights kept in host memory; 2: weights dropped "
                                                        "(default: its idle_action's level, else 1)")
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
        _run(adminclient.stream(ctx.cfg, path, write))
    except KeyboardInterrupt:  # Ctrl-C ends a follow: that is how it is meant to end
        pass
    except BrokenPipeError:  # | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit
    except adminclient.NoServer as exc:
        _fail(f"{exc}; start it with `ondemand serve`", EXIT_NO_SERVER)
    except adminclient.Refused as exc:
        err = (exc.body or {}).get("error", {}) if isinstance(exc.body, dict) else {}
        _fail(f"{err.get('message', exc.status)} ({err.get('code', exc.status)})")


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


def _warn_if_blind(view: dict[str, Any]) -> None:
    from .engines.metrics import BLIND_WARNING, blind
    if blind(Deployment.from_row(view)):
        click.echo(f"warning: {view['name']}: {BLIND_WARNING}", err=True)


# --- audit ---------------------------------------------------------------------

@cli.command()
@click.option("--deployment", "dep_id", type=int, help="only this deployment's rows")
@click.option("-n", "--limit", default=20, show_default=True, type=click.IntRange(1, 1000), help="how many rows")
@json_option
@pass_ctx
def audit(ctx: Ctx, dep_id: int | None, limit: int, as_json: bool) -> None:
    """The audit log, newest first: time, action, actor, deployment and text (as GET
    /api/audit; read from the state file when no server runs)."""
    query = f"?limit={limit}" + (f"&deployment_id={dep_id}" if dep_id is not None else "")
    names: dict[int, str] = {}
    try:
        status, data = _run(adminclient.request(ctx.cfg, "GET", "/audit" + query))
    except adminclient.NoServer:
        offline = _run(adminclient.offline_audit(ctx.cfg, dep_id, limit))
        if offline is None:
            _fail(f"no server runs and there is no state file at {ctx.cfg.db_path}", EXIT_NO_SERVER)
        data, names = offline
    else:
        if status >= 400:
            err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
            _fail(f"{err.get('message', status)} ({err.get('code', status)})")
        if not as_json and any(r.get("deployment_id") is not None for r in data):
            names = {v["id"]: v["name"] for v in _call(ctx, "GET", "/deployments")}
    if as_json:
        _echo_json(data)
        return
    rows = [[_when(r.get("at")), r["action"], r["actor"] + (f" ({r['user']})" if r.get("user") else ""),
             _who(r.get("deployment_id"), names), r.get("text")] for r in data]
    click.echo(_table(rows, ["TIME", "ACTION", "ACTOR", "DEPLOYMENT", "TEXT"]) if rows else "no audit rows")


def _when(at: float | None) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "-"


def _who(dep_id: int | None, names: dict[int, str]) -> str | None:
    if dep_id is None:
        return None
    return f"{dep_id} ({names[dep_id]})" if dep_id in names else str(dep_id)


# --- sync ----------------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def sync(ctx: Ctx, as_json: bool) -> None:
    """Run a LiteLLM sync now and print what it patched in place, added and deleted."""
    result = _call(ctx, "POST", "/sync")
    if as_json:
        _echo_json(result)
        return
    for item in result.get("patched") or ():  # a change of warmth, in place (the same LiteLLM id)
        click.echo(f"patched: {item.get('model_name')} order {item.get('order')} ({item.get('state')})")
    for what in ("added", "deleted"):
        for item in result.get(what) or ():
            click.echo(f"{what}: {item.get('model_name', item) if isinstance(item, dict) else item}")
    if result.get("error"):
        _fail(f"sync failed: {result['error']}")
    if not result.get("added") and not result.get("deleted") and not result.get("patched"):
        click.echo("in sync: nothing to change")


# --- doctor ----------------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def doctor(ctx: Ctx, as_json: bool) -> None:
    """Check the Docker socket, nvidia-smi, the key file, LiteLLM and the listener; and
    what the engine recipes need: the images on the Docker host, Docker's GPU runtime,
    the model cache, the token file, each deployment against the box's GPUs."""
    from .admin import doctor as doctor_mod
    checks = _run(doctor_mod.run(ctx.cfg))
    if as_json:
        _echo_json(checks)
    else:
        for c in checks:
            mark = "OK  " if c["ok"] else "FAIL" if c["ok"] is False else "SKIP"
            click.echo(f"{mark}  {c['check']:10} {c['detail']}")
    if any(c["ok"] is False for c in checks):
        sys.exit(EXIT_FAILED)


# --- the engine simulator --------------------------------------------------

@cli.command("sim-engine", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                             "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sim_engine(args: tuple[str, ...]) -> None:
    """Run the engine simulator (not a real engine): vLLM's routes for demos and tests.

    Options are the simulator's own; see `ondemand sim-engine --help`.
    """
    from .sim import engine
    sys.exit(engine.main(list(args)))


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="ondemand", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
