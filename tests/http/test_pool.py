"""The engines' connection pools (ondemand/http/pool.py): a ``Pool`` per engine address (the
request as the engine sees it, keep-alive reuse, the limit and the line for a free connection,
the one retry of a stale keep-alive connection, an idle connection's end, cancellations that
leak nothing) and ``Upstreams``, the pools by deployment (a new address retires the old pool
after its last stream, ``forget``, ondemand's own calls on pools of their own, one set for
the whole app). Against engine doubles on loopback (engine_double.py) that count their
connections and answer exactly as each test scripts.

Every test here runs on asyncio's loop and on uvloop, the one ondemand serves on (see
test_connection.py)."""
import asyncio
import contextlib
import random

import pytest
from engine_double import JSON, Engine, fetch, gateway_to, ok_answer, pool_of
from helpers import free_port, wait_for

from ondemand.http import pool
from ondemand.http.pool import PayloadError, UpstreamError, Upstreams

LOOPS = ("asyncio", "uvloop")


# --- a pool: one engine address -------------------------------------------------------------------

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


async def test_an_engine_address_with_a_path_puts_every_request_under_it(ups):
    """An engine reached under a path (``http://user@host:port/path``): every request's target,
    the traffic's and ondemand's own calls', is under the path, and the Host header is the
    host and port alone; an address that is not http:// is refused when its pool is made."""
    async with Engine() as eng:
        under = eng.url.replace("http://", "http://someone@") + "/engine/"
        await fetch(ups, under, target="/v1/chat/completions")
        assert await ups.call(2, eng.url + "/engine", "GET", "/metrics?x=1", timeout=5) == (200, b'{"ok": true}')
    assert [r["target"] for r in eng.requests] == ["/engine/v1/chat/completions", "/engine/metrics?x=1"]
    assert {r["headers"][0] for r in eng.requests} == {("Host", eng.url.removeprefix("http://"))}
    for bad in ("https://127.0.0.1:8000", "127.0.0.1:8000", "http:///v1"):
        with pytest.raises(ValueError, match="not an http:// engine address"):
            ups.open(3, bad)
    assert ups.pool(3) is None

async def test_one_connection_serves_sequential_requests(ups):
    async with Engine() as eng:
        for _ in range(5):
            status, headers, body = await fetch(ups, eng.url)
            assert (status, body) == (200, b'{"ok": true}')
        assert eng.accepted == 1 and len(eng.requests) == 5
        assert pool_of(ups).size == 1 and len(pool_of(ups).idle) == 1


async def test_unreachable_engine(ups):
    with pytest.raises(UpstreamError):
        await fetch(ups, f"http://127.0.0.1:{free_port()}")
    assert pool_of(ups).size == 0


async def test_an_idle_connection_the_engine_closes_leaves_the_pool_at_once(ups):
    async def answer(req, writer):
        await ok_answer(req, writer)
        await asyncio.sleep(0.05)  # the engine double's behaviour: it closes an idle connection
        return False  # uvicorn's keep-alive timeout, shortened
    async with Engine(answer) as eng:
        await fetch(ups, eng.url)
        p = pool_of(ups)
        await wait_for(lambda: p.size == 0 and not p.idle and not p.conns, timeout=2, what="dropped")
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 2


async def test_a_connection_idle_too_long_is_closed_not_reused(ups, monkeypatch):
    # Engines close idle keep-alive connections after 5 s; one idle for IDLE_MAX (4 s)
    # is not risked: it is closed and the request goes on a new one.
    async with Engine() as eng:
        await fetch(ups, eng.url)
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 1  # reused while fresh
        monkeypatch.setattr(pool, "IDLE_MAX", -1.0)  # now idle past IDLE_MAX, without waiting for it
        assert (await fetch(ups, eng.url))[0] == 200
        assert eng.accepted == 2
        await wait_for(lambda: eng.closed_by_peer == 1 and eng.open == 1, what="the old one closed")
        p = pool_of(ups)
        assert p.size == len(p.conns) == len(p.idle) == 1


