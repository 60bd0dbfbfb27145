"""aiohttp's side of a connection handed to it: :class:`AioConnection`, aiohttp's own
connection object (``web.RequestHandler``, made with its public constructor) with the
server's :class:`~.limits.Limits` and its refusals in the documented JSON.

aiohttp answers a malformed request (and a handler's unhandled exception) through
``handle_error`` with plain text, and logs each with its traceback; here it is the JSON error
(issue 23: two Transfer-Encodings on an admin path, ``GET *``) and one log line a minute.
aiohttp's answers before the refusal go out first: it queues the refusal behind them.

A head that is still arriving after ``head_timeout_s``, or grows past ``max_head_bytes``
(aiohttp bounds neither: a slowloris held an admin connection until its keep-alive ran out,
then got a FIN), is refused in aiohttp's order too: a parser of our own watches where heads
begin and end (it never changes a byte), and when one is late or too large aiohttp's parser
is given a NUL, which it refuses as a malformed request; ``handle_error`` then answers 408 or
431 instead of 400; so is a request line without an HTTP version (llhttp reads it as HTTP/0.9).

The same watch tells the connection's :class:`~.caps.Seat` when a whole request arrives (busy)
and :meth:`AioConnection.finish_response` when none is owed any more (idle: it gives way at a
cap). A body aiohttp reads and drops after an early answer (its lingering, ``lingering_s``) is
bounded in size too (``linger_max_bytes``; aiohttp bounds only its time). Imports nothing of ours
but ``errors`` and this package.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from aiohttp import web

from ..errors import OndemandError, internal_error
from .caps import UNCOUNTED, Seat
from .limits import Limits
from .refusals import REFUSALS, line_without_version

_log = logging.getLogger("ondemand.http")


class _Watch:
    """llhttp callbacks that only note where request heads begin and end."""
    __slots__ = ("conn",)

    def __init__(self, conn: AioConnection):
        self.conn = conn

    def on_message_begin(self) -> None:
        self.conn.head_begins()

    def on_headers_complete(self) -> None:
        self.conn.head_ends()

    def on_message_complete(self) -> None:
        self.conn.watch_in_body = False
        self.conn.drop_left = None


class BodyMalformedError(Exception):
    """The body's framing broke (a bad chunk size, say)."""


class ClientGone(ConnectionResetError):
    """The client hung up before its request's body had arrived: nothing was done, no one is
    left to answer, and it is no defect of ours."""


async def read_body(request: web.BaseRequest, limits: Limits) -> bytes:
    """An admin request's body, within ``body_timeout_s``; a malformed one is 400 at once.
    Raises ``OndemandError`` (408 and 400 close the connection), or ``ClientGone``."""
    conn = request.protocol if isinstance(request.protocol, AioConnection) else None
    if conn is not None:
        conn.reading = request
        conn.body_broke()
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except ConnectionResetError:
        # aiohttp fails the read and cancels the handler, but wait_for (before Python 3.12) hands
        # on the read's error, which the admin API logged as a defect with its traceback.
        raise ClientGone("the client hung up before its request's body had arrived") from None
    except asyncio.TimeoutError:  # TimeoutError itself from 3.11
        err = OndemandError(408, "request_timeout", f"The request body did not arrive within "
                            f"{limits.body_timeout_s:g} s", headers={"Connection": "close"})
    except BodyMalformedError as exc:
        err = OndemandError(400, "invalid_body", f"The request body is malformed: {exc}",
                            headers={"Connection": "close"})
    finally:
        if conn is not None:
            conn.reading = None
    raise err


