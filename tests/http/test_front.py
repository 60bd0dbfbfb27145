"""The lean front (ondemand/http/protocol.py): the gateway's requests are parsed by llhttp and
answered without aiohttp's application; a connection's first request that is not the gateway's
hands it to aiohttp for good (design.md, "The HTTP layer"). Raw sockets where the framing
matters, aiohttp's client where it does not.

Run on both loops: handing a connection over to aiohttp (``set_protocol``) and flow
control are the transports' own business."""
import asyncio
import contextlib

import orjson
import pytest
from helpers import wait_for

from ondemand.app import CONTROLLER, GATEWAY
from ondemand.http.refusals import REFUSALS

LOOPS = ("asyncio", "uvloop")
CHAT = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hello"}]})


def _port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


def _req(server, dep, *lines: str, method: str = "POST", path: str | None = None, body: bytes = CHAT,
         version: str = "1.1", key: str | None = None) -> bytes:
    target = path or f"/dgxmm/ondemand/{dep}/v1/chat/completions"
    head = [f"{method} {target} HTTP/{version}", "Host: x", f"Authorization: Bearer {key or server.key}", *lines]
    if method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body if method == "POST" else b"")


def _admin(server, path: str = "/dgxmm/api/host") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n\r\n".encode()


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One answer: its status line, headers (lower-case names) and body (Content-Length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            body += (await reader.readexactly(size + 2))[:-2]
            if not size:
                break
    else:
        body = await reader.read()
    return lines[0].encode(), headers, body


@contextlib.asynccontextmanager
async def _conn(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        yield reader, writer
    finally:
        writer.close()


@pytest.fixture
def gateway_calls(server, monkeypatch) -> list:
    """The requests that reached the gateway, by raw path."""
    seen: list = []
    gateway = server.app[GATEWAY]
    handle = gateway.handle

    async def spy(call):
        seen.append(call.raw_path)
        await handle(call)
    monkeypatch.setattr(gateway, "handle", spy)
    return seen


@pytest.fixture
async def ready(server):
    dep = await server.add("a")
    await server.deployer.restart(dep)
    return server, dep


async def test_gateway_then_admin_hands_the_connection_to_aiohttp_for_good(ready, gateway_calls):
    """Gateway requests, then an admin request: from that request on the connection is
    aiohttp's; a gateway request after it is 421 misdirected_request (RFC 9110: retry on
    another connection), in the documented JSON, and never reaches the gateway."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        for _ in range(2):
            writer.write(_req(server, dep))
            status, headers, body = await _answer(reader)
            assert status == b"HTTP/1.1 200 OK" and orjson.loads(body)["object"] == "chat.completion"
        writer.write(_admin(server))
        status, _, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and "hostname" in orjson.loads(body)
        writer.write(_req(server, dep, "X-Request-Id: after-admin"))
        status, headers, body = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 421") and orjson.loads(body)["error"]["code"] == "misdirected_request"
        assert headers["content-type"].startswith("application/json")
    assert len(gateway_calls) == 2


async def test_a_connection_that_starts_with_the_admin_api_stays_aiohttps(ready, gateway_calls):
    """The first request is aiohttp's (and a long one: the page); the admin requests after it
    are aiohttp's too; a gateway request is 421; a new connection serves it."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_admin(server, "/dgxmm/api/deployments"))
        status, _, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and isinstance(orjson.loads(body), (list, dict))
        writer.write(_admin(server, "/dgxmm/ui/"))
        status, headers, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and b"<html" in body.lower()
        writer.write(_req(server, dep))
        status, _, body = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 421")
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep))
        status, headers, body = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK" and len(headers["x-request-id"]) == 32
    assert len(gateway_calls) == 1


