"""The engine connection pool (ondemand.http.forward) against real loopback servers: raw asyncio
engine doubles that count their connections and answer exactly as each test scripts."""
import asyncio
import contextlib
import random

import aiohttp
import pytest
from helpers import wait_for

from ondemand.http import pool as forward
from ondemand.http.forward import request_lines, response_lines
from ondemand.http.pool import PayloadError, UpstreamError, Upstreams

JSON = b"Content-Type: application/json\r\n"  # the pool takes the header lines, encoded (forward.request_lines)


# Every test here runs on asyncio's loop and on uvloop, the one ondemand serves on: the
# pool is a Protocol, and the two loops' transports differ in when they call it
# (conftest.py's pytest_asyncio_loop_factories reads this).
LOOPS = ("asyncio", "uvloop")


class Engine:
    """An HTTP/1.1 engine double on loopback. ``answer(req, writer)`` writes the answer
    (an async function of the test's); it returns False to close the connection."""

    def __init__(self, answer=None):
        self.answer = answer or ok_answer
        self.accepted = 0
        self.open = 0            # connections open right now (server side)
        self.closed_by_peer = 0  # connections the gateway closed (EOF seen while reading)
        self.requests: list[dict] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.accepted += 1
        conn = self.accepted  # this connection's number (a later accept must not renumber it)
        self.open += 1
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_peer += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ")
                headers = [tuple(x.split(": ", 1)) for x in lines[1:] if x]
                length = int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
                body = await reader.readexactly(length) if length else b""
                req = dict(method=method, target=target, headers=headers, body=body, raw=head, conn=conn,
                           reader=reader)
                self.requests.append(req)
                if await self.answer(req, writer) is False:
                    return
        finally:
            self.open -= 1
            writer.close()


async def ok_answer(req, writer, body=b'{"ok": true}'):
    if req["method"] == "HEAD":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
    await writer.drain()


async def fetch(ups, url, method="POST", target="/v1/chat/completions", body=b"{}", dep=1, headers=JSON):
    lease = ups.open(dep, url)
    try:
        r = await lease.request(method, target, headers, body)
        try:
            return r.status, r.headers, await r.read()
        finally:
            r.release()
    finally:
        lease.end()


@pytest.fixture
async def ups():
    u = Upstreams()
    yield u
    await u.close()


def pool(ups, dep=1):
    p = ups.pool(dep)
    assert p is not None, f"no pool for deployment {dep}"
    return p


async def test_the_request_as_the_engine_sees_it(ups):
    async with Engine() as eng:
        await fetch(ups, eng.url, body=b'{"a": 1}',
                    headers=b"Content-Type: application/json\r\nAccept-Encoding: identity\r\nX-Custom: \xc3\xa9\r\n")
        await fetch(ups, eng.url, body=b"", headers=b"")
        await fetch(ups, eng.url, method="GET", target="/v1/models/A", body=None, headers=b"")
    port = eng.url.rsplit(":", 1)[1]
    assert eng.requests[0]["raw"] == (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"Content-Type: application/json\r\nAccept-Encoding: identity\r\nX-Custom: \xc3\xa9\r\n"
        b"Content-Length: 8\r\n\r\n")
    assert eng.requests[0]["body"] == b'{"a": 1}'
    # a body without a Content-Type gets none (FastAPI then reads it as JSON); a GET has no body
    assert eng.requests[1]["headers"][1:] == [("Content-Length", "0")]
    assert eng.requests[2]["headers"][1:] == []
    assert eng.accepted == 1


def test_a_line_break_in_a_header_is_refused():
    # llhttp refuses CR and LF in names and values; the header lines count them all the same.
    for raw in ([(b"X-A", b"1\r\nX-Injected: 2")], [(b"X-A\n", b"1")], [(b"X-A", b"1\r")]):
        with pytest.raises(ValueError):
            request_lines(raw, "rid")
        with pytest.raises(ValueError):
            response_lines(raw)


