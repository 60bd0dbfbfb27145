"""The command line: ``python3 ondemand.pyz [--config FILE] COMMAND``.

The configuration is read here, once, and passed down. Commands that read or
change state talk to the running server over its admin socket
(``{state_dir}/admin.sock``); read-only ones open the state file themselves
when no server runs. ``--json`` prints machine-readable output; errors go to
stderr with a non-zero exit: 1 for a refused or failed action, 2 for bad
usage or configuration, 3 when the server is needed but not running.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click
import orjson

from . import __version__, config as config_mod
from .errors import ConfigError

EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 1, 2, 3


def _run(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(coro)


def _echo_json(data: Any) -> None:
    click.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())


def _fail(message: str, code: int = EXIT_FAILED) -> None:
    click.echo(f"ondemand: {message}", err=True)
    sys.exit(code)


class Ctx:
    def __init__(self, config_path: str | None):
        self.config_path = config_path
        self._cfg = None

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

@cli.command()
@pass_ctx
def serve(ctx: Ctx) -> None:
    """Run the gateway, the admin API, the controller and the deployer."""
    from . import app
    cfg = ctx.cfg
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
    from . import keys
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
    from . import keys
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
    from .migrations import SchemaTooNew
    from .store import Store

    async def go():
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


# --- the engine simulator --------------------------------------------------

@cli.command("sim-engine", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                             "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sim_engine(args: tuple[str, ...]) -> None:
    """Run the engine simulator (not a real engine): vLLM's routes for demos and tests.

    Options are the simulator's own; see `ondemand sim-engine --help`.
    """
    from . import simengine
    sys.exit(simengine.main(list(args)))


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="ondemand", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
