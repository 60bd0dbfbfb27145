"""Forwarding to an engine: the headers rule.

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

Both directions work on the header bytes as llhttp gave them (never decoded here) and give
the header lines ready to write. The engines' connection pools are ``http/pool.py``'s.
"""
from __future__ import annotations

from collections.abc import Sequence

from .headers import HEALTH_HEADER, ID_HEADER

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
_CONNECTION = b"Connection"  # a cache entry's mark: this header names others to drop
CACHE_MAX = 4096   # header lines remembered per direction (only key holders' requests add any)
CACHE_BYTES = 512  # of headers at most this long (name and value): 4 MiB at worst


class _Rule:
    """One direction's headers rule, with the line of every (name, value) it has seen: LiteLLM
    sends the same headers request after request, so most are a dict look-up (a third of the
    work of lowering, matching and formatting each one, twice a request)."""

    def __init__(self, drop: frozenset[bytes], prefixes: tuple[bytes, ...]):
        self.drop = drop
        self.prefixes = prefixes
        self.seen: dict[tuple[bytes, bytes], bytes] = {}

    def _line(self, pair: tuple[bytes, bytes]) -> bytes:
        """The header's line, b"" when dropped, :data:`_CONNECTION` for a Connection header."""
        name, value = pair
        # Names and values came through llhttp, which refuses CR and LF in them; a line break
        # of their own would be a second header or request: checked, never trusted.
        if b"\n" in name or b"\r" in name or b"\n" in value or b"\r" in value:
            raise ValueError("line break in a header")
        lower = name.lower()
        if lower == b"connection":
            return _CONNECTION
        if lower in self.drop or (self.prefixes and lower.startswith(self.prefixes)):
            return b""
        return b"%s: %s\r\n" % pair

    def lines(self, raw: RawHeaders) -> list[bytes]:
        """The lines of the headers kept; the names a ``Connection`` header lists (hop-by-hop
        too) are taken out after it, when there is one."""
        seen = self.seen
        out = []
        connection = False
        for pair in raw:
            line = seen.get(pair)
            if line is None:
                line = self._line(pair)
                if len(pair[0]) + len(pair[1]) <= CACHE_BYTES:
                    if len(seen) >= CACHE_MAX:
                        seen.clear()
                    seen[pair] = line
            if line is _CONNECTION:
                connection = True
            elif line:
                out.append(line)
        if connection:
            named = {t.strip().lower() for name, value in raw if name.lower() == b"connection"
                     for t in value.split(b",") if t.strip()}
            out = [line for line in out if line.partition(b":")[0].lower() not in named]
        return out


_REQUEST = _Rule(_DROP_REQUEST, _DROP_PREFIXES)
_RESPONSE = _Rule(_DROP_RESPONSE, ())


def request_lines(raw: RawHeaders, rid: str) -> bytes:
    """The client's headers as the engine gets them: the header lines (each ending CRLF),
    ``Accept-Encoding: identity`` and ``X-Request-Id: rid`` (the engine logs it too; vLLM takes
    it as its request id) among them; raises ValueError for a line break in a header."""
    lines = _REQUEST.lines(raw)
    lines.append(_IDENTITY)
    lines.append(b"X-Request-Id: %s\r\n" % rid.encode("ascii"))  # printable ASCII (exchange.valid_id)
    return b"".join(lines)


def response_lines(raw: RawHeaders) -> bytes:
    """The engine's headers as the client gets them: the header lines, each ending CRLF."""
    return b"".join(_RESPONSE.lines(raw))