async def test_an_admin_request_pipelined_behind_a_gateway_one_is_421_after_its_answer(ready, gateway_calls):
    """In one write: where the admin request begins is not known (llhttp tells no offsets), so
    it cannot be handed off with its bytes; the gateway's answer goes first, then 421, closed."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, "X-Request-Id: one") + _admin(server) + _req(server, dep))
        first, second = await _answer(reader), await _answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert first[0] == b"HTTP/1.1 200 OK" and first[1]["x-request-id"] == "one"
    assert second[0].startswith(b"HTTP/1.1 421") and second[1]["connection"] == "close"
    assert orjson.loads(second[2])["error"]["code"] == "misdirected_request"
    assert len(gateway_calls) == 1


async def test_pipelined_gateway_requests_wait_their_turn(ready):
    """Three in one write: one handler at a time, answers in order, nothing left behind."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(b"".join(_req(server, dep, f"X-Request-Id: n{i}") for i in range(3)))
        ids = [(await _answer(reader))[1]["x-request-id"] for _ in range(3)]
    assert ids == ["n0", "n1", "n2"]
    assert server.app[CONTROLLER].inflight(dep) == 0


async def test_expect_100_continue_is_answered_when_the_gateway_reads_the_body(ready):
    server, dep = ready
    async with _conn(server) as (reader, writer):
        head, _, body = _req(server, dep, "Expect: 100-continue").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        status, _, _ = await _answer(reader)
        assert status == b"HTTP/1.1 200 OK"
        # Refused before the body is read: no 100, the answer at once.
        writer.write(_req(server, dep, "Expect: 100-continue", key="wrong").partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
        status, headers, _ = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 401")


async def test_http_1_0_gets_a_1_0_answer_and_the_connection_ends(ready):
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, version="1.0"))
        status, headers, body = await _answer(reader)
        assert status == b"HTTP/1.0 200 OK" and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    async with _conn(server) as (reader, writer):  # a streamed answer: no chunking in 1.0
        stream = orjson.dumps({"model": "A", "stream": True, "messages": [{"role": "user", "content": "x"}]})
        writer.write(_req(server, dep, version="1.0", body=stream))
        status, headers, body = await _answer(reader)
        assert status == b"HTTP/1.0 200 OK" and "transfer-encoding" not in headers
        assert body.endswith(b"data: [DONE]\n\n")


async def test_a_streamed_answer_is_chunked_and_the_connection_kept(server):
    dep = await server.add("a", 10, "--token-delay", "0.02")  # still coming when its head is passed on
    await server.deployer.restart(dep)
    stream = orjson.dumps({"model": "A", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    async with _conn(server) as (reader, writer):
        for _ in range(2):
            writer.write(_req(server, dep, body=stream))
            status, headers, body = await _answer(reader)
            assert status == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
            assert headers["content-type"].startswith("text/event-stream") and body.endswith(b"data: [DONE]\n\n")


async def test_a_413_before_the_body_came_is_answered_at_once_and_the_connection_ends(ready):
    """Refused before its body came (Content-Length over the limit): 413 at once, and the
    connection ends with it (issue 29): the answer and a FIN at once; the rest of such a body,
    perhaps endless, is read and dropped only for the bounded lingering (issue 40)."""
    server, dep = ready
    server.app[GATEWAY].max_body = 1000
    big = b"{" + b" " * 5000 + b"}"
    async with _conn(server) as (reader, writer):
        head, _, _ = _req(server, dep, body=big).partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n" + big[:100])
        status, headers, body = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 413") and orjson.loads(body)["error"]["code"] == "request_too_large"
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 3) == b""  # the FIN


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(ready):
    server, dep = ready
    server.set_limits(keepalive_timeout_s=0.4)
    async with _conn(server) as (reader, writer):
        for _ in range(3):  # requests within the timeout keep it
            writer.write(_req(server, dep))
            assert (await _answer(reader))[0] == b"HTTP/1.1 200 OK"
            await asyncio.sleep(0.25)
        assert await asyncio.wait_for(reader.read(), 3) == b""


async def test_malformed_requests_get_a_json_400(ready):
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, "Content-Length: 2"))
        status, headers, body = await _answer(reader)
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_request"


