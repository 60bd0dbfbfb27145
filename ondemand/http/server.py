"""The HTTP server: its listeners, the two stacks, and their shutdown.

Every connection starts on the lean front (:class:`~.protocol.HttpProtocol`), which serves
the gateway's routes (:class:`Route`) itself and hands any other connection to aiohttp's
application once, for good (:class:`~.aio.AioConnection`). aiohttp's runner is used through
its public API only: ``AppRunner.setup``, ``runner.server`` (whose connections it drains at
shutdown), ``cleanup``; the listeners are ours (``loop.create_server``), so no aiohttp class
is changed or reached into.

Shutdown (uvicorn's order): the listeners close; idle connections close; the application's
``on_shutdown`` (the controller ends its waiters first) ends with :meth:`HttpServer._drain`,
which lets both stacks' requests finish within the timeout and cancels what is left; then the
cleanup contexts. Imports nothing of ours but this package and ``errors``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from .aio import AioConnection
from .cycle import Call
from .limits import Limits
from .protocol import HttpProtocol
from .refusals import REFUSALS, RefusalLog

__all__ = ["Route", "ROUTE", "LIMITS", "HttpServer", "Front"]


class Route:
    """What the lean front serves: requests whose target starts with ``prefix + "/"``, handed
    to ``handle(call)``; ``max_body()``: how much body a request may buffer before its
    handler asks for it (the handler's own limit applies from then)."""

    def __init__(self, prefix: str, handle: Callable[[Call], Awaitable[None]], max_body: Callable[[], int]):
        self.prefix = (prefix.rstrip("/") + "/").encode()
        self.handle = handle
        self.max_body = max_body


ROUTE = web.AppKey("http_route", Route)
LIMITS = web.AppKey("http_limits", Limits)


class Front:
    """What the lean front's connections share: the route, the bounds, the set of open
    connections (for the shutdown) and how to make aiohttp's connection for a hand-off."""

    def __init__(self, route: Route, limits: Limits, aiohttp_connection: Callable[[], AioConnection],
                 refusals: RefusalLog = REFUSALS, *, hand_off: bool = True):
        self.loop = asyncio.get_running_loop()
        self.hand_off = hand_off  # False: a listener of the gateway's alone (admin_listen is set)
        self.prefix = route.prefix
        self.handle = route.handle
        self.max_body = route.max_body
        self.limits = limits
        self.aiohttp_connection = aiohttp_connection
        self.refusals = refusals
        self.connections: set[HttpProtocol] = set()

    def __call__(self) -> HttpProtocol:
        return HttpProtocol(self)


class HttpServer:
    """The application (with a :data:`ROUTE` and :data:`LIMITS`) behind our listeners."""

    def __init__(self, app: web.Application, *, shutdown_timeout: float):
        self.app = app
        self.limits = app.get(LIMITS) or Limits()
        self.shutdown_timeout = shutdown_timeout
        # The runner's server is used for its request handling and its connections' drain;
        # its connections are made here (AioConnection, with the limits), never by its factory.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
        self.front: Front | None = None
        self.gateway_only: Front | None = None
        self.listeners: list[asyncio.AbstractServer] = []
        app.on_shutdown.append(self._drain)  # after the application's own (signals run in order)

    async def start(self) -> None:
        await self.runner.setup()
        server = self.runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        route = self.app[ROUTE]

        def aiohttp_connection() -> AioConnection:
            return AioConnection(server, front.limits, loop, access_log=None)
        front = self.front = Front(route, self.limits, aiohttp_connection)
        self.gateway_only = Front(route, self.limits, aiohttp_connection, hand_off=False)
        self.gateway_only.connections = front.connections  # one set: the shutdown drains both

    async def listen_tcp(self, host: str | None, port: int, *, backlog: int = 4096,
                         serves: str = "all") -> None:
        """``serves``: "all" (the lean front, handing other connections to aiohttp), "gateway"
        (the gateway alone: anything else is 404) or "admin" (aiohttp's from the first byte)."""
        assert self.front is not None and self.gateway_only is not None
        factories: dict[str, Callable[[], asyncio.Protocol]] = {
            "all": self.front, "gateway": self.gateway_only, "admin": self.front.aiohttp_connection}
        factory = factories[serves]
        self.listeners.append(await asyncio.get_running_loop().create_server(
            factory, host, port, reuse_address=True, backlog=backlog))

    async def listen_unix(self, path: str) -> None:
        assert self.front is not None
        self.listeners.append(await asyncio.get_running_loop().create_unix_server(self.front, path))

    async def stop(self) -> None:
        """Stop accepting, let requests finish within the shutdown timeout, clean up."""
        for listener in self.listeners:
            listener.close()
        self.listeners.clear()
        if self.front is not None:
            for conn in list(self.front.connections):
                conn.shutdown_begin()
        await self.runner.cleanup()

    async def _drain(self, app: web.Application) -> None:
        """Both stacks' requests finish together: the lean front's and aiohttp's."""
        lean = list(self.front.connections) if self.front is not None else []
        server = self.runner.server
        await asyncio.gather(*(c.shutdown(self.shutdown_timeout) for c in lean),
                             *([server.shutdown(self.shutdown_timeout)] if server is not None else []))
        if self.front is not None:
            self.front.connections.clear()
