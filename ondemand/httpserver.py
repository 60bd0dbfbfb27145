"""The HTTP server: the gateway's lean front, aiohttp's application for the rest, and the
bounds on what a client may make either hold.

**The lean front** (:class:`_Front`, on when the application has a :data:`LEAN_ROUTE`):
every connection starts here. llhttp parses (through httptools, as uvicorn uses it; no
parser of our own), and a request whose target starts with the gateway's prefix goes
straight to the gateway's handler as a :class:`Call`, without aiohttp's request and
response objects, router, middlewares or writer: the gateway writes its answer's bytes
itself. Requests on one connection are handled one at a time, in order. Any other request
(the admin API, the page, ``/metrics``, ``/healthz``, anything unknown) goes to aiohttp's
own connection object, :class:`_Protocol`, its head written anew from what llhttp parsed,
once the gateway's answers before it are out; the connection's requests stay with aiohttp
until it is between requests when a gateway request comes. A gateway request that comes
while aiohttp still has the connection (pipelined behind an admin request) reaches the
gateway through :class:`AioCall`, with the same checks and answers.

**The bounds.** aiohttp's limits, applied by the lean front too: a request line over
``MAX_LINE_SIZE``, a header over ``MAX_FIELD_SIZE`` or more than ``MAX_HEADERS`` headers
is 400 and the connection is closed; so is every framing trick llhttp refuses
(Content-Length with Transfer-Encoding, two Content-Lengths, obs-fold, bare CR or LF, bad
chunk sizes, unknown codings); the lean front's 400 is JSON (``invalid_request``).
aiohttp alone does not bound the time a request head may take to arrive (a "slowloris"
holds its connection until the keep-alive timeout), nor the total size of a head
(``max_headers`` times ``max_field_size``: 8 MiB a connection), and it logs every
malformed request with a traceback (a log flood for anyone who can open a TCP
connection). Here, on both:

- :data:`HEAD_TIMEOUT_S`: a request head must be complete within this many seconds
  of its first byte, else 408 and the connection is closed;
- :data:`MAX_HEAD_BYTES`: a head may hold at most this many bytes, else 431 and the
  connection is closed;
- :data:`KEEPALIVE_TIMEOUT_S`: an idle keep-alive connection is closed after this;
  it is longer than LiteLLM's own idle limit (120 s), so that LiteLLM never sends a
  request on a connection the gateway is closing;
- :data:`LINGERING_S`: the rest of a body after an early answer (401, 413) is read and
  dropped for this long at most, so that the client reads the answer (an unread body
  would make the close a reset);
- one log line (no traceback) per minute for malformed requests, with their count (the
  lean front's, :class:`_RefusalLog`; aiohttp's, :class:`_MalformedFilter`).

:class:`Runner` is an ``aiohttp.web.AppRunner`` whose connections are the lean front's,
or :class:`_Protocol` without a lean route; its shutdown waits for the lean front's
answers as aiohttp's does for its own. ``serve`` and the tests' ``run_app`` both use it.
Imports nothing of ours.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

import httptools
import orjson
from aiohttp import web, web_server
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict, CIMultiDictProxy

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # Python 3.10 (DGX OS): aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

__all__ = ["Runner", "HANDLER_ARGS", "HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "KEEPALIVE_TIMEOUT_S",
           "quiet_malformed_requests", "LeanRoute", "LEAN_ROUTE", "Call", "AioCall", "BodyTooLarge", "BodyMalformed"]

HEAD_TIMEOUT_S = 10.0          # from the first byte of a request head to its end
MAX_HEAD_BYTES = 128 * 1024    # request line and headers together
KEEPALIVE_TIMEOUT_S = 300.0    # an idle keep-alive connection; LiteLLM's own is 120 s
MAX_LINE_SIZE = 8190           # the request line (aiohttp's default): an overlong path is 400
MAX_FIELD_SIZE = 65536         # one header, name and value
MAX_HEADERS = 128              # header lines (aiohttp's default)
LINGERING_S = 10.0             # how long an unread body is read and dropped after an early answer

# The aiohttp server options (web.Application's handler_args: they win over the runner's).
HANDLER_ARGS: dict[str, Any] = {
    "max_line_size": MAX_LINE_SIZE, "max_field_size": MAX_FIELD_SIZE, "max_headers": MAX_HEADERS,
    "keepalive_timeout": KEEPALIVE_TIMEOUT_S, "lingering_time": LINGERING_S}

_log = logging.getLogger("ondemand.http")


def _refusal(status: int, reason: str, code: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Protocol(web.RequestHandler):
    """aiohttp's connection, with a deadline and a size limit on each request head.

    A head begins with the first byte that arrives while the connection waits for a
    request (aiohttp's ``_waiter``; or before its first request); it ends when aiohttp's
    parser hands over a message. Bytes that arrive while a request is handled are its
    body or a pipelined head, which aiohttp holds (at most ``max_headers`` times
    ``max_field_size``) until the keep-alive timeout at the latest.
    """

    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0

    def _between_requests(self) -> bool:
        waiter = self._waiter
        if waiter is not None:
            return not waiter.done()
        return self._request_count == 0 and not self._messages and not self._request_in_progress

    def data_received(self, data: bytes) -> None:
        between = self._between_requests()
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a head ended (or the parser refused one)
            self._head_done()
            return
        if not between or not data or self.transport is None:
            return
        # No message came out: every byte since the head began belongs to it.
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "Request Header Fields Too Large", "headers_too_large",
                         f"The request head is larger than {MAX_HEAD_BYTES // 1024} KiB")
        elif self._head_timer is None:
            self._head_timer = self._loop.call_later(HEAD_TIMEOUT_S, self._head_late, count)

    def _head_done(self) -> None:
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self, count: int) -> None:
        self._head_timer = None
        if self._request_count == count and self._between_requests():
            self._refuse(408, "Request Timeout", "request_timeout",
                         f"The request head did not arrive within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        self._head_done()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(_refusal(status, reason, code, message))
        _log.debug("closed a connection from %s: %s", self.peername, message)
        self.force_close()  # closes after the write is flushed (asyncio's close() does)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_done()
        super().connection_lost(exc)


class _Server(web_server.Server):
    """aiohttp's server, whose connections are the lean front's (:class:`_Front`) when the
    application has a :data:`LEAN_ROUTE`, else aiohttp's own with :class:`_Protocol`'s bounds."""
    route: LeanRoute | None = None
    _lean: set[_Front]

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # a protocol factory, as create_server wants
        if self.route is not None:
            return _Front(self, self.route)
        return self.aiohttp_protocol()

    def aiohttp_protocol(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for front in list(self._lean):
            front.shutdown_begin()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(super().shutdown(timeout), *(f.shutdown(timeout) for f in list(self._lean)))
        self._lean.clear()


class Runner(web.AppRunner):
    """``web.AppRunner`` whose connections are the lean front's (with the application's
    :data:`LEAN_ROUTE`) or keep :class:`_Protocol`'s bounds."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds it; only its protocol factory differs
        assert isinstance(server, _Server)
        server._lean = set()
        server.route = self.app.get(LEAN_ROUTE)
        return server


