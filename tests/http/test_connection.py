"""One keep-alive connection to an engine (ondemand/http/connection.py) and its answer: the
head and the framing as llhttp parses them (chunked, close-delimited, none for HEAD, 204 and
304, an interim 1xx), the body passed on as it arrives and paused for a slow reader, when the
connection may serve again and when it is closed (the engine's close, a malformed or broken
answer, an answer before the whole request was sent, a hang-up), and which failures are the
stale keep-alive race the pool may send again. Against engine doubles on loopback
(engine_double.py), through the pools and through the whole gateway.

Every test here runs on asyncio's loop and on uvloop, the one ondemand serves on: the
connection is a Protocol, and the two loops' transports differ in when they call it
(conftest.py's pytest_asyncio_loop_factories reads this)."""
import asyncio
import contextlib

import aiohttp
import pytest
from engine_double import JSON, Engine, fetch, gateway_requests, gateway_to, not_ours, ok_answer, pool_of
from helpers import wait_for

from ondemand.http import pool
from ondemand.http.pool import PayloadError, UpstreamError, Upstreams

LOOPS = ("asyncio", "uvloop")


# --- the answer's framing -------------------------------------------------------------------------

async def _chunked(req, writer):
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(3):
        data = b"data: %d\n\n" % i
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        await asyncio.sleep(0.01)  # the engine's pace: chunks arrive apart
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def test_chunked_body_is_decoded_and_the_connection_kept(ups):
    async with Engine(_chunked) as eng:
        for _ in range(2):
            status, headers, body = await fetch(ups, eng.url)
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert eng.accepted == 1


async def test_chunked_pieces_pass_as_they_arrive(ups):
    go = asyncio.Event()

    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
    async with Engine(answer) as eng:
        lease = ups.open(1, eng.url)
        r = await lease.request("POST", "/v1/x", JSON, b"{}")
        assert await asyncio.wait_for(r.content.readany(), 5) == b"first"  # before the rest exists
        go.set()
        assert await r.content.read() == b"second"
        r.release()
        lease.end()
        assert pool_of(ups).idle


async def test_close_delimited_body_then_a_new_connection(ups):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        for _ in range(2):
            assert (await fetch(ups, eng.url))[2] == b"until the end"
        assert eng.accepted == 2
        await wait_for(lambda: pool_of(ups).size == 0, what="closed connection left the pool")


async def test_connection_close_from_the_engine_is_not_reused(ups):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.2)  # the engine double lingers: the gateway must not send on it anyway
    async with Engine(answer) as eng:
        for _ in range(2):
            assert (await fetch(ups, eng.url))[2] == b"ok"
        assert eng.accepted == 2


async def test_head_has_no_body_and_keeps_the_connection(ups):
    async with Engine() as eng:
        status, headers, body = await asyncio.wait_for(fetch(ups, eng.url, method="HEAD", body=None), 5)
        assert status == 200 and headers["Content-Length"] == "12" and body == b""
        assert (await fetch(ups, eng.url))[2] == b'{"ok": true}'
        assert eng.accepted == 1


async def test_204_and_304_have_no_body(ups):
    async def answer(req, writer):
        code = b"204 No Content" if req["target"] == "/a" else b"304 Not Modified"
        writer.write(b"HTTP/1.1 " + code + b"\r\nX-A: 1\r\n\r\n")
        await writer.drain()
    async with Engine(answer) as eng:
        assert await asyncio.wait_for(fetch(ups, eng.url, target="/a"), 5) == (204, {"X-A": "1"}, b"")
        status, _, body = await asyncio.wait_for(fetch(ups, eng.url, target="/b", method="GET", body=None), 5)
        assert (status, body) == (304, b"")
        assert eng.accepted == 1


async def test_an_interim_answer_is_passed_over_for_the_final_one(ups):
    """An engine (or a proxy in front of it) may send 1xx answers before its answer: the
    answer's head is the final one's, without the interim one's headers, its body follows,
    and the connection serves on."""
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
        await writer.drain()
        await ok_answer(req, writer)
    async with Engine(answer) as eng:
        for _ in range(2):
            status, headers, body = await asyncio.wait_for(fetch(ups, eng.url), 5)
            assert (status, body) == (200, b'{"ok": true}')
            assert sorted(headers) == ["Content-Length", "Content-Type"]
        assert eng.accepted == 1

# --- failures: which the pool may send again ------------------------------------------------------

