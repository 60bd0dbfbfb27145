"""The HTTP server's bounds on what a client may make it hold, beyond aiohttp's own.

aiohttp's parser already refuses (400, connection closed) a request line over
``max_line_size``, a header over ``max_field_size``, more than ``max_headers``
headers, and every framing trick (Content-Length with Transfer-Encoding, two
Content-Lengths, obs-fold, bare CR or LF, bad chunk sizes, unknown codings). It
does not bound the time a request head may take to arrive (a "slowloris" holds
its connection until the keep-alive timeout, an hour by default), nor the total
size of a head (``max_headers`` times ``max_field_size``: 8 MiB a connection), and
it logs every malformed request with a traceback (a log flood for anyone who can
open a TCP connection). Here:

- :data:`HEAD_TIMEOUT_S`: a request head must be complete within this many seconds
  of its first byte, else 408 and the connection is closed;
- :data:`MAX_HEAD_BYTES`: a head may hold at most this many bytes, else 431 and the
  connection is closed;
- :data:`KEEPALIVE_TIMEOUT_S`: an idle keep-alive connection is closed after this;
  it is longer than LiteLLM's own idle limit (120 s), so that LiteLLM never sends a
  request on a connection the gateway is closing;
- one log line (no traceback) per minute for malformed requests, with their count.

:class:`Runner` is an ``aiohttp.web.AppRunner`` whose connections are
:class:`_Protocol`: aiohttp's own, with the two bounds above. ``serve`` and the
tests' ``run_app`` both use it. Imports nothing of ours.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web, web_server
from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["Runner", "HANDLER_ARGS", "HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "KEEPALIVE_TIMEOUT_S",
           "quiet_malformed_requests"]

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
    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """``web.AppRunner`` whose connections keep :class:`_Protocol`'s bounds."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds it; only its protocol factory differs
        return server


class _MalformedFilter(logging.Filter):
    """aiohttp logs each malformed request as an error with its traceback: one line a
    minute instead, with the count, so that no client can flood the log."""

    def __init__(self, every_s: float = 60.0):
        super().__init__()
        self.every_s = every_s
        self.suppressed = 0
        self._last = -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return False
        more = f" ({self.suppressed} more since the last such line)" if self.suppressed else ""
        self._last, self.suppressed = now, 0
        first = str(exc.message).strip().splitlines()[0] if exc.message else type(exc).__name__
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "refused a malformed request from %s (400): %s%s", (peer, first, more), None, None)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_FILTER = _MalformedFilter()


def quiet_malformed_requests() -> None:
    """Install the filter on aiohttp's server logger (idempotent)."""
    logger = logging.getLogger("aiohttp.server")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
