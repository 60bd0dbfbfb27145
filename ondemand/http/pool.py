"""The engines' connection pools: one per deployment, plain HTTP/1.1 on ``asyncio.Protocol``.

At most 256 connections; 10 s to connect; 60 s to wait for a free connection when all 256 are
busy; no read or write timeout, because generation can be long. A request is one write (head
and body); the answer's head and chunked framing are parsed by llhttp through httptools' public
response parser (aiohttp's private ``HttpResponseParser`` before issue 23), and the body is
passed on as it arrives through a :class:`~.body.Body`, which pauses reading the engine's
socket while more than 128 KiB wait for a slow client. A connection goes back to the pool only
when the whole answer arrived, the whole request was sent and the engine allows keep-alive (no
``Connection: close``, no close-delimited body); otherwise (the client hung up, the engine broke
off) it is closed, which makes vLLM and llama.cpp cancel the generation. A request that finds
every connection busy waits in line (first come, first served) for a connection or for the slot
of one that closed. An idle connection the engine closes (uvicorn and llama.cpp do after 5 s)
leaves the pool at once, and one idle for more than 4 s is not reused (closed instead), so that
race hardly ever happens. A request whose reused connection closes within 1 s of the request
and before any byte of the answer (the engine closed it while the request was on its way) is
sent once more on a connection that never sat idle; a later close is the caller's
:class:`UpstreamError`, like any other failure: the engine may have worked on the request, and
a generation must not run twice. A connection closed with part of its request unsent is aborted
(reset), not closed after a flush that an engine no longer reading would never allow. When an
engine comes back on a new address, the old pool is closed only when its last stream ends: a
long generation must not be cut by a restart of a neighbour's engine on the same deployment id.

No locks or shields: all of it runs on the event loop, and every await that a cancellation
(the client hanging up) can interrupt closes the connection or gives its slot back; a
connection or slot handed to a waiter that is cancelled in the same turn of the loop is passed
on to the next. Imports nothing of ours but this package.
"""
from __future__ import annotations

import asyncio
import collections
import socket
import sys
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .body import Body, PayloadError

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # Python 3.10 (DGX OS): aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

__all__ = ["Upstreams", "UpstreamError", "Response", "PayloadError"]

LIMIT = 256              # connections per deployment
CONNECT_TIMEOUT = 10.0   # seconds to open a TCP connection
POOL_TIMEOUT = 60.0      # seconds to wait for a free connection when all are busy
IDLE_MAX = 4.0           # seconds an idle connection is reused: below the 5 s keep-alive of uvicorn (vLLM)
                         # and of llama.cpp's server, so the engine hardly ever closes one we are about to use
STALE_WINDOW = 1.0       # a reused connection closed within this of the request, with no answer, was stale
READ_LIMIT = 2 ** 16     # the body's low-water mark; reading pauses at twice this
_FLOW_CONTROL_ERRORS = (AttributeError, NotImplementedError, RuntimeError)  # as aiohttp's BaseProtocol


class UpstreamError(Exception):
    """The engine could not be reached, or closed or garbled the connection before its answer's head."""


class _Stale(UpstreamError):
    """The connection closed before any byte of the answer arrived."""


