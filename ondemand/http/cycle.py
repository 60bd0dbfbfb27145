"""One request and its answer on the lean front: :class:`Call`, the per-request cycle
(uvicorn's ``RequestResponseCycle``).

The protocol (``protocol.py``) fills the request's head and body from llhttp's callbacks; the
gateway reads the body with :meth:`Call.body` and answers with ``send`` (head and body in one
write), or ``start``, ``write``s and ``end``. The answer's state (started, ended, whether the
connection closes after it) is the cycle's. ``rid`` (when set) goes out as ``X-Request-Id``
on every head. Writing to a client that went away raises ``ConnectionResetError``.
Imports nothing of ours but ``http.flow_control`` (through the protocol it is handed).
"""
from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time
from collections.abc import Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import unquote

from multidict import CIMultiDictProxy

from .flow_control import BODY
from .limits import timeout as _timeout

if TYPE_CHECKING:
    from .protocol import HttpProtocol

__all__ = ["Call", "BodyTooLarge", "BodyMalformed"]

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodyTooLarge(Exception):
    """The request body grew past the limit the handler gave."""


class BodyMalformed(Exception):
    """The request body's framing broke after its head (a bad chunk size, say)."""


class _Date:
    """The Date line, formatted once a second."""
    second = -1
    line = ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second = t
            cls.line = f"Date: {email.utils.formatdate(t, usegmt=True)}\r\n"
        return cls.line


