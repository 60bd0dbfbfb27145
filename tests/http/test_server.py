"""The HTTP server (ondemand/http/server.py): its listeners (one for both stacks, or with
``admin_listen`` the gateway's alone and the admin API's, aiohttp's from the first byte),
aiohttp's refusals that end their connection as the lean front's do (issue 40), and the
shutdown, which closes idle connections and lets both stacks' requests finish within the
grace. Against a whole server on loopback."""
import asyncio

import orjson
import pytest
from helpers import run_app
from raw_http import MiB, admin, error_code, parse_answers, port, read_answer, req, talk


async def test_admin_listen_gives_the_admin_api_a_listener_of_its_own(tmp_path):
    """With ``admin_listen``, ``listen`` serves the gateway alone (anything else is 404) and the
    admin listener is aiohttp's from the first byte (a gateway request there is 421)."""
    from helpers import free_port
    admin_port = free_port()
    async with run_app(tmp_path, admin_listen=f"127.0.0.1:{admin_port}") as server:
        dep = await server.add("a")
        await server.deployer.restart(dep)
        answers = parse_answers(await talk(server, req(server, dep) + req(server, dep, "Connection: close")))
        assert [a[0] for a in answers] == [200, 200]
        [answer] = parse_answers(await talk(server, admin(server)))
        assert answer[0] == 404 and error_code(answer) == "not_found"
        assert "admin_listen" in orjson.loads(answer[2])["error"]["message"]  # where the admin API is

        async def admin_talk(data: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
            writer.write(data)
            try:
                return await asyncio.wait_for(reader.read(65536), 5)
            finally:
                writer.close()
        answers = parse_answers(await admin_talk(admin(server)))
        assert answers[0][0] == 200 and "hostname" in orjson.loads(answers[0][2])
        answers = parse_answers(await admin_talk(req(server, dep)))
        assert answers[0][0] == 421 and error_code(answers[0]) == "misdirected_request"
        # aiohttp's from the first byte: a request line without a version is refused there too.
        answers = parse_answers(await admin_talk(b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"))
        assert answers[0][0] == 400 and error_code(answers[0]) == "invalid_request"
        # A bare request line (HTTP/0.9's whole request) is 400 at once, not 408 at the head's
        # timeout (llhttp waits for headers), in pieces too: the line ends only with its piece.
        for pieces in ([b"GET /\r\n"], [b"GET /dgxm", b"m/api/host", b"\r\n"], [b"\r\nGET /\n"]):
            t0 = asyncio.get_running_loop().time()
            reader, writer = await asyncio.open_connection("127.0.0.1", admin_port)
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
            try:
                answers = parse_answers(await asyncio.wait_for(reader.read(65536), 5))
            finally:
                writer.close()
            assert answers[0][0] == 400 and error_code(answers[0]) == "invalid_request", pieces
            assert asyncio.get_running_loop().time() - t0 < 2, pieces


async def test_admin_then_gateway_is_421_and_the_connection_ends(ready):
    """A 421 ends its connection like every refusal (issue 40: it kept it, so a client pool that
    mixed admin and gateway requests got 421 on 1,504 of 2,000): the client's next request goes
    on a new connection, and the request pipelined behind the 421 is not answered."""
    server, dep = ready
    data = admin(server) + req(server, dep) + b"GET /dgxmm/api/host HTTP/1.1\r\nHost x\r\n\r\n"
    answers = parse_answers(await talk(server, data))
    assert [a[0] for a in answers] == [200, 421]
    assert "hostname" in orjson.loads(answers[0][2])
    assert error_code(answers[1]) == "misdirected_request" and answers[1][1]["connection"] == "close"


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


@pytest.mark.uvloop
async def test_shutdown_lets_streams_end_within_the_grace_and_closes_idle_connections(tmp_path):
    """As aiohttp does for its own: at shutdown an idle connection closes at once, a stream
    that ends within the grace period (1 s in run_app) ends whole, a longer one is cut then."""
    from helpers import run_app

    cm = run_app(tmp_path)
    server = await cm.__aenter__()
    stopped = False
    try:
        dep = await server.add("a", 10, "--token-delay", "0.02", "--tokens", "400")
        await server.deployer.restart(dep)

        def stream(tokens: int) -> bytes:
            return req(server, dep, body=orjson.dumps({"model": "A", "stream": True, "max_tokens": tokens,
                                                        "messages": [{"role": "user", "content": "x"}]}))
        idle = await asyncio.open_connection("127.0.0.1", port(server))
        idle[1].write(req(server, dep, body=orjson.dumps({"model": "A", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "x"}]})))
        await read_answer(idle[0])
        short = await asyncio.open_connection("127.0.0.1", port(server))
        short[1].write(stream(20))  # about 0.4 s
        long = await asyncio.open_connection("127.0.0.1", port(server))
        long[1].write(stream(400))  # about 8 s
        for reader, _ in (short, long):
            await asyncio.wait_for(reader.readuntil(b"data:"), 5)
        t0 = asyncio.get_running_loop().time()
        stopping = asyncio.ensure_future(cm.__aexit__(None, None, None))
        assert await asyncio.wait_for(idle[0].read(), 2) == b""
        short_rest = await asyncio.wait_for(short[0].read(), 5)
        long_rest = await asyncio.wait_for(long[0].read(), 5)
        took = asyncio.get_running_loop().time() - t0
        await stopping
        stopped = True
        assert b"data: [DONE]" in short_rest and b"data: [DONE]" not in long_rest
        assert 0.9 < took < 3, took
        for _, writer in (idle, short, long):
            writer.close()
    finally:
        if not stopped:
            await cm.__aexit__(None, None, None)
