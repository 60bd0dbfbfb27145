"""What a client still sends after its answer, read and dropped within bounds: :class:`Linger`,
for the lean front's connections (issue 40; aiohttp's lingering does the same for its own,
``aio.py`` bounds its size).

A client may send its whole request before it reads (httpx, so the OpenAI SDK, with a body; a
pipelining client, with more requests). A server that closes while those bytes arrive has its
kernel answer them with a reset, and the client's kernel then drops the answer it had not read
yet: httpx raised ReadError instead of reading its 413, 9 times in 9. So what comes after an
answer is read and dropped for ``Limits.lingering_s`` and at most ``Limits.linger_max_bytes``
(nginx's lingering close), then the connection closes:

- after an answer that keeps the connection (an unknown deployment's 404 before the body came),
  the rest of the body is parsed and dropped, and the next request is read once it is in
  (``HttpProtocol._linger_done``);
- after an answer that ends it (:meth:`Linger.ending`), the connection is half-closed (the
  answer, then a FIN, so that a client reading to the end has it all), and every byte is dropped
  unparsed until the client closes too.

Imports nothing of ours but this package.
"""
from __future__ import annotations

import asyncio

from .limits import Limits

__all__ = ["Linger"]


class Linger:
    __slots__ = ("transport", "left", "timer")

    def __init__(self, transport: asyncio.Transport, limits: Limits, loop: asyncio.AbstractEventLoop):
        self.transport = transport
        self.left = limits.linger_max_bytes
        self.timer = loop.call_later(limits.lingering_s, transport.close)

    @classmethod
    def ending(cls, transport: asyncio.Transport, limits: Limits, loop: asyncio.AbstractEventLoop) -> Linger | None:
        """The connection's end: half-closed, then lingering; None when it cannot be half-closed
        (it is closed then) or is closing already."""
        if transport.is_closing():
            return None
        try:
            transport.write_eof()  # after what is still buffered: the answer goes out whole
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return None
        return cls(transport, limits, loop)

    def dropped(self, n: int) -> None:
        """``n`` more bytes read and dropped: past the bound, the connection closes."""
        self.left -= n
        if self.left < 0:
            self.transport.close()

    def cancel(self) -> None:
        self.timer.cancel()