class _HeadOnly(Exception):
    """Raised in a callback: the answer to a HEAD request has no body, whatever it says."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""
    __slots__ = ("pool", "transport", "parser", "active", "head", "payload", "got_bytes", "keep", "paused",
                 "sent_at", "idle_since", "head_only", "answered", "status", "reason", "raw_headers", "framed")

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.active = False           # an exchange runs
        self.head: asyncio.Future[Response] | None = None
        self.payload: Body | None = None   # the body once the head arrived
        self.got_bytes = False
        self.keep = True              # False once anything rules out another exchange
        self.paused = False
        self.sent_at = 0.0            # loop time of the current exchange's request
        self.idle_since = 0.0         # loop time it went back to the pool
        self.head_only = False
        self.answered = False         # the final answer's end arrived
        self.status = 0
        self.reason = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.framed = False           # Content-Length or chunked: an early close is a cut body

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if not self.active:  # idle: the engine has nothing to say now
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            why = exc.__context__
            if isinstance(why, _HeadOnly):
                self.parser = httptools.HttpResponseParser(self)  # this one stopped inside the answer
                return
            self._failed(f"malformed answer from the engine: {why or exc}")
            self.close()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._failed(f"malformed answer from the engine: {exc!r}")
            self.close()

    def eof_received(self) -> None:
        return None  # close the transport: a half-closed engine connection is of no further use

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.keep = False
        self.pool._lost(self)
        if not self.active:
            return
        head = self.head
        if head is not None and not head.done():
            why = f"the engine closed the connection{': ' + str(exc) if exc else ''}"
            # Stale (safe to send again) only when the close came right after the request:
            # the engine closing an idle connection as it arrived. Later, the engine may have
            # worked on it (a generation, a crash): sending it again could run it twice.
            stale = not self.got_bytes and self.pool.loop.time() - self.sent_at < STALE_WINDOW
            head.set_exception(_Stale(why) if stale else UpstreamError(why))
            return
        payload = self.payload
        if payload is not None and not payload.is_eof() and payload.exception() is None:
            if self.framed or exc is not None:
                payload.set_exception(PayloadError("the engine broke off the answer"))
            else:
                payload.feed_eof()  # a close-delimited body ends with the connection

    # --- llhttp's callbacks ---

    def on_message_begin(self) -> None:
        if self.answered:
            raise ValueError("the engine sent more than one answer")
        self.status = 0
        self.reason = b""
        self.raw_headers = []

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = self.status = parser.get_status_code()
        if status < 200:  # an interim answer (1xx): the real one follows
            return
        headers: CIMultiDict[str] = CIMultiDict()
        chunked = False
        for name, value in self.raw_headers:
            n = name.decode("utf-8", "surrogateescape")
            v = value.decode("utf-8", "surrogateescape")
            headers.add(n, v)
            lower = n.lower()
            if lower == "content-length" or (lower == "transfer-encoding" and "chunked" in v.lower()):
                chunked = True
        self.framed = chunked
        if not parser.should_keep_alive():
            self.keep = False
        payload = self.payload = Body(self, READ_LIMIT)
        head = self.head
        if head is not None and not head.done():
            head.set_result(Response(self, status, self.reason.decode("utf-8", "surrogateescape"),
                                     CIMultiDictProxy(headers), payload))
        if self.head_only or status in (204, 304):
            self.answered = True
            payload.feed_eof()
            if self.head_only:
                raise _HeadOnly()

    def on_body(self, body: bytes) -> None:
        if self.payload is not None:
            self.payload.feed_data(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.answered = True
        if self.payload is not None:
            self.payload.feed_eof()

    # --- flow control, called by the body ---

    def pause_reading(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            try:
                self.transport.pause_reading()
            except _FLOW_CONTROL_ERRORS:  # a closing transport: nothing more to read anyway
                pass

    def resume_reading(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None:
                try:
                    self.transport.resume_reading()
                except _FLOW_CONTROL_ERRORS:
                    pass

    # --- ours ---

    def _failed(self, why: str) -> None:
        self.keep = False
        head = self.head
        if head is not None and not head.done():
            head.set_exception(UpstreamError(why))
        elif self.payload is not None and not self.payload.is_eof():
            self.payload.set_exception(PayloadError(why))

    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        self.keep = False
        if self.transport is not None:
            if self.transport.get_write_buffer_size():
                # Part of the request is unsent (the client hung up during a big upload, or the
                # engine answered early): close() would first wait for an engine that may never
                # read it, holding the slot; and the engine would get the whole request after all.
                self.transport.abort()
            else:
                self.transport.close()

    async def exchange(self, data: bytes | list[bytes], head_only: bool) -> Response:
        """Send one request and wait for the answer's head; on any exception the connection is closed."""
        loop = self.pool.loop
        self.active = True
        self.head_only = head_only
        self.answered = False
        head: asyncio.Future[Response] = loop.create_future()
        self.head = head
        self.payload = None
        self.got_bytes = False
        self.sent_at = loop.time()
        try:
            if self.transport is None or self.transport.is_closing():
                raise _Stale("the engine closed the connection")
            if type(data) is list:
                self.transport.writelines(data)
            else:
                self.transport.write(data)  # type: ignore[arg-type]
            return await head
        except BaseException:
            # Cancelled (the client hung up) or failed: the engine must see the connection close.
            self.close()
            if not head.done():
                head.cancel()  # awaited by no one now: connection_lost must not leave an exception in it
            raise

    def done(self) -> None:
        """The exchange is over: back to the pool when the answer was read to its end, else closed."""
        payload = self.payload
        transport = self.transport
        # Not while part of the request is still unsent: an engine that answered early would
        # read the rest of that body as the next request.
        if self.keep and self.answered and payload is not None and payload.is_eof() \
                and payload.exception() is None and transport is not None and not transport.is_closing() \
                and not transport.get_write_buffer_size():
            self.active = False
            self.head = self.payload = None
            self.resume_reading()  # an idle connection must notice the engine closing it
            self.pool._put_back(self)
        else:
            self.close()