class _OnceAMinute:
    """A line at most every ``every_s``: :meth:`due` is None while it must keep quiet, else
    what to add to the line (the count of those not logged since the last one)."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self.suppressed = 0
        self._last = -float("inf")

    def due(self) -> str | None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return None
        more = f" ({self.suppressed} more since the last such line)" if self.suppressed else ""
        self._last, self.suppressed = now, 0
        return more


class _MalformedFilter(logging.Filter):
    """aiohttp logs each malformed request as an error with its traceback: one line a
    minute instead, with the count, so that no client can flood the log."""

    def __init__(self, every_s: float = 60.0):
        super().__init__()
        self._quiet = _OnceAMinute(every_s)

    @property
    def suppressed(self) -> int:
        return self._quiet.suppressed

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        more = self._quiet.due()
        if more is None:
            return False
        first = str(exc.message).strip().splitlines()[0] if exc.message else type(exc).__name__
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "refused a malformed request from %s (400): %s%s", (peer, first, more), None, None)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_FILTER = _MalformedFilter()


class _RefusalLog(_OnceAMinute):
    """The lean front's malformed requests, as aiohttp's are with :class:`_MalformedFilter`."""

    def note(self, peer: str, why: str) -> None:
        more = self.due()
        if more is None:
            return
        _log.warning("refused a malformed request from %s (400): %s%s", peer, why.splitlines()[0] if why else "", more)


_REFUSALS = _RefusalLog()


def quiet_malformed_requests() -> None:
    """Install the filter on aiohttp's server logger (idempotent)."""
    logger = logging.getLogger("aiohttp.server")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