class Call:
    """A gateway request and its answer. The head (method, target, headers) is complete when
    the cycle is made; the body arrives through :meth:`feed` while the handler runs."""
    __slots__ = ("_proto", "method", "raw_path", "headers", "peer", "content_length", "rid", "status",
                 "version", "keep_alive", "expect", "started", "ended", "close", "bytes_out", "_chunked",
                 "_continued", "parts", "size", "limit", "complete", "too_large", "failed", "_body_waiter",
                 "raw_headers")

    def __init__(self, proto: HttpProtocol, method: str, raw_path: str, headers: CIMultiDictProxy[str],
                 version: str, keep_alive: bool, limit: int, raw_headers: list[tuple[bytes, bytes]]):
        self._proto = proto
        self.method = method
        self.raw_path = raw_path
        self.headers = headers
        self.raw_headers = raw_headers  # as llhttp gave them: forwarded without decoding
        self.peer = proto.peer
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isascii() and length.isdigit() else None
        expect = headers.get("Expect")
        self.expect = expect is not None and expect.lower() == "100-continue"
        self.version = version
        self.keep_alive = keep_alive
        self.rid = ""
        self.status = 0
        self.started = self.ended = self.close = False
        self.bytes_out = 0
        self._chunked = False
        self._continued = False
        # The request's body, as it arrives.
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.complete = False
        self.too_large = False
        self.failed: BaseException | None = None
        self._body_waiter: asyncio.Future[None] | None = None

    @property
    def path(self) -> str:
        """The decoded path without the query (for observers)."""
        return unquote(self.raw_path.partition("?")[0])

    # --- the request's body, from the protocol ---

    def feed(self, data: bytes) -> None:
        if self.too_large:  # refused, or answered before it came: read and dropped (never paused) ...
            linger = self._proto.linger
            if linger is not None:  # ... within bounds (linger.py)
                linger.dropped(len(data))
            return
        self.size += len(data)
        if self.size > self.limit:
            if not self.too_large:
                self.too_large = True
                self.parts.clear()
                self._wake()
            return
        self.parts.append(data)
        if self._body_waiter is None and self.size > self._proto.limits.high_water:
            self._proto.flow.pause_reading(BODY)  # nobody reads it yet: let the kernel hold the rest

    def done(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self._wake()

    def _wake(self) -> None:
        if self._body_waiter is not None and not self._body_waiter.done():
            self._body_waiter.set_result(None)

    def body_now(self, limit: int) -> bytes | None:
        """The whole body when it is here already and within ``limit`` (the usual: a request's
        body comes in its head's read), else None: then :meth:`body` waits for it."""
        if self.complete and not self.too_large and self.failed is None and self.size <= limit:
            parts = self.parts
            return parts[0] if len(parts) == 1 else b"".join(parts)
        return None

    async def body(self, limit: int, timeout_s: float) -> bytes:
        """The whole body, at most ``limit`` bytes (else :class:`BodyTooLarge`), within
        ``timeout_s`` (else ``TimeoutError``)."""
        if self.size > limit:
            self.too_large = True
        self.limit = limit
        if not (self.complete or self.too_large or self.failed):
            if self.expect and not self._continued:  # the client waits for this before it sends
                self._continued = True
                self._proto.write(_CONTINUE)
            self._body_waiter = self._proto.loop.create_future()
            self._proto.flow.resume_reading(BODY)
            async with _timeout(timeout_s):
                await self._body_waiter
        if self.failed is not None:
            raise self.failed
        if self.too_large:
            raise BodyTooLarge()
        parts = self.parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # --- the answer ---

    def _head(self, status: int, reason: str | None, headers: Mapping[str, str], length: int | None,
              lines: bytes) -> bytes:
        version = self.version
        first = [f"HTTP/{version} {status} {reason or _REASONS.get(status, 'Unknown')}\r\n"]
        first.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        last = [f"X-Request-Id: {self.rid}\r\n"] if self.rid else []
        if length is not None:
            if status >= 200 and status not in (204, 304):
                last.append(f"Content-Length: {length}\r\n")
        elif status in (204, 304) or self.method == "HEAD":
            pass  # no body follows, whatever its length: the connection can carry the next request
        elif version == "1.1":
            self._chunked = True
            last.append("Transfer-Encoding: chunked\r\n")
        else:
            self.close = True  # the answer's end is the connection's
        if status == 413 and not self.complete:
            # The rest of a body over the limit (perhaps one that never ends: a huge length, chunks
            # without end) is only read and dropped for the bounded lingering: the connection ends.
            self.close = True
        if self.close or not self.keep_alive or self._proto.closing:
            connection = "Connection: close\r\n"
        else:  # HTTP/1.1 keeps it without saying so; 1.0 only when told
            connection = "Connection: keep-alive\r\n" if version == "1.0" else ""
        last.append(f"{_Date.now()}{self._proto.front.server_line}{connection}\r\n")
        self.status = status
        self.started = True
        # Our header names and values are constants or came through llhttp (which refuses CR
        # and LF in them); ``lines``, the engine's, through httptools' response parser, which
        # does too (``forward.response_lines`` counts them all the same).
        return ("".join(first).encode("utf-8", "surrogateescape") + lines
                + "".join(last).encode("utf-8", "surrogateescape"))

    async def send(self, status: int, headers: Mapping[str, str], body: bytes, *, reason: str | None = None,
                   close: bool = False, lines: bytes = b"") -> None:
        """The whole answer in one write. ``lines``: more header lines, already encoded (the
        engine's, ``forward.response_lines``), after ``headers``."""
        self.close = self.close or close
        head = self._head(status, reason, headers, len(body), lines)
        full = self._put(head if self.method == "HEAD" or status in (204, 304) else head + body)
        self.ended = True
        if full:
            await self._proto.flow.drain()

    async def start(self, status: int, headers: Mapping[str, str], *, reason: str | None = None,
                    length: int | None = None, lines: bytes = b"", body: bytes = b"") -> None:
        """The head, and the start of the body when some is here already (in the same write)."""
        head = self._head(status, reason, headers, length, lines)
        if body and self.method != "HEAD":
            head += self._framed(body)
        self._put(head)

    def _put(self, data: bytes) -> bool:
        """``data`` to the client, counted (none: nothing is written). True when the client cannot
        take more now: the caller awaits the drain, a coroutine only when there is something to
        wait for (or raise)."""
        if data:
            self._proto.write(data)
            self.bytes_out += len(data)
        return not self._proto.flow.writable

    def _framed(self, data: bytes) -> bytes:
        """Body bytes as they go out: one chunk of a chunked answer, else as they are."""
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    async def write(self, data: bytes) -> None:
        if not data or self.method == "HEAD":
            return
        if self._put(self._framed(data)):
            await self._proto.flow.drain()

    def write_now(self, data: bytes) -> bool:
        """:meth:`write` when it would not wait: True when written (or dropped, for HEAD), False
        when nothing was written because the client cannot take it now (or is gone)."""
        if self.method == "HEAD":
            return True
        proto = self._proto
        transport = proto.transport
        if transport is None or transport.is_closing() or not proto.flow.writable:
            return False
        data = self._framed(data)
        transport.write(data)
        self.bytes_out += len(data)
        return True

    async def end(self, data: bytes = b"") -> None:
        """The answer's end, after the last of its body (``data``, in the same write)."""
        data = self._framed(data) if data and self.method != "HEAD" else b""
        if self._chunked:
            data += b"0\r\n\r\n"
        full = self._put(data)
        self.ended = True
        if full:
            await self._proto.flow.drain()

    def abort(self) -> None:
        self.close = True
        self._proto.close()

    def broke_off(self, answer: bytes) -> None:
        """Its handler failed: the connection ends after ``answer`` (a 500), written when
        nothing of an answer went out yet."""
        self.close = True
        if not self.started:
            with contextlib.suppress(ConnectionError):
                self._proto.write(answer)
                self.ended = True

    def drop_rest(self) -> None:
        """Answered before its body was in: the rest is read and dropped (never paused)."""
        self.too_large = True
        self.parts.clear()