async def test_a_client_gone_mid_stream_frees_its_slot(server):
    dep = await server.add("a", 10, "--token-delay", "0.05")
    await server.deployer.restart(dep)
    stream = orjson.dumps({"model": "A", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "x"}]})
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, body=stream))
        await asyncio.wait_for(reader.readuntil(b"data:"), 10)
        assert server.app[CONTROLLER].inflight(dep) == 1
    await wait_for(lambda: server.app[CONTROLLER].inflight(dep) == 0, timeout=5, what="the slot back")


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
            return _req(server, dep, body=orjson.dumps({"model": "A", "stream": True, "max_tokens": tokens,
                                                        "messages": [{"role": "user", "content": "x"}]}))
        idle = await asyncio.open_connection("127.0.0.1", _port(server))
        idle[1].write(_req(server, dep, body=orjson.dumps({"model": "A", "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "x"}]})))
        await _answer(idle[0])
        short = await asyncio.open_connection("127.0.0.1", _port(server))
        short[1].write(stream(20))  # about 0.4 s
        long = await asyncio.open_connection("127.0.0.1", _port(server))
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
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, method="GET", path=target.replace("models", "mod%65ls")))
        await _answer(reader)
        writer.write(_req(server, dep, method="GET", path=target))
        assert (await _answer(reader))[0] == b"HTTP/1.1 200 OK"
    assert seen == [f"/dgxmm/ondemand/{dep}/v1/models"] * 2


async def test_lower_case_header_names_are_kept_from_the_engine_too(ready):
    """httpx (the OpenAI SDK's client, LiteLLM's) sends lower-case names: the header rules
    compare names without case, so nothing secret or hop-by-hop reaches the engine."""
    server, dep = ready
    raw = (f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
           f"authorization: Bearer {server.key}\r\ncookie: session=1\r\nconnection: keep-alive, x-private\r\n"
           f"x-private: secret\r\nkeep-alive: timeout=5\r\naccept-encoding: gzip\r\nproxy-connection: x\r\n"
           f"x-custom: kept\r\ncontent-type: application/json\r\ncontent-length: {len(CHAT)}\r\n\r\n").encode() + CHAT
    async with _conn(server) as (reader, writer):
        writer.write(raw)
        assert (await _answer(reader))[0] == b"HTTP/1.1 200 OK"
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep) + "/_sim/requests") as r:
        rows = [x for x in await r.json() if x["path"] == "/v1/chat/completions"]
    names = {}
    for k, v in rows[-1]["headers"]:
        names.setdefault(k.lower(), []).append(v)
    for banned in ("authorization", "cookie", "x-private", "keep-alive", "proxy-connection", "connection"):
        assert banned not in names, banned
    assert names["host"] == [server.deployer.base_url(dep).split("://")[1]]  # ours, once
    assert names["accept-encoding"] == ["identity"] and names["x-custom"] == ["kept"]


async def test_malformed_requests_are_logged_once_a_minute_with_their_count(ready, monkeypatch, caplog):
    server, dep = ready
    refusals = REFUSALS
    monkeypatch.setattr(refusals, "_last", -float("inf"))
    monkeypatch.setattr(refusals, "suppressed", 0)
    for _ in range(5):
        async with _conn(server) as (reader, writer):
            writer.write(_req(server, dep, "Content-Length: 2"))  # two Content-Lengths
            assert (await _answer(reader))[0].startswith(b"HTTP/1.1 400")
    lines = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING" and "127.0.0.1" in lines[0].getMessage()
    assert refusals.suppressed == 4
    refusals._last -= 61  # a minute later: the next one is logged, with the count
    refusals.note("10.0.0.9", "Duplicate Content-Length")
    assert caplog.records[-1].getMessage() == ("refused a malformed request from 10.0.0.9 (400): "
                                               "Duplicate Content-Length (4 more since the last such line)")


