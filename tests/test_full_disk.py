"""The state file on a full disk (a small tmpfs, filled for real): the admin API says so
clearly and writes nothing half-way, the gateway keeps serving (a cold start included),
and once there is room again the next change stores the whole state."""
import contextlib
import os
import sqlite3
import subprocess

import pytest
from helpers import run_app, two_pools

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
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * 65536)
            f.flush()


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
