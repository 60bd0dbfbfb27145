"""The replay reports an admin keeps in ``{state_dir}/replays/``: the page ``ondemand replay
--html`` wrote there, listed newest first and downloaded through the admin API (the admin page
links the newest), and nothing else of the state directory reachable through it."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import tracemalloc
import urllib.parse

import aiohttp
import pytest
from helpers import wait_for
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
    assert status == 200 and json.loads(body) == {"dir": str(folder), "count": 0, "reports": []}

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
    assert listing["reports"][1]["modified"] == 1_700_000_000 and listing["count"] == 2

    for unix in (False, True):
        status, headers, body = await get(server, "/replays/monday.html", unix=unix)
        assert status == 200 and body == page
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Content-Disposition"] == 'attachment; filename="monday.html"'
        assert headers["Content-Security-Policy"] == "sandbox" and headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("name", ["key.html", "linked.html", "fifo.html", "notes.txt", "old.html",
                                  ".tuesday.html.123.tmp", "nope.html", "..%2Fondemand.key", "%2E%2E%2Fsecret.html",
                                  "..%2Fsecret.html", "a%2Fb.html", "%2Fetc%2Fpasswd.html", "caf%C3%A9.html",
                                  "x" * 300 + ".html"])
async def test_nothing_but_a_plain_report_is_served(server, name):
    folder = server.cfg.state_dir / "replays"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a page")
    (folder / "old.html").mkdir()
    (folder / ".tuesday.html.123.tmp").write_bytes(b"half a page")
    (folder / "key.html").symlink_to(server.cfg.key_file)
    os.link(server.cfg.key_file, folder / "linked.html")  # a second name of the key file
    os.mkfifo(folder / "fifo.html")  # opened, it would block a reader that waits for a writer
    (folder / "a").mkdir()
    (folder / "a" / "b.html").write_text("<!doctype html>")
    (server.cfg.state_dir / "secret.html").write_text(server.key)
    (folder / "caf\u00e9.html").write_text("<!doctype html>")
    status, headers, body = await get(server, f"/replays/{name}")
    assert status == 404, body
    assert json.loads(body)["error"]["code"] == "not_found"
    assert server.key.encode() not in body
    status, _, body = await get(server, "/replays")
    assert status == 200 and json.loads(body)["reports"] == []  # none of them is listed either


async def test_a_linked_replays_folder_is_not_followed(server, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "monday.html").write_text("<!doctype html>")
    (server.cfg.state_dir / "replays").symlink_to(elsewhere)
    status, _, body = await get(server, "/replays")
    assert status == 503 and json.loads(body)["error"]["code"] == "replays_unreadable"
    status, _, body = await get(server, "/replays/monday.html")
    assert status == 503 and b"doctype" not in body


async def test_a_report_too_large_to_serve_says_so(server):
    folder = server.cfg.state_dir / "replays"
    folder.mkdir()
    with open(folder / "huge.html", "wb") as fh:
        fh.truncate(64 * 1024 * 1024 + 1)  # sparse: no disk spent
    status, _, body = await get(server, "/replays")
    assert [r["name"] for r in json.loads(body)["reports"]] == ["huge.html"]
    status, _, body = await get(server, "/replays/huge.html")
    assert status == 409 and json.loads(body)["error"]["code"] == "replay_report_too_large"


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


async def test_the_twenty_newest_are_listed_and_all_are_counted(server):
    folder = server.cfg.state_dir / "replays"
    folder.mkdir()
    for day in range(25):
        (folder / f"day-{day:02d}.html").write_text("<!doctype html>")
        os.utime(folder / f"day-{day:02d}.html", (1_700_000_000 + day, 1_700_000_000 + day))
    status, _, body = await get(server, "/replays")
    listing = json.loads(body)
    assert listing["count"] == 25
    assert [r["name"] for r in listing["reports"]] == [f"day-{day:02d}.html" for day in range(24, 4, -1)]


def test_a_page_written_through_a_link_replaces_the_file_it_names_and_keeps_its_mode(tmp_path):
    (tmp_path / "deps.toml").write_text(DEPLOYMENTS)
    (tmp_path / "trace.csv").write_text(TRACE)
    real = tmp_path / "reports" / "latest.html"
    real.parent.mkdir()
    real.write_text("the old page")
    real.chmod(0o640)
    old_inode = real.stat().st_ino
    link = tmp_path / "latest.html"
    link.symlink_to(real)
    fresh = tmp_path / "reports" / "fresh.json"
    r = replay(str(tmp_path / "trace.csv"), "--deployments", str(tmp_path / "deps.toml"), "--gpus", "1x80",
               "--host-gib", "512", "--html", str(link), "--json", str(fresh))
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and real.read_bytes().startswith(b"<!doctype html>")
    assert real.stat().st_ino != old_inode  # renamed into place, not written over in place
    assert oct(real.stat().st_mode & 0o777) == oct(0o640)
    umask = os.umask(0)
    os.umask(umask)
    assert oct(fresh.stat().st_mode & 0o777) == oct(0o666 & ~umask)  # a new file: as open() makes one
    assert sorted(os.listdir(real.parent)) == ["fresh.json", "latest.html"]


REPORT_BYTES = 32 << 20


def big_report(server, name: str = "big.html") -> tuple[object, bytes]:
    """A report of REPORT_BYTES in ``replays/``, and its bytes."""
    folder = server.cfg.state_dir / "replays"
    folder.mkdir(exist_ok=True)
    block = b"<!doctype html>" + bytes(range(256)) * 4096
    data = (block * (REPORT_BYTES // len(block) + 1))[:REPORT_BYTES]
    (folder / name).write_bytes(data)
    return folder / name, data


async def slow_get(server, path: str):
    """A client that reads only when the test says: a socket with a small receive buffer, the
    request sent, the head read. Returns (reader, writer, status, Content-Length)."""
    url = urllib.parse.urlsplit(server.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the kernel holds little for it
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (url.hostname, url.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 << 10)
    headers = "".join(f"{k}: {v}\r\n" for k, v in server.admin_headers().items())
    writer.write(f"GET {url.path}/api{path} HTTP/1.1\r\nHost: ondemand\r\n{headers}\r\n".encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if line)
    return reader, writer, int(head[0].split()[1]), int(fields.get("Content-Length", -1))


async def read_body(reader, length: int) -> tuple[int, str]:
    """Up to ``length`` bytes, or until the connection ends: how many, and their SHA-256."""
    got, digest = 0, hashlib.sha256()
    while got < length:
        piece = await reader.read(min(256 << 10, length - got))
        if not piece:
            break
        got += len(piece)
        digest.update(piece)
    return got, digest.hexdigest()


async def test_a_report_is_sent_as_it_is_read_never_held_whole(server):
    """A 32 MiB report read slowly: the server reads it as the client takes it, so what Python
    holds stays far below the report (the whole file was read into memory at the request, and
    eight unread 64 MiB downloads pinned 1.1 GB)."""
    _, data = big_report(server)
    want = hashlib.sha256(data).hexdigest()
    del data
    tracemalloc.start()
    try:
        reader, writer, status, length = await slow_get(server, "/replays/big.html")
        assert (status, length) == (200, REPORT_BYTES)
        first = await reader.read(64 << 10)
        # The client takes nothing for a moment; the server goes as far as the socket lets it.
        await asyncio.sleep(0.3)
        rest, _ = await read_body(reader, REPORT_BYTES - len(first))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    writer.close()
    assert len(first) + rest == REPORT_BYTES
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB held for a {REPORT_BYTES >> 20} MiB report"
    reader, writer, status, length = await slow_get(server, "/replays/big.html")  # whole, as written
    assert (status, length) == (200, REPORT_BYTES) and (await read_body(reader, length)) == (REPORT_BYTES, want)
    writer.close()


async def test_a_report_is_the_size_it_was_when_looked_at(server):
    """One that grows while it is sent is sent as it was (its Content-Length); one cut short
    while it is sent ends the connection before the promised length: the client sees a broken
    download, never a hang or one that looks whole."""
    path, data = big_report(server)
    reader, writer, _, length = await slow_get(server, "/replays/big.html")
    with open(path, "ab") as fh:
        fh.write(b"<p>written since</p>" * 1000)
    assert await read_body(reader, length) == (REPORT_BYTES, hashlib.sha256(data).hexdigest())
    writer.close()

    path.write_bytes(data)
    reader, writer, _, length = await slow_get(server, "/replays/big.html")
    assert length == REPORT_BYTES
    await reader.read(64 << 10)
    os.truncate(path, 1 << 20)
    got, _ = await asyncio.wait_for(read_body(reader, length), 60)
    assert got < length and reader.at_eof()
    writer.close()
    status, _, body = await get(server, "/replays/big.html")  # the server goes on: now it is 1 MiB
    assert status == 200 and body == data[:1 << 20]


async def test_a_client_that_takes_nothing_is_let_go(server, monkeypatch):
    """A download nobody reads is ended after SEND_TIMEOUT_S without a byte taken: its connection
    is closed and the report's descriptor with it (they were held for as long as the client
    stayed connected)."""
    from ondemand.admin import replays
    monkeypatch.setattr(replays, "SEND_TIMEOUT_S", 0.5)
    big_report(server)
    fds = len(os.listdir("/proc/self/fd"))
    reader, writer, status, length = await slow_get(server, "/replays/big.html")
    assert (status, length) == (200, REPORT_BYTES)

    def ended() -> bool:  # the client takes nothing meanwhile; its own socket is still open
        return len(os.listdir("/proc/self/fd")) <= fds + 1
    await wait_for(ended, timeout=10, what="the report's descriptor and the server's socket closed")
    got, _ = await asyncio.wait_for(read_body(reader, length), 10)
    assert got < length and reader.at_eof()
    writer.close()
