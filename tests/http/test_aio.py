"""aiohttp's side of a connection (ondemand/http/aio.py's ``AioConnection``): once a connection
carries an admin request it is aiohttp's, every answer owed is given, in order, and every
refusal is the documented JSON: a malformed head after a good one, a head too slow or too
large, a request line without a version, a body with broken chunking, too large or too slow,
an Upgrade (issue 23's raw-socket findings, one write on one connection each, each failed on
the code before the issue); the rest of a refused body is read for a bounded time and size
(issue 40). Against a whole server on loopback."""
import asyncio

import orjson
import pytest
from helpers import run_app, wait_for
from raw_http import MiB, admin, error_code, keep_sending, parse_answers, port, read_answer, req, talk

from ondemand.app import GATEWAY
from ondemand.http.limits import Limits

# --- answers owed once aiohttp holds the connection -----------------------------------------------

async def test_healthz_then_two_content_lengths_is_200_then_400(server):
    bad = b"POST /dgxmm/api/host HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}"
    answers = parse_answers(await talk(server, b"GET /dgxmm/healthz HTTP/1.1\r\nHost: x\r\n\r\n" + bad))
    assert [a[0] for a in answers] == [200, 400]
    assert error_code(answers[1]) == "invalid_request"


async def test_healthz_in_http_1_0_then_a_stray_byte_is_answered(server):
    answers = parse_answers(await talk(server, b"GET /dgxmm/healthz HTTP/1.0\r\n\r\nx"))
    assert answers and answers[0][0] == 200 and orjson.loads(answers[0][2])["status"] == "ok"


async def test_an_admin_change_with_connection_close_then_a_byte_is_answered_and_applied(ready):
    server, dep = ready
    data = admin(server, f"/dgxmm/api/deployments/{dep}/mode", "Connection: close", "Content-Type: application/json",
                  method="PATCH", body=b'{"mode": "always_on"}') + b"x"
    answers = parse_answers(await talk(server, data))
    assert answers and answers[0][0] == 200, answers
    assert server.deployer.get(dep).mode.value == "always_on"


async def test_after_an_admin_request_a_malformed_head_is_400_json(server):
    answers = parse_answers(await talk(server, admin(server) + b"GET /dgxmm/healthz HTTP/1.1\r\nHo st: x\r\n\r\n"))
    assert [a[0] for a in answers] == [200, 400] and error_code(answers[1]) == "invalid_request"


@pytest.mark.uvloop
async def test_after_an_admin_request_a_slow_head_is_408_json(server):
    server.set_limits(head_timeout_s=0.3)
    answers = parse_answers(await talk(server, admin(server) + b"GET /dgxmm/healthz HTTP/1.1\r\nHost", timeout=5))
    assert [a[0] for a in answers] == [200, 408] and error_code(answers[1]) == "request_timeout"


async def test_after_an_admin_request_a_head_too_large_is_431_json(server):
    server.set_limits(max_head_bytes=4096, max_field_size=100_000)
    big = b"GET /dgxmm/healthz HTTP/1.1\r\nX-Big: " + b"a" * 8000
    answers = parse_answers(await talk(server, admin(server) + big, timeout=5))
    assert [a[0] for a in answers] == [200, 431] and error_code(answers[1]) == "headers_too_large"


