"""The lean front's connection (ondemand/http/protocol.py): llhttp parses, the gateway's
requests are answered one at a time and in order without aiohttp's application, and a
connection's first request that is not the gateway's hands it to aiohttp for good, with its
bytes (design.md, "The HTTP layer"); refusals come after the answers owed before them, and a
refused request ends its connection, its client reading the answer first (issue 40). Against a
whole server on loopback: raw sockets where the framing matters, httpx where its way of sending
does.

The tests marked ``uvloop`` run on both loops: handing a connection over to aiohttp
(``set_protocol``) and flow control are the transports' own business."""
import asyncio

import orjson
import pytest
from helpers import wait_for
from raw_http import (
    MiB,
    admin,
    connection,
    error_code,
    forwarded,
    gateway_url,
    keep_sending,
    parse_answers,
    port,
    read_answer,
    refused_then_closed,
    req,
    talk,
    until_closed,
)

from ondemand.app import CONTROLLER, GATEWAY
from ondemand.http.refusals import REFUSALS

# --- one stack per connection: the hand-off to aiohttp --------------------------------------------

@pytest.mark.uvloop
async def test_gateway_then_admin_hands_the_connection_to_aiohttp_for_good(ready, gateway_calls):
    """Gateway requests, then an admin request: from that request on the connection is
    aiohttp's; a gateway request after it is 421 misdirected_request (RFC 9110: retry on
    another connection), in the documented JSON, and never reaches the gateway."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        for _ in range(2):
            writer.write(req(server, dep))
            status, headers, body = await read_answer(reader)
            assert status == b"HTTP/1.1 200 OK" and orjson.loads(body)["object"] == "chat.completion"
        writer.write(admin(server))
        status, _, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and "hostname" in orjson.loads(body)
        writer.write(req(server, dep, "X-Request-Id: after-admin"))
        status, headers, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 421") and orjson.loads(body)["error"]["code"] == "misdirected_request"
        assert headers["content-type"].startswith("application/json")
    assert len(gateway_calls) == 2


@pytest.mark.uvloop
async def test_a_connection_that_starts_with_the_admin_api_stays_aiohttps(ready, gateway_calls):
    """The first request is aiohttp's (and a long one: the page); the admin requests after it
    are aiohttp's too; a gateway request is 421; a new connection serves it."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(admin(server, "/dgxmm/api/deployments"))
        status, _, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and isinstance(orjson.loads(body), (list, dict))
        writer.write(admin(server, "/dgxmm/ui/"))
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and b"<html" in body.lower()
        writer.write(req(server, dep))
        status, _, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 421")
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep))
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and len(headers["x-request-id"]) == 32
    assert len(gateway_calls) == 1


@pytest.mark.uvloop
async def test_an_admin_request_pipelined_behind_a_gateway_one_is_421_after_its_answer(ready, gateway_calls):
    """In one write: where the admin request begins is not known (llhttp tells no offsets), so
    it cannot be handed off with its bytes; the gateway's answer goes first, then 421, closed."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, "X-Request-Id: one") + admin(server) + req(server, dep))
        first, second = await read_answer(reader), await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert first[0] == b"HTTP/1.1 200 OK" and first[1]["x-request-id"] == "one"
    assert second[0].startswith(b"HTTP/1.1 421") and second[1]["connection"] == "close"
    assert orjson.loads(second[2])["error"]["code"] == "misdirected_request"
    assert len(gateway_calls) == 1


# --- the gateway's requests, one at a time --------------------------------------------------------

@pytest.mark.uvloop
async def test_pipelined_gateway_requests_wait_their_turn(ready):
    """Three in one write: one handler at a time, answers in order, nothing left behind."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(b"".join(req(server, dep, f"X-Request-Id: n{i}") for i in range(3)))
        ids = [(await read_answer(reader))[1]["x-request-id"] for _ in range(3)]
    assert ids == ["n0", "n1", "n2"]
    assert server.app[CONTROLLER].inflight(dep) == 0