class AioConnection(web.RequestHandler):
    def __init__(self, server: web.Server, limits: Limits, loop: asyncio.AbstractEventLoop, **kwargs: Any):
        super().__init__(server, loop=loop, **limits.aiohttp_args(), **kwargs)
        self.limits = limits
        self.watch_loop = loop
        self.watch: Any = httptools.HttpRequestParser(_Watch(self))
        self.watch_head = False
        self.watch_bytes = 0
        self.watch_timer: asyncio.TimerHandle | None = None
        self.refuse_as: tuple[int, str, str] | None = None  # what the next parse error really is
        self.watch_in_body = False
        self.reading: web.BaseRequest | None = None  # a request whose body read_body awaits
        self.broken_body: BodyMalformedError | None = None  # the body being received broke
        self.begun = False  # a request head began on this connection
        self.no_version = False  # a request line without an HTTP version: refused
        # The head's bytes while they may be its request line alone (``refusals.line_without_version``),
        # kept only for a head that began a piece: a piece that also ends a body holds that body too.
        self.watch_line: list[bytes] | None = None
        self.piece_fresh = True  # the piece being watched began between two messages
        self.seat: Seat = UNCOUNTED  # its place in its listener's count (the caps)
        self.pending = 0  # whole request heads not answered yet
        self.drop_left: int | None = None  # of a body aiohttp reads and drops after its answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The first request's head is timed from the accept (a hand-off's is here already):
        a connection that sends nothing is closed after ``head_timeout_s``, not kept alive."""
        super().connection_made(transport)
        if self.watch_timer is None:
            self.watch_timer = self.watch_loop.call_later(self.limits.head_timeout_s, self.head_late)

    def take_over(self, transport: asyncio.Transport, seat: Seat, data: bytes = b"", paused: bool = False) -> None:
        """The transport of a connection just accepted (the admin listener's) or handed off by the
        lean front (``HttpProtocol._hand_off``: ``data``, the bytes from its first request that is
        not the gateway's on; ``paused``, reading was paused for the requests before it), with its
        seat in the caps' count."""
        self.seat = seat
        if seat is not UNCOUNTED:  # the admin socket's shared seat keeps no connection
            seat.conn = self
        if paused:  # this connection expects to read
            transport.resume_reading()
        self.connection_made(transport)
        transport.set_protocol(self)
        if data:
            self.data_received(data)

    def body_broke(self) -> None:
        """The first request whose body has not all arrived is the one whose body broke."""
        request = self.reading
        if self.broken_body is not None and request is not None and not request.content.is_eof():
            request.content.set_exception(self.broken_body)

    # --- watching the heads ---

    def data_received(self, data: bytes) -> None:
        """In pieces that each end with a head's end (any split of the stream is as good as
        another): aiohttp's parser drops every message it parsed in a read when the read holds
        a malformed head too (issue 23: the 200 before a 400 was lost); so it holds one head."""
        start = 0
        while (end := data.find(b"\r\n\r\n", start)) >= 0 and end + 4 < len(data):
            self.feed_piece(data[start:end + 4])
            start = end + 4
        self.feed_piece(data[start:] if start else data)

    def feed_piece(self, data: bytes) -> None:
        if self.drop_left is not None:
            self.drop_left -= len(data)
            if self.drop_left < 0 and self.transport is not None:
                self.transport.close()
                return
        watch = self.watch
        if watch is not None:
            self.piece_fresh = not self.watch_head and not self.watch_in_body
            try:
                watch.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # aiohttp's parser answers it
                in_body = self.watch_in_body
                self.unwatch()
                if in_body:
                    # aiohttp gives up on such a body without ending it: its reader would wait
                    # for ever (until read_body's time limit), the 400 queued behind it.
                    self.broken_body = BodyMalformedError(str(exc) or type(exc).__name__)
                    self.body_broke()
            if self.no_version:
                self.head_refused(400, "invalid_request", "The request line has no HTTP version")
                return
            if self.watch_head:
                self.watch_bytes += len(data)
                if self.watch_bytes > self.limits.max_head_bytes:
                    self.head_refused(431, "headers_too_large",
                                       f"The request head is larger than {self.limits.max_head_bytes // 1024} KiB")
                    return
                if self.request_line_refused(data):  # llhttp would wait for headers (a bare "GET /")
                    self.head_refused(400, "invalid_request", "The request line has no HTTP version")
                    return
        super().data_received(data)

    def request_line_refused(self, data: bytes) -> bool:
        """Has the head's request line ended, in ``data`` (the piece just watched), with no HTTP
        version? Joined only once a line ends, so a head sent a byte at a time costs no more."""
        line = self.watch_line
        if line is None:
            return False
        line.append(data)
        if b"\n" not in data:
            return False
        ended = line_without_version(line)
        if ended is not None:
            self.watch_line = None
        return bool(ended)

    def head_begins(self) -> None:
        self.begun = True
        self.watch_head = True
        self.watch_bytes = 0
        self.watch_line = [] if self.piece_fresh else None
        if self.watch_timer is None:
            self.watch_timer = self.watch_loop.call_later(self.limits.head_timeout_s, self.head_late)

    def head_ends(self) -> None:
        self.watch_head = False
        self.watch_line = None
        self.watch_in_body = True
        self.pending += 1
        self.seat.busy = True
        if self.watch is not None and self.watch.get_http_version() == "0.9":
            self.no_version = True  # aiohttp would answer it in HTTP/0.9 (issue 40)
        if self.watch_timer is not None:
            self.watch_timer.cancel()
            self.watch_timer = None

    def head_late(self) -> None:
        self.watch_timer = None
        if self.watch_head:
            self.head_refused(408, "request_timeout",
                               f"The request head did not arrive within {self.limits.head_timeout_s:g} s")
        elif not self.begun and self.transport is not None:
            self.transport.close()  # nothing came since the accept: no request to answer

    def head_refused(self, status: int, code: str, message: str) -> None:
        self.refuse_as = (status, code, message)
        self.unwatch()
        super().data_received(b"\x00\r\n\r\n")  # no head may hold a NUL: aiohttp refuses it, in its order

    def unwatch(self) -> None:
        self.watch = None
        self.watch_head = False
        if self.watch_timer is not None:
            self.watch_timer.cancel()
            self.watch_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.unwatch()
        self.seat.release()
        super().connection_lost(exc)

    def give_way(self) -> None:
        """Idle at a cap: closed for a new connection (``caps.py``); nothing is owed to its client."""
        if self.transport is not None:
            self.transport.close()

    # --- the answers ---

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.answered()

    def answered(self) -> None:
        """An answer is out. With none owed the connection rests; when the body of the request
        just answered is still arriving, aiohttp reads and drops it now (its lingering): bounded."""
        self.pending = max(0, self.pending - 1)
        if not self.pending:
            self.seat.rest()
            if self.watch_in_body:
                self.drop_left = self.limits.linger_max_bytes

    # --- aiohttp's refusals, in the documented form ---

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, BodyMalformedError):
            return  # answered 400 already: aiohttp's lingering read meets it once more
        super().log_exception(*args, **kw)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer is not None and request.writer.output_size > 0:
            # Part of an answer went out: the connection is broken (aiohttp's rule).
            raise ConnectionError("an answer is under way: the connection is cut")
        peer = request.remote or "a local client"
        if self.refuse_as is not None:
            status, code, text = self.refuse_as
            REFUSALS.note(peer, text, status)
            err = OndemandError(status, code, text)
        elif status >= 500:
            _log.error("%s %s failed", request.method, request.path, exc_info=exc)
            err = internal_error(status)
        else:
            first = str(message or exc or "Bad Request").strip().splitlines()
            text = f"Malformed HTTP request: {first[0] if first else 'Bad Request'}"
            REFUSALS.note(peer, text, status)
            err = OndemandError(status, "invalid_request", text)
        # Said in the answer too: aiohttp names a close only in an HTTP/1.1 answer, and a head it
        # could not parse is answered as HTTP/1.0.
        resp = web.Response(status=status, body=err.body(), content_type="application/json",
                            headers={"Connection": "close"})
        resp.force_close()
        return resp
