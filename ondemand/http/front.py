"""What the lean front serves and what its connections share: :class:`Route` and :class:`Front`
(design.md, "The HTTP layer").

Apart from ``server.py`` so that a server of plain lean-front connections, with no hand-off to
aiohttp, imports no aiohttp at all: the engine simulator (``sim/server.py``) serves on this
front, and a simulator's start is most of the test suite's CPU. Imports nothing of ours but this
package (``aio`` for its types only).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .caps import OpenConnections, Seat, Yields, peer_of
from .cycle import Call
from .limits import Limits
from .protocol import HttpProtocol
from .refusals import GATEWAY_ONLY, REFUSALS, RefusalLog

if TYPE_CHECKING:
    from .aio import AioConnection

__all__ = ["Route", "Front"]


class Route:
    """What the lean front serves: requests whose target starts with ``prefix + "/"``, handed
    to ``handle(call)``; ``max_body()``: how much body a request may buffer before its
    handler asks for it (the handler's own limit applies from then); ``allows(ip)``: whether the
    peer policy lets a client IP reach the gateway (a listener of the gateway's alone closes one
    it refuses at the accept)."""

    def __init__(self, prefix: str, handle: Callable[[Call], Awaitable[None]], max_body: Callable[[], int],
                 allows: Callable[[str], bool] | None = None):
        self.prefix = (prefix.rstrip("/") + "/").encode()
        self.handle = handle
        self.max_body = max_body
        self.allows = allows


class Front:
    """What the lean front's connections share: the route, the bounds, the set of open
    connections (for the shutdown), their count against the caps (one listener's), the Server
    line of their answers and how to make aiohttp's connection for a hand-off (None: no
    hand-off; a target outside the route is refused with ``outside``: by default the gateway's
    404, which names ``admin_listen``)."""

    def __init__(self, route: Route, limits: Limits, aiohttp_connection: Callable[[], AioConnection] | None,
                 refusals: RefusalLog = REFUSALS, *, server: str, outside: bytes = GATEWAY_ONLY):
        self.loop = asyncio.get_running_loop()
        self.hand_off = aiohttp_connection is not None
        self.outside = outside  # the whole answer to a target outside the route, with no hand-off
        self.prefix = route.prefix
        self.handle = route.handle
        self.max_body = route.max_body
        self.limits = limits
        self.aiohttp_connection = aiohttp_connection
        self.refusals = refusals
        self.server_line = f"Server: {server}\r\n"  # on every head (``Call``)
        self.connections: set[HttpProtocol] = set()
        self.open = OpenConnections()
        # The gateway's listener alone: a peer the policy refuses could reach nothing there.
        self.allows = None if self.hand_off else route.allows

    def __call__(self) -> HttpProtocol:
        return HttpProtocol(self)

    def accept(self, transport: asyncio.BaseTransport, conn: Yields) -> tuple[str, Seat | None]:
        """A connection just accepted: its peer (``""``: the admin socket), and its seat in the
        count (``caps.py``), or None when it is closed at once: the peer policy refuses it (on the
        gateway's listener alone), or it is over a cap with no idle connection to give way.
        TCP_NODELAY on the others."""
        peer = peer_of(transport)
        seat = None
        if peer and self.allows is not None and not self.allows(peer):
            self.open.refused(peer, "the peer policy refuses it")
        else:
            seat = self.open.admit(peer, self.limits, conn)
        if seat is None:
            transport.close()
            return peer, None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return peer, seat

    def take_over(self, transport: asyncio.Transport, seat: Seat, data: bytes, paused: bool) -> None:
        """A hand-off (``HttpProtocol._hand_off``): aiohttp's connection gets the transport."""
        assert self.aiohttp_connection is not None, "a front without aiohttp's connection hands nothing off"
        self.aiohttp_connection().take_over(transport, seat, data, paused)