async def test_an_early_answer_drops_a_body_past_the_high_water_mark_and_serves_on(ready):
    """A 404 (an unknown deployment, with the key: no refusal, so the connection is kept) before
    a 1 MiB body came: the body is read and dropped (reading is not paused for a body nobody
    will read), and the next request on the connection is answered."""
    server, dep = ready
    big = b"{" + b" " * 2**20 + b"}"
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    try:
        writer.write(req(server, 999, body=big) + req(server, dep, body=b"{}"))
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert first.startswith(b"HTTP/1.1 404") and b"onnection: close" not in first
        await asyncio.wait_for(reader.readuntil(b"}}"), 10)  # its JSON body
        second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert second.startswith(b"HTTP/1.1 400")  # {} is no chat request, but it was answered
    finally:
        writer.close()


@pytest.mark.uvloop
async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(ready):
    server, dep = ready
    server.set_limits(keepalive_timeout_s=0.4)
    async with connection(server) as (reader, writer):
        for _ in range(3):  # requests within the timeout keep it
            writer.write(req(server, dep))
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
            await asyncio.sleep(0.25)
        assert await asyncio.wait_for(reader.read(), 3) == b""


@pytest.mark.uvloop
async def test_a_client_gone_mid_stream_frees_its_slot(server):
    dep = await server.add("a", 10, "--token-delay", "0.05")
    await server.deployer.restart(dep)
    stream = orjson.dumps({"model": "A", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "x"}]})
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, body=stream))
        await asyncio.wait_for(reader.readuntil(b"data:"), 10)
        assert server.app[CONTROLLER].inflight(dep) == 1
    await wait_for(lambda: server.app[CONTROLLER].inflight(dep) == 0, timeout=5, what="the slot back")


# --- refusals, after the answers owed before them -------------------------------------------------

@pytest.mark.uvloop
async def test_malformed_requests_get_a_json_400(ready):
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, "Content-Length: 2"))
        status, headers, body = await read_answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_request"


@pytest.mark.uvloop
async def test_malformed_requests_are_logged_once_a_minute_with_their_count(ready, monkeypatch, caplog):
    server, dep = ready
    refusals = REFUSALS
    monkeypatch.setattr(refusals, "_last", -float("inf"))
    monkeypatch.setattr(refusals, "suppressed", 0)
    for _ in range(5):
        async with connection(server) as (reader, writer):
            writer.write(req(server, dep, "Content-Length: 2"))  # two Content-Lengths
            assert (await read_answer(reader))[0].startswith(b"HTTP/1.1 400")
    lines = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING" and "127.0.0.1" in lines[0].getMessage()
    assert refusals.suppressed == 4
    refusals._last -= 61  # a minute later: the next one is logged, with the count
    refusals.note("10.0.0.9", "Duplicate Content-Length")
    assert caplog.records[-1].getMessage() == ("refused a malformed request from 10.0.0.9 (400): "
                                               "Duplicate Content-Length (4 more since the last such line)")