class Response:
    """An engine's answer: status, headers and ``content`` (a :class:`~.body.Body`)."""
    __slots__ = ("status", "reason", "headers", "content", "_conn")

    def __init__(self, conn: _Conn, status: int, reason: str, headers: CIMultiDictProxy[str], content: Body):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content = content
        self._conn: _Conn | None = conn

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("Content-Length")
        return int(v) if v is not None and v.isdigit() else None

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "application/octet-stream").partition(";")[0].strip().lower()

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Exactly once per answer, however it ended (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done()


class _Pool:
    """The connections to one engine address."""

    def __init__(self, base_url: str, limit: int = LIMIT, connect_timeout: float = CONNECT_TIMEOUT,
                 pool_timeout: float = POOL_TIMEOUT):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// engine address: {base_url!r}")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2]
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.pool_timeout = pool_timeout
        self.loop = asyncio.get_running_loop()
        self.size = 0                  # connections open or being opened (each holds a slot)
        self.conns: set[_Conn] = set()   # every open connection, idle or busy
        self.idle: list[_Conn] = []    # LIFO: the most recently used connection is the likeliest alive
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.streams = 0               # leases not yet ended
        self.retired = False
        self.closed = False

    # --- requests ---

    def _encode(self, method: str, target: str, headers: CIMultiDict[str], body: bytes | None) -> bytes | list[bytes]:
        lines = [f"{method} {self.prefix}{target} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        head = "".join(lines)
        # Names and values came through llhttp, which refuses CR and LF in them; a line break
        # of their own would be a second header or request: count, never trust.
        if head.count("\n") != len(lines) + 1 or head.count("\r") != len(lines) + 1:
            raise ValueError("line break in a request header")
        raw = head.encode("utf-8", "surrogateescape")  # the bytes the client sent (decoded with surrogateescape)
        if not body:
            return raw
        return raw + body if len(body) <= 65536 else [raw, body]

    async def request(self, method: str, target: str, headers: CIMultiDict[str], body: bytes | None) -> Response:
        """The answer's head; the caller must ``release()`` it. Raises :class:`UpstreamError`."""
        data = self._encode(method, target, headers, body)
        head_only = method == "HEAD"
        conn, reused = await self._acquire(fresh=False)
        try:
            return await conn.exchange(data, head_only)
        except _Stale:
            if not reused:
                raise
        # The engine closed the idle connection while the request was on its way: once more,
        # on a connection that did not sit idle.
        conn, _ = await self._acquire(fresh=True)
        return await conn.exchange(data, head_only)

    # --- connections ---

    async def _acquire(self, fresh: bool) -> tuple[_Conn, bool]:
        if self.closed:
            raise UpstreamError("the engine's address changed")
        if not fresh:
            now = self.loop.time()
            while self.idle:
                conn = self.idle.pop()
                if conn.alive():
                    if now - conn.idle_since <= IDLE_MAX:
                        return conn, True
                    conn.close()  # idle too long: the engine may close it any moment (its slot comes back)
        if self.size < self.limit:
            self.size += 1
            return await self._connect(), False
        waiter = self.loop.create_future()
        self.waiters.append(waiter)
        try:
            async with _timeout(self.pool_timeout):
                got = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._hand_on(waiter.result())  # handed a connection or a slot in the same turn: pass it on
            else:
                waiter.cancel()
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.TimeoutError):  # TimeoutError itself from 3.11
                raise UpstreamError(f"no free connection to the engine within {self.pool_timeout:g} s") from None
            raise
        if got is None:  # a slot: connect
            return await self._connect(), False
        if fresh:  # a connection handed over straight from a finished answer never sat idle
            return got, False
        return got, True

    async def _connect(self) -> _Conn:
        """Open a connection on a slot the caller holds; the slot is passed on when this fails."""
        try:
            async with _timeout(self.connect_timeout):
                _tr, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except BaseException as exc:
            self._slot_free()
            if isinstance(exc, asyncio.TimeoutError):  # TimeoutError itself from 3.11
                raise UpstreamError(f"connect to {self.host}:{self.port} timed out after "
                                    f"{self.connect_timeout:g} s") from None
            if isinstance(exc, OSError):
                raise UpstreamError(str(exc) or repr(exc)) from None
            raise
        if self.closed or conn.transport is None:  # closed while connecting, by us or the engine
            conn.close()
            self._slot_free()  # connection_lost frees only the slots of registered connections
            raise _Stale("the engine's address changed" if self.closed else "the engine closed the connection")
        self.conns.add(conn)
        return conn

    def _hand_on(self, got: _Conn | None) -> None:
        if got is None:
            self._slot_free()
        else:
            self._put_back(got)

    def _put_back(self, conn: _Conn) -> None:
        if self.closed:
            conn.close()
            return
        waiters = self.waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(conn)
                return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)

    def _slot_free(self) -> None:
        """A connection closed (or never opened): its slot goes to the first waiter, else back."""
        waiters = self.waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self.size -= 1

    def _lost(self, conn: _Conn) -> None:
        """connection_lost: called once per connection; a registered one gives its slot back."""
        if conn in self.conns:
            self.conns.discard(conn)
            try:
                self.idle.remove(conn)
            except ValueError:
                pass
            self._slot_free()

    def close(self) -> None:
        """Close every connection, busy ones too, and refuse new requests."""
        self.closed = True
        for w in self.waiters:
            if not w.done():
                w.set_exception(UpstreamError("the engine's address changed"))
        self.waiters.clear()
        self.idle.clear()
        for conn in list(self.conns):
            conn.close()


