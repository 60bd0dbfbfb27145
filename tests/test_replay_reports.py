"""The replay reports an admin keeps in ``{state_dir}/replays/``: the page ``ondemand replay
--html`` wrote there, listed newest first and downloaded through the admin API (the admin page
links the newest), and nothing else of the state directory reachable through it."""
from __future__ import annotations

import json
import os

import aiohttp
import pytest
from test_replay_cli import DEPLOYMENTS, TRACE, replay


async def get(server, path, *, headers=None, unix=False):
    if unix:
        conn = aiohttp.UnixConnector(path=str(server.cfg.admin_socket))
        url = f"http://ondemand{server.cfg.base_path}/api{path}"
        headers = {}
    else:
        conn = None
        url = f"{server.url}/api{path}"
        headers = server.admin_headers() if headers is None else headers
    async with aiohttp.ClientSession(connector=conn) as s, s.get(url, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def test_a_replays_page_is_listed_newest_first_and_downloaded_as_written(server, tmp_path):
    folder = server.cfg.state_dir / "replays"
    status, _, body = await get(server, "/replays")
    assert status == 200 and json.loads(body) == {"dir": str(folder), "reports": []}

    folder.mkdir()
    (tmp_path / "deps.toml").write_text(DEPLOYMENTS)
    (tmp_path / "trace.csv").write_text(TRACE)
    r = replay(str(tmp_path / "trace.csv"), "--deployments", str(tmp_path / "deps.toml"), "--gpus", "1x80",
               "--host-gib", "512", "--html", str(folder / "monday.html"))
    assert r.returncode == 0, r.stderr
    page = (folder / "monday.html").read_bytes()
    assert page.startswith(b"<!doctype html>") and sorted(os.listdir(folder)) == ["monday.html"]  # no temp left
    older = folder / "sunday.html"
    older.write_bytes(b"<!doctype html><p>the day before</p>")
    os.utime(older, (1_700_000_000, 1_700_000_000))
    # Not reports: a hidden file (a page being written), another kind, a folder, a link out.
    (folder / ".tuesday.html.123.tmp").write_bytes(b"half a page")
    (folder / "notes.txt").write_text("not a page")
    (folder / "old.html").mkdir()
    (folder / "key.html").symlink_to(server.cfg.key_file)

    status, _, body = await get(server, "/replays")
    listing = json.loads(body)
    assert status == 200 and [(r["name"], r["bytes"]) for r in listing["reports"]] == \
        [("monday.html", len(page)), ("sunday.html", older.stat().st_size)]
    assert listing["reports"][1]["modified"] == 1_700_000_000

    for unix in (False, True):
        status, headers, body = await get(server, "/replays/monday.html", unix=unix)
        assert status == 200 and body == page
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Content-Disposition"] == 'attachment; filename="monday.html"'
        assert headers["Content-Security-Policy"] == "sandbox" and headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("name", ["key.html", "notes.txt", "old.html", ".tuesday.html.123.tmp", "nope.html",
                                  "..%2Fondemand.key", "%2E%2E%2Fadmin.token"])
async def test_nothing_but_a_plain_report_is_served(server, name):
    folder = server.cfg.state_dir / "replays"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a page")
    (folder / "old.html").mkdir()
    (folder / ".tuesday.html.123.tmp").write_bytes(b"half a page")
    (folder / "key.html").symlink_to(server.cfg.key_file)
    status, headers, body = await get(server, f"/replays/{name}")
    assert status == 404, body
    assert json.loads(body)["error"]["code"] == "not_found"
    assert server.key.encode() not in body


async def test_the_reports_need_the_admin_token(server):
    folder = server.cfg.state_dir / "replays"
    folder.mkdir()
    (folder / "monday.html").write_bytes(b"<!doctype html>")
    for path in ("/replays", "/replays/monday.html"):
        status, _, body = await get(server, path, headers={"Authorization": f"Bearer {server.key}"})
        assert status == 401 and b"doctype" not in body


def test_a_page_is_written_whole_or_not_at_all_and_a_device_is_written_to(tmp_path):
    """The page is renamed into place (no reader sees half of it); a path that is not a plain
    file (a device, a pipe) is written to as it is, never renamed over."""
    (tmp_path / "deps.toml").write_text(DEPLOYMENTS)
    (tmp_path / "trace.csv").write_text(TRACE)
    args = (str(tmp_path / "trace.csv"), "--deployments", str(tmp_path / "deps.toml"), "--gpus", "1x80",
            "--host-gib", "512")
    r = replay(*args, "--html", str(tmp_path / "missing" / "monday.html"))
    assert r.returncode == 1 and r.stderr.startswith(f"ondemand: cannot write {tmp_path / 'missing' / 'monday.html'}: ")
    assert not (tmp_path / "missing").exists()
    before = os.stat("/dev/null")
    r = replay(*args, "--html", "/dev/null", "--json", "/dev/null")
    assert r.returncode == 0, r.stderr
    after = os.stat("/dev/null")
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not [n for n in os.listdir("/dev") if n.startswith(".null.")]