@pytest.mark.uvloop
async def test_a_malformed_request_behind_a_good_one_is_refused_after_its_answer(ready):
    """Pipelined in one write: the good request's handler is already under way when llhttp
    refuses the next head, so its answer goes first, then the 400, then the close; the
    engine sees only the good one."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, "X-Request-Id: good") + req(server, dep, "Content-Length: 1"))
        first, second = await read_answer(reader), await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert first[0] == b"HTTP/1.1 200 OK" and first[1]["x-request-id"] == "good"
    assert second[0].startswith(b"HTTP/1.1 400") and orjson.loads(second[2])["error"]["code"] == "invalid_request"


@pytest.mark.uvloop
async def test_a_chunked_body_that_breaks_while_the_gateway_reads_it_is_400_invalid_body(ready):
    server, dep = ready
    head = req(server, dep, "Transfer-Encoding: chunked", body=b"").replace(b"Content-Length: 0\r\n", b"")
    gateway = server.app[GATEWAY]
    handle, reading = gateway.handle, asyncio.Event()

    async def entered(call):
        reading.set()
        await handle(call)
    gateway.handle = entered
    try:
        async with connection(server) as (reader, writer):
            writer.write(head + b"2\r\n{}")
            await asyncio.wait_for(reading.wait(), 5)  # the handler has begun: it waits for the rest
            writer.write(b"\r\nzz\r\n")
            status, headers, body = await read_answer(reader)
    finally:
        gateway.handle = handle
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_body"
    assert server.app[CONTROLLER].inflight(dep) == 0


@pytest.mark.uvloop
async def test_an_upgrade_request_is_refused_after_the_answers_before_it(ready, gateway_calls):
    """Nothing here switches protocols: an Upgrade head (its body after it) is 400 in the
    documented JSON once the answers before it are out, and the connection closes (issue 23:
    aiohttp lost the requests pipelined behind one)."""
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep))
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        writer.write(req(server, dep, "Connection: Upgrade", "Upgrade: h2c") + req(server, dep))
        status, headers, body = await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_request"
    assert len(gateway_calls) == 1


async def test_transfer_encoding_identity_on_a_gateway_get_is_400_and_not_forwarded(ready):
    server, dep = ready
    before = len(await forwarded(server, dep))
    data = req(server, dep, "Transfer-Encoding: identity", method="GET", route="models/A") + req(server, dep)
    answers = parse_answers(await talk(server, data))
    assert [a[0] for a in answers] == [400] and error_code(answers[0]) == "invalid_request"
    assert len(await forwarded(server, dep)) == before


# --- issue 40: a refused request ends its connection, and its client reads the answer -------------

@pytest.mark.uvloop
async def test_a_413_reaches_a_client_that_sends_its_whole_body_before_it_reads(server):
    """httpx (the OpenAI SDK's client) writes the whole body before it reads: the server used
    to close as soon as it answered 413, the client's kernel got a reset for the bytes still
    coming and dropped the answer (httpx raised ReadError, 9 times in 9). Now the rest is read
    and dropped (a second at most, 64 MiB at most) and the 413 arrives; a raw socket that
    writes 32 MiB before it reads gets it too. (No deployment: the size is checked first.)"""
    import httpx2
    headers = {"Authorization": f"Bearer {server.key}", "Content-Type": "application/json"}
    async with httpx2.AsyncClient(timeout=30) as client:
        for size in (16 * MiB + 40, 17 * MiB, 32 * MiB):
            r = await client.post(gateway_url(server), content=b"{" + b" " * (size - 2) + b"}", headers=headers)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", size
            assert r.headers["connection"] == "close"
    body = b" " * (32 * MiB)
    async with connection(server) as (reader, writer):
        head = (f"POST /dgxmm/ondemand/999/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                f"{server.key}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        writer.write(head + body)
        await asyncio.wait_for(writer.drain(), 30)  # all of it sent before reading a byte
        status, headers, answer = await read_answer(reader)
    assert status.startswith(b"HTTP/1.1 413") and orjson.loads(answer)["error"]["code"] == "request_too_large"


@pytest.mark.uvloop
async def test_a_wrong_key_on_a_2_mib_body_reads_its_401_and_the_connection_ends(server):
    """A refused request ends its connection (Connection: close), and its body is read and
    dropped first, so httpx, which sends all 2 MiB before it reads, gets the 401."""
    import httpx2
    async with httpx2.AsyncClient(timeout=30) as client:
        for _ in range(2):
            r = await client.post(gateway_url(server), content=b"{" + b" " * (2 * MiB) + b"}",
                                  headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["connection"] == "close"


@pytest.mark.uvloop
async def test_a_refused_request_ends_its_connection(ready):
    """Issue 40: a refused request (the peer guard's 404, a 401, a 429 of the rate limit, a
    400) held its connection for the keep-alive time, so refused clients could fill the cap;
    now only a request that passed the checks keeps its connection."""
    server, dep = ready
    cases = {
        "peer guard": (req(server, dep, "X-Forwarded-For: 10.0.0.1"), 404, "not_found"),
        "key": (req(server, dep, key="wrong"), 401, "invalid_api_key"),
        "path": (req(server, dep, path=f"/dgxmm/ondemand/{dep}/v1/../v1/models", method="GET"), 400, "invalid_path"),
        "json": (req(server, dep, body=b"[]"), 400, "invalid_json"),
    }
    for name, (raw, want, code) in cases.items():
        status, _, body = await refused_then_closed(server, raw)
        assert (status.split()[1], orjson.loads(body)["error"]["code"]) == (str(want).encode(), code), name
    limiter = server.app[GATEWAY].limiter
    for _ in range(20):
        limiter.fail("127.0.0.5")
    status, _, body = await refused_then_closed(server, req(server, dep), peer="127.0.0.5")
    assert status.startswith(b"HTTP/1.1 429") and orjson.loads(body)["error"]["code"] == "rate_limited"
    async with connection(server) as (reader, writer):  # a request that passed the checks keeps it
        for _ in range(2):
            writer.write(req(server, dep))
            status, headers, _ = await read_answer(reader)
            assert status == b"HTTP/1.1 200 OK" and "connection" not in headers


@pytest.mark.uvloop
@pytest.mark.parametrize("raw", [b"GET /\r\n", b"GET /\r\n\r\n", b"GET /dgxmm/ondemand/1/v1/models\r\n\r\n",
                                 b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"])
async def test_a_request_line_without_a_version_is_400_and_closed(server, raw):
    """llhttp reads it as HTTP/0.9, and it was answered so ("HTTP/0.9 401"); a bare one waited
    for the head timeout."""
    status, _, body = await refused_then_closed(server, raw)
    assert status.startswith(b"HTTP/1.1 400") and orjson.loads(body)["error"]["code"] == "invalid_request"


@pytest.mark.uvloop
@pytest.mark.parametrize("pieces, status", [
    ([b"GET /dgx", b"mm/api/", b"host", b"\r\n"], b"HTTP/1.1 400"),  # the line ends in a read of its own
    ([b"\r", b"\nGET /", b"\r\n"], b"HTTP/1.1 400"),  # an empty line first, a byte at a time
    ([b"GET /dgxmm/healthz HT", b"TP/1.1\r", b"\nHost: x\r\n", b"Connection: close\r\n\r\n"], b"HTTP/1.1 200"),
])
async def test_a_request_line_in_pieces_is_judged_when_it_ends(server, pieces, status):
    """The line is looked at in the read that ends it (not joined again at every byte): one
    without a version is 400 at once, one with it read on, whatever the pieces."""
    async with connection(server) as (reader, writer):
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        got, _, _ = await asyncio.wait_for(read_answer(reader), 5)
    assert got.startswith(status), got


async def test_a_request_line_sent_a_byte_at_a_time_is_read_once_it_ends(server, monkeypatch):
    """Its bytes are joined and read only in the read that brings its line break, not at every
    byte (a long line sent a byte at a time would otherwise cost its length squared)."""
    from ondemand.http import refusals
    calls = []
    real = refusals.line_without_version
    monkeypatch.setattr(refusals, "line_without_version", lambda line: calls.append(1) or real(line))
    async with connection(server) as (reader, writer):
        for byte in b"GET /dgxmm/healthz?" + b"x" * 200 + b" HTTP/1.1\r\n":
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"Host: x\r\nConnection: close\r\n\r\n")
        got, _, _ = await asyncio.wait_for(read_answer(reader), 5)
    assert got.startswith(b"HTTP/1.1 200") and len(calls) <= 2, (got, len(calls))


@pytest.mark.uvloop
async def test_the_rest_of_a_refused_body_is_read_for_a_bounded_time_and_size(server):
    """What comes after the answer is read and dropped for ``lingering_s`` and
    ``linger_max_bytes`` at most, then the connection closes: a client that keeps sending
    (a body of a TiB) holds it no longer."""
    head = (f"POST /dgxmm/ondemand/999/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{server.key}\r\nContent-Length: {2 ** 40}\r\n\r\n").encode()

    for limits, chunk, pause, bound in (({"lingering_s": 0.5}, b" " * 1024, 0.05, (0.4, 5)),  # time
                                        ({"lingering_s": 30, "linger_max_bytes": MiB}, b" " * 65536, 0, (0, 10))):
        server.set_limits(**limits)
        async with connection(server) as (reader, writer):
            t0 = asyncio.get_running_loop().time()  # before the answer: its lingering starts after
            writer.write(head)
            status, headers, _ = await read_answer(reader)
            assert status.startswith(b"HTTP/1.1 413") and headers["connection"] == "close"
            sending = asyncio.ensure_future(keep_sending(writer, chunk, pause))
            try:
                took = await until_closed(server, t0)
            finally:
                sending.cancel()
        assert bound[0] <= took < bound[1], (limits, took)
