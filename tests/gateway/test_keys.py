"""The on-demand key file and its watcher (BEHAVIOUR.md, checks 3 and 5, "Key rotation")."""
from __future__ import annotations

import logging
import os
import re
import stat

import pytest

from ondemand.gateway.keys import KeyWatcher, fingerprint, generate_key, read_key_file, write_key_file


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_generate_key_is_random_and_url_safe():
    keys = {generate_key() for _ in range(50)}
    assert len(keys) == 50
    for k in keys:
        assert re.fullmatch(r"odk-[A-Za-z0-9_-]{43}", k)


def test_fingerprint_is_12_hex_of_sha256():
    assert fingerprint("abc") == "ba7816bf8f01"
    assert re.fullmatch(r"[0-9a-f]{12}", fingerprint(generate_key()))


def test_write_key_file_atomic_0600(tmp_path, monkeypatch):
    path = tmp_path / "ondemand.key"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    created = []
    real_open = os.open

    def spy_open(p, flags, mode=0o777, **kw):
        created.append((os.fspath(p), flags, mode))
        return real_open(p, flags, mode, **kw)

    monkeypatch.setattr(os, "open", spy_open)
    write_key_file(path, "new-key")
    monkeypatch.undo()
    # The temporary file is created in the same directory, exclusively, with 0600 from creation.
    tmp, flags, mode = created[0]
    assert os.path.dirname(tmp) == str(tmp_path) and tmp != str(path)
    assert flags & os.O_CREAT and flags & os.O_EXCL and mode == 0o600
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "new-key\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ondemand.key"]  # no temp left


def test_write_key_file_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "ondemand.key"
    write_key_file(path, "old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        write_key_file(path, "new")
    monkeypatch.undo()
    assert read_key_file(path) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ondemand.key"]


def test_read_key_file(tmp_path):
    path = tmp_path / "k"
    assert read_key_file(path) is None
    path.write_text("")
    assert read_key_file(path) is None
    path.write_text("  \n\t")
    assert read_key_file(path) is None
    path.write_text("  secret \n")
    assert read_key_file(path) == "secret"
    path.write_bytes(b"\xff\xfe")
    assert read_key_file(path) is None
    assert read_key_file(tmp_path) is None  # a directory: unreadable


def test_watcher_picks_up_rotation_without_restart(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    changes = []
    w = KeyWatcher(path, clock=clock, publish=lambda e: changes.append(w.current()))
    assert w.current() == "key-a"
    assert w.fingerprint == fingerprint("key-a")
    assert changes == []  # loading at start is not a change
    write_key_file(path, "key-b")
    assert w.current() == "key-a"  # within the second: not looked at
    clock.t += 1.0
    assert w.current() == "key-b"
    assert changes == ["key-b"]
    assert w.check("key-b") == "ok"


def test_watcher_stats_at_most_once_a_second(tmp_path, monkeypatch):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    stats = []
    reads = []
    real_stat = os.stat

    def spy_stat(p, *a, **kw):
        if os.fspath(p) == str(path):
            stats.append(clock.t)
        return real_stat(p, *a, **kw)

    import ondemand.gateway.keys as keys_mod
    real_read = keys_mod.read_key_file

    def spy_read(p):
        reads.append(clock.t)
        return real_read(p)

    monkeypatch.setattr(os, "stat", spy_stat)
    monkeypatch.setattr(keys_mod, "read_key_file", spy_read)
    for i in range(100):
        clock.t = 1000.0 + i * 0.05  # 5 s of requests
        w.current()
        w.check("key-a")
    assert len(stats) == 5
    assert len(reads) == 1  # unchanged inode, mtime and size: never re-read
    w.check("x")  # a key it would refuse: one look more first (a rotation may be under way)
    assert len(stats) == 6 and len(reads) == 1


def test_a_key_rotated_within_the_second_is_accepted_at_its_first_use(tmp_path):
    """Found by the soak: clients that switched to the new key right after `key rotate` got
    401 until the next once-a-second look, each counted as a failed attempt, and the 21st
    had their shared address (LiteLLM's, in production) refused with 429 for everyone."""
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    assert w.check("key-a") == "ok"
    write_key_file(path, "key-b")
    clock.t += 0.01  # well within the second
    assert w.check("key-b") == "ok"
    assert w.check("key-a") == "previous"
    assert w.check("nope") == "bad"


def test_watcher_rereads_on_same_size_rewrite_with_new_mtime(tmp_path):
    path = tmp_path / "k"
    path.write_text("key-a")
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    assert w.current() == "key-a"
    with open(path, "w") as f:  # in place: same inode, same size
        f.write("key-b")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000))
    clock.t += 1
    assert w.current() == "key-b"