# --- the lean front: the gateway's routes without aiohttp's per-request machinery ---------------

class BodyTooLarge(Exception):
    """The request body grew past the limit the handler gave."""


class BodyMalformed(Exception):
    """The request body's framing broke after its head (a bad chunk size, say)."""


class Call(Protocol):
    """One request and its answer, as the gateway sees it, on either path (:class:`_LeanCall`
    on the lean front, :class:`AioCall` on aiohttp's application). An answer is ``send`` (head
    and body in one write), or ``start`` then ``write``s then ``end``; ``rid`` (when set) goes
    out as ``X-Request-Id`` on every head. Writing to a client that went away raises
    ``ConnectionResetError``."""
    method: str
    raw_path: str
    headers: CIMultiDictProxy[str]
    peer: str
    content_length: int | None
    rid: str
    status: int

    @property
    def bytes_out(self) -> int: ...
    @property
    def path(self) -> str:
        """The decoded path without the query, as aiohttp's ``Request.path`` (for observers)."""
    async def body(self, limit: int, timeout_s: float) -> bytes: ...
    async def send(self, status: int, headers: Mapping[str, str], body: bytes, *, reason: str | None = None,
                   close: bool = False) -> None: ...
    async def start(self, status: int, headers: Mapping[str, str], *, reason: str | None = None,
                    length: int | None = None) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end(self) -> None: ...
    def abort(self) -> None: ...


class LeanRoute:
    """What the lean front serves: requests whose target starts with ``prefix + "/"``, handed
    to ``handle(call)``; ``max_body()``: how much body a message may buffer before its
    handler asks for it (the handler's own limit applies from then)."""

    def __init__(self, prefix: str, handle: Callable[[Call], Awaitable[None]], max_body: Callable[[], int]):
        self.prefix = (prefix.rstrip("/") + "/").encode()
        self.handle = handle
        self.max_body = max_body


LEAN_ROUTE = web.AppKey("lean_route", LeanRoute)
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Date:
    """The Date header's value, formatted once a second."""
    second = -1
    value = ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, email.utils.formatdate(t, usegmt=True)
        return cls.value