class Upstreams:
    """The connection pools of the engines, by deployment id."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._current: dict[int, _Pool] = {}
        self._retired: set[_Pool] = set()

    def open(self, dep_id: int, base_url: str) -> _Lease:
        up = self._current.get(dep_id)
        if up is None or up.base_url != base_url:
            if up is not None:
                self._retire(up)
            up = self._current[dep_id] = _Pool(base_url, self.limit)
        up.streams += 1
        return _Lease(self, up)

    def _retire(self, up: _Pool) -> None:
        up.retired = True
        if up.streams == 0:
            up.close()
        else:
            self._retired.add(up)

    def _ended(self, up: _Pool) -> None:
        up.streams -= 1
        if up.retired and up.streams == 0:
            self._retired.discard(up)
            up.close()

    def forget(self, dep_id: int) -> None:
        """The deployment was removed: close its pool once idle."""
        up = self._current.pop(dep_id, None)
        if up is not None:
            self._retire(up)

    async def close(self) -> None:
        ups = list(self._current.values()) + list(self._retired)
        self._current.clear()
        self._retired.clear()
        for up in ups:
            up.close()
        await asyncio.sleep(0)  # the transports' connection_lost runs on the next turn of the loop


class _Lease:
    """One stream's use of a pool; ``end()`` exactly once (idempotent), after its answer's ``release()``."""
    __slots__ = ("_owner", "_up", "_ended")

    def __init__(self, owner: Upstreams, up: _Pool):
        self._owner = owner
        self._up = up
        self._ended = False

    @property
    def base_url(self) -> str:
        return self._up.base_url

    def request(self, method: str, target: str, headers: CIMultiDict[str], body: bytes | None
                ) -> Coroutine[Any, Any, Response]:
        """``await`` it for the answer's head (a :class:`Response`); raises :class:`UpstreamError`."""
        return self._up.request(method, target, headers, body)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._owner._ended(self._up)
