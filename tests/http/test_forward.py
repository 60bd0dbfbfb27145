"""The header rule between a client and an engine (ondemand/http/forward.py): which request
headers reach the engine and which of the engine's answer headers come back, as header lines,
remembered within a bound; and through the whole gateway (lower-case names, the WebSocket
headers, the engine's own request id)."""
import pytest
from engine_double import Engine, gateway_to, not_ours
from raw_http import CHAT, connection, forwarded, parse_answers, read_answer, req, talk

from ondemand.http.forward import request_lines, response_lines


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


def test_the_remembered_header_lines_are_bounded():
    from ondemand.http import forward as rule
    for i in range(rule.CACHE_MAX + 10):
        assert request_lines([(b"X-Call", b"%d" % i)], "r").startswith(b"X-Call: %d\r\n" % i)
    assert 0 < len(rule._REQUEST.seen) <= rule.CACHE_MAX


# --- through the gateway --------------------------------------------------------------------------

@pytest.mark.uvloop
async def test_lower_case_header_names_are_kept_from_the_engine_too(ready):
    """httpx (the OpenAI SDK's client, LiteLLM's) sends lower-case names: the header rules
    compare names without case, so nothing secret or hop-by-hop reaches the engine."""
    server, dep = ready
    raw = (f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
           f"authorization: Bearer {server.key}\r\ncookie: session=1\r\nconnection: keep-alive, x-private\r\n"
           f"x-private: secret\r\nkeep-alive: timeout=5\r\naccept-encoding: gzip\r\nproxy-connection: x\r\n"
           f"x-custom: kept\r\nupgrade: h2c\r\ncontent-type: application/json\r\ncontent-length: {len(CHAT)}\r\n"
           "\r\n").encode() + CHAT
    async with connection(server) as (reader, writer):
        writer.write(raw)
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep) + "/_sim/requests") as r:
        rows = [x for x in await r.json() if x["path"] == "/v1/chat/completions"]
    names = {}
    for k, v in rows[-1]["headers"]:
        names.setdefault(k.lower(), []).append(v)
    # An Upgrade not named in Connection asks nothing (the request is served), and is not forwarded.
    for banned in ("authorization", "cookie", "x-private", "keep-alive", "proxy-connection", "connection", "upgrade"):
        assert banned not in names, banned
    assert names["host"] == [server.deployer.base_url(dep).split("://")[1]]  # ours, once
    assert names["accept-encoding"] == ["identity"] and names["x-custom"] == ["kept"]


async def test_sec_websocket_headers_are_not_forwarded(ready):
    server, dep = ready
    data = req(server, dep, "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
               "Connection: close")
    assert parse_answers(await talk(server, data))[0][0] == 200
    [row] = (await forwarded(server, dep))[-1:]
    assert not [k for k, _ in row["headers"] if k.lower().startswith("sec-websocket-")]


@pytest.mark.uvloop
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