class _Msg:
    """A request the lean front parsed: its head, and its body as it arrives."""
    __slots__ = ("url", "raw_headers", "headers", "method", "version", "keep_alive", "parts", "size", "complete",
                 "waiter", "limit", "too_large", "expect", "chunked", "failed")

    def __init__(self, limit: int):
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: CIMultiDictProxy[str] | None = None
        self.method = "GET"
        self.version = "1.1"
        self.keep_alive = True
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = False
        self.waiter: asyncio.Future[None] | None = None
        self.limit = limit
        self.too_large = False
        self.expect = False
        self.chunked = False
        self.failed: BaseException | None = None

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            if not self.too_large:
                self.too_large = True
                self.parts.clear()
                self._wake()
            return
        self.parts.append(data)

    def done(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _LeanCall:
    """:class:`Call` on the lean front: the head is written by hand (the engine's headers came
    through aiohttp's parser, which refuses CR and LF in them; ours are constants)."""
    __slots__ = ("_front", "_msg", "method", "raw_path", "headers", "peer", "content_length", "rid", "status",
                 "started", "ended", "close", "bytes_out", "_chunked", "_continued")

    def __init__(self, front: _Front, msg: _Msg):
        self._front = front
        self._msg = msg
        self.method = msg.method
        self.raw_path = msg.url.decode("utf-8", "surrogateescape")
        self.headers: CIMultiDictProxy[str] = msg.headers  # type: ignore[assignment]
        self.peer = front.peer
        length = self.headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.rid = ""
        self.status = 0
        self.started = self.ended = self.close = False
        self.bytes_out = 0
        self._chunked = False
        self._continued = False

    @property
    def path(self) -> str:
        return unquote(self.raw_path.partition("?")[0])

    async def body(self, limit: int, timeout_s: float) -> bytes:
        msg = self._msg
        if msg.size > limit:
            msg.too_large = True
        msg.limit = limit
        if not (msg.complete or msg.too_large or msg.failed):
            if msg.expect and not self._continued:  # the client waits for this before it sends
                self._continued = True
                self._front.write(_CONTINUE)
            msg.waiter = self._front.loop.create_future()
            async with _timeout(timeout_s):
                await msg.waiter
        if msg.failed is not None:
            raise msg.failed
        if msg.too_large:
            raise BodyTooLarge()
        parts = msg.parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _head(self, status: int, reason: str | None, headers: Mapping[str, str], length: int | None) -> bytes:
        version = self._msg.version
        lines = [f"HTTP/{version} {status} {reason or _REASONS.get(status, 'Unknown')}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        if self.rid:
            lines.append(f"X-Request-Id: {self.rid}\r\n")
        if length is not None:
            if status >= 200 and status not in (204, 304):
                lines.append(f"Content-Length: {length}\r\n")
        elif version == "1.1" and status not in (204, 304) and self.method != "HEAD":
            self._chunked = True
            lines.append("Transfer-Encoding: chunked\r\n")
        else:
            self.close = True  # the answer's end is the connection's
        if self.close or not self._msg.keep_alive or self._front.closing:
            connection = "Connection: close\r\n"
        else:  # HTTP/1.1 keeps it without saying so; 1.0 only when told
            connection = "Connection: keep-alive\r\n" if version == "1.0" else ""
        lines.append(f"Date: {_Date.now()}\r\nServer: {SERVER_SOFTWARE}\r\n{connection}\r\n")
        self.status = status
        self.started = True
        return "".join(lines).encode("utf-8", "surrogateescape")

    async def send(self, status: int, headers: Mapping[str, str], body: bytes, *, reason: str | None = None,
                   close: bool = False) -> None:
        self.close = self.close or close
        head = self._head(status, reason, headers, len(body))
        data = head if self.method == "HEAD" or status in (204, 304) else head + body
        self._front.write(data)
        self.bytes_out += len(data)
        self.ended = True
        await self._front.drain()

    async def start(self, status: int, headers: Mapping[str, str], *, reason: str | None = None,
                    length: int | None = None) -> None:
        head = self._head(status, reason, headers, length)
        self._front.write(head)
        self.bytes_out += len(head)

    async def write(self, data: bytes) -> None:
        if not data or self.method == "HEAD":
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._front.write(data)
        self.bytes_out += len(data)
        await self._front.drain()

    async def end(self) -> None:
        if self._chunked:
            self._front.write(b"0\r\n\r\n")
            self.bytes_out += 5
        self.ended = True
        await self._front.drain()

    def abort(self) -> None:
        self.close = True
        transport = self._front.transport
        if transport is not None:
            transport.close()


_LEAN, _SHIM, _PASS = range(3)


class _Refuse(Exception):
    def __init__(self, status: int, reason: str, code: str, message: str):
        super().__init__(message)
        self.answer = _refusal(status, reason, code, message)


class _Front(asyncio.Protocol):
    """One connection of the lean front. httptools (llhttp, as uvicorn uses) parses; requests
    under the gateway's prefix are handled here, one at a time and in order (a pipelined one
    waits, with reading paused). Any other request goes to aiohttp's own connection object
    (:class:`_Protocol`, made for the connection when first needed), with every request after
    it, until aiohttp is between requests when a gateway request comes: aiohttp then lets the
    connection go and the lean front takes it back. What aiohttp gets is written anew from
    what llhttp parsed (the head, and the body framed as it came: ``Content-Length`` or
    chunked), and only once the gateway's answers before it are out, so answers leave in the
    order requests came. Bytes after an ``Upgrade`` head go to aiohttp as they are, for good.

    The bounds are aiohttp's (request line, header size and count) and
    :class:`_Protocol`'s (head time and size, idle keep-alive), applied here.
    """

    def __init__(self, server: _Server, route: LeanRoute):
        self.server = server
        self.route = route
        self.loop = server._loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.parser = httptools.HttpRequestParser(self)
        self.mode = _LEAN
        self.msg: _Msg | None = None       # the message being parsed
        self.in_head = False
        self.queue: collections.deque[_Msg] = collections.deque()  # gateway heads not yet handled
        self.task: asyncio.Task[None] | None = None  # the handler of the current request
        self.current: _Msg | None = None
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        self.linger_timer: asyncio.TimerHandle | None = None
        self.lingering: _Msg | None = None
        self.aio: _Protocol | None = None
        self.pending: list[bytes] | None = None  # for aiohttp, until the gateway's answers are out
        self.refuse_after: bytes | None = None   # an answer to write and close on, after the current one
        self.broken = False                 # the parser refused: nothing more is read
        self.closing = False                # the server is shutting down
        self.paused_writing = False
        self.drain_waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) and peer else ""
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server._lean.add(self)
        self._idle()

    def data_received(self, data: bytes) -> None:
        if self.mode is _PASS:
            self._shim(data)
            return
        if self.broken:
            return
        if self.msg is None or self.in_head:  # a head is on its way
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as up:
            if self.mode is _SHIM:
                self.mode = _PASS
                self._shim(data[up.args[0]:])
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refuse):
                self._refuse(refusal.answer)
            elif self.mode is _LEAN or self.mode is _SHIM:
                raise
        except httptools.HttpParserError as exc:
            if self.mode is _LEAN or self.mode is _SHIM:
                self._malformed(exc)
        if self._head_pending() and not self.broken and self.mode is not _PASS:
            # Timed from its first chunk: a head that came whole (the usual) never needs the timer.
            if self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(_refusal(431, "Request Header Fields Too Large", "headers_too_large",
                                      f"The request head is larger than {MAX_HEAD_BYTES // 1024} KiB"))
            elif self.head_timer is None:
                self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_pending(self) -> bool:
        """Part of a request head is here (or only the empty lines llhttp skips before one)."""
        return self.in_head or (self.msg is None and self.head_bytes > 0)

    def eof_received(self) -> bool | None:
        if self.aio is not None:
            self.aio.eof_received()
        return None  # the transport closes: a hang-up

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.server._lean.discard(self)
        for timer in (self.head_timer, self.idle_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        if self.aio is not None:
            self.aio.connection_lost(exc)
        if self.task is not None:  # the client went away: its handler is cancelled (a hang-up)
            self.task.cancel()
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.paused_writing = True
        if self.aio is not None:
            self.aio.pause_writing()

    def resume_writing(self) -> None:
        self.paused_writing = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.aio is not None:
            self.aio.resume_writing()

    # --- writing, for _LeanCall ---

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    async def drain(self) -> None:
        if self.paused_writing and self.transport is not None:
            self.drain_waiter = waiter = self.loop.create_future()
            await waiter

    # --- llhttp's callbacks ---

    def on_message_begin(self) -> None:
        if self.mode is _LEAN or self.mode is _SHIM:
            self.msg = _Msg(self.route.max_body())
            self.in_head = True

    def on_url(self, url: bytes) -> None:
        msg = self.msg
        if msg is not None and self.in_head:
            msg.url += url
            if len(msg.url) > MAX_LINE_SIZE:
                raise _Refuse(400, "Bad Request", "invalid_request", "The request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        msg = self.msg
        if msg is not None and self.in_head:
            msg.raw_headers.append((name, value))
            if len(name) + len(value) > MAX_FIELD_SIZE or len(msg.raw_headers) > MAX_HEADERS:
                raise _Refuse(400, "Bad Request", "invalid_request",
                              f"A request header is over {MAX_FIELD_SIZE} bytes, or there are over "
                              f"{MAX_HEADERS} of them")

    def on_headers_complete(self) -> None:
        msg = self.msg
        if msg is None or not self.in_head:
            return
        self.in_head = False
        self._head_done()
        parser = self.parser
        msg.method = parser.get_method().decode("ascii", "replace")
        msg.version = parser.get_http_version()
        msg.keep_alive = parser.should_keep_alive()
        gateway = msg.url.startswith(self.route.prefix) and not parser.should_upgrade()
        if self.mode is _SHIM and gateway and self.pending is None and self.aio is not None \
                and self.aio._between_requests():
            self._detach_aio()  # aiohttp answered all it had: the gateway's requests are ours again
        if self.mode is _LEAN:
            if gateway:
                self._lean_head(msg)
                return
            self.mode = _SHIM
            self.pending = []
        msg.chunked = any(n.lower() == b"transfer-encoding" for n, _ in msg.raw_headers)
        head = [msg.method.encode(), b" ", msg.url, b" HTTP/", msg.version.encode(), b"\r\n"]
        for name, value in msg.raw_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        self._shim(b"".join(head))
        if self.aio is None and self.task is None and not self.queue:
            self._start_aio()  # nothing of the gateway's to answer first

    def on_body(self, body: bytes) -> None:
        msg = self.msg
        if msg is None:
            return
        if self.mode is _LEAN:
            msg.add(body)
        elif self.mode is _SHIM:
            self._shim(b"%x\r\n%b\r\n" % (len(body), body) if msg.chunked else body)

    def on_message_complete(self) -> None:
        msg, self.msg = self.msg, None
        if msg is None:
            return
        if self.mode is _LEAN:
            msg.done()
            if msg is self.lingering:
                self._linger_done()
        elif self.mode is _SHIM and msg.chunked:
            self._shim(b"0\r\n\r\n")

    # --- the gateway's requests ---

    def _lean_head(self, msg: _Msg) -> None:
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in msg.raw_headers:
            headers.add(name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        msg.headers = CIMultiDictProxy(headers)
        expect = headers.get("Expect")
        msg.expect = expect is not None and expect.lower() == "100-continue"
        self.queue.append(msg)
        if self.task is None:
            self._next()
        elif self.transport is not None:
            self.transport.pause_reading()  # one request at a time: the next waits in the kernel

    def _next(self) -> None:
        msg = self.queue.popleft()
        self.current = msg
        # A child of this connection, not a background task: connection_lost cancels it.
        self.task = self.loop.create_task(self._run(msg))  # noqa: TID251

    async def _run(self, msg: _Msg) -> None:
        call = _LeanCall(self, msg)
        try:
            await self.route.handle(call)
        except asyncio.CancelledError:
            return  # the client went away (connection_lost) or the server is stopping
        except Exception:
            _log.exception("the gateway failed on %s %s", msg.method, call.raw_path)
            call.close = True
            if not call.started and self.transport is not None:
                with contextlib.suppress(ConnectionError):
                    self.write(_refusal(500, "Internal Server Error", "internal_error",
                                        "ondemand failed on this request; see its log"))
                    call.ended = True
        finally:
            self.task = self.current = None
        self._after(call, msg)

    def _after(self, call: _LeanCall, msg: _Msg) -> None:
        """The answer is out: the next request, or the connection's end."""
        transport = self.transport
        if transport is None:
            return
        if self.refuse_after is not None:
            self._refuse(self.refuse_after)
            return
        if not call.ended or call.close or not msg.keep_alive or self.closing or self.broken:
            transport.close()
            return
        if not msg.complete:  # answered before its body was in: read and drop the rest for a while
            msg.too_large = True
            msg.parts.clear()
            self.lingering = msg
            self.linger_timer = self.loop.call_later(LINGERING_S, transport.close)
            return
        self._go_on()

    def _linger_done(self) -> None:
        self.lingering = None
        if self.linger_timer is not None:
            self.linger_timer.cancel()
            self.linger_timer = None
        self._go_on()

    def _go_on(self) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.resume_reading()  # paused while a request waited behind this one
        if self.queue:
            self._next()
            return
        if self.pending is not None:
            self._start_aio()
        else:
            self._idle()

    def _idle(self) -> None:
        """Waiting for the next request: closed after KEEPALIVE_TIMEOUT_S of this. One timer
        lives across requests (set again when it fires early), not one per request."""
        self.idle_since = self.loop.time()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(KEEPALIVE_TIMEOUT_S, self._idle_late)

    def _idle_late(self) -> None:
        self.idle_timer = None
        if self.task is not None or self.queue or self.msg is not None or self.aio is not None \
                or self.head_bytes or self.transport is None:
            return  # busy: _idle() sets it again after the answer
        left = self.idle_since + KEEPALIVE_TIMEOUT_S - self.loop.time()
        if left > 0.001:
            self.idle_timer = self.loop.call_later(left, self._idle_late)
        else:
            self.transport.close()

    # --- the head's bounds, refusals ---

    def _head_done(self) -> None:
        self.head_bytes = 0
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self._head_pending():
            self._refuse(_refusal(408, "Request Timeout", "request_timeout",
                                  f"The request head did not arrive within {HEAD_TIMEOUT_S:g} s"))

    def _refuse(self, answer: bytes) -> None:
        """Write ``answer`` and close, after the answer being written (if any); nothing more is read."""
        self.broken = True
        self._head_done()
        self.queue.clear()
        transport = self.transport
        if transport is None:
            return
        if self.aio is not None:  # aiohttp has the connection's requests: they end with it
            transport.close()
            return
        if self.task is not None:
            self.refuse_after = answer
            transport.pause_reading()
            return
        self.refuse_after = None
        if not transport.is_closing():
            transport.write(answer)
        transport.close()

    def _malformed(self, exc: Exception) -> None:
        msg = self.current
        if msg is not None and msg is self.msg and self.mode is _LEAN:  # its handler is reading the body
            self.broken = True
            msg.fail(BodyMalformed(str(exc) or type(exc).__name__))
            return
        _REFUSALS.note(self.peer or "a local client", str(exc) or type(exc).__name__)
        self._refuse(_refusal(400, "Bad Request", "invalid_request", f"Malformed HTTP request: {exc}"))

    # --- aiohttp's requests ---

    def _shim(self, data: bytes) -> None:
        if self.aio is not None:
            self.aio.data_received(data)
        elif self.pending is not None:
            self.pending.append(data)

    def _start_aio(self) -> None:
        """The gateway's answers are out: aiohttp takes the connection's next requests (until
        it is between requests when a gateway request comes: see on_headers_complete)."""
        pending, self.pending = self.pending or [], None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.aio = aio = self.server.aiohttp_protocol()
        aio.connection_made(self.transport)  # type: ignore[arg-type]
        for data in pending:
            aio.data_received(data)

    def _detach_aio(self) -> None:
        """aiohttp is between requests: it lets the connection go (as if it had closed, but
        the connection stays open here) and the lean front takes the next request."""
        aio, self.aio = self.aio, None
        assert aio is not None
        aio.transport = None  # its connection_lost would close the connection otherwise
        aio.connection_lost(None)
        self.mode = _LEAN

    # --- shutting down ---

    def shutdown_begin(self) -> None:
        """No new requests: an idle connection closes now, a busy one after its answer."""
        self.closing = True
        if self.aio is None and self.task is None and not self.queue and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:
        task = self.task
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.aio is None and self.transport is not None:
            self.transport.close()


class AioCall:
    """:class:`Call` on aiohttp's application: a gateway request on a connection aiohttp took
    (its first request was the admin API's, say). ``response``: what the route returns."""

    def __init__(self, request: web.Request):
        self.request = request
        self.method = request.method
        self.raw_path = request.raw_path
        self.headers = request.headers
        self.peer = request.remote or ""
        self.content_length = request.content_length
        self.rid = ""
        self.status = 0
        self.response: web.StreamResponse | None = None

    @property
    def path(self) -> str:
        return self.request.path

    @property
    def bytes_out(self) -> int:
        writer = self.request.writer
        return writer.output_size if writer is not None else 0

    def _headers(self, headers: Mapping[str, str]) -> CIMultiDict[str]:
        out = CIMultiDict(headers)
        if self.rid:
            out["X-Request-Id"] = self.rid
        return out

    async def body(self, limit: int, timeout_s: float) -> bytes:
        """aiohttp stops at the application's client_max_size, counting chunked bodies too."""
        try:
            body = await asyncio.wait_for(self.request.read(), timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge() from None
        except web.RequestPayloadError as exc:
            raise BodyMalformed(str(exc)) from None
        if len(body) > limit:
            raise BodyTooLarge()
        return body

    async def send(self, status: int, headers: Mapping[str, str], body: bytes, *, reason: str | None = None,
                   close: bool = False) -> None:
        resp = web.Response(status=status, reason=reason, body=body, headers=self._headers(headers))
        if close:
            resp.force_close()
        self.response = resp
        self.status = status
        await resp.prepare(self.request)
        await resp.write_eof()

    async def start(self, status: int, headers: Mapping[str, str], *, reason: str | None = None,
                    length: int | None = None) -> None:
        resp = self.response = web.StreamResponse(status=status, reason=reason, headers=self._headers(headers))
        if length is not None:
            resp.content_length = length
        self.status = status
        await resp.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def abort(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.close()
