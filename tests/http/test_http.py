"""Issue 23's raw-socket findings, one write on one connection each, against a whole server
(``ondemand/http/``): every answer owed is given, in order, and every refusal from either
stack is the documented JSON. Each test failed on the code before the issue."""
import asyncio
import contextlib
import logging

import orjson
import pytest
from helpers import run_app, wait_for

from ondemand.app import GATEWAY, TELEMETRY
from ondemand.http.limits import Limits

CHAT = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hello"}]})


async def _stalled(writer, timeout: float = 10) -> None:
    """Until the writer's unsent bytes no longer shrink (the peer takes no more): three readings
    apart, all equal and not nil."""
    seen: list[int] = []

    def still() -> bool:
        seen.append(writer.transport.get_write_buffer_size())
        return len(seen) >= 3 and seen[-1] > 0 and seen[-1] == seen[-2] == seen[-3]
    await wait_for(still, timeout=timeout, interval=0.05, what="the client's writes to stall")


def _port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


async def _talk(server, data: bytes, *, timeout: float = 10, want: int | None = None) -> bytes:
    """Write ``data`` at once, then read until the server closes (or ``timeout``), or, with
    ``want``, until that many whole answers came (where the connection may stay open: a
    keep-alive answer, or aiohttp reading an unread body for its lingering time)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        writer.write(data)
        out = b""
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), deadline - asyncio.get_running_loop().time()):
                out += chunk
                if want is not None and len(_answers(out)) >= want:
                    break
        return out
    finally:
        writer.close()


def _answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The answers in ``data``: status, headers (lower-case names), body (Content-Length only)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        n = int(headers.get("content-length", "0"))
        if len(rest) < n:
            break  # its body is still on the way
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def _code(answer) -> str:
    status, headers, body = answer
    assert headers["content-type"].startswith("application/json"), answer
    return orjson.loads(body)["error"]["code"]


def _admin(server, path: str = "/dgxmm/api/host", *lines: str, method: str = "GET", body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {server.token}", *lines]
    if body or method in ("POST", "PATCH"):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _gw(server, dep, *lines: str, method: str = "POST", route: str = "chat/completions", body: bytes = CHAT) -> bytes:
    head = [f"{method} /dgxmm/ondemand/{dep}/v1/{route} HTTP/1.1", "Host: x", f"Authorization: Bearer {server.key}",
            *lines]
    if method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body if method == "POST" else b"")


@pytest.fixture
async def ready(server):
    dep = await server.add("a")
    await server.deployer.restart(dep)
    return server, dep


# --- 1. a non-UTF-8 byte in the admin token ---------------------------------------------------

@pytest.mark.parametrize("path", ["/dgxmm/api/host", "/dgxmm/metrics", "/dgxmm/api/deployments"])
async def test_a_non_utf8_admin_token_is_401_counted_without_a_traceback(server, path, caplog):
    registry = server.app[TELEMETRY].registry
    failures = registry.get_sample_value("ondemand_auth_failures_total")
    raw = f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + b"Authorization: Bearer \xff\r\n\r\n"
    with caplog.at_level(logging.DEBUG):
        [answer] = _answers(await _talk(server, raw, timeout=2, want=1))
    assert answer[0] == 401 and _code(answer) == "invalid_admin_token"
    assert registry.get_sample_value("ondemand_auth_failures_total") == failures + 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


# --- 2. answers owed once aiohttp holds the connection ----------------------------------------

async def test_healthz_then_two_content_lengths_is_200_then_400(server):
    bad = b"POST /dgxmm/api/host HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}"
    answers = _answers(await _talk(server, b"GET /dgxmm/healthz HTTP/1.1\r\nHost: x\r\n\r\n" + bad))
    assert [a[0] for a in answers] == [200, 400]
    assert _code(answers[1]) == "invalid_request"


async def test_admin_then_gateway_is_421_and_the_connection_ends(ready):
    """A 421 ends its connection like every refusal (issue 40: it kept it, so a client pool that
    mixed admin and gateway requests got 421 on 1,504 of 2,000): the client's next request goes
    on a new connection, and the request pipelined behind the 421 is not answered."""
    server, dep = ready
    data = _admin(server) + _gw(server, dep) + b"GET /dgxmm/api/host HTTP/1.1\r\nHost x\r\n\r\n"
    answers = _answers(await _talk(server, data))
    assert [a[0] for a in answers] == [200, 421]
    assert "hostname" in orjson.loads(answers[0][2])
    assert _code(answers[1]) == "misdirected_request" and answers[1][1]["connection"] == "close"


async def test_healthz_in_http_1_0_then_a_stray_byte_is_answered(server):
    answers = _answers(await _talk(server, b"GET /dgxmm/healthz HTTP/1.0\r\n\r\nx"))
    assert answers and answers[0][0] == 200 and orjson.loads(answers[0][2])["status"] == "ok"


async def test_an_admin_change_with_connection_close_then_a_byte_is_answered_and_applied(ready):
    server, dep = ready
    data = _admin(server, f"/dgxmm/api/deployments/{dep}/mode", "Connection: close", "Content-Type: application/json",
                  method="PATCH", body=b'{"mode": "always_on"}') + b"x"
    answers = _answers(await _talk(server, data))
    assert answers and answers[0][0] == 200, answers
    assert server.deployer.get(dep).mode.value == "always_on"


async def test_after_an_admin_request_a_malformed_head_is_400_json(server):
    answers = _answers(await _talk(server, _admin(server) + b"GET /dgxmm/healthz HTTP/1.1\r\nHo st: x\r\n\r\n"))
    assert [a[0] for a in answers] == [200, 400] and _code(answers[1]) == "invalid_request"


@pytest.mark.uvloop
async def test_after_an_admin_request_a_slow_head_is_408_json(server):
    server.set_limits(head_timeout_s=0.3)
    answers = _answers(await _talk(server, _admin(server) + b"GET /dgxmm/healthz HTTP/1.1\r\nHost", timeout=5))
    assert [a[0] for a in answers] == [200, 408] and _code(answers[1]) == "request_timeout"


async def test_after_an_admin_request_a_head_too_large_is_431_json(server):
    server.set_limits(max_head_bytes=4096, max_field_size=100_000)
    big = b"GET /dgxmm/healthz HTTP/1.1\r\nX-Big: " + b"a" * 8000
    answers = _answers(await _talk(server, _admin(server) + big, timeout=5))
    assert [a[0] for a in answers] == [200, 431] and _code(answers[1]) == "headers_too_large"


async def test_an_admin_body_with_broken_chunking_is_400_json(server):
    data = (b"POST /dgxmm/api/deployments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.token.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n")
    answers = _answers(await _talk(server, data, timeout=5))
    assert answers and answers[0][0] == 400 and _code(answers[0]) == "invalid_body", answers


# --- 3. a request pipelined behind an Upgrade with a body ---------------------------------------

@pytest.mark.uvloop
@pytest.mark.parametrize("first", ["admin", "gateway"])
async def test_an_upgrade_with_a_body_is_refused_and_nothing_pairs_with_the_wrong_request(ready, first):
    server, dep = ready
    upgrade = (_admin(server, "/dgxmm/api/deployments", "Connection: Upgrade", "Upgrade: foo", method="POST",
                      body=b"{}") if first == "admin"
               else _gw(server, dep, "Connection: Upgrade", "Upgrade: foo", body=b"{}"))
    answers = _answers(await _talk(server, _admin(server) + upgrade + _admin(server, "/dgxmm/api/deployments")))
    assert [a[0] for a in answers] == [200, 400], answers
    assert _code(answers[1]) == "invalid_request" and answers[1][1]["connection"] == "close"


# --- 4. Transfer-Encoding: identity ----------------------------------------------------------

async def test_transfer_encoding_identity_on_a_gateway_get_is_400_and_not_forwarded(ready):
    server, dep = ready
    before = len(await _forwarded(server, dep))
    data = _gw(server, dep, "Transfer-Encoding: identity", method="GET", route="models/A") + _gw(server, dep)
    answers = _answers(await _talk(server, data))
    assert [a[0] for a in answers] == [400] and _code(answers[0]) == "invalid_request"
    assert len(await _forwarded(server, dep)) == before


async def _forwarded(server, dep) -> list:
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep) + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"].startswith("/v1/") and x["path"] != "/v1/models"]


# --- 5. the small ones --------------------------------------------------------------------------

async def test_an_admin_body_one_byte_over_16_mib_is_413(server):
    body = b"{" + b" " * (16 * 2**20 - 1) + b"}"
    head = _admin(server, "/dgxmm/api/deployments", "Content-Type: application/json", method="POST", body=b"")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    answers = _answers(await _talk(server, head + body, timeout=20, want=1))
    assert answers and answers[0][0] == 413 and _code(answers[0]) == "request_too_large", answers[:1]


@pytest.mark.parametrize("raw", [
    b"POST /dgxmm/api/deployments HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /dgxmm/ondemand%2F1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
])
@pytest.mark.parametrize("after_admin", [False, True])
async def test_refusals_are_the_documented_json(server, raw, after_admin):
    answers = _answers(await _talk(server, (_admin(server) if after_admin else b"") + raw, timeout=5,
                                  want=1 + after_admin))
    assert len(answers) == 1 + after_admin and 400 <= answers[-1][0] < 500, answers
    assert _code(answers[-1])


async def test_an_authenticated_admin_body_has_a_time_limit(tmp_path):
    async with run_app(tmp_path, limits=Limits(body_timeout_s=0.5)) as server:
        head = _admin(server, "/dgxmm/api/deployments", "Content-Type: application/json", method="POST", body=b"")
        head = head.replace(b"Content-Length: 0", b"Content-Length: 100")
        answers = _answers(await _talk(server, head + b'{"na', timeout=5, want=1))
    assert answers and answers[0][0] == 408 and _code(answers[0]) == "request_timeout"
    assert answers[0][1]["connection"] == "close"


async def test_sec_websocket_headers_are_not_forwarded(ready):
    server, dep = ready
    data = _gw(server, dep, "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
               "Connection: close")
    assert _answers(await _talk(server, data))[0][0] == 200
    [row] = (await _forwarded(server, dep))[-1:]
    assert not [k for k, _ in row["headers"] if k.lower().startswith("sec-websocket-")]


async def test_a_gateway_body_past_the_high_water_mark_pauses_reading(ready):
    """The lean front holds at most ``high_water`` of a body its handler has not asked for:
    here the handler waits (before its body read) while the client sends 4 MiB."""
    server, dep = ready
    gateway = server.app[GATEWAY]
    release = asyncio.Event()
    handle = gateway.handle
    held = []

    async def slow(call):
        await release.wait()
        held.append(sum(map(len, call.parts)))
        await handle(call)
    gateway.handle = slow
    body = b'{"model": "A", "messages": [], "x": "' + b"a" * (4 * 2**20) + b'"}'
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        writer.write(_gw(server, dep, body=body))
        await _stalled(writer)  # the client has written what the kernel and the server take
        release.set()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
        gateway.handle = handle
    assert head.startswith(b"HTTP/1.1 ") and held and held[0] < 2 * 2**20, held


async def test_an_early_answer_drops_a_body_past_the_high_water_mark_and_serves_on(ready):
    """A 404 (an unknown deployment, with the key: no refusal, so the connection is kept) before
    a 1 MiB body came: the body is read and dropped (reading is not paused for a body nobody
    will read), and the next request on the connection is answered."""
    server, dep = ready
    big = b"{" + b" " * 2**20 + b"}"
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        writer.write(_gw(server, 999, body=big) + _gw(server, dep, body=b"{}"))
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert first.startswith(b"HTTP/1.1 404") and b"onnection: close" not in first
        await asyncio.wait_for(reader.readuntil(b"}}"), 10)  # its JSON body
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert second.startswith(b"HTTP/1.1 400")  # {} is no chat request, but it was answered
    finally:
        writer.close()


async def test_admin_listen_gives_the_admin_api_a_listener_of_its_own(tmp_path):
    """With ``admin_listen``, ``listen`` serves the gateway alone (anything else is 404) and the
    admin listener is aiohttp's from the first byte (a gateway request there is 421)."""
    from helpers import free_port
    admin_port = free_port()
    async with run_app(tmp_path, admin_listen=f"127.0.0.1:{admin_port}") as server:
        dep = await server.add("a")
        await server.deployer.restart(dep)
        answers = _answers(await _talk(server, _gw(server, dep) + _gw(server, dep, "Connection: close")))
        assert [a[0] for a in answers] == [200, 200]
        [answer] = _answers(await _talk(server, _admin(server)))
        assert answer[0] == 404 and _code(answer) == "not_found"

        async def admin_talk(data: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
            writer.write(data)
            try:
                return await asyncio.wait_for(reader.read(65536), 5)
            finally:
                writer.close()
        answers = _answers(await admin_talk(_admin(server)))
        assert answers[0][0] == 200 and "hostname" in orjson.loads(answers[0][2])
        answers = _answers(await admin_talk(_gw(server, dep)))
        assert answers[0][0] == 421 and _code(answers[0]) == "misdirected_request"
        # aiohttp's from the first byte: a request line without a version is refused there too.
        answers = _answers(await admin_talk(b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"))
        assert answers[0][0] == 400 and _code(answers[0]) == "invalid_request"


def test_admin_listen_is_host_port_or_nothing():
    from ondemand import config
    from ondemand.errors import ConfigError
    assert config.load(env={}).admin_listen is None
    assert config.load(env={"ONDEMAND_ADMIN_LISTEN": "127.0.0.1:8091"}).admin_listen_host_port == ("127.0.0.1", 8091)
    with pytest.raises(ConfigError, match="admin_listen"):
        config.load(env={}, overrides={"admin_listen": "8091"})


async def test_a_stream_to_a_client_that_stops_reading_pauses_the_engine_and_resumes(ready):
    """Through the whole gateway: a long stream to a client that reads nothing for a while (the
    engine is paused meanwhile), then reads: every event arrives, once, in order."""
    server, _ = ready
    dep = await server.add("long", 4, "--max-model-len", "200000")
    await server.deployer.restart(dep)
    body = orjson.dumps({"model": "LONG", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 100000, "ignore_eos": True})  # about 10 MB: past every buffer
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server), limit=1 << 26)
    try:
        writer.write(_gw(server, dep, body=body))
        await writer.drain()
        await asyncio.sleep(1.0)  # not reading: the kernel buffers fill, the gateway pauses the engine
        data = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 60)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    body, at = bytearray(), 0
    while True:  # the chunked framing off: the chunks need not end where the events do
        eol = rest.index(b"\r\n", at)
        n = int(rest[at:eol], 16)
        if n == 0:
            break
        body += rest[eol + 2:eol + 2 + n]
        at = eol + 2 + n + 2
    events = [line for line in bytes(body).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    tokens = [c for e in events[:-1] if (c := orjson.loads(e[6:])["choices"][0]["delta"].get("content"))]
    assert tokens == ["tok0"] + [f" tok{i}" for i in range(1, 100000)]  # every one, once, in order


# --- issue 40: aiohttp's refusals end their connection, after the rest of the body --------------

MiB = 2 ** 20


async def test_the_admin_apis_413_and_401_reach_httpx_and_end_the_connection(server):
    """httpx writes the whole body before it reads: aiohttp's 413 (17 MiB) and its 401 (a wrong
    token on 2 MiB) arrive, and say Connection: close (a refused request keeps no connection)."""
    import httpx2
    url = f"{server.url}/api/deployments"
    async with httpx2.AsyncClient(timeout=30) as client:
        for token, size, status, code in ((server.token, 17 * MiB, 413, "request_too_large"),
                                          ("wrong", 2 * MiB, 401, "invalid_admin_token")):
            r = await client.post(url, content=b"{" + b" " * (size - 2) + b"}",
                                  headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            assert (r.status_code, r.json()["error"]["code"]) == (status, code)
            assert r.headers["connection"] == "close"


async def test_after_an_admin_request_a_request_line_without_a_version_is_400(server):
    """aiohttp read it as HTTP/0.9 and answered "HTTP/0.9 401"."""
    answers = _answers(await _talk(server, _admin(server) + b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"))
    assert [a[0] for a in answers] == [200, 400] and _code(answers[1]) == "invalid_request"


async def _keep_sending(writer, chunk: bytes, pause: float) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):  # closed under us (uvloop says RuntimeError)
        while True:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(pause)


@pytest.mark.parametrize("bound", ["time", "size"])
async def test_aiohttps_read_of_a_refused_body_is_bounded(server, bound):
    """After its 401, aiohttp reads and drops the rest of the body (its lingering) for a second
    (``lingering_s``; it was 10 s) and at most ``linger_max_bytes`` (it had no bound in size),
    then closes, however long the client goes on sending."""
    if bound == "size":
        server.set_limits(lingering_s=30, linger_max_bytes=MiB)
    raw = _admin(server, "/dgxmm/api/deployments", method="POST").replace(server.token.encode(), b"wrong")
    raw = raw.replace(b"Content-Length: 0", b"Content-Length: %d" % 2 ** 40)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()  # before the answer: its lingering starts after
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 401") and b"Connection: close" in head
        sending = asyncio.ensure_future(_keep_sending(writer, b" " * (65536 if bound == "size" else 1024),
                                                      0 if bound == "size" else 0.05))
        try:
            await wait_for(lambda: server.http.front.open.total == 0, timeout=20, what="the connection closed")
        finally:
            sending.cancel()
    finally:
        writer.close()
    assert 0.9 <= loop.time() - t0 < 5 if bound == "time" else loop.time() - t0 < 10
