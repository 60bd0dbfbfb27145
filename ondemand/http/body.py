"""An engine answer's body as it arrives: :class:`Body`, a small stream with flow control.

The pool's connection feeds it from httptools' callbacks; the gateway reads it. While more
than ``high`` bytes wait for a slow client, the engine's socket is not read (the kernel and
then the engine hold the rest); reading resumes below ``low``. While its reader waits with
nothing left to read, a read the reader's sink (:meth:`Body.pipe`) can take at once goes
straight to it, with no wake-up of the reader. It replaces aiohttp's
``StreamReader``, which came with aiohttp's private response parser (issue 23), and keeps the
part of its interface the gateway and the tests use. Imports nothing of ours.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Protocol

__all__ = ["Body", "PayloadError"]


class PayloadError(Exception):
    """The engine broke off its answer's body (or garbled it)."""


class _Source(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Body:
    __slots__ = ("_source", "_parts", "buffered", "_eof", "_exc", "_reader", "low", "high", "_sink")

    def __init__(self, source: _Source, low: int):
        self._source = source
        self._parts: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._reader: asyncio.Future[None] | None = None
        self.low = low
        self.high = 2 * low
        self._sink: Callable[[bytes], bool] | None = None

    # --- from the connection ---

    def arrived(self, chunks: list[bytes]) -> None:
        """A read's worth of the body: its chunks as llhttp gave them (an engine's stream brings
        a dozen a read), told to the reader once. Reading pauses past the high-water mark."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        # The reader waits, so it took all that came before: this read is all there is.
        if self._reader is not None and self._sink is not None and self._sink(data):
            return
        self._parts.append(data)
        self.buffered += len(data)
        self._wake()
        if self.buffered > self.high:
            self._source.pause_reading()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._reader = self._reader, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- state ---

    def exception(self) -> BaseException | None:
        return self._exc

    def is_eof(self) -> bool:
        """The whole body arrived (some of it may still be unread)."""
        return self._eof

    def at_eof(self) -> bool:
        """The whole body arrived and was read."""
        return self._eof and not self._parts

    # --- reading ---

    def pipe(self, sink: Callable[[bytes], bool] | None) -> None:
        """While the reader waits, hand each read to ``sink`` instead of waking the reader (a
        stream relayed to a client costs one call a read, not a task's turn). ``sink`` says
        whether it took the bytes; when it did not (the client cannot take more now, or is
        gone), the reader is woken with them as without a sink. None: no sink."""
        self._sink = sink

    async def _wait(self) -> None:
        waiter = self._reader = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._reader = None

    def _take(self, n: int) -> bytes:
        parts = self._parts
        if n < 0 or n >= self.buffered:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
        else:
            chunks = []
            need = n
            while need:
                first = parts[0]
                if len(first) <= need:
                    chunks.append(parts.popleft())
                    need -= len(first)
                else:
                    chunks.append(first[:need])
                    parts[0] = first[need:]
                    need = 0
            data = b"".join(chunks)
        self.buffered -= len(data)
        if self.buffered < self.low:
            self._source.resume_reading()
        return data

    def take_now(self) -> bytes:
        """What has arrived and was not read yet (maybe b""): no wait, no error."""
        return self._take(-1) if self._parts else b""

    def read_now(self) -> bytes:
        """The whole body, once it all arrived (:meth:`is_eof`): no wait, no coroutine."""
        assert self._eof, "read_now() before the whole body arrived"
        if self._exc is not None:
            raise self._exc
        return self.take_now()

    async def readany(self) -> bytes:
        """What has arrived (at least one byte), or b"" at the end. What arrived before the
        engine broke off is passed on first; the error comes after it."""
        while True:
            if self._parts:
                return self._take(-1)
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._wait()

    async def read(self, n: int = -1) -> bytes:
        """``n`` < 0: the whole rest of the body; else at most ``n`` bytes of what arrived."""
        if n >= 0:
            while True:
                if self._parts:
                    return self._take(n)
                if self._exc is not None:
                    raise self._exc
                if self._eof:
                    return b""
                await self._wait()
        while not self._eof:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        if self._exc is not None:
            raise self._exc
        return self._take(-1) if self._parts else b""

    async def readuntil(self, separator: bytes) -> bytes:
        while True:
            if self._exc is not None:
                raise self._exc
            if self._parts:
                joined = b"".join(self._parts)
                self._parts.clear()
                self._parts.append(joined)
                at = joined.find(separator)
                if at >= 0:
                    return self._take(at + len(separator))
            if self._eof:
                return self._take(-1) if self._parts else b""
            await self._wait()

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            data = await self.readany()
            if not data:
                return
            yield data