async def test_an_answer_after_the_first_byte_is_never_retried(ups):
    async def answer(req, writer):
        if len(eng.requests) == 1:
            await ok_answer(req, writer)
            return
        writer.write(b"HTTP/1.1 200")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        with pytest.raises(UpstreamError):
            await fetch(ups, eng.url)
        assert len(eng.requests) == 2


async def test_a_request_the_engine_worked_on_is_never_sent_again(ups, monkeypatch):
    # The engine read the request, worked on it (a generation), then its connection closed
    # with no answer (a crash, a killed worker): sending it again could run it twice.
    monkeypatch.setattr(pool, "STALE_WINDOW", 0.1)

    async def answer(req, writer):
        if len(eng.requests) == 2:
            await asyncio.sleep(0.3)  # the engine double's behaviour: working on it (> STALE_WINDOW)
            return False              # then gone, no byte of an answer
        await ok_answer(req, writer)
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await fetch(ups, eng.url, body=b'{"prompt": "expensive"}')
        assert [r["body"] for r in eng.requests] == [b"{}", b'{"prompt": "expensive"}']  # once
        assert eng.accepted == 1


@pytest.mark.parametrize("answer_bytes", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
])
async def test_engine_breaking_off_mid_body_is_an_error(ups, answer_bytes):
    async def answer(req, writer):
        writer.write(answer_bytes)
        await writer.drain()
        await asyncio.sleep(0.05)  # the engine double's behaviour: a moment, then it breaks off
        return False
    async with Engine(answer) as eng:
        with pytest.raises(PayloadError):
            await fetch(ups, eng.url)
        await wait_for(lambda: pool_of(ups).size == 0, what="connection gone")


async def test_a_malformed_answer_is_an_upstream_error(ups):
    async def answer(req, writer):
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()
        # and keeps the connection (it reads on for a next request): the gateway must close it
    async with Engine(answer) as eng:
        with pytest.raises(UpstreamError):
            await fetch(ups, eng.url)
        await wait_for(lambda: eng.closed_by_peer == 1 or eng.open == 0, what="closed by the gateway")


# --- the end of an exchange: back to the pool, or closed ------------------------------------------

async def test_releasing_an_unread_answer_closes_the_engine_connection(ups):
    """A client that hangs up mid-answer: the engine sees its connection close (that stops vLLM)."""
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        assert await req["reader"].read(1) == b""  # waits for the gateway to close
        eng.closed_by_peer += 1
        return False
    async with Engine(answer) as eng:
        lease = ups.open(1, eng.url)
        r = await lease.request("POST", "/v1/x", JSON, b"{}")
        assert await r.content.readany() == b"hello"
        r.release()
        lease.end()
        await wait_for(lambda: eng.closed_by_peer == 1, what="engine connection closed")
        await wait_for(lambda: pool_of(ups).size == 0 and not pool_of(ups).conns)


async def test_back_pressure_pauses_reading_the_engine(ups):
    """A client that reads nothing: the pool stops reading the engine's socket (the engine's writes
    block) instead of buffering the whole answer."""
    sent = 0
    blocked = asyncio.Event()

    async def answer(req, writer):
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        while sent < 64 * 2**20:
            writer.write(b"10000\r\n" + piece + b"\r\n")
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
            except asyncio.TimeoutError:
                blocked.set()
                return False
            sent += len(piece)
    async with Engine(answer) as eng:
        lease = ups.open(1, eng.url)
        r = await lease.request("POST", "/v1/x", JSON, b"{}")
        await asyncio.wait_for(blocked.wait(), 10)
        assert sent < 16 * 2**20  # kernel buffers plus the StreamReader's 128 KiB, not 64 MiB
        assert r.content.buffered <= 4 * 2**20
        r.release()
        lease.end()


async def test_an_answer_before_the_whole_request_was_sent_closes_the_connection(ups):
    """An engine that answers (say 413) without reading a large body: the rest of that body must
    never be read by the engine as the next request on a reused connection."""
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)  # the engine double's behaviour: it reads nothing more for a while
        return False

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        eng.requests.append({})
        await answer(None, writer)
        writer.close()
    async with Engine() as eng:
        eng.server.close()
        eng.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{eng.server.sockets[0].getsockname()[1]}"
        lease = ups.open(1, url)
        r = await lease.request("POST", "/v1/x", JSON, b"x" * (32 * 2**20))
        assert r.status == 413 and await r.read() == b""
        r.release()
        lease.end()
        assert not pool_of(ups).idle


