"""One client connection of the lean front: :class:`HttpProtocol` (uvicorn's
``HttpToolsProtocol``; design.md, "The HTTP layer").

llhttp (httptools) parses; a request under the gateway's prefix becomes a :class:`~.cycle.Call`
for the gateway's handler, one at a time and in order. The first request that is not the
gateway's hands the connection to aiohttp for good (:meth:`HttpProtocol._hand_off`), with the
bytes from that request's first on, once the answers before it are out; one pipelined in the
same read behind a gateway request (where it begins is unknown: llhttp tells no offsets) is 421
instead. Refusals are the documented JSON, after the answers owed before them, then the end
(``linger.py``). The connection's :class:`~.caps.Seat` hears when it rests and when a whole
request arrives. Imports nothing of ours but ``errors`` (through ``refusals``) and this package.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from . import refusals
from .caps import UNCOUNTED, Seat
from .cycle import BodyMalformed, Call
from .flow_control import BODY, PIPELINE, FlowControl
from .headers import decoded
from .linger import Linger
from .refusals import NO_VERSION, Refuse, check_head, refusal, unfinished_head

if TYPE_CHECKING:
    from .front import Front

_log = logging.getLogger("ondemand.http")


class _HandOff(Exception):
    """Raised in a parser callback: stop parsing, the rest is aiohttp's."""


