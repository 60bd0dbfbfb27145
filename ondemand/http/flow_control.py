"""Flow control for one connection, both ways (uvicorn's ``flow_control.py``): the one of
the lean front's client connections and of the pool's engine connections.

Reading: the protocol pauses the transport when it holds more than the high-water mark of a
request's body that the handler has not taken yet (before issue 23 the lean front buffered up
to the whole 16 MiB body limit without pausing), and while a pipelined request waits for the
one before it; it resumes when the handler takes what is buffered, or the next request starts.
An engine connection pauses while its answer's body (``body.Body``) holds more than its
high-water mark that the gateway has not relayed to a slow client yet.
Several reasons may hold the pause at once: reading resumes only when none is left.

Writing: the transport calls ``pause_writing`` past its own high-water mark; a writer awaits
:meth:`FlowControl.drain` until ``resume_writing``, or until the connection is lost (then
``ConnectionResetError``). Imports nothing of ours.
"""
from __future__ import annotations

import asyncio

__all__ = ["FlowControl", "BODY", "PIPELINE"]

BODY = 1       # a body past the high-water mark, not yet taken by its reader (the default reason)
PIPELINE = 2   # a request waits for the answer to the one before it


class FlowControl:
    __slots__ = ("_transport", "_reasons", "write_paused", "_drained", "_lost")

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._reasons = 0
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._lost = False

    # --- reading ---

    @property
    def read_paused(self) -> bool:
        return self._reasons != 0

    def pause_reading(self, reason: int = BODY) -> None:
        if not self._reasons and not self._lost:
            self._transport.pause_reading()  # a closing transport's (asyncio's, uvloop's) does nothing
        self._reasons |= reason

    def resume_reading(self, reason: int = BODY) -> None:
        if self._reasons & reason:
            self._reasons &= ~reason
            if not self._reasons and not self._lost:
                self._transport.resume_reading()

    # --- writing ---

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def writable(self) -> bool:
        """Nothing to wait for: :meth:`drain` would return at once."""
        return not (self.write_paused or self._lost)

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            waiter = self._drained
            if waiter is None or waiter.done():
                waiter = self._drained = asyncio.get_running_loop().create_future()
            await waiter
            if self._lost:
                raise ConnectionResetError("the client closed the connection")

    def connection_lost(self) -> None:
        self._lost = True
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # its writer raises ConnectionResetError