async def test_a_malformed_request_behind_a_good_one_is_refused_after_its_answer(ready):
    """Pipelined in one write: the good request's handler is already under way when llhttp
    refuses the next head, so its answer goes first, then the 400, then the close; the
    engine sees only the good one."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep, "X-Request-Id: good") + _req(server, dep, "Content-Length: 1"))
        first, second = await _answer(reader), await _answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert first[0] == b"HTTP/1.1 200 OK" and first[1]["x-request-id"] == "good"
    assert second[0].startswith(b"HTTP/1.1 400") and orjson.loads(second[2])["error"]["code"] == "invalid_request"


async def test_a_chunked_body_that_breaks_while_the_gateway_reads_it_is_400_invalid_body(ready):
    server, dep = ready
    head = _req(server, dep, "Transfer-Encoding: chunked", body=b"").replace(b"Content-Length: 0\r\n", b"")
    gateway = server.app[GATEWAY]
    handle, reading = gateway.handle, asyncio.Event()

    async def entered(call):
        reading.set()
        await handle(call)
    gateway.handle = entered
    try:
        async with _conn(server) as (reader, writer):
            writer.write(head + b"2\r\n{}")
            await asyncio.wait_for(reading.wait(), 5)  # the handler has begun: it waits for the rest
            writer.write(b"\r\nzz\r\n")
            status, headers, body = await _answer(reader)
    finally:
        gateway.handle = handle
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_body"
    assert server.app[CONTROLLER].inflight(dep) == 0


async def test_an_upgrade_request_is_refused_after_the_answers_before_it(ready, gateway_calls):
    """Nothing here switches protocols: an Upgrade head (its body after it) is 400 in the
    documented JSON once the answers before it are out, and the connection closes (issue 23:
    aiohttp lost the requests pipelined behind one)."""
    server, dep = ready
    async with _conn(server) as (reader, writer):
        writer.write(_req(server, dep))
        assert (await _answer(reader))[0] == b"HTTP/1.1 200 OK"
        writer.write(_req(server, dep, "Connection: Upgrade", "Upgrade: h2c") + _req(server, dep))
        status, headers, body = await _answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "invalid_request"
    assert len(gateway_calls) == 1


# --- issue 40: a refused request ends its connection, and its client reads the answer ---------

MiB = 2 ** 20


def _gateway_url(server, dep: int = 999) -> str:
    return f"{server.url}/ondemand/{dep}/v1/chat/completions"


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
            r = await client.post(_gateway_url(server), content=b"{" + b" " * (size - 2) + b"}", headers=headers)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", size
            assert r.headers["connection"] == "close"
    body = b" " * (32 * MiB)
    async with _conn(server) as (reader, writer):
        head = (f"POST /dgxmm/ondemand/999/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                f"{server.key}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        writer.write(head + body)
        await asyncio.wait_for(writer.drain(), 30)  # all of it sent before reading a byte
        status, headers, answer = await _answer(reader)
    assert status.startswith(b"HTTP/1.1 413") and orjson.loads(answer)["error"]["code"] == "request_too_large"


async def test_a_wrong_key_on_a_2_mib_body_reads_its_401_and_the_connection_ends(server):
    """A refused request ends its connection (Connection: close), and its body is read and
    dropped first, so httpx, which sends all 2 MiB before it reads, gets the 401."""
    import httpx2
    async with httpx2.AsyncClient(timeout=30) as client:
        for _ in range(2):
            r = await client.post(_gateway_url(server), content=b"{" + b" " * (2 * MiB) + b"}",
                                  headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["connection"] == "close"


async def _refused(server, raw: bytes, peer: str = "127.0.0.1") -> tuple[bytes, dict[str, str], bytes]:
    """``raw`` on a connection of its own: the answer, which must say close, and then the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server), local_addr=(peer, 0))
    try:
        writer.write(raw)
        status, headers, body = await _answer(reader)
        assert headers.get("connection") == "close", (status, headers)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection ends
        return status, headers, body
    finally:
        writer.close()


