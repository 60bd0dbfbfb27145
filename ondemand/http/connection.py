"""One keep-alive connection to an engine (:class:`EngineConnection`) and its answer
(:class:`Response`): a request is one write; the answer's head and chunked framing are parsed
by llhttp through httptools' public response parser (aiohttp's private ``HttpResponseParser``
before issue 23), and its body arrives through a :class:`~.body.Body`, which pauses reading
the engine through the connection's :class:`~.flow_control.FlowControl`. The pool
(``pool.py``) owns the connections; a connection tells it when it closes. Imports nothing of
ours but this package.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Protocol

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .body import Body, PayloadError
from .flow_control import BODY, FlowControl
from .headers import decoded
from .limits import READ_SIZE

__all__ = ["EngineConnection", "Response", "UpstreamError", "Stale", "PayloadError"]



class Owner(Protocol):
    """What a connection needs of its pool."""
    loop: asyncio.AbstractEventLoop

    @property
    def stale_window(self) -> float: ...
    def lost(self, conn: EngineConnection) -> None: ...
    def put_back(self, conn: EngineConnection) -> None: ...


class UpstreamError(Exception):
    """The engine could not be reached, or closed or garbled the connection before its answer's head."""


class Stale(UpstreamError):
    """The connection closed before any byte of the answer arrived."""


class _HeadOnly(Exception):
    """Raised in a callback: the answer to a HEAD request has no body, whatever it says."""


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""
    __slots__ = ("pool", "transport", "parser", "active", "head", "payload", "got_bytes", "keep", "flow",
                 "sent_at", "idle_since", "head_only", "answered", "status", "reason", "raw_headers", "framed",
                 "chunks", "on_body")

    def __init__(self, pool: Owner):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        # llhttp's body callback is this list's append (C to C: no Python call a chunk, and an
        # engine's stream brings a dozen chunks a read); a read's chunks go to the body at once.
        self.chunks: list[bytes] = []
        self.on_body = self.chunks.append
        self.parser = httptools.HttpResponseParser(self)
        self.active = False           # an exchange runs
        self.head: asyncio.Future[Response] | None = None
        self.payload: Body | None = None   # the body once the head arrived
        self.got_bytes = False
        self.keep = True              # False once anything rules out another exchange
        self.flow: FlowControl = None  # type: ignore[assignment]  # set in connection_made
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
        self.flow = FlowControl(self.transport)  # type: ignore[arg-type]
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
                self.chunks.clear()
                return
            self._deliver()  # what came before the fault is passed on before it
            self._failed(f"malformed answer from the engine: {why or exc}")
            self.close()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._deliver()
            self._failed(f"malformed answer from the engine: {exc!r}")
            self.close()
        else:
            if self.chunks:
                self._deliver()

    def _deliver(self) -> None:
        """This read's body chunks to the body, at once (its reader is woken once for them all)."""
        chunks = self.chunks
        if chunks and self.payload is not None:
            self.payload.arrived(chunks)
        chunks.clear()

    def eof_received(self) -> None:
        return None  # close the transport: a half-closed engine connection is of no further use

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        if self.flow is not None:
            self.flow.connection_lost()
        self.keep = False
        self.pool.lost(self)
        if not self.active:
            return
        head = self.head
        if head is not None and not head.done():
            why = f"the engine closed the connection{': ' + str(exc) if exc else ''}"
            # Stale (safe to send again) only when the close came right after the request:
            # the engine closing an idle connection as it arrived. Later, the engine may have
            # worked on it (a generation, a crash): sending it again could run it twice.
            stale = not self.got_bytes and self.pool.loop.time() - self.sent_at < self.pool.stale_window
            head.set_exception(Stale(why) if stale else UpstreamError(why))
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
        raw = self.raw_headers
        framed = False
        for name, value in raw:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                framed = True
        self.framed = framed
        if not parser.should_keep_alive():
            self.keep = False
        # The body's low-water mark: its reading pauses at twice this, resumes below it.
        payload = self.payload = Body(self.flow, READ_SIZE)
        head = self.head
        if head is not None and not head.done():
            head.set_result(Response(self, status, self.reason.decode("utf-8", "surrogateescape"), raw, payload))
        if self.head_only or status in (204, 304):
            self.answered = True
            payload.feed_eof()
            if self.head_only:
                raise _HeadOnly()

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.answered = True
        if self.payload is not None:
            self.payload.feed_eof()

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
                raise Stale("the engine closed the connection")
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
            self.flow.resume_reading(BODY)  # an idle connection must notice the engine closing it
            self.pool.put_back(self)
        else:
            self.close()


class Response:
    """An engine's answer: status, headers and ``content`` (a :class:`~.body.Body`).
    ``raw_headers`` as llhttp gave them (the gateway passes them on undecoded); ``headers``
    decoded, made when first asked for."""
    __slots__ = ("status", "reason", "raw_headers", "content", "_conn", "_headers")

    def __init__(self, conn: EngineConnection, status: int, reason: str, raw_headers: list[tuple[bytes, bytes]],
                 content: Body):
        self.status = status
        self.reason = reason
        self.raw_headers = raw_headers
        self.content = content
        self._conn: EngineConnection | None = conn
        self._headers: CIMultiDictProxy[str] | None = None

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict([decoded(pair) for pair in self.raw_headers]))
        return self._headers

    def _first(self, name: bytes) -> bytes | None:
        for n, v in self.raw_headers:
            if n.lower() == name:
                return v
        return None

    @property
    def content_length(self) -> int | None:
        v = self._first(b"content-length")
        return int(v) if v is not None and v.isascii() and v.isdigit() else None

    @property
    def content_type(self) -> str:
        v = self._first(b"content-type")
        if v is None:
            return "application/octet-stream"
        return v.partition(b";")[0].strip().lower().decode("latin-1")

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Exactly once per answer, however it ended (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done()
