"""Forwarding to an engine: one client session per deployment, and the headers rule.

Request headers: Authorization, Cookie, Host, forwarding headers, hop-by-hop
headers (and any named in Connection), Content-Length (aiohttp sets its own)
and the health-check marker are removed; ``Accept-Encoding: identity`` is
sent, so the bytes passed back are the bytes the engine wrote. Response
headers: all but hop-by-hop, Server and Date (aiohttp writes its own).

Sessions: one per deployment (256 connections; 10 s to connect; 60 s to
wait for a pooled connection; no read or write timeout, because generation
can be long). When an engine comes back on a new address, the old session is
closed only when its last stream ends: a long generation must not be cut by
a restart of a neighbour's engine on the same deployment id.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy, istr

log = logging.getLogger("ondemand.forward")

HOP_BY_HOP = frozenset(istr(h) for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
    "TE", "Trailer", "Trailers", "Transfer-Encoding", "Upgrade"))
_DROP_REQUEST = HOP_BY_HOP | frozenset(istr(h) for h in (
    "Authorization", "Cookie", "Host", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto",
    "X-Forwarded-Port", "X-Forwarded-Prefix", "Forwarded", "X-Real-IP", "Content-Length",
    "Accept-Encoding", "Expect", "x-dgxmm-health-check"))
_DROP_RESPONSE = HOP_BY_HOP | frozenset(istr(h) for h in ("Server", "Date", "Content-Length"))
_IDENTITY = (istr("Accept-Encoding"), "identity")


def _named_in_connection(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    named = headers.getall("Connection", ())
    if not named:
        return frozenset()
    return frozenset(istr(t.strip()) for v in named for t in v.split(",") if t.strip())


def request_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    extra = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name not in _DROP_REQUEST and name not in extra and not name.lower().startswith("x-forwarded-"):
            out.add(name, value)
    out.add(*_IDENTITY)
    return out


def response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    extra = _named_in_connection(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name not in _DROP_RESPONSE and name not in extra:
            out.add(name, value)
    return out


class _Upstream:
    __slots__ = ("base_url", "session", "streams", "retired")

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=256, ttl_dns_cache=60,
                                           enable_cleanup_closed=False),
            # connect: waiting for a pooled connection plus connecting; sock_connect: connecting.
            timeout=aiohttp.ClientTimeout(total=None, connect=60, sock_connect=10, sock_read=None),
            # No cookie jar: a Set-Cookie of one answer must never ride on another user's request.
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"))
        self.streams = 0
        self.retired = False


class Upstreams:
    """The client sessions of the engines, by deployment id."""

    def __init__(self) -> None:
        self._current: dict[int, _Upstream] = {}
        self._retired: set[_Upstream] = set()
        self._closing: set[asyncio.Task] = set()

    def open(self, dep_id: int, base_url: str) -> "_Lease":
        up = self._current.get(dep_id)
        if up is None or up.base_url != base_url:
            if up is not None:
                self._retire(up)
            up = self._current[dep_id] = _Upstream(base_url)
        up.streams += 1
        return _Lease(self, up)

    def _retire(self, up: _Upstream) -> None:
        up.retired = True
        if up.streams == 0:
            self._close(up)
        else:
            self._retired.add(up)

    def _ended(self, up: _Upstream) -> None:
        up.streams -= 1
        if up.retired and up.streams == 0:
            self._retired.discard(up)
            self._close(up)

    def _close(self, up: _Upstream) -> None:
        task = asyncio.get_running_loop().create_task(up.session.close(), name=f"close upstream {up.base_url}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def forget(self, dep_id: int) -> None:
        """The deployment was removed: close its session once idle."""
        up = self._current.pop(dep_id, None)
        if up is not None:
            self._retire(up)

    async def close(self) -> None:
        ups = list(self._current.values()) + list(self._retired)
        self._current.clear()
        self._retired.clear()
        await asyncio.gather(*(u.session.close() for u in ups), *self._closing, return_exceptions=True)


class _Lease:
    """One stream's use of a session; ``end()`` exactly once (idempotent)."""
    __slots__ = ("_owner", "_up", "_ended")

    def __init__(self, owner: Upstreams, up: _Upstream):
        self._owner = owner
        self._up = up
        self._ended = False

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._up.session

    @property
    def base_url(self) -> str:
        return self._up.base_url

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._owner._ended(self._up)
