"""The on-demand key LiteLLM sends to the gateway, and the LiteLLM sync."""
from __future__ import annotations

import click

from .. import config as config_mod
from .shared import Ctx, _call, _echo_json, _fail, cli, json_option, pass_ctx

# --- key -------------------------------------------------------------------

@cli.group()
def key() -> None:
    """The on-demand key LiteLLM sends to the gateway."""


def _write_new_key(cfg: config_mod.Config, must_exist: bool | None) -> str:
    from ..gateway import keys
    path = cfg.key_file
    exists = keys.read_key_file(path) is not None
    if must_exist is False and exists:
        _fail(f"{path} already holds a key; use `key rotate` to replace it")
    if must_exist is True and not exists:
        _fail(f"{path} holds no key; use `key init` first")
    new = keys.generate_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        keys.write_key_file(path, new)  # whole or not at all: a key that is there stays
    except OSError as exc:  # a full or read-only disk, a directory not ours: one line, not a traceback
        _fail(f"cannot write {exc.filename or path}: {exc.strerror or exc}")
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
    from ..gateway import keys
    k = keys.read_key_file(ctx.cfg.key_file)
    if k is None:
        _fail(f"no key in {ctx.cfg.key_file}: run `ondemand key init`")
    fp = keys.fingerprint(k)
    _echo_json({"file": str(ctx.cfg.key_file), "fingerprint": fp}) if as_json else click.echo(fp)


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