def test_missing_or_empty_file_fails_closed_and_logs_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ondemand.gateway.keys")
    path = tmp_path / "k"
    clock = Clock()
    changes = []
    w = KeyWatcher(path, clock=clock, publish=lambda e: changes.append(1))
    for _ in range(5):
        assert w.current() is None
        assert w.check("anything") == "bad"
        assert w.check(None) == "bad"
        clock.t += 1
    not_configured = [r for r in caplog.records if "not configured" in r.getMessage()]
    assert len(not_configured) == 1 and not_configured[0].levelno == logging.WARNING

    write_key_file(path, "key-a")
    clock.t += 1
    assert w.current() == "key-a"
    assert changes == [1]

    path.write_text("")  # went empty: fails closed again
    clock.t += 1
    assert w.current() is None and w.check("key-a") == "bad"
    assert changes == [1, 1]
    path.write_text("key-a")
    clock.t += 1
    assert w.current() == "key-a"
    os.unlink(path)  # went missing
    clock.t += 1
    for _ in range(3):
        assert w.current() is None
        clock.t += 1
    not_configured = [r for r in caplog.records if "not configured" in r.getMessage()]
    assert len(not_configured) == 3  # once per transition, not per request
    # The key is never logged.
    assert all("key-a" not in r.getMessage() for r in caplog.records)


def test_unreadable_file_is_retried(tmp_path, monkeypatch):
    # A chmod changes no mtime: a file that was there but unreadable is re-read every second.
    import ondemand.gateway.keys as keys_mod
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    monkeypatch.setattr(keys_mod, "read_key_file", lambda p: None)  # as if EACCES
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    assert w.current() is None
    monkeypatch.undo()
    clock.t += 1
    assert w.current() == "key-a"


def test_previous_key_for_300_s_then_bad(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    assert w.check("key-a") == "ok"
    assert w.check("key-b") == "bad"
    write_key_file(path, "key-b")
    clock.t += 1
    changed_at = clock.t
    assert w.check("key-b") == "ok"
    assert w.check("key-a") == "previous"
    assert w.check("key-c") == "bad"
    assert w.check("") == "bad"
    clock.t = changed_at + 299.9
    assert w.check("key-a") == "previous"
    clock.t = changed_at + 300.0
    assert w.check("key-a") == "bad"
    assert w.check("key-b") == "ok"


def test_previous_key_survives_a_removal_and_restarts_its_grace(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    w = KeyWatcher(path, clock=clock)
    assert w.current() == "key-a"
    os.unlink(path)
    clock.t += 1
    assert w.check("key-a") == "bad"  # not configured: nothing is ok
    clock.t += 250
    write_key_file(path, "key-b")
    assert w.check("key-a") == "previous"
    clock.t += 299
    assert w.check("key-a") == "previous"
    clock.t += 1
    assert w.check("key-a") == "bad"


def test_same_key_rewritten_is_no_change(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    changes = []
    w = KeyWatcher(path, clock=clock, publish=lambda e: changes.append(1))
    w.current()
    write_key_file(path, "key-a")  # new inode, same key
    clock.t += 1
    assert w.current() == "key-a" and changes == []


def test_rotation_publishes_key_rotated_on_the_bus(tmp_path):
    from ondemand.events import EventBus, KeyRotated
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    clock = Clock()
    bus = EventBus()
    w = KeyWatcher(path, clock=clock, publish=bus.publish)
    seen = []
    bus.subscribe(KeyRotated, seen.append)
    w.current()
    assert seen == []  # loading the key at start is not a rotation
    write_key_file(path, "key-b")
    clock.t += 1
    assert w.current() == "key-b"
    assert seen == [KeyRotated()]


def test_check_handles_non_ascii_header_values(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, "key-a")
    w = KeyWatcher(path, clock=Clock())
    assert w.check("ké\udcff\ud800") == "bad"
