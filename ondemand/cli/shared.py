"""What every command shares: the root group and its context (the configuration, read once),
the exit codes, the calls to the running server, and the output helpers."""
from __future__ import annotations

import asyncio
import errno
import sqlite3
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import orjson

from .. import __version__
from .. import config as config_mod
from ..admin import client as adminclient
from ..engines.recipes import MASK, is_secret
from ..errors import ConfigError

EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 1, 2, 3
T = TypeVar("T")


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


def whole_number(flag: str, value: str, digits: int = 9) -> int:
    """A number option's value: ASCII digits (a '-' too, for the server to refuse with its
    range), at most ``digits`` of them; else one line and exit 2. int() took 10**23, which
    the client could not send (orjson writes 64-bit integers: a traceback) nor SQLite hold."""
    bare = value.strip().removeprefix("-")
    if not (bare.isascii() and bare.isdigit() and len(bare) <= digits):  # "²" is isdigit() too
        shown = value if len(value) <= 40 else value[:40] + "..."
        _fail(f"{flag} takes a whole number of at most {digits} digits, not {shown!r}", EXIT_USAGE)
    return int(value)


class Whole(click.ParamType[int, Any]):
    """click's type for a ``whole_number`` option (the server checks the range)."""
    name = "integer"

    def __init__(self, digits: int = 9):
        self.digits = digits

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):  # a default
            return value
        flag = max(param.opts, key=len) if param is not None and param.opts else "a number"
        return whole_number(flag, str(value), self.digits)


# A disk that takes no more writes: full, over quota, read only.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# SQLite's words for the same, its primary codes (an extended code's low byte; the sqlite3
# module's names for them are missing from its type stubs): a full disk is SQLITE_FULL (13),
# over quota SQLITE_IOERR (10: it says FULL for ENOSPC only), read only SQLITE_READONLY (8) or
# SQLITE_CANTOPEN (14).
_SQLITE_DISK = frozenset({13, 10, 8, 14})


def disk_error(exc: BaseException, cfg: config_mod.Config | None, in_dir: Path | None = None) -> str | None:
    """One line for a write the disk refused, found in ``exc`` or what it was raised from
    (an error naming no file is placed ``in_dir``); None for any other error, which keeps its
    traceback (a bug)."""
    seen: BaseException | None = exc
    for _ in range(10):  # the chain of causes is short; never follow a cycle
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            where = seen.filename if seen.filename is not None else (f"in {in_dir}" if in_dir else None)
            return f"cannot write {where}: {seen.strerror}" if where else f"cannot write: {seen.strerror}"
        if isinstance(seen, sqlite3.Error) and getattr(seen, "sqlite_errorcode", 0) & 0xFF in _SQLITE_DISK:
            return f"cannot write the state file {cfg.db_path}: {seen}" if cfg else \
                f"cannot write the state file: {seen}"
        seen = seen.__cause__ or seen.__context__
    return None


class _Root(click.Group):
    """The root group: every command that fails on a disk that takes no more writes ends
    with one line on stderr and exit 1, never a traceback (the key commands and serve ended
    in one on a full disk)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = disk_error(exc, ctx.obj.loaded if isinstance(ctx.obj, Ctx) else None)
            if line is None:
                raise
            _fail(line)


class Ctx:
    def __init__(self, config_path: str | None):
        self.config_path = config_path
        self._cfg: config_mod.Config | None = None

    @property
    def loaded(self) -> config_mod.Config | None:
        """The configuration if a command has read it (None: not read, or unreadable)."""
        return self._cfg

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


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"]})
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