async def test_a_refused_request_ends_its_connection(ready):
    """Issue 40: a refused request (the peer guard's 404, a 401, a 429 of the rate limit, a
    400) held its connection for the keep-alive time, so refused clients could fill the cap;
    now only a request that passed the checks keeps its connection."""
    server, dep = ready
    cases = {
        "peer guard": (_req(server, dep, "X-Forwarded-For: 10.0.0.1"), 404, "not_found"),
        "key": (_req(server, dep, key="wrong"), 401, "invalid_api_key"),
        "path": (_req(server, dep, path=f"/dgxmm/ondemand/{dep}/v1/../v1/models", method="GET"), 400, "invalid_path"),
        "json": (_req(server, dep, body=b"[]"), 400, "invalid_json"),
    }
    for name, (raw, want, code) in cases.items():
        status, _, body = await _refused(server, raw)
        assert (status.split()[1], orjson.loads(body)["error"]["code"]) == (str(want).encode(), code), name
    limiter = server.app[GATEWAY].limiter
    for _ in range(20):
        limiter.fail("127.0.0.5")
    status, _, body = await _refused(server, _req(server, dep), peer="127.0.0.5")
    assert status.startswith(b"HTTP/1.1 429") and orjson.loads(body)["error"]["code"] == "rate_limited"
    async with _conn(server) as (reader, writer):  # a request that passed the checks keeps it
        for _ in range(2):
            writer.write(_req(server, dep))
            status, headers, _ = await _answer(reader)
            assert status == b"HTTP/1.1 200 OK" and "connection" not in headers


@pytest.mark.parametrize("raw", [b"GET /\r\n", b"GET /\r\n\r\n", b"GET /dgxmm/ondemand/1/v1/models\r\n\r\n",
                                 b"GET /dgxmm/api/host\r\nHost: x\r\n\r\n"])
async def test_a_request_line_without_a_version_is_400_and_closed(server, raw):
    """llhttp reads it as HTTP/0.9, and it was answered so ("HTTP/0.9 401"); a bare one waited
    for the head timeout."""
    status, _, body = await _refused(server, raw)
    assert status.startswith(b"HTTP/1.1 400") and orjson.loads(body)["error"]["code"] == "invalid_request"


async def _until_closed(server, t0: float) -> float:
    """Seconds from ``t0`` until the server closed every connection (its count is given back then)."""
    await wait_for(lambda: server.http.front.open.total == 0, timeout=20, what="the connection closed")
    return asyncio.get_running_loop().time() - t0


async def test_the_rest_of_a_refused_body_is_read_for_a_bounded_time_and_size(server):
    """What comes after the answer is read and dropped for ``lingering_s`` and
    ``linger_max_bytes`` at most, then the connection closes: a client that keeps sending
    (a body of a TiB) holds it no longer."""
    head = (f"POST /dgxmm/ondemand/999/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{server.key}\r\nContent-Length: {2 ** 40}\r\n\r\n").encode()

    async def keep_sending(writer, chunk: bytes, pause: float) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):  # (uvloop says RuntimeError)
            while True:
                writer.write(chunk)
                await writer.drain()
                await asyncio.sleep(pause)

    for limits, chunk, pause, bound in (({"lingering_s": 0.5}, b" " * 1024, 0.05, (0.4, 5)),  # time
                                        ({"lingering_s": 30, "linger_max_bytes": MiB}, b" " * 65536, 0, (0, 10))):
        server.set_limits(**limits)
        async with _conn(server) as (reader, writer):
            t0 = asyncio.get_running_loop().time()  # before the answer: its lingering starts after
            writer.write(head)
            status, headers, _ = await _answer(reader)
            assert status.startswith(b"HTTP/1.1 413") and headers["connection"] == "close"
            sending = asyncio.ensure_future(keep_sending(writer, chunk, pause))
            try:
                took = await _until_closed(server, t0)
            finally:
                sending.cancel()
        assert bound[0] <= took < bound[1], (limits, took)
