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

from multidict import CIMultiDict, CIMultiDictProxy, istr

from .http.headers import HEALTH_HEADER, ID_HEADER

# Lower-case: names are compared as ``name.lower()``. (An ``istr`` hashes as its text: a set of
# them finds "Host" but not "host", which httpx, the OpenAI SDK's client, sends.)
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
    "TE", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade"))
_DROP_REQUEST = HOP_BY_HOP | frozenset(h.lower() for h in (
    "Authorization", "Cookie", "Host", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto",
    "X-Forwarded-Port", "X-Forwarded-Prefix", "Forwarded", "X-Real-IP", "Content-Length",
    "Accept-Encoding", "Expect", HEALTH_HEADER))
# X-Request-Id: the gateway writes its own (the engine's would be a second one, issue 23).
_DROP_RESPONSE = HOP_BY_HOP | frozenset(h.lower() for h in ("Server", "Date", "Content-Length", ID_HEADER))
_IDENTITY = (istr("Accept-Encoding"), "identity")
_DROP_PREFIXES = ("x-forwarded-", "sec-websocket-")

def _named_in_connection(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    named = headers.getall("Connection", ())
    if not named:
        return frozenset()
    return frozenset(t.strip().lower() for v in named for t in v.split(",") if t.strip())


def request_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    extra = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        # Sec-WebSocket-*: the gateway upgrades nothing, an engine must not see a handshake (issue 23).
        if lower not in _DROP_REQUEST and lower not in extra and not lower.startswith(_DROP_PREFIXES):
            out.add(name, value)
    out.add(*_IDENTITY)
    return out


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    extra = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in _DROP_RESPONSE and lower not in extra:
            out.add(name, value)
    return out