def test_the_header_rule_on_raw_headers():
    raw = [(b"Host", b"gw"), (b"Authorization", b"Bearer k"), (b"Content-Type", b"application/json"),
           (b"X-Request-Id", b"theirs"), (b"Connection", b"keep-alive, X-Private"), (b"x-private", b"1"),
           (b"Sec-WebSocket-Key", b"k"), (b"X-Forwarded-Host", b"h"), (b"x-dgxmm-health-check", b"1"),
           (b"Accept-Encoding", b"gzip"), (b"X-Custom", b"\xc3\xa9")]
    answer = [(b"Server", b"uvicorn"), (b"Date", b"x"), (b"Content-Length", b"2"), (b"x-request-id", b"e"),
              (b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked"), (b"X-Engine", b"1")]
    for _ in range(2):  # the lines are remembered: the second time is the same
        assert request_lines(raw, "mine") == (b"Content-Type: application/json\r\nX-Custom: \xc3\xa9\r\n"
                                              b"Accept-Encoding: identity\r\nX-Request-Id: mine\r\n")
        assert response_lines(answer) == b"Content-Type: application/json\r\nX-Engine: 1\r\n"
    # without the Connection header, the header it named is an end-to-end one again
    assert request_lines([p for p in raw if p[0] != b"Connection"], "r").count(b"x-private: 1") == 1


async def test_one_connection_serves_sequential_requests(ups):
    async with Engine() as eng:
        for _ in range(5):
            status, headers, body = await fetch(ups, eng.url)
            assert (status, body) == (200, b'{"ok": true}')
        assert eng.accepted == 1 and len(eng.requests) == 5
        assert pool(ups).size == 1 and len(pool(ups).idle) == 1


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
        assert pool(ups).idle


async def test_close_delimited_body_then_a_new_connection(ups):
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        for _ in range(2):
            assert (await fetch(ups, eng.url))[2] == b"until the end"
        assert eng.accepted == 2
        await wait_for(lambda: pool(ups).size == 0, what="closed connection left the pool")


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


async def test_an_idle_connection_the_engine_closes_leaves_the_pool_at_once(ups):
    async def answer(req, writer):
        await ok_answer(req, writer)
        await asyncio.sleep(0.05)  # the engine double's behaviour: it closes an idle connection
        return False  # uvicorn's keep-alive timeout, shortened
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        p = pool(ups)
        await wait_for(lambda: p.size == 0 and not p.idle and not p.conns, timeout=2, what="dropped")
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 2


async def test_stale_keep_alive_race_is_retried_once_on_a_fresh_connection(ups):
    async def answer(req, writer):
        if req["conn"] == 1 and len(eng.requests) == 2:
            return False  # closes the reused connection with the request unanswered
        await ok_answer(req, writer)
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        assert (await fetch(ups, eng.url, body=b'{"n": 2}'))[0] == 200
        assert [(r["conn"], r["body"]) for r in eng.requests] == [(1, b"{}"), (1, b'{"n": 2}'), (2, b'{"n": 2}')]


async def test_a_fresh_connection_that_fails_is_reported_not_retried(ups):
    async def answer(req, writer):
        return False
    async with Engine(answer) as eng:
        with pytest.raises(UpstreamError):
            await fetch(ups, eng.url)
        assert eng.accepted == 1
        await wait_for(lambda: pool(ups).size == 0, what="slot freed")


async def test_a_reused_connection_fails_twice_is_reported(ups):
    async def answer(req, writer):
        if len(eng.requests) == 1:
            await ok_answer(req, writer)
            return
        return False
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        with pytest.raises(UpstreamError):
            await fetch(ups, eng.url)
        assert eng.accepted == 2 and len(eng.requests) == 3  # one retry only


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


async def test_unreachable_engine(ups):
    from helpers import free_port
    with pytest.raises(UpstreamError):
        await fetch(ups, f"http://127.0.0.1:{free_port()}")
    assert pool(ups).size == 0


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
        await wait_for(lambda: pool(ups).size == 0, what="connection gone")


async def test_a_malformed_answer_is_an_upstream_error(ups):
    async def answer(req, writer):
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()
        # and keeps the connection (it reads on for a next request): the gateway must close it
    async with Engine(answer) as eng:
        with pytest.raises(UpstreamError):
            await fetch(ups, eng.url)
        await wait_for(lambda: eng.closed_by_peer == 1 or eng.open == 0, what="closed by the gateway")


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
        await wait_for(lambda: pool(ups).size == 0 and not pool(ups).conns)


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


async def test_limit_and_waiting_for_a_free_connection():
    assert forward.LIMIT == 256 and Upstreams().limit == 256
    assert (forward.CONNECT_TIMEOUT, forward.POOL_TIMEOUT) == (10.0, 60.0)
    hold = asyncio.Event()

    async def answer(req, writer):
        await hold.wait()
        await ok_answer(req, writer)
    ups = Upstreams(limit=2)
    try:
        async with Engine(answer) as eng:
            tasks = [asyncio.ensure_future(fetch(ups, eng.url)) for _ in range(3)]
            await wait_for(lambda: len(eng.requests) == 2, what="two requests at the engine")
            p = pool(ups)
            await wait_for(lambda: len(p.waiters) == 1, what="the third waiting for a connection")
            assert eng.accepted == 2 and len(p.waiters) == 1 and not any(t.done() for t in tasks)
            hold.set()
            assert [s for s, _, _ in await asyncio.gather(*tasks)] == [200, 200, 200]
            assert eng.accepted == 2  # the third waited for a connection and reused it
            # a wait that runs out is the upstream error
            hold.clear()
            p.pool_timeout = 0.2
            tasks = [asyncio.ensure_future(fetch(ups, eng.url)) for _ in range(2)]
            await wait_for(lambda: len(eng.requests) == 5)
            with pytest.raises(UpstreamError, match="no free connection"):
                await fetch(ups, eng.url)
            assert not p.waiters
            hold.set()
            await asyncio.gather(*tasks)
            assert p.size == 2 and len(p.idle) == 2
    finally:
        await ups.close()


async def test_a_waiter_gets_the_slot_of_a_closed_connection():
    hold = asyncio.Event()

    async def answer(req, writer):
        if req["target"] == "/close":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return False
        await hold.wait()
        await ok_answer(req, writer)
    ups = Upstreams(limit=1)
    try:
        async with Engine(answer) as eng:
            first = asyncio.ensure_future(fetch(ups, eng.url, target="/close"))
            second = asyncio.ensure_future(fetch(ups, eng.url))
            hold.set()
            assert (await first)[0] == 200 and (await second)[0] == 200
            assert eng.accepted == 2 and pool(ups).size == 1
    finally:
        await ups.close()


async def test_new_address_retires_the_old_pool_after_its_last_stream(ups):
    go = asyncio.Event()

    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        await writer.drain()
    async with Engine(answer) as old_eng, Engine() as new_eng:
        lease = ups.open(1, old_eng.url)
        r = await lease.request("POST", "/v1/x", JSON, b"{}")
        old = pool(ups)
        assert await r.content.readany() == b"first"
        assert (await fetch(ups, new_eng.url))[0] == 200  # the engine came back on a new address
        assert old.retired and not old.closed and pool(ups) is not old
        go.set()
        assert await r.content.read() == b"last"  # the running stream is not cut
        r.release()
        assert not old.closed
        lease.end()
        assert old.closed
        await wait_for(lambda: old_eng.open == 0 and not old.conns, what="old connections closed")
        with pytest.raises(UpstreamError):
            await old.request("POST", "/v1/x", JSON, b"{}")


async def test_forget_and_close(ups):
    async with Engine() as eng:
        await fetch(ups, eng.url, dep=1)
        await fetch(ups, eng.url, dep=2)
        p1 = pool(ups, 1)
        ups.forget(1)
        assert p1.closed and ups.pool(1) is None
        await wait_for(lambda: eng.open == 1, what="the forgotten pool's connection closed")
        await ups.close()
        await wait_for(lambda: eng.open == 0, what="every connection closed")


async def test_a_call_of_ondemands_own_reads_the_whole_answer_within_its_timeout(ups):
    """``Upstreams.call`` (the deployer's and the sampler's calls): the answer read whole, however
    big (past the body's high-water mark, which pauses reading until it is read); a JSON body sent
    with its length; a call the engine does not answer ends at its timeout, its connection closed."""
    big = b"x" * (600 * 1024)

    async def answer(req, writer):
        if req["target"] == "/stall":
            await asyncio.sleep(30)
        await ok_answer(req, writer, body=big if req["target"] == "/metrics" else req["body"])
    async with Engine(answer) as eng:
        assert await ups.call(1, eng.url, "GET", "/metrics", timeout=5) == (200, big)
        assert await ups.call(1, eng.url, "POST", "/sleep?level=1", body=b'{"a": 1}', lines=JSON,
                              timeout=5) == (200, b'{"a": 1}')
        sent = eng.requests[-1]
        assert sent["target"] == "/sleep?level=1" and ("Content-Length", "8") in sent["headers"]
        assert eng.accepted == 1  # one keep-alive connection served both
        with pytest.raises(asyncio.TimeoutError):
            await ups.call(1, eng.url, "GET", "/stall", timeout=0.2)
        calls = ups.pool(1, calls=True)
        assert calls is not None
        await wait_for(lambda: not calls.conns and calls.size == 0, what="the timed-out call's connection closed")


async def test_a_call_never_waits_behind_the_traffic_and_forget_closes_both_pools():
    """ondemand's own calls have pools of their own: with every traffic connection busy (a long
    generation each), the watchdog's probe still answers at once; ``forget`` (removed, asleep)
    closes both."""
    hold = asyncio.Event()

    async def answer(req, writer):
        if req["target"] != "/health":
            await hold.wait()
        await ok_answer(req, writer)
    ups = Upstreams(limit=1)
    try:
        async with Engine(answer) as eng:
            busy = asyncio.ensure_future(fetch(ups, eng.url))
            await wait_for(lambda: len(eng.requests) == 1, what="the traffic's one connection busy")
            assert (await ups.call(1, eng.url, "GET", "/health", timeout=1))[0] == 200
            assert eng.accepted == 2 and pool(ups).size == 1 and not busy.done()
            hold.set()
            await busy
            ups.forget(1)
            await wait_for(lambda: eng.open == 0, what="both pools' connections closed")
    finally:
        await ups.close()


async def test_the_engine_client_says_what_failed():
    """``engines/client.py`` on those calls: an unreachable engine is not answering (the probe),
    not yet serving (readiness), a CallFailed with no status (a sleep call); an answer other
    than 200 is a CallFailed with its status and text."""
    from ondemand.engines.backends import Engine as Handle
    from ondemand.engines.client import CallFailed, EngineClient

    async def answer(req, writer):
        if req["target"] == "/v1/models":
            await ok_answer(req, writer, body=b'{"data": [{"id": "A"}]}')
        else:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 7\r\n\r\nloading")
            await writer.drain()
    ups = Upstreams()
    client = EngineClient(ups, probe_timeout_s=1)
    try:
        async with Engine(answer) as eng:
            up, down = Handle(1, "a", eng.url), Handle(2, "b", "http://127.0.0.1:1")
            assert await client.served_names(up, checks_name=True) == ["A"]
            assert not await client.answers(up, "/health")  # 503
            with pytest.raises(CallFailed, match="answered 503: loading") as exc:
                await client.post(up, "/sleep")
            assert exc.value.status == 503
            assert not await client.answers(down) and await client.served_names(down, checks_name=True) is None
            with pytest.raises(CallFailed) as exc:
                await client.post(down, "/sleep")
            assert exc.value.status == 0
    finally:
        await ups.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_race_cancelled_requests_leak_nothing(seed):
    """Requests cancelled at random moments (waiting for a connection, connecting, waiting for
    the head, reading the body) against an engine with random answers: afterwards every
    connection is idle in the pool or closed, no slot or waiter is left, and the engine has
    exactly the pool's connections open."""
    rng = random.Random(seed)

    async def answer(req, writer):
        await asyncio.sleep(rng.random() * 0.01)  # the sleeps of this race are its random timing
        kind = rng.random()
        if kind < 0.3:
            await ok_answer(req, writer)
        elif kind < 0.8:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(rng.randrange(1, 5)):
                writer.write(b"3\r\nabc\r\n")
                await writer.drain()
                await asyncio.sleep(rng.random() * 0.005)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        elif kind < 0.9:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")
            await writer.drain()
            return False  # closes the connection after the answer
        else:
            return False  # closes the connection unanswered
    ups = Upstreams(limit=4)
    try:
        async with Engine(answer) as eng:
            async def one():
                with contextlib.suppress(UpstreamError, PayloadError):
                    await fetch(ups, eng.url)

            tasks = []
            for _ in range(300):
                t = asyncio.ensure_future(one())
                tasks.append(t)
                if rng.random() < 0.6:
                    asyncio.get_running_loop().call_later(rng.random() * 0.02, t.cancel)
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.003)
            done, pending = await asyncio.wait(tasks, timeout=60)
            assert not pending
            for t in done:
                assert t.cancelled() or t.exception() is None
            p = pool(ups)
            await wait_for(lambda: p.size == len(p.conns) == len(p.idle) and eng.open == p.size,
                           what="every connection idle or closed")
            assert p.size <= 4 and not p.waiters and p.streams == 0
            assert all(c.alive() and not c.active for c in p.idle)
            eng.answer = ok_answer
            for _ in range(4):  # and the pool still works
                assert (await fetch(ups, eng.url))[0] == 200
    finally:
        await ups.close()


async def test_the_retry_never_takes_another_idle_connection(ups):
    """The engine closed every idle connection at once (say, a restart of its keep-alive):
    the retry must not go to a second idle connection that is just as stale."""
    hold = asyncio.Event()
    stale = set()

    async def answer(req, writer):
        if req["conn"] in stale:
            return False
        await hold.wait()
        await ok_answer(req, writer)
    async with Engine(answer) as eng:
        tasks = [asyncio.ensure_future(fetch(ups, eng.url)) for _ in range(2)]
        await wait_for(lambda: len(eng.requests) == 2)
        hold.set()
        await asyncio.gather(*tasks)
        assert len(pool(ups).idle) == 2
        stale.update((1, 2))
        assert (await fetch(ups, eng.url))[0] == 200
        first, retry = (r["conn"] for r in eng.requests[2:])
        assert first in (1, 2) and retry == 3  # an idle one (the latest), then a new one: never the other idle one


@pytest.mark.parametrize("how", ["reuse", "close"])
async def test_a_waiter_cancelled_as_it_is_handed_a_connection_passes_it_on(how):
    """The connection (or, when it closed, its slot) is handed to a waiting request in the same
    turn of the loop as that request is cancelled: it must go back, not vanish."""
    ups = Upstreams(limit=1)
    close_now = asyncio.Event()
    try:
        async def answer(req, writer):
            if how == "close" and len(eng.requests) == 1:
                writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                await close_now.wait()
                return False
            await ok_answer(req, writer)
        async with Engine(answer) as eng:
            lease = ups.open(1, eng.url)
            r = await lease.request("POST", "/v1/x", JSON, b"{}")
            await r.read()
            waiting = asyncio.ensure_future(fetch(ups, eng.url))
            await wait_for(lambda: pool(ups).waiters)
            p = pool(ups)
            if how == "close":
                lost = p.lost

                def lost_then_cancel(conn):
                    lost(conn)  # the slot is handed to the waiter ...
                    waiting.cancel()  # ... which goes away in the same turn
                p.lost = lost_then_cancel
                close_now.set()
                await wait_for(lambda: waiting.done(), what="the engine closed it")
                r.release()
            else:
                r.release()  # the connection is handed to the waiter ...
                waiting.cancel()  # ... which goes away in the same turn
            lease.end()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            assert not p.waiters and p.size == len(p.idle) == (1 if how == "reuse" else 0)
            p.pool_timeout = 2
            assert (await fetch(ups, eng.url))[0] == 200  # the slot is usable
    finally:
        await ups.close()


# --- through the gateway ------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def gateway_to(tmp_path, engine):
    """A running ondemand whose deployment ``a`` is ready and reached at the engine double."""
    from helpers import FAKES, run_app
    async with run_app(tmp_path) as server:
        # started as a stand-in that is ready at once (the simulator's start is most of a test)
        a = await server.add("a", command=["python", str(FAKES / "ready_engine.py"), "{port}"])
        await server.deployer.restart(a)
        server.deployer.engine(a).base_url = engine.url
        async with aiohttp.ClientSession() as http:
            yield server, http, server.gw(a, "chat/completions"), a


async def not_ours(req, writer):
    """The deployer's own requests (metrics, health) are not the gateway's: a plain 404."""
    if req["target"].startswith("/v1/"):
        return False
    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    return True


def gateway_requests(eng):
    return [r for r in eng.requests if r["target"].startswith("/v1/")]


async def test_one_engine_client_for_the_gateway_the_deployer_and_the_sampler(tmp_path):
    """The app builds one set of engine pools (issue 30): the gateway forwards on them, and the
    deployer's and the metrics sampler's calls go through one client on them, the deployer's."""
    from ondemand import app as app_mod
    async with Engine() as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        sampler = server.app[app_mod.SAMPLER]
        assert server.deployer.client.upstreams is server.app[app_mod.GATEWAY].upstreams
        assert sampler.client is server.deployer.client
        await sampler.sample_once()
        assert "/metrics" in [r["target"] for r in eng.requests]  # the sampler's read, at the engine it forwards to


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
        assert not pool(ups).idle


# --- found in review: never twice, never held by an unsent body, no stray errors ----------

async def test_a_request_the_engine_worked_on_is_never_sent_again(ups, monkeypatch):
    # The engine read the request, worked on it (a generation), then its connection closed
    # with no answer (a crash, a killed worker): sending it again could run it twice.
    monkeypatch.setattr(forward, "STALE_WINDOW", 0.1)

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


async def test_a_connection_idle_too_long_is_closed_not_reused(ups, monkeypatch):
    # Engines close idle keep-alive connections after 5 s; one idle for IDLE_MAX (4 s)
    # is not risked: it is closed and the request goes on a new one.
    async with Engine() as eng:
        await fetch(ups, eng.url)
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 1  # reused while fresh
        monkeypatch.setattr(forward, "IDLE_MAX", -1.0)  # now idle past IDLE_MAX, without waiting for it
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 2
        await wait_for(lambda: eng.closed_by_peer == 1 and eng.open == 1, what="the old one closed")
        p = pool(ups)
        assert p.size == len(p.conns) == len(p.idle) == 1


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
        p = pool(ups)
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
            await wait_for(lambda: pool(ups).waiters)
            [conn] = pool(ups).conns  # limit=1: the answer's, the only one
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


class _Out:
    """What answers.into_stream writes to (a Call): the client's answer, already begun by the queued notice."""

    def __init__(self):
        self.data = b""

    async def write(self, b):
        self.data += b

    async def end(self):
        self.data += b"<eof>"


async def test_after_the_notice_an_engine_error_in_pieces_is_passed_whole(ups):
    from ondemand.gateway import answers
    err = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'

    async def answer(req, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(err), err[:20]))
        await writer.drain()
        await asyncio.sleep(0.05)  # the engine double's behaviour: the error in two pieces
        writer.write(err[20:])
        await writer.drain()
    async with Engine(answer) as eng:
        lease = ups.open(1, eng.url)
        up = await lease.request("POST", "/v1/chat/completions", JSON, b"{}")
        out = _Out()
        try:
            await answers.into_stream(out, up)
        finally:
            up.release()
            lease.end()
    import orjson
    assert out.data == b"data: " + orjson.dumps(orjson.loads(err)) + b"\n\ndata: [DONE]\n\n<eof>", out.data


