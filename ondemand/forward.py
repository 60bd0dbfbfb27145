"""Forwarding to an engine: a keep-alive connection pool per deployment, and the headers rule.

Request headers: Authorization, Cookie, Host, forwarding headers, hop-by-hop
headers (and any named in Connection), Content-Length, Expect and the
health-check marker are removed; ``Accept-Encoding: identity`` is sent, so the
bytes passed back are the bytes the engine wrote. Host is the engine's
host:port; a request with a body (possibly empty) gets its Content-Length. No
Content-Type is added when the client sent none (aiohttp's client added
``application/octet-stream``, which FastAPI engines such as vLLM then refuse to
read as JSON; with none they parse it). Response headers: all but hop-by-hop,
Server and Date (the gateway writes its own), Content-Length (set from
the body passed back) and X-Request-Id (the gateway's replaces the engine's). Sec-WebSocket-*
request headers are dropped too: nothing is upgraded. There is no cookie jar: nothing of one answer rides on
another request.

The engines' connection pools are ``http/pool.py``'s.
"""
from __future__ import annotations

from collections.abc import Sequence

from .http.headers import HEALTH_HEADER, ID_HEADER

RawHeaders = Sequence[tuple[bytes, bytes]]  # as llhttp gave them

# Lower-case bytes: names are compared as llhttp gave them, ``name.lower()``, never decoded.
HOP_BY_HOP = frozenset(h.lower().encode() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
    "TE", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade"))
_DROP_REQUEST = HOP_BY_HOP | frozenset(h.lower().encode() for h in (
    "Authorization", "Cookie", "Host", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto",
    "X-Forwarded-Port", "X-Forwarded-Prefix", "Forwarded", "X-Real-IP", "Content-Length",
    "Accept-Encoding", "Expect", HEALTH_HEADER, ID_HEADER))
# X-Request-Id: the gateway writes its own, to the engine and to the client (the engine's would
# be a second one, issue 23).
_DROP_RESPONSE = HOP_BY_HOP | frozenset(h.lower().encode() for h in ("Server", "Date", "Content-Length", ID_HEADER))
# Sec-WebSocket-*: the gateway upgrades nothing, an engine must not see a handshake (issue 23).
_DROP_PREFIXES = (b"x-forwarded-", b"sec-websocket-")
_IDENTITY = b"Accept-Encoding: identity\r\n"


def _lines(raw: RawHeaders, drop: frozenset[bytes], prefixes: tuple[bytes, ...]) -> list[bytes]:
    """The lines of the headers kept, in one pass (this runs twice a request); the names a
    ``Connection`` header lists (hop-by-hop too) are taken out after it, when there is one."""
    out = []
    named: list[bytes] | None = None
    for name, value in raw:
        lower = name.lower()
        if lower in drop:
            if lower == b"connection":
                named = (named or []) + [t.strip().lower() for t in value.split(b",") if t.strip()]
            continue
        if prefixes and lower.startswith(prefixes):
            continue
        out.append(b"%s: %s\r\n" % (name, value))
    if named:
        out = [line for line in out if line.partition(b":")[0].lower() not in named]
    return out


def _joined(lines: list[bytes]) -> bytes:
    block = b"".join(lines)
    # Names and values came through llhttp, which refuses CR and LF in them; a line break of
    # their own would be a second header or request: count, never trust.
    if block.count(b"\n") != len(lines) or block.count(b"\r") != len(lines):
        raise ValueError("line break in a header")
    return block


def request_lines(raw: RawHeaders, rid: str) -> bytes:
    """The client's headers as the engine gets them: the header lines (each ending CRLF),
    ``Accept-Encoding: identity`` and ``X-Request-Id: rid`` (the engine logs it too; vLLM takes
    it as its request id) among them; raises ValueError for a line break in a header."""
    lines = _lines(raw, _DROP_REQUEST, _DROP_PREFIXES)
    lines.append(_IDENTITY)
    lines.append(b"X-Request-Id: %s\r\n" % rid.encode("ascii"))  # printable ASCII (exchange.valid_id)
    return _joined(lines)


def response_lines(raw: RawHeaders) -> bytes:
    """The engine's headers as the client gets them: the header lines, each ending CRLF."""
    return _joined(_lines(raw, _DROP_RESPONSE, ()))
