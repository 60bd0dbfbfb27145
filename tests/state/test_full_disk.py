"""The state file on a full disk (a small tmpfs, filled for real): the admin API says so
clearly and writes nothing half-way, the gateway keeps serving (a cold start included),
and once there is room again the next change stores the whole state. The command line on a
full or read-only disk: one line on stderr and exit 1 from every command, nothing half-written."""
import asyncio
import contextlib
import errno
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from helpers import run_app, two_pools
from test_cli import cli, write_config

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path) -> None:
    # Unbuffered: a buffered file kept the part of a write that did not fit, and its close
    # raised ENOSPC again when the disk had some room left before the fill.
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * 65536)


async def test_a_full_disk_is_a_clear_error_and_nothing_is_half_written(small_disk):
    async with run_app(small_disk) as server:
        a = await server.add("a", 4)
        filler = small_disk / "filler"
        fill(filler)
        async with two_pools() as http:
            async with http.post(f"{server.url}/api/deployments", headers=server.admin_headers(),
                                 json={"name": "b", "command": ["ondemand", "sim-engine", "--port", "{port}"]}) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "state_file_unwritable", body
                assert "disk is full" in body["error"]["message"] and "ondemand.db" in body["error"]["message"]
            async with http.patch(f"{server.url}/api/deployments/{a}", headers=server.admin_headers(),
                                  json={"memory_gib": 6}) as r:
                assert r.status == 503  # an edit that could not be stored is not kept either
            assert server.deployer.get(a).memory_gib == 4
            async with http.post(server.gw(a, "chat/completions"), json=CHAT, headers=server.auth()) as r:
                assert r.status == 200  # the engine started, though its transitions were not stored
            assert server.state(a) == "ready" and [d.name for d in server.deployer.all()] == ["a"]
            filler.unlink()  # room again: the next transition stores the whole state
            async with http.post(f"{server.url}/api/deployments/{a}/stop", headers=server.admin_headers()) as r:
                assert r.status == 200
        db = server.cfg.db_path
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT name, state, memory_gib FROM deployments").fetchall() == [("a", "stopped", 4.0)]


# --- the command line on a disk that takes no more writes: one line on stderr, exit 1 ---------

def one_line(err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ondemand: ") and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), (words, err)
    return lines[0]


def listing(path) -> list[str]:
    return sorted(os.listdir(path))


async def test_the_key_commands_on_a_full_disk_say_one_line_and_keep_the_key(small_disk, tmp_path):
    state = small_disk / "s"
    state.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "c.toml", state)
    fill(small_disk / "filler")
    rc, _, err = await cli("key", "init", config=cfg)
    assert rc == 1
    one_line(err, f"cannot write {state / 'ondemand.key'}: No space left on device")
    assert listing(state) == []  # no key, no temporary left behind
    (small_disk / "filler").unlink()
    assert (await cli("key", "init", config=cfg))[0] == 0
    key = (state / "ondemand.key").read_bytes()
    fill(small_disk / "filler")
    rc, _, err = await cli("key", "rotate", config=cfg)
    assert rc == 1
    one_line(err, f"cannot write {state / 'ondemand.key'}: No space left on device")
    assert (state / "ondemand.key").read_bytes() == key and listing(state) == ["ondemand.key"]


async def test_serve_on_a_full_disk_says_one_line_and_writes_nothing_half(small_disk, tmp_path):
    state = small_disk / "s"
    state.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "c.toml", state)
    fill(small_disk / "filler")
    # the admin token first
    rc, _, err = await asyncio.wait_for(cli("serve", config=cfg), 60)
    assert rc == 1
    one_line(err, f"cannot start: cannot write {state / 'admin.token'}: No space left on device")
    assert "admin.token" not in listing(state) and not [n for n in listing(state) if n.endswith(".tmp")]
    # the state file's migrations
    (small_disk / "filler").unlink()
    assert (await cli("key", "init", config=cfg))[0] == 0
    (state / "admin.token").write_text("oda-" + "a" * 40 + "\n")
    (state / "ondemand.lock").write_text("1\n")  # the lock's own page: the next write reuses it
    fill(small_disk / "filler")
    rc, _, err = await asyncio.wait_for(cli("serve", config=cfg), 60)
    assert rc == 1
    one_line(err, f"cannot start: cannot write the state file {state / 'ondemand.db'}: database or disk is full")
    # the other commands that write the state file: the same one line
    for command in (["migrate"], ["deploy", "list"], ["status"]):
        rc, _, err = await cli(*command, config=cfg)
        assert rc == 1, command
        one_line(err, f"cannot write the state file {state / 'ondemand.db'}")
    # room again: the state file is a sound one (nothing of a migration was kept half-done)
    (small_disk / "filler").unlink()
    rc, out, err = await cli("migrate", "--json", config=cfg)
    assert rc == 0, err
    with sqlite3.connect(state / "ondemand.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.fixture
def read_only_disk(small_disk, tmp_path):
    """A state directory with a key and a token, on a disk then remounted read only."""
    state = small_disk / "s"
    state.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "c.toml", state)
    (state / "ondemand.key").write_text("odk-" + "k" * 40 + "\n")
    (state / "admin.token").write_text("oda-" + "a" * 40 + "\n")
    if subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read only")
    return state, cfg


async def test_a_read_only_disk_is_one_line_too(read_only_disk):
    state, cfg = read_only_disk
    for command in (["key", "rotate"], ["serve"], ["migrate"]):
        rc, _, err = await asyncio.wait_for(cli(*command, config=cfg), 60)
        assert rc == 1, command
        one_line(err, "cannot ", "Read-only file system" if command[0] == "key" else "")
    assert (state / "ondemand.key").read_text() == "odk-" + "k" * 40 + "\n"


def test_over_quota_is_a_disk_error_as_a_full_one():
    # EDQUOT cannot be made here (no quota on a tmpfs without quota tools): the rule that
    # tells a disk's refusal from a bug, on what the kernel and SQLite raise then.
    from ondemand.cli.shared import disk_error
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/s/ondemand.key")
    assert disk_error(quota, None) == f"cannot write /s/ondemand.key: {os.strerror(errno.EDQUOT)}"
    try:
        raise RuntimeError("cannot start") from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except RuntimeError as exc:
        assert disk_error(exc, None, in_dir=Path("/s")) == f"cannot write in /s: {os.strerror(errno.ENOSPC)}"
    io = sqlite3.OperationalError("disk I/O error")
    io.sqlite_errorcode = 778  # SQLITE_IOERR_WRITE: SQLite's word for EDQUOT
    assert disk_error(io, None) == "cannot write the state file: disk I/O error"
    for other in (OSError(errno.EACCES, "Permission denied", "/s/k"), ValueError("x"),
                  sqlite3.OperationalError("database is locked")):
        assert disk_error(other, None) is None  # a bug or another trouble keeps its traceback
