"""One request and its answer on the lean front (ondemand/http/cycle.py's ``Call``): the body
as the gateway reads it (Expect: 100-continue; reading paused past the high-water mark), the
answer's framing (HTTP/1.0, chunked, none for a 204 or a HEAD) and whether the connection
carries the next request after it, the writes that wait for a slow client, the head's lines
(as aiohttp's), and the path as observers read it. Against a whole server on loopback, raw
sockets where the framing matters.

The tests marked ``uvloop`` run on both loops (flow control is the transports' business)."""
import asyncio
import email.utils
import time

import orjson
import pytest
from engine_double import Engine, gateway_requests, gateway_to, not_ours
from helpers import wait_for
from raw_http import admin, connection, port, read_answer, req, writes_stalled

from ondemand.app import GATEWAY

# --- the request's body ---------------------------------------------------------------------------

@pytest.mark.uvloop
async def test_expect_100_continue_is_answered_when_the_gateway_reads_the_body(ready):
    server, dep = ready
    async with connection(server) as (reader, writer):
        head, _, body = req(server, dep, "Expect: 100-continue").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        status, _, _ = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK"
        # Refused before the body is read: no 100, the answer at once.
        writer.write(req(server, dep, "Expect: 100-continue", key="wrong").partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
        status, headers, _ = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 401")


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
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    try:
        writer.write(req(server, dep, body=body))
        await writes_stalled(writer)  # the client has written what the kernel and the server take
        release.set()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()
        gateway.handle = handle
    assert head.startswith(b"HTTP/1.1 ") and held and held[0] < 2 * 2**20, held


@pytest.mark.uvloop
async def test_a_413_before_the_body_came_is_answered_at_once_and_the_connection_ends(ready):
    """Refused before its body came (Content-Length over the limit): 413 at once, and the
    connection ends with it (issue 29): the answer and a FIN at once; the rest of such a body,
    perhaps endless, is read and dropped only for the bounded lingering (issue 40)."""
    server, dep = ready
    server.app[GATEWAY].max_body = 1000
    big = b"{" + b" " * 5000 + b"}"
    async with connection(server) as (reader, writer):
        head, _, _ = req(server, dep, body=big).partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n" + big[:100])
        status, headers, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 413") and orjson.loads(body)["error"]["code"] == "request_too_large"
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 3) == b""  # the FIN


# --- the answer -----------------------------------------------------------------------------------

@pytest.mark.uvloop
async def test_http_1_0_gets_a_1_0_answer_and_the_connection_ends(ready):
    server, dep = ready
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, version="1.0"))
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.0 200 OK" and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    async with connection(server) as (reader, writer):  # a streamed answer: no chunking in 1.0
        stream = orjson.dumps({"model": "A", "stream": True, "messages": [{"role": "user", "content": "x"}]})
        writer.write(req(server, dep, version="1.0", body=stream))
        status, headers, body = await read_answer(reader)
        assert status == b"HTTP/1.0 200 OK" and "transfer-encoding" not in headers
        assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.uvloop
async def test_a_streamed_answer_is_chunked_and_the_connection_kept(server):
    dep = await server.add("a", 10, "--token-delay", "0.02")  # still coming when its head is passed on
    await server.deployer.restart(dep)
    stream = orjson.dumps({"model": "A", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    async with connection(server) as (reader, writer):
        for _ in range(2):
            writer.write(req(server, dep, body=stream))
            status, headers, body = await read_answer(reader)
            assert status == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
            assert headers["content-type"].startswith("text/event-stream") and body.endswith(b"data: [DONE]\n\n")


@pytest.mark.uvloop
async def test_a_204_and_an_answer_to_head_keep_the_clients_connection(tmp_path):
    """Neither has a body, so neither's end needs the connection's: the client's next request
    goes on the same connection (they were answered with Connection: close)."""
    async def answer(req, writer):
        if await not_ours(req, writer):
            return
        if req["method"] == "HEAD":  # an engine's HEAD answer without a length
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
    async with Engine(answer) as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        host, port = url.split("/")[2].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            auth = f"Authorization: Bearer {server.key}\r\n"
            for method, path, body in (("POST", f"/dgxmm/ondemand/{a}/v1/chat/completions", b"{}"),
                                       ("HEAD", f"/dgxmm/ondemand/{a}/v1/models/A", b""),
                                       ("POST", f"/dgxmm/ondemand/{a}/v1/chat/completions", b"{}")):
                writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).lower()
                assert head.startswith(b"http/1.1 204" if method == "POST" else b"http/1.1 200"), head
                assert b"connection: close" not in head and b"transfer-encoding" not in head
        finally:
            writer.close()
        assert len(gateway_requests(eng)) == 3


async def test_a_stream_to_a_client_that_stops_reading_pauses_the_engine_and_resumes(server):
    """Through the whole gateway: a long stream to a client that reads nothing for a while (its
    transport's reading paused: the kernel's buffers fill, as they grow only as it reads): the
    answer's writes wait for it, and the gateway stops reading the engine meanwhile; then the
    client reads: every event arrives, once, in order."""
    dep = await server.add("long", 4, "--max-model-len", "200000")
    await server.deployer.restart(dep)
    body = orjson.dumps({"model": "LONG", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "max_tokens": 100000, "ignore_eos": True})  # about 17 MB: past every buffer
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server), limit=1 << 26)

    def engine_paused() -> bool:
        pool = server.app[GATEWAY].upstreams.pool(dep)
        return pool is not None and any(conn.flow.read_paused for conn in pool.conns)
    try:
        writer.transport.pause_reading()  # not reading (its StreamReader would take all 17 MB)
        writer.write(req(server, dep, body=body))
        await writer.drain()
        await wait_for(engine_paused, timeout=30, what="the gateway to stop reading the engine")
        writer.transport.resume_reading()
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


async def test_the_heads_date_and_server_lines_are_aiohttps(server):
    """Both stacks' answers look alike: the lean front's head (here a gateway's 404: no such
    deployment) carries the Server line aiohttp's answers do (an admin request's), and a Date
    of the same form, now."""
    async with connection(server) as (reader, writer):
        writer.write(req(server, 999))
        gateway = await read_answer(reader)
        writer.write(admin(server))  # the connection is aiohttp's from this request on
        aio = await read_answer(reader)
    assert gateway[0].startswith(b"HTTP/1.1 404") and aio[0] == b"HTTP/1.1 200 OK"
    assert gateway[1]["server"] == aio[1]["server"] and " aiohttp/" in gateway[1]["server"]
    for date in (gateway[1]["date"], aio[1]["date"]):
        assert date.endswith(" GMT"), date
        assert abs(email.utils.parsedate_to_datetime(date).timestamp() - time.time()) < 60, date

@pytest.mark.uvloop
async def test_a_call_tells_its_decoded_path_as_aiohttp_does(ready):
    """Observers of the gateway (the LiteLLM suite's spy) read ``call.path``."""
    server, dep = ready
    seen = []
    gateway = server.app[GATEWAY]
    handle = gateway.handle

    async def spy(call):
        seen.append(call.path)
        await handle(call)
    gateway.handle = spy
    target = f"/dgxmm/ondemand/{dep}/v1/models"
    async with connection(server) as (reader, writer):
        writer.write(req(server, dep, method="GET", path=target.replace("models", "mod%65ls")))
        await read_answer(reader)
        writer.write(req(server, dep, method="GET", path=target))
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
    assert seen == [f"/dgxmm/ondemand/{dep}/v1/models"] * 2