async def test_after_the_notice_an_engine_breaking_off_its_error_is_an_upstream_error(ups):
    from ondemand.gateway import answers

    async def answer(req, writer):
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False
    async with Engine(answer) as eng:
        lease = ups.open(1, eng.url)
        up = await lease.request("POST", "/v1/chat/completions", JSON, b"{}")
        out = _Out()
        try:
            await answers.into_stream(out, up)
        finally:
            up.release()
            lease.end()
    assert b'"ondemand_upstream_error"' in out.data and b"broke off" in out.data and out.data.endswith(b"<eof>")


async def test_the_engines_own_request_id_is_replaced_not_duplicated(tmp_path):
    """vLLM answers with an X-Request-Id of its own: the client sees one, the gateway's (issue 23)."""
    async def answer(req, writer):
        if await not_ours(req, writer):
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: engine-own\r\n"
                     b"Content-Length: 12\r\n\r\n{\"ok\": true}")
        await writer.drain()
    async with Engine(answer) as eng, gateway_to(tmp_path, eng) as (server, http, url, a):
        async with http.post(url, json={"model": "A"}, headers={**server.auth(), "X-Request-Id": "mine"}) as r:
            assert r.status == 200 and r.headers.getall("X-Request-Id") == ["mine"]


def test_the_remembered_header_lines_are_bounded():
    from ondemand.http import forward as rule
    for i in range(rule.CACHE_MAX + 10):
        assert request_lines([(b"X-Call", b"%d" % i)], "r").startswith(b"X-Call: %d\r\n" % i)
    assert 0 < len(rule._REQUEST.seen) <= rule.CACHE_MAX