class HttpProtocol(asyncio.Protocol):
    def __init__(self, front: Front):
        self.front = front
        self.limits = front.limits
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.flow: FlowControl = None  # type: ignore[assignment]  # set in connection_made
        self.peer = ""
        self.parser = httptools.HttpRequestParser(self)
        # The message being parsed.
        self.in_message = False
        self.in_head = False
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.cycle: Call | None = None       # the gateway request whose body is being parsed
        # The bytes since the current message began, while that beginning is known (see _hand_off).
        self.raw: list[bytes] | None = None
        self.fresh = False                   # no message ended in the read being parsed
        # The gateway's requests.
        self.pipeline: collections.deque[Call] = collections.deque()
        self.current: Call | None = None
        self.task: asyncio.Task[None] | None = None
        self.lingering: Call | None = None  # answered early: the rest of its body is dropped
        self.linger: Linger | None = None    # what comes after an answer, dropped within bounds
        # What comes once the answers owed are out: a refusal, or the hand-off's bytes.
        self.refusal: bytes | None = None
        self.handoff: list[bytes] | None = None
        self.broken = False                  # nothing more is parsed
        self.closing = False                 # the server is shutting down
        self.head_bytes = 0
        self.begun = False                   # a request began on this connection
        self.seat: Seat = UNCOUNTED          # its place in the front's count (the caps)
        self.head_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.peer, seat = self.front.accept(transport, self)
        if seat is None:  # over a cap, or a peer the gateway's listener refuses: closed
            return
        self.seat = seat
        self.transport = transport  # type: ignore[assignment]
        self.flow = FlowControl(self.transport)  # type: ignore[arg-type]
        self.front.connections.add(self)
        self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_late)  # from the accept

    def data_received(self, data: bytes) -> None:
        if self.broken:
            if self.handoff is not None:
                self.handoff.append(data)  # aiohttp's, once the answers before it are out
            elif self.linger is not None:  # ended: the client's last bytes
                self.linger.dropped(len(data))
            return
        if not self.in_message:  # whatever begins in this read begins at its first byte
            self.raw = [data]
            self.fresh = True
            self.head_bytes += len(data)
        else:
            if self.raw is not None:
                self.raw.append(data)
            if self.in_head:
                self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            why = exc.__context__
            if isinstance(why, Refuse):
                self._refuse(why.answer)
            elif not isinstance(why, _HandOff):
                raise
        except httptools.HttpParserUpgrade:  # cannot be: on_headers_complete refuses upgrades
            self._refuse(refusals.UPGRADE)
        except httptools.HttpParserError as exc:
            self._malformed(exc)
        if self.broken:
            if self.handoff is not None and self.current is None and not self.pipeline:
                self._hand_off()
            return
        if self._head_pending():
            # Timed from its first read: a head that came whole (the usual) never needs the timer.
            version = self.parser.get_http_version() if self.in_head else ""
            answer = unfinished_head(self.limits, self.head_bytes, version,
                                     self.raw if self.in_head and not self.raw_headers and b"\n" in data else None)
            if answer is not None:
                self._refuse(answer)
            elif self.head_timer is None:
                self.head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_late)

    def _head_pending(self) -> bool:
        """Part of a request head is here (or only the empty lines llhttp skips before one)."""
        return self.in_head or (not self.in_message and self.head_bytes > 0)

    def eof_received(self) -> bool | None:
        return None  # the transport closes: a hang-up

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self._forget()
        self.seat.release()
        if self.task is not None:  # the client went away: its handler is cancelled (a hang-up)
            self.task.cancel()

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def _forget(self) -> None:
        self.front.connections.discard(self)
        for timer in (self.head_timer, self.idle_timer, self.linger):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.idle_timer = self.linger = None
        if self.flow is not None:
            self.flow.connection_lost()

    # --- writing, for Call ---

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    give_way = close  # idle at a cap: closed for a new connection (caps.py); nothing is owed

    # --- llhttp's callbacks ---

    def on_message_begin(self) -> None:
        self.in_message = self.in_head = self.begun = True
        self.url = b""
        self.raw_headers = []
        if not self.fresh:  # a message ended earlier in this read: where this one begins is unknown
            self.raw = None

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_line_size:
            raise Refuse(refusals.LINE_TOO_LONG)

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.raw_headers
        headers.append((name, value))
        if len(name) + len(value) > self.limits.max_field_size or len(headers) > self.limits.max_headers:
            raise Refuse(refusals.header_too_large(self.limits))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._head_done()
        parser = self.parser
        version = parser.get_http_version()
        if version == "0.9":
            raise Refuse(NO_VERSION)
        headers = CIMultiDict([decoded(pair) for pair in self.raw_headers])
        check_head(parser.should_upgrade(), headers)
        if not self.url.startswith(self.front.prefix):
            if not self.front.hand_off:
                raise Refuse(self.front.outside)
            if self.raw is None:
                raise Refuse(refusals.PIPELINED)
            self.broken = True
            self.handoff, self.raw = self.raw, None
            if self.current is not None or self.pipeline:
                self.flow.pause_reading(PIPELINE)  # the bytes wait in the kernel until aiohttp takes them
            raise _HandOff()
        self.raw = None  # a gateway request is never handed off: its bytes need not be kept
        cycle = self.cycle = Call(self, parser.get_method().decode("ascii", "replace"),
                                  self.url.decode("utf-8", "surrogateescape"), CIMultiDictProxy(headers),
                                  version, parser.should_keep_alive(), self.front.max_body(), self.raw_headers)
        self.seat.busy = True  # a whole request: it does not give way until answered
        if self.current is None and not self.pipeline:
            self._start(cycle)
        else:
            self.pipeline.append(cycle)
            self.flow.pause_reading(PIPELINE)  # one request at a time: the next waits in the kernel

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is not None:
            cycle.feed(body)

    def on_message_complete(self) -> None:
        self.in_message = self.fresh = False
        cycle, self.cycle = self.cycle, None
        if cycle is not None:
            cycle.done()
            if cycle is self.lingering:
                self._linger_done()

    # --- the gateway's requests ---

    def _start(self, cycle: Call) -> None:
        self.current = cycle
        # A child of this connection, not a background task: connection_lost cancels it.
        self.task = self.loop.create_task(self._run(cycle))  # noqa: TID251

    async def _run(self, cycle: Call) -> None:
        try:
            await self.front.handle(cycle)
        except asyncio.CancelledError:
            return  # the client went away (connection_lost) or the server is stopping
        except Exception:
            _log.exception("the gateway failed on %s %s", cycle.method, cycle.raw_path)
            cycle.broke_off(refusals.INTERNAL_ERROR)
        finally:
            self.task = self.current = None
        self._after(cycle)

    def _after(self, cycle: Call) -> None:
        """The answer is out: the next request, or the connection's end."""
        transport = self.transport
        if transport is None:
            return
        if not cycle.ended or cycle.close or not cycle.keep_alive or self.closing:
            if cycle.ended and not self.closing and (not cycle.complete or self.pipeline or self.in_message):
                self._end()  # more is on its way: let the client read the answer first
            else:
                transport.close()
            return
        if not cycle.complete and not cycle.failed:  # answered before its body was in: read and drop the rest
            cycle.drop_rest()
            self.lingering = cycle
            self.linger = Linger(transport, self.limits, self.loop)
            self.flow.resume_reading(BODY)
            return
        self._go_on()

    def _linger_done(self) -> None:
        linger, self.linger, self.lingering = self.linger, None, None
        if linger is not None:
            linger.cancel()
        self._go_on()

    def _go_on(self) -> None:
        transport = self.transport
        if transport is None:
            return
        self.flow.resume_reading(BODY)  # the answered request's body is no one's concern now
        if self.pipeline:
            self._start(self.pipeline.popleft())
            if not self.pipeline and not self.broken:
                self.flow.resume_reading(PIPELINE)
            return
        if self.refusal is not None:
            self._refuse(self.refusal)
        elif self.handoff is not None:
            self._hand_off()
        else:
            self.flow.resume_reading(PIPELINE)
            self._idle()

    def _idle(self) -> None:
        """Waiting for the next request: closed after the keep-alive timeout of this. One timer
        lives across requests (set again when it fires early), not one per request."""
        self.idle_since = self.loop.time()
        self.seat.rest()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.limits.keepalive_timeout_s, self._idle_late)

    def _idle_late(self) -> None:
        self.idle_timer = None
        if self.transport is None or self.broken:
            return
        if self.task is not None or self.pipeline or self.in_message or self.head_bytes:
            return  # busy: _idle() sets it again after the answer
        left = self.idle_since + self.limits.keepalive_timeout_s - self.loop.time()
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
        if self._head_pending() and not self.broken:
            self._refuse(refusals.head_late(self.limits))
        elif not self.begun and self.transport is not None:
            self.transport.close()  # nothing came since the accept: no request to answer

    def _refuse(self, answer: bytes) -> None:
        """Write ``answer`` and close, after the answers owed before it; nothing more is parsed."""
        self.broken = True
        self._head_done()
        transport = self.transport
        if transport is None:
            return
        if self.current is not None or self.pipeline:
            self.refusal = answer
            self.flow.pause_reading(PIPELINE)
            return
        self.refusal = None
        if not transport.is_closing():
            transport.write(answer)
        self._end()

    def _end(self) -> None:
        """The end after an answer while the client may still be sending: half-closed, and what
        comes is read and dropped within bounds (``linger.py``), not answered with a reset."""
        transport = self.transport
        if transport is None:
            return
        self.broken = True
        if self.linger is not None:
            self.linger.cancel()
        self.linger = Linger.ending(transport, self.limits, self.loop)
        self.flow.resume_reading(BODY)
        self.flow.resume_reading(PIPELINE)
        self.seat.rest()  # nothing is owed now: it gives way at a cap

    def _malformed(self, exc: Exception) -> None:
        cycle = self.cycle
        why = str(exc) or type(exc).__name__
        if cycle is not None:  # its body broke: its handler says so (400 invalid_body), or it lingers
            self.broken = True
            if cycle is self.lingering:
                self.close()
            else:
                cycle.fail(BodyMalformed(why))
            return
        self.front.refusals.note(self.peer or "a local client", why)
        self._refuse(refusal(400, "invalid_request", f"Malformed HTTP request: {why}"))

    # --- the hand-off ---

    def _hand_off(self) -> None:
        """aiohttp's connection object gets the transport, and every byte from the first
        request that is not the gateway's on, as they came; this protocol is done with it."""
        transport, data = self.transport, b"".join(self.handoff or ())
        paused = self.flow.read_paused
        self.handoff = None
        self.transport = None
        self._forget()
        if transport is None or transport.is_closing():
            return
        seat, self.seat = self.seat, UNCOUNTED  # aiohttp's connection holds the seat from now
        self.front.take_over(transport, seat, data, paused)

    # --- shutting down ---

    def shutdown_begin(self) -> None:
        """No new requests: an idle connection closes now, a busy one after its answer (the
        server gives its handler the grace period, then cancels it: ``server._finish``)."""
        self.closing = True
        if self.task is None and not self.pipeline and self.transport is not None:
            self.transport.close()