async def test_upstream_sessions_keep_no_cookies(ups):
    """By name (as engines are reached in Docker) a cookie jar would keep the engine's
    cookie and send it with the next user's request."""
    async def answer(req, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: engine_session=1; Path=/\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
    async with Engine(answer) as eng:
        for _ in range(2):
            status, headers, body = await fetch(ups, eng.url.replace("127.0.0.1", "localhost"))
            assert (status, body, headers["Set-Cookie"]) == (200, b"ok", "engine_session=1; Path=/")
    assert len(eng.requests) == 2 and not [k for r in eng.requests for k, _ in r["headers"] if k.lower() == "cookie"]


# --- the stale keep-alive race: one retry, on a fresh connection ----------------------------------

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
        await wait_for(lambda: pool_of(ups).size == 0, what="slot freed")


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
        assert len(pool_of(ups).idle) == 2
        stale.update((1, 2))
        assert (await fetch(ups, eng.url))[0] == 200
        first, retry = (r["conn"] for r in eng.requests[2:])
        assert first in (1, 2) and retry == 3  # an idle one (the latest), then a new one: never the other idle one


# --- the limit, and the line for a free connection ------------------------------------------------

async def test_limit_and_waiting_for_a_free_connection():
    assert pool.LIMIT == 256 and Upstreams().limit == 256
    assert (pool.CONNECT_TIMEOUT, pool.POOL_TIMEOUT) == (10.0, 60.0)
    hold = asyncio.Event()

    async def answer(req, writer):
        await hold.wait()
        await ok_answer(req, writer)
    ups = Upstreams(limit=2)
    try:
        async with Engine(answer) as eng:
            tasks = [asyncio.ensure_future(fetch(ups, eng.url)) for _ in range(3)]
            await wait_for(lambda: len(eng.requests) == 2, what="two requests at the engine")
            p = pool_of(ups)
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
            assert eng.accepted == 2 and pool_of(ups).size == 1
    finally:
        await ups.close()


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
            await wait_for(lambda: pool_of(ups).waiters)
            p = pool_of(ups)
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
            p = pool_of(ups)
            await wait_for(lambda: p.size == len(p.conns) == len(p.idle) and eng.open == p.size,
                           what="every connection idle or closed")
            assert p.size <= 4 and not p.waiters and p.streams == 0
            assert all(c.alive() and not c.active for c in p.idle)
            eng.answer = ok_answer
            for _ in range(4):  # and the pool still works
                assert (await fetch(ups, eng.url))[0] == 200
    finally:
        await ups.close()


# --- Upstreams: the pools by deployment -----------------------------------------------------------

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
        old = pool_of(ups)
        assert await r.content.readany() == b"first"
        assert (await fetch(ups, new_eng.url))[0] == 200  # the engine came back on a new address
        assert old.retired and not old.closed and pool_of(ups) is not old
        go.set()
        assert await r.content.read() == b"last"  # the running stream is not cut
        r.release()
        assert not old.closed
        lease.end()
        assert old.closed
        await wait_for(lambda: old_eng.open == 0 and not old.conns, what="old connections closed")
        with pytest.raises(UpstreamError):
            await old.request("POST", "/v1/x", JSON, b"{}")


@pytest.mark.uvloop
async def test_a_client_per_deployment_closed_after_its_last_stream(server, http):
    a = await server.add("a", 10, "--token-delay", "0.02", "--tokens", "20")  # a stream still running below
    await server.deployer.restart(a)
    from ondemand import app as app_mod
    gw = server.app[app_mod.GATEWAY]
    body = {"model": "A", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    r = await http.post(server.gw(a, "chat/completions"), json=body, headers=server.auth())
    await r.content.readuntil(b"\n\n")
    old = gw.upstreams.pool(a)
    # the engine restarts on a new address while the stream runs
    lease = gw.upstreams.open(a, "http://127.0.0.1:9")
    lease.end()
    assert old.retired and not old.closed and old.conns
    rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    await wait_for(lambda: old.closed and not old.conns, what="old pool closed after its stream")


async def test_forget_and_close(ups):
    async with Engine() as eng:
        await fetch(ups, eng.url, dep=1)
        await fetch(ups, eng.url, dep=2)
        p1 = pool_of(ups, 1)
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
            assert eng.accepted == 2 and pool_of(ups).size == 1 and not busy.done()
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