async def test_after_an_admin_request_a_request_line_without_a_version_is_400(server):
    """aiohttp read it as HTTP/0.9 and answered "HTTP/0.9 401"; a bare one (no header, no empty
    line: HTTP/0.9's whole request) waited for the head's timeout, then 408."""
    answers = parse_answers(await talk(server, admin(server) + b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"))
    assert [a[0] for a in answers] == [200, 400] and error_code(answers[1]) == "invalid_request"
    server.set_limits(head_timeout_s=30)
    t0 = asyncio.get_running_loop().time()
    answers = parse_answers(await talk(server, admin(server) + b"GET /dgxmm/api/host\r\n", timeout=10))
    assert [a[0] for a in answers] == [200, 400] and error_code(answers[1]) == "invalid_request"
    assert asyncio.get_running_loop().time() - t0 < 5


@pytest.mark.parametrize("bad", [b"GET /dgxmm/healthz\r\n\r\n", b"GET /dgxmm/healthz HTTP/1.1\nHost: x\n\n",
                                 b"POST /dgxmm/api/host HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n"])
async def test_after_an_admin_request_a_refused_head_says_connection_close(server, bad):
    """A refusal ends its connection and says so (interfaces.md, "The front, for everyone"):
    aiohttp answers a head it could not parse as HTTP/1.0, where it names no close."""
    answers = parse_answers(await talk(server, admin(server) + bad))
    assert [a[0] for a in answers] == [200, 400] and answers[1][1].get("connection") == "close", answers


async def test_a_body_that_ends_in_the_piece_of_the_next_head_is_no_request_line(ready):
    """A POST whose body holds a line break, with the next request in the same write: the piece
    that holds the next head's start holds the body's end too, which is no request line (the
    pipelined request is answered, not refused for its "version")."""
    server, dep = ready
    body = b'{"mode":\n"on_demand"}'
    data = admin(server, f"/dgxmm/api/deployments/{dep}/mode", "Content-Type: application/json", method="PATCH",
                 body=body) + admin(server)
    answers = parse_answers(await talk(server, admin(server) + data))
    assert [a[0] for a in answers] == [200, 200, 200], answers


@pytest.mark.uvloop
@pytest.mark.parametrize("first", ["admin", "gateway"])
async def test_an_upgrade_with_a_body_is_refused_and_nothing_pairs_with_the_wrong_request(ready, first):
    server, dep = ready
    upgrade = (admin(server, "/dgxmm/api/deployments", "Connection: Upgrade", "Upgrade: foo", method="POST",
                      body=b"{}") if first == "admin"
               else req(server, dep, "Connection: Upgrade", "Upgrade: foo", body=b"{}"))
    answers = parse_answers(await talk(server, admin(server) + upgrade + admin(server, "/dgxmm/api/deployments")))
    assert [a[0] for a in answers] == [200, 400], answers
    assert error_code(answers[1]) == "invalid_request" and answers[1][1]["connection"] == "close"


@pytest.mark.uvloop
async def test_a_connection_handed_over_behind_a_gateway_request_reads_on(server):
    """An admin request that comes (in a read of its own) while a gateway request on the same
    connection is being answered waits, reading paused, until that answer is out; then the
    connection is aiohttp's (``AioConnection.take_over``), which reads again: the admin request
    and the next one after it are answered."""
    gateway = server.app[GATEWAY]
    handle, entered, go = gateway.handle, asyncio.Event(), asyncio.Event()

    async def held(call):
        entered.set()
        await go.wait()
        await handle(call)
    gateway.handle = held
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    try:
        writer.write(req(server, 999))
        await asyncio.wait_for(entered.wait(), 5)
        writer.write(admin(server))
        await wait_for(lambda: any(c.handoff for c in server.http.front.connections),
                       what="the admin request read, waiting for the hand-off")
        go.set()
        first, second = await read_answer(reader), await read_answer(reader)
        writer.write(admin(server, "/dgxmm/api/deployments"))
        third = await read_answer(reader)
    finally:
        writer.close()
        gateway.handle = handle
    assert first[0].startswith(b"HTTP/1.1 404") and orjson.loads(first[2])["error"]["code"] == "not_found"
    assert second[0] == b"HTTP/1.1 200 OK" and "hostname" in orjson.loads(second[2])
    assert third[0] == b"HTTP/1.1 200 OK" and isinstance(orjson.loads(third[2]), (list, dict))

# --- the admin API's bodies -----------------------------------------------------------------------

async def test_an_admin_body_with_broken_chunking_is_400_json(server):
    data = (b"POST /dgxmm/api/deployments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.token.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n")
    answers = parse_answers(await talk(server, data, timeout=5))
    assert answers and answers[0][0] == 400 and error_code(answers[0]) == "invalid_body", answers


async def test_an_admin_body_one_byte_over_16_mib_is_413(server):
    body = b"{" + b" " * (16 * 2**20 - 1) + b"}"
    head = admin(server, "/dgxmm/api/deployments", "Content-Type: application/json", method="POST", body=b"")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    answers = parse_answers(await talk(server, head + body, timeout=20, want=1))
    assert answers and answers[0][0] == 413 and error_code(answers[0]) == "request_too_large", answers[:1]


async def test_an_authenticated_admin_body_has_a_time_limit(tmp_path):
    async with run_app(tmp_path, limits=Limits(body_timeout_s=0.5)) as server:
        head = admin(server, "/dgxmm/api/deployments", "Content-Type: application/json", method="POST", body=b"")
        head = head.replace(b"Content-Length: 0", b"Content-Length: 100")
        answers = parse_answers(await talk(server, head + b'{"na', timeout=5, want=1))
    assert answers and answers[0][0] == 408 and error_code(answers[0]) == "request_timeout"
    assert answers[0][1]["connection"] == "close"


@pytest.mark.parametrize("bound", ["time", "size"])
async def test_aiohttps_read_of_a_refused_body_is_bounded(server, bound):
    """After its 401, aiohttp reads and drops the rest of the body (its lingering) for a second
    (``lingering_s``; it was 10 s) and at most ``linger_max_bytes`` (it had no bound in size),
    then closes, however long the client goes on sending."""
    if bound == "size":
        server.set_limits(lingering_s=30, linger_max_bytes=MiB)
    raw = admin(server, "/dgxmm/api/deployments", method="POST").replace(server.token.encode(), b"wrong")
    raw = raw.replace(b"Content-Length: 0", b"Content-Length: %d" % 2 ** 40)
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()  # before the answer: its lingering starts after
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 401") and b"Connection: close" in head
        sending = asyncio.ensure_future(keep_sending(writer, b" " * (65536 if bound == "size" else 1024),
                                                      0 if bound == "size" else 0.05))
        try:
            await wait_for(lambda: server.http.front.open.total == 0, timeout=20, what="the connection closed")
        finally:
            sending.cancel()
    finally:
        writer.close()
    assert 0.9 <= loop.time() - t0 < 5 if bound == "time" else loop.time() - t0 < 10
