"""ondemand/cli/shared.py: what every command shares. As an admin runs them (real processes, the
real state file): the root group's help, a bad configuration or environment named in one line
with exit 2, and the views read from the state file when no server runs (secrets masked, exit 3
for a change); on the module's own functions, the table, the "ago" of a time, and the one line
for a write the disk refused (found down the chain of causes)."""
import errno
import json
import sqlite3
import time

import pytest
from helpers import run_app
from test_cli import cli, write_config

from ondemand.cli import shared


def test_every_command_says_what_it_does():
    import click

    from ondemand.cli import cli as root

    def walk(cmd, path):
        assert cmd.help or cmd.short_help, f"`{path} --help` has no description"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
    walk(root, "ondemand")
    assert isinstance(root, click.Group) and len(root.commands) >= 8



@pytest.mark.parametrize("text, key", [("bogus = 1\n", "bogus"),
                                       ("ondemand_queue_timeout_s = -1\n", "ondemand_queue_timeout_s")])
async def test_bad_config_names_the_key(tmp_path, text, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    rc, out, err = await cli("migrate", config=cfg)
    assert rc == 2 and key in err and len(err.strip().splitlines()) == 1



@pytest.mark.parametrize("command", ["status", "serve", "migrate"])
async def test_a_config_path_that_is_a_directory_or_not_utf8_is_one_line(tmp_path, command):
    """Not a traceback (IsADirectoryError, UnicodeDecodeError): one line and exit 2, as a missing file."""
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe")
    for cfg, says in ((tmp_path, "Is a directory"), (binary, "not valid TOML")):
        rc, out, err = await cli(command, config=cfg)
        assert rc == 2 and says in err and str(cfg) in err and len(err.strip().splitlines()) == 1, err


async def test_bad_environment_names_the_key(tmp_path):
    rc, _, err = await cli("migrate", env={"ONDEMAND_ONDEMAND_MAX_QUEUED": "0",
                                           "ONDEMAND_STATE_DIR": str(tmp_path)})
    assert rc == 2 and "ondemand_max_queued" in err



async def test_read_only_commands_without_a_server(tmp_path):
    async with run_app(tmp_path) as server:
        await server.add("alpha")
        await server.deployer.update(1, env={"HF_X_TOKEN": "s3cret", "A": "1"}, model="Qwen/Qwen3-8B")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, _ = await cli("status", config=cfg)
    assert rc == 0 and "no server runs" in out and "alpha" in out
    for args in (("deploy", "show", "1"), ("deploy", "show", "1", "--json"), ("deploy", "list", "--json")):
        rc, out, _ = await cli(*args, config=cfg)
        assert rc == 0 and "s3cret" not in out and "HF_X_TOKEN" in out  # masked as a view masks it
    rc, out, _ = await cli("deploy", "show", "1", config=cfg)
    assert "argv:            - (derived by the running server" in out and "model:           Qwen/Qwen3-8B" in out
    rc, out, _ = await cli("deploy", "list", "--json", config=cfg)
    assert json.loads(out)[0]["name"] == "alpha"
    rc, _, err = await cli("deploy", "start", "1", config=cfg)
    assert rc == 3 and "ondemand serve" in err
    rc, _, err = await cli("deploy", "set", "1", "--memory-gib", "4", config=cfg)
    assert rc == 3 and "ondemand serve" in err  # a change goes through the server, like start
    rc, out, _ = await cli("doctor", config=cfg)
    assert rc == 0 and "no server runs" in out


def test_a_table_pads_its_columns_says_dash_for_none_and_ends_no_line_with_spaces():
    assert shared._table([[1, "alpha", None], [22, "b", "x"]], ["ID", "NAME", "NOTE"]).splitlines() == [
        "ID  NAME   NOTE", "1   alpha  -", "22  b      x"]
    assert shared._table([], ["ID", "NAME"]) == "ID  NAME"


def test_ago_in_seconds_then_minutes_then_hours():
    now = time.time()
    assert shared._ago(None) == shared._ago(0) == "never"
    assert shared._ago(now - 5) == "5s ago" and shared._ago(now + 60) == "0s ago"  # a clock ahead: now
    assert shared._ago(now - 119) == "119s ago" and shared._ago(now - 120) == "2m ago"
    assert shared._ago(now - 7199) == "119m ago" and shared._ago(now - 7200) == "2h ago"


def test_a_refused_write_is_one_line_found_down_the_causes_and_anything_else_is_none(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", "/state/ondemand.key")
    assert shared.disk_error(full, None) == "cannot write /state/ondemand.key: No space left on device"
    nameless = OSError(errno.EROFS, "Read-only file system")
    assert shared.disk_error(nameless, None, tmp_path) == f"cannot write in {tmp_path}: Read-only file system"
    assert shared.disk_error(nameless, None) == "cannot write: Read-only file system"
    try:  # what a command sees: its own error, raised from the disk's
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/state/x")
        except OSError as exc:
            raise RuntimeError("could not save") from exc
    except RuntimeError as wrapped:
        assert shared.disk_error(wrapped, None) == "cannot write /state/x: Disk quota exceeded"
    # SQLite's word for a full disk, on a real database that can take no more pages
    db = sqlite3.connect(tmp_path / "small.db")
    db.execute("PRAGMA max_page_count = 2")
    try:
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (randomblob(100000))")
    except sqlite3.Error as exc:
        assert shared.disk_error(exc, None).startswith("cannot write the state file: ")
    else:
        raise AssertionError("the insert fitted")
    finally:
        db.close()
    for other in (OSError(errno.EACCES, "Permission denied", "/x"), ValueError("a bug"), sqlite3.OperationalError("no such table")):
        assert shared.disk_error(other, None) is None, other
