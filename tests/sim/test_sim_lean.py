"""The engine simulator on the lean front (ondemand/sim/server.py): no aiohttp in its process,
whatever it serves (a simulator's start is most of the suite's CPU, and aiohttp's import was most
of a start), and what aiohttp's application decided there, decided the same: the path, the
router's path and the query string as yarl decodes them, 404 and 405 as aiohttp's router
tells them."""
from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st
from yarl import URL

from ondemand.sim.server import QUERY_KEPT, unquote

HEAVY = ("aiohttp", "yarl", "attr")

# A simulator in a process of its own: every kind of route answered over a socket, then the
# modules it loaded. (A route that imported aiohttp when first called would show here.)
SERVE_ALL = r"""
import asyncio, sys
from ondemand.sim.engine import SimOptions, SimServer

MP = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nxx\r\n--B--\r\n')
ASKS = [("GET", "/health", b"", ""), ("GET", "/v1/models/m", b"", ""), ("GET", "/metrics", b"", ""),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "stream": true}',
         "application/json"),
        ("POST", "/v1/completions", b'{"prompt": "a"}', "application/json"),
        ("POST", "/v1/audio/transcriptions", MP, "multipart/form-data; boundary=B"),
        ("POST", "/sleep?level=2", b"", ""), ("POST", "/wake_up", b"", ""), ("GET", "/nope", b"", ""),
        ("GET", "/_sim/requests", b"", ""), ("GET", "/_sim/launch", b"", ""), ("POST", "/_sim/state", b"", "")]

async def main():
    server = SimServer(SimOptions(port=0, model="m"))
    port = await server.start()
    statuses = []
    for method, path, body, ctype in ASKS:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + (f"Content-Type: {ctype}\r\n".encode() if ctype else b"") + b"\r\n" + body)
        statuses.append(int((await reader.read()).split(b" ", 2)[1]))
        writer.close()
    await server.stop()
    print(statuses, sorted(m for m in sys.modules if m.split(".")[0] in ("aiohttp", "yarl", "attr")))

asyncio.run(main())
"""


def test_the_simulator_imports_no_aiohttp():
    code = ("import sys, ondemand.sim.engine\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_simulator_serves_every_kind_of_route_without_aiohttp():
    out = subprocess.run([sys.executable, "-c", SERVE_ALL], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert out.strip() == "[200, 200, 200, 200, 200, 200, 200, 200, 404, 200, 200, 405] []", out


_PIECES = st.sampled_from(["%", "%2", "%2F", "%2f", "%25", "%2B", "%20", "+", "&", "=", ";", "/", "a", "Z", "~",
                           "%C3%A9", "%c3", "%A9", "%E2%82%AC", "%E2%82", "%F0%9F%98%80", "%ED%A0%80", "%C0%AF",
                           "%FF", "%3F", "%23", "%7B", "é", "%zz", "%41%42"])


@given(st.lists(_PIECES, max_size=12).map("".join))
def test_the_path_and_query_decode_as_yarl_decodes_them(raw):
    url = URL.build(path="/" + raw, query_string=raw, encoded=True)
    assert unquote("/" + raw) == url.path
    assert unquote("/" + raw, "/%") == url.path_safe
    assert unquote(raw, QUERY_KEPT, plus=True) == url.query_string


async def test_a_target_that_is_not_a_path_gets_an_engines_404_not_the_gateways():
    """The front refuses an absolute-form target where it hands nothing off; the simulator's
    answer names no setting of the gateway's (``admin_listen``), as an engine's would not."""
    import asyncio

    import orjson

    from ondemand.sim.engine import SimOptions, SimServer
    server = SimServer(SimOptions(port=0, model="m"), shutdown_timeout=0.1)
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # it ends the connection
        writer.close()
    finally:
        await server.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ")
    error = orjson.loads(body)["error"]
    assert error["code"] == "not_found" and "admin_listen" not in error["message"]


async def test_a_request_goes_on_when_its_client_hangs_up_once_it_is_in(tmp_path):
    """Listener._serve's shield: as under aiohttp, a route whose request has come in whole runs
    to its end when the client goes away (the journal's end line comes after the whole answer,
    1 s of tokens here, not at the hang-up)."""
    import asyncio

    import orjson

    from ondemand.sim.engine import SimOptions, SimServer
    journal = tmp_path / "journal"
    server = SimServer(SimOptions(port=0, model="m", tokens=10, token_delay=0.1, journal=str(journal)),
                       shutdown_timeout=0.1)
    port = await server.start()
    try:
        body = b'{"prompt": "a", "max_tokens": 10}'
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

        async def journal_has(ev: str) -> list[dict]:
            for _ in range(400):  # 20 s at most: a loaded machine
                lines = [orjson.loads(line) for line in journal.read_bytes().splitlines()] if journal.exists() else []
                if any(e["ev"] == ev for e in lines):
                    return lines
                await asyncio.sleep(0.05)
            raise AssertionError(f"no {ev} line in the journal")
        await journal_has("req")  # the request is in (read whole, recorded)
        writer.close()
        lines = await journal_has("end")
    finally:
        await server.stop()
    req = next(e for e in lines if e["ev"] == "req")
    end = next(e for e in lines if e["ev"] == "end")
    assert end["t"] - req["t"] >= 0.9