async def test_hang_up_during_a_big_upload_resets_the_engine_connection(ups):
    # The engine does not read the body (busy); the client hangs up. A plain close would wait
    # for the 32 MiB to flush first: the slot stays taken, the engine never sees a close.
    got_head = asyncio.Event()
    checked = asyncio.Event()
    closed = asyncio.Event()

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        got_head.set()
        await checked.wait()  # busy: reads nothing until the test has seen the slot come back
        try:
            while await reader.read(2**20):
                pass
        except ConnectionError:
            pass
        closed.set()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        t = asyncio.ensure_future(fetch(ups, url, body=b"z" * (32 * 2**20)))
        await got_head.wait()
        t.cancel()  # the client hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await t
        p = pool_of(ups)
        await wait_for(lambda: p.size == 0 and not p.conns, timeout=1, what="slot back at once")
        checked.set()
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        checked.set()
        server.close()


async def test_a_connection_lost_in_the_turn_it_was_handed_over_leaves_no_stray_error():
    import gc
    errors = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["message"]))
    ups = Upstreams(limit=1)
    try:
        async with Engine() as eng:
            lease = ups.open(1, eng.url)
            r = await lease.request("POST", "/v1/x", JSON, b"{}")
            await r.read()
            waiting = asyncio.ensure_future(fetch(ups, eng.url))
            await wait_for(lambda: pool_of(ups).waiters)
            [conn] = pool_of(ups).conns  # limit=1: the answer's, the only one
            r.release()             # handed to the waiter ...
            conn.transport.close()  # ... and closed in the same turn
            lease.end()
            assert (await waiting)[0] == 200  # sent on a new connection
            del conn, r
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0.01)
            assert errors == []  # no "Future exception was never retrieved"
    finally:
        await ups.close()
        loop.set_exception_handler(None)


# --- through the gateway --------------------------------------------------------------------------

async def test_gateway_client_hang_up_mid_stream_closes_the_engine_connection(tmp_path):
    async def answer(req, writer):
        if await not_ours(req, writer):
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"c\r\ndata: one\n\n\r\n")
        await writer.drain()
        assert await req["reader"].read(1) == b""  # the gateway closes; the engine stops generating
        saw_close.set()
        return False
    saw_close = asyncio.Event()  # (the deployer's own requests to the engine close connections too)
    async with Engine(answer) as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        r = await http.post(url, json={"model": "A", "stream": True}, headers=server.auth())
        assert await r.content.readuntil(b"\n\n") == b"data: one\n\n"
        r.close()  # the client goes away
        await asyncio.wait_for(saw_close.wait(), 10)
        await wait_for(lambda: server.controller.inflight(a) == 0)


async def test_gateway_cuts_the_client_when_the_engine_breaks_off_a_sized_answer(tmp_path):
    async def answer(req, writer):
        if await not_ours(req, writer):
            return
        if len(gateway_requests(eng)) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"par")
            await writer.drain()
            await asyncio.sleep(0.05)  # the engine double's behaviour: a moment, then it breaks off
            return False
        await ok_answer(req, writer)
    async with Engine(answer) as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        async with http.post(url, json={"model": "A"}, headers=server.auth()) as r:
            assert r.status == 200 and r.headers["Content-Length"] == "100"
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(r.read(), 10)
        # and the next request gets a whole answer, in one piece with its length
        async with http.post(url, json={"model": "A"}, headers=server.auth()) as r:
            assert r.status == 200 and await r.read() == b'{"ok": true}' and r.headers["Content-Length"] == "12"
            assert r.headers["Content-Type"] == "application/json"
        await wait_for(lambda: server.controller.inflight(a) == 0)


async def test_gateway_passes_204_and_head_without_a_body(tmp_path):
    async def answer(req, writer):
        if await not_ours(req, writer):
            return
        if req["method"] == "HEAD":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\nX-Engine: 1\r\n\r\n")
        await writer.drain()
    async with Engine(answer) as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        async with http.post(url, json={"model": "A"}, headers=server.auth()) as r:
            assert r.status == 204 and r.headers["X-Engine"] == "1" and await r.read() == b""
        async with http.head(server.gw(a, "models/A"), headers=server.auth()) as r:
            assert r.status == 200 and r.headers["Content-Length"] == "12"
        assert len({r["conn"] for r in gateway_requests(eng)}) == 1
