"""Hostile and malformed HTTP over raw sockets against a running ondemand with a ready engine
simulator behind it (BEHAVIOUR.md, "Malformed and slow requests"): request smuggling attempts,
oversized and slow heads, slow and broken bodies, pipelining. Each gets its documented answer
or a closed connection; none reaches the engine unchecked, and none holds a slot or an engine
connection afterwards."""
import asyncio
import contextlib
import logging
import time

import aiohttp
import orjson
import pytest
from helpers import wait_for

from ondemand.app import GATEWAY
from ondemand.http.refusals import RefusalLog

CHAT = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hello"}]})
ALLOWED_ENGINE_PATHS = {"/v1/chat/completions"}


def _port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


@pytest.fixture
async def ready(server):
    """The server and one ready deployment (its engine simulator running)."""
    dep = await server.add("a")
    await server.deployer.restart(dep)
    return server, dep


async def _talk(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 5.0,
                want: int | None = None) -> tuple[bytes, bool]:
    """Send ``parts`` (``pause`` s apart) and read until the server closes, ``want`` whole
    answers came, or ``timeout``: what came back, and whether the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data, closed = b"", False

    async def read() -> None:
        nonlocal data, closed
        while not (want and len(_answers(data, partial=True)) >= want):
            try:
                got = await reader.read(65536)
            except ConnectionError:
                got = b""
            if not got:
                closed = True
                return
            data += got
    reading = asyncio.ensure_future(read())
    try:
        for i, part in enumerate(parts):
            if i and pause:
                await asyncio.sleep(pause)
            if reading.done() or writer.is_closing():
                break  # the server closed it: the rest is never sent
            try:
                writer.write(part)
            except (ConnectionError, RuntimeError):  # closed under us (uvloop says RuntimeError)
                break
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(reading), timeout)
        return data, closed
    finally:
        reading.cancel()
        writer.close()


def _answers(data: bytes, partial: bool = False) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP answers in ``data``, one after another (each with a Content-Length); with
    ``partial``, only the complete ones."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if partial and not sep:
            break
        assert sep, data[:200]
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", "0"))
        if partial and len(rest) < n:
            break
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


async def _forwarded(server, dep) -> list[dict]:
    """What the engine received from the gateway (its requests carry X-Request-Id)."""
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep) + "/_sim/requests") as r:
        rows = await r.json()
    return [x for x in rows if any(k.lower() == "x-request-id" for k, _ in x["headers"])]


async def _quiet(server, dep) -> None:
    """No slot, no waiter, no busy engine connection left."""
    pool = server.app[GATEWAY].upstreams.pool(dep)

    def idle():
        busy = 0 if pool is None else len(pool.conns) - len(pool.idle)
        streams = 0 if pool is None else pool.streams
        return (server.controller.inflight(dep), server.controller.waiting(), streams, busy) == (0, 0, 0, 0)
    await wait_for(idle, timeout=5, what="no slot, waiter or busy engine connection")


def _head(dep, *lines: str, method: str = "POST", path: str | None = None, key: str = "") -> bytes:
    target = path or f"/dgxmm/ondemand/{dep}/v1/chat/completions"
    return (f"{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            + "".join(line + "\r\n" for line in lines) + "\r\n").encode()


# Each: the request's bytes after "POST <gateway chat path> HTTP/1.1\r\nHost\r\nAuthorization\r\n".
SMUGGLING = {
    "content-length with transfer-encoding": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "transfer-encoding then content-length": b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "duplicate content-length, equal": b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "duplicate content-length, different": b"Content-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
    "content-length list": b"Content-Length: 2, 2\r\n\r\n{}",
    "content-length sign": b"Content-Length: +2\r\n\r\n{}",
    "obs-fold continuation": b"X-A: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",
    "obs-fold of transfer-encoding": b"Transfer-Encoding:\r\n chunked\r\nContent-Length: 2\r\n\r\n{}",
    "bare CR in the head": b"X-A: a\rContent-Length: 2\r\n\r\n{}",
    "invalid chunk size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "negative chunk size": b"Transfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n",
    "overflowing chunk size": b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n{}\r\n0\r\n\r\n",
    "chunk size with bare LF": b"Transfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n",
    "transfer-encoding chunked, identity": b"Transfer-Encoding: chunked, identity\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "transfer-encoding identity with length": b"Transfer-Encoding: identity\r\nContent-Length: 2\r\n\r\n{}",
    "transfer-encoding xchunked": b"Transfer-Encoding: xchunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "space before the colon": b"Content-Length : 2\r\n\r\n{}",
    "space inside a header name": b"X A: 1\r\nContent-Length: 2\r\n\r\n{}",
    "header line without a colon": b"Content-Length 2\r\n\r\n{}",
    "NUL in a header value": b"X-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
    "one huge header (over 64 KiB)": b"X-A: " + b"a" * 70_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
    "too many headers (200)": b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"Content-Length: 2\r\n\r\n{}",
}


async def test_smuggling_attempts_are_400_and_closed_and_never_forwarded(ready, caplog):
    """Framing tricks are refused by the HTTP parser itself: 400 and the connection closed,
    before any check of ours. One log line at most, never a traceback per request."""
    server, dep = ready
    port = _port(server)
    for name, tail in SMUGGLING.items():
        start = f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n" \
                f"Authorization: Bearer {server.key}\r\n".encode()
        data, closed = await _talk(port, start + tail)
        assert closed, name
        assert [a[0] for a in _answers(data)] == [400], (name, data[:200])  # the parser's 400
    # The bare-LF request line: a head of bare LFs.
    data, closed = await _talk(port, f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\nHost: x\n"
                                     f"Authorization: Bearer {server.key}\nContent-Length: 2\n\n{{}}".encode())
    assert closed and [a[0] for a in _answers(data)] == [400]
    assert await _forwarded(server, dep) == []
    await _quiet(server, dep)
    # The parser's refusals are logged, but not one traceback each: at most a line a minute.
    aiohttp_lines = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(aiohttp_lines) <= 1 and all(r.exc_info is None for r in aiohttp_lines)


async def test_a_well_formed_chunked_body_is_forwarded_with_a_content_length(ready):
    server, dep = ready
    data, _ = await _talk(_port(server), _head(dep, "Transfer-Encoding: chunked", "Content-Type: application/json",
                                               "Connection: close", key=server.key)
                          + b"%x\r\n" % len(CHAT) + CHAT + b"\r\n0\r\n\r\n")
    assert _answers(data)[0][0] == 200
    [row] = await _forwarded(server, dep)
    names = {k.lower(): v for k, v in row["headers"]}
    assert row["path"] == "/v1/chat/completions" and names["content-length"] == str(len(CHAT))
    assert "transfer-encoding" not in names and row["body"] == CHAT.decode()
    await _quiet(server, dep)


@pytest.mark.uvloop
async def test_pipelined_requests_are_each_checked(ready):
    """Two requests in one write: each is answered in order, and the second goes through every
    check (here the path check) like any other; the engine sees only the first."""
    server, dep = ready
    first = _head(dep, "Content-Type: application/json", f"Content-Length: {len(CHAT)}", key=server.key) + CHAT
    sneaky = [
        _head(dep, "Connection: close", method="GET", path=f"/dgxmm/ondemand/{dep}/v1/../../metrics", key=server.key),
        _head(dep, "Connection: close", method="GET", path=f"/dgxmm/ondemand/{dep}/v1/%2e%2e/health", key=server.key),
        _head(dep, "Connection: close", method="POST", key="wrong") + b"",
        _head(dep, "Connection: close", method="GET", path="/metrics", key=server.key),
    ]
    for second, (status, code) in zip(sneaky, [(400, "invalid_path"), (400, "invalid_path"),
                                               (401, "invalid_api_key"), (421, "misdirected_request")]):
        data, closed = await _talk(_port(server), first + second)
        answers = _answers(data)
        assert closed and [a[0] for a in answers] == [200, status], data[:300]
        if code:
            assert orjson.loads(answers[1][2])["error"]["code"] == code
    # A second request with broken framing after a good one, in the same write: aiohttp's parser
    # refuses the whole batch (one 400, closed), the good one with it; arriving apart, the good
    # one would be answered first. Either way the broken one never goes further.
    data, closed = await _talk(_port(server), first + _head(dep, "Content-Length: 1", "Content-Length: 2",
                                                            key=server.key) + b"{}")
    statuses = [a[0] for a in _answers(data)]
    assert closed and statuses in ([400], [200, 400])
    rows = await _forwarded(server, dep)
    assert [r["path"] for r in rows] == ["/v1/chat/completions"] * (4 + len(statuses) - 1)
    await _quiet(server, dep)


@pytest.fixture
def short_head_timeout(server):
    server.set_limits(head_timeout_s=0.3)


@pytest.mark.uvloop
async def test_slow_heads_are_closed_after_the_head_timeout(ready, short_head_timeout):
    """Slowloris: a head trickled byte by byte, or left unfinished, is answered 408 and closed
    HEAD_TIMEOUT_S after its first byte, and holds nothing."""
    server, dep = ready
    port = _port(server)
    head = _head(dep, "Content-Length: 2", key=server.key)
    t0 = time.monotonic()
    data, closed = await _talk(port, *[head[i:i + 1] for i in range(40)], pause=0.03, timeout=5)
    assert closed and _answers(data)[0][0] == 408, data
    assert orjson.loads(_answers(data)[0][2])["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 1.5
    data, closed = await _talk(port, head[:30], timeout=5)  # unfinished, then silence
    assert closed and _answers(data)[0][0] == 408
    await _quiet(server, dep)
    assert await _forwarded(server, dep) == []


async def test_a_silent_connection_is_closed_after_the_head_timeout_an_idle_keep_alive_one_is_kept(
        ready, short_head_timeout):
    """Issue 29: the first request's head is timed from the accept, so a connection that sends
    nothing is closed (without an answer: nothing was asked) after the head timeout, not held for
    the keep-alive timeout; one idle after an answer is kept (LiteLLM reuses its connections)."""
    server, dep = ready
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - t0 >= 0.25  # the head timeout (0.3 s), not at once
    finally:
        writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        req = _head(dep, "Content-Type: application/json", f"Content-Length: {len(CHAT)}", key=server.key) + CHAT
        for i in range(2):
            if i:
                await asyncio.sleep(0.6)  # twice the head timeout, idle after an answer
            writer.write(req)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
    finally:
        writer.close()


async def _open(port: int, peer: str = "127.0.0.1"):
    """A raw connection from ``peer`` (any 127/8 address is this host's)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(peer, 0))


async def _closed_at_once(reader: asyncio.StreamReader) -> bool:
    """The server closed it without a byte, well before any timeout (the head timeout is 10 s)."""
    try:
        return await asyncio.wait_for(reader.read(), 3) == b""
    except ConnectionError:
        return True


HEALTHZ = b"GET /dgxmm/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.mark.server(max_connections=8, max_connections_per_peer=3)
async def test_one_peer_at_its_connection_cap_churns_only_its_own_connections(ready):
    """Issues 29 and 40: a peer holding its cap of silent connections (max_connections_per_peer)
    that opens more has its own idle connections closed for them, oldest first (nginx's way at
    its cap: the idle give way); another peer's gateway requests and /healthz are served
    meanwhile; and the count is given back as they close. (test_caps.py: the rules, and floods.)"""
    server, dep = ready
    port, front = _port(server), server.http.front
    held = [await _open(port, "127.0.0.2") for _ in range(3)]
    await wait_for(lambda: front.open.count("127.0.0.2") == 3, timeout=5)
    more = [await _open(port, "127.0.0.2") for _ in range(3)]
    for reader, _ in held:
        assert await _closed_at_once(reader)
    assert front.open.count("127.0.0.2") == 3 and front.open.gave_way == 3
    req = _head(dep, "Content-Type: application/json", f"Content-Length: {len(CHAT)}", "Connection: close",
                key=server.key) + CHAT
    for _ in range(2):
        data, closed = await _talk(port, req)
        assert closed and _answers(data)[0][0] == 200, data[:200]
        data, closed = await _talk(port, HEALTHZ)
        assert closed and _answers(data)[0][0] == 200, data[:200]
    assert front.open.count("127.0.0.2") == 3 and front.open.gave_way == 3  # (nothing gave way to those)
    for _, w in held + more:
        w.close()
    await wait_for(lambda: (front.open.total, front.open.peers, front.open.idle) == (0, {}, {}), timeout=5)
    data, closed = await _talk(port, req)
    assert _answers(data)[0][0] == 200
    await _quiet(server, dep)


async def test_a_413_on_a_body_without_end_ends_the_connection(ready):
    """Issues 29 and 40: a chunked body past the gateway's limit that never ends is 413, and the
    connection ends with it: the answer and a FIN at once, then what more comes is read and
    dropped for the lingering time (a second), no longer, however long the client holds on."""
    server, dep = ready
    server.app[GATEWAY].max_body = 1000
    chunked = _head(dep, "Content-Type: application/json", "Transfer-Encoding: chunked", key=server.key)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        writer.write(chunked + b"7d0\r\n" + b" " * 2000 + b"\r\n")  # and no end
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close\r\n" in head
        rest = await asyncio.wait_for(reader.read(), 3)  # the answer's body, then the FIN
        assert orjson.loads(rest)["error"]["code"] == "request_too_large"
        await wait_for(lambda: server.http.front.open.total == 0, timeout=5, what="closed after its lingering")
    finally:
        writer.close()
    await _quiet(server, dep)
    assert await _forwarded(server, dep) == []


async def test_the_gateway_listener_closes_a_refused_peer_at_the_accept_and_the_admin_listener_is_capped(
        tmp_path):
    """With admin_listen, ``listen`` serves the gateway alone: a peer the policy refuses is
    closed at the accept there. The admin listener (aiohttp's from the first byte) serves it,
    closes a silent connection after the head timeout, and has its caps of its own."""
    from helpers import free_port, run_app
    admin_port = free_port()
    async with run_app(tmp_path, admin_listen=f"127.0.0.1:{admin_port}", ondemand_allowed_cidrs=["127.0.0.1/32"],
                       max_connections_per_peer=2) as server:
        port = _port(server)
        reader, writer = await _open(port, "127.0.0.2")
        assert await _closed_at_once(reader)
        writer.close()
        assert server.http.gateway_only.open.total == 0
        data, closed = await _talk(admin_port, HEALTHZ)  # _talk connects from 127.0.0.1
        assert closed and _answers(data)[0][0] == 200
        server.set_limits(head_timeout_s=0.3)
        held = [await _open(admin_port, "127.0.0.2") for _ in range(2)]
        await wait_for(lambda: server.http.admin_open.count("127.0.0.2") == 2, timeout=5)
        reader, writer = await _open(admin_port, "127.0.0.2")
        assert await _closed_at_once(held[0][0])  # at its cap: its oldest idle one gives way
        held[0][1].close()
        held[0] = reader, writer
        for r, w in held:  # silent: closed after the head timeout
            assert await asyncio.wait_for(r.read(), 5) == b""
            w.close()
        await wait_for(lambda: server.http.admin_open.total == 0, timeout=5)
        data, closed = await _talk(admin_port, HEALTHZ)
        assert closed and _answers(data)[0][0] == 200


async def test_a_head_over_the_size_limit_is_431(ready):
    """A head still unfinished past MAX_HEAD_BYTES (headers each under the per-header limit)
    is answered 431 and closed: aiohttp alone would hold 128 headers of 64 KiB each."""
    server, dep = ready
    big = [f"X-{i}: " + "a" * 60_000 for i in range(3)]
    data, closed = await _talk(_port(server), _head(dep, *big, key=server.key)[:-2], timeout=5)
    assert closed and _answers(data)[0][0] == 431
    assert orjson.loads(_answers(data)[0][2])["error"]["code"] == "headers_too_large"
    await _quiet(server, dep)


@pytest.mark.uvloop
async def test_slow_and_broken_bodies_are_bounded(ready):
    """A body trickled too slowly is 408 after the gateway's body timeout; a chunked body whose
    framing breaks after the head (aiohttp never ends such a body) the same, where it hung
    for ever; a hang-up mid-body frees everything. None takes a slot or reaches the engine."""
    server, dep = ready
    server.app[GATEWAY].body_timeout_s = 0.5
    port = _port(server)
    head = _head(dep, "Content-Type: application/json", "Content-Length: 200", key=server.key)
    # The answer comes at 0.5 s and says close; aiohttp then reads and drops what more comes
    # for up to LINGERING_S before it closes: the client here hangs up once answered.
    t0 = time.monotonic()
    data, _ = await _talk(port, head, *[b"{"] + [b" "] * 30, pause=0.05, timeout=5, want=1)
    [(status, headers, body)] = _answers(data)
    assert (status, orjson.loads(body)["error"]["code"], headers["connection"]) == (408, "request_timeout", "close")
    assert time.monotonic() - t0 < 2
    chunked = _head(dep, "Content-Type: application/json", "Transfer-Encoding: chunked", key=server.key)
    data, _ = await _talk(port, chunked, b"zz\r\n{}\r\n0\r\n\r\n", pause=0.2, timeout=5, want=1)
    assert [a[0] for a in _answers(data)] in ([400], [408]), data
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b'{"model": ')
    await asyncio.sleep(0.2)
    writer.close()
    await _quiet(server, dep)
    assert await _forwarded(server, dep) == []
    data, _ = await _talk(port, _head(dep, "Content-Type: application/json", f"Content-Length: {len(CHAT)}",
                                      "Connection: close", key=server.key) + CHAT)
    assert _answers(data)[0][0] == 200  # and the server serves on


def test_the_refusal_log_lets_one_line_a_minute_through(caplog):
    """Both stacks' malformed requests go through one RefusalLog: one line a minute, the
    first line of the reason, and the count of the others."""
    log = RefusalLog(every_s=60)
    with caplog.at_level(logging.WARNING, logger="ondemand.http"):
        log.note("10.0.0.9", "Duplicate Content-Length:\n\n  b'Content-Length: 2'")
        for _ in range(50):
            log.note("10.0.0.9", "again")
    lines = [r for r in caplog.records if r.name == "ondemand.http"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    assert lines[0].getMessage() == "refused a malformed request from 10.0.0.9 (400): Duplicate Content-Length:"
    assert log.suppressed == 50
