"""The client's side of the wire, for the tests of ondemand/http/ that talk to a whole server
(``helpers.run_app``, the ``server`` fixture) on raw loopback sockets, where the framing
matters: requests as bytes, and the answers read back as status, headers and body."""
from __future__ import annotations

import asyncio
import contextlib

import orjson
from helpers import wait_for

CHAT = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hello"}]})
MiB = 2 ** 20


def port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


def req(server, dep, *lines: str, method: str = "POST", route: str = "chat/completions", path: str | None = None,
        body: bytes = CHAT, version: str = "1.1", key: str | None = None) -> bytes:
    """A gateway request to deployment ``dep`` (``path``: another target); a POST with its body."""
    target = path or f"/dgxmm/ondemand/{dep}/v1/{route}"
    head = [f"{method} {target} HTTP/{version}", "Host: x", f"Authorization: Bearer {key or server.key}", *lines]
    if method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body if method == "POST" else b"")


def admin(server, path: str = "/dgxmm/api/host", *lines: str, method: str = "GET", body: bytes = b"") -> bytes:
    """An admin API request, with the admin token."""
    head = [f"{method} {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {server.token}", *lines]
    if body or method in ("POST", "PATCH"):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def gateway_url(server, dep: int = 999) -> str:
    return f"{server.url}/ondemand/{dep}/v1/chat/completions"


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
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
async def connection(server):
    """A connection to the server's listener: (reader, writer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    try:
        yield reader, writer
    finally:
        writer.close()


async def talk(server, data: bytes, *, timeout: float = 10, want: int | None = None) -> bytes:
    """Write ``data`` at once, then read until the server closes (or ``timeout``), or, with
    ``want``, until that many whole answers came (where the connection may stay open: a
    keep-alive answer, or aiohttp reading an unread body for its lingering time)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
    try:
        writer.write(data)
        out = b""
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), deadline - asyncio.get_running_loop().time()):
                out += chunk
                if want is not None and len(parse_answers(out)) >= want:
                    break
        return out
    finally:
        writer.close()


def parse_answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The answers in ``data``: status, headers (lower-case names), body (Content-Length only)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        n = int(headers.get("content-length", "0"))
        if len(rest) < n:
            break  # its body is still on the way
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def error_code(answer) -> str:
    """The documented JSON error's code of a parsed answer (which must be JSON)."""
    status, headers, body = answer
    assert headers["content-type"].startswith("application/json"), answer
    return orjson.loads(body)["error"]["code"]


async def refused_then_closed(server, raw: bytes, peer: str = "127.0.0.1") -> tuple[bytes, dict[str, str], bytes]:
    """``raw`` on a connection of its own: the answer, which must say close, and then the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port(server), local_addr=(peer, 0))
    try:
        writer.write(raw)
        status, headers, body = await read_answer(reader)
        assert headers.get("connection") == "close", (status, headers)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection ends
        return status, headers, body
    finally:
        writer.close()


async def forwarded(server, dep) -> list:
    """The requests the engine simulator of ``dep`` got on the gateway's routes, as it recorded them."""
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep) + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"].startswith("/v1/") and x["path"] != "/v1/models"]


async def writes_stalled(writer, timeout: float = 10) -> None:
    """Until the writer's unsent bytes no longer shrink (the peer takes no more): three readings
    apart, all equal and not nil."""
    seen: list[int] = []

    def still() -> bool:
        seen.append(writer.transport.get_write_buffer_size())
        return len(seen) >= 3 and seen[-1] > 0 and seen[-1] == seen[-2] == seen[-3]
    await wait_for(still, timeout=timeout, interval=0.05, what="the client's writes to stall")


async def keep_sending(writer, chunk: bytes, pause: float) -> None:
    """``chunk`` after ``chunk``, ``pause`` apart, until the server closes the connection."""
    with contextlib.suppress(ConnectionError, RuntimeError):  # closed under us (uvloop says RuntimeError)
        while True:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(pause)


async def until_closed(server, t0: float) -> float:
    """Seconds from ``t0`` until the server closed every connection (its count is given back then)."""
    await wait_for(lambda: server.http.front.open.total == 0, timeout=20, what="the connection closed")
    return asyncio.get_running_loop().time() - t0
