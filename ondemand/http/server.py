"""The HTTP server: its listeners, the two stacks, and their shutdown.

Every connection starts on the lean front (:class:`~.protocol.HttpProtocol`), which serves
the gateway's routes (:class:`~.front.Route`) itself and hands any other connection to aiohttp's
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
import contextlib
import logging
import resource
import sys
from collections.abc import Callable

import aiohttp
from aiohttp import web

from .aio import AioConnection
from .caps import OpenConnections, peer_of
from .front import Front, Route
from .limits import Limits
from .protocol import HttpProtocol

_log = logging.getLogger("ondemand.http")

__all__ = ["Route", "ROUTE", "LIMITS", "HttpServer", "Front", "SERVER_SOFTWARE"]

# The Server header aiohttp's answers carry, on the lean front's too: both stacks' look alike.
SERVER_SOFTWARE = f"Python/{sys.version_info[0]}.{sys.version_info[1]} aiohttp/{aiohttp.__version__}"

ROUTE = web.AppKey("http_route", Route)
LIMITS = web.AppKey("http_limits", Limits)


class _AdminGate(asyncio.Protocol):
    """The admin listener's accept: the caps, then aiohttp's connection takes the transport
    (as a hand-off does) with its seat."""

    def __init__(self, open_: OpenConnections, limits: Callable[[], Limits],
                 aiohttp_connection: Callable[[], AioConnection]):
        self.open = open_
        self.limits = limits
        self.aiohttp_connection = aiohttp_connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = peer_of(transport)
        seat = self.open.admit(peer, self.limits(), None)
        if seat is None:
            transport.close()
            return
        self.aiohttp_connection().take_over(transport, seat)  # type: ignore[arg-type]


# aiohttp's answers that refuse a request end its connection, as the lean front's do (issue 40:
# a refused client held its connection for the keep-alive time): Connection: close, and aiohttp
# reads and drops the rest of the body for its lingering time (bounded in size by AioConnection).
_ENDS_CONNECTION = frozenset({400, 401, 413, 421})


async def _refusal_ends_connection(request: web.BaseRequest, response: web.StreamResponse) -> None:
    if response.status in _ENDS_CONNECTION:
        response.force_close()
        response.headers["Connection"] = "close"  # (the head is made before this signal: said here)


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
        self.aiohttp_connection: Callable[[], AioConnection] | None = None  # once started
        self.admin_open = OpenConnections()  # the admin listener's own count: a flood on listen leaves it be
        self.listeners: list[asyncio.AbstractServer] = []
        app.on_shutdown.append(self._drain)  # after the application's own (signals run in order)
        app.on_response_prepare.append(_refusal_ends_connection)

    async def start(self) -> None:
        await self.runner.setup()
        server = self.runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        route = self.app[ROUTE]

        def aiohttp_connection() -> AioConnection:
            return AioConnection(server, front.limits, loop, access_log=None)
        self.aiohttp_connection = aiohttp_connection
        front = self.front = Front(route, self.limits, aiohttp_connection, server=SERVER_SOFTWARE)
        # A listener of the gateway's alone (admin_listen is set): no hand-off.
        self.gateway_only = Front(route, self.limits, None, server=SERVER_SOFTWARE)
        self.gateway_only.connections = front.connections  # one set: the shutdown drains both

    async def listen_tcp(self, host: str | None, port: int, *, backlog: int = 4096,
                         serves: str = "all") -> None:
        """``serves``: "all" (the lean front, handing other connections to aiohttp), "gateway"
        (the gateway alone: anything else is 404) or "admin" (aiohttp's from the first byte)."""
        assert self.front is not None and self.gateway_only is not None and self.aiohttp_connection is not None
        front, connect = self.front, self.aiohttp_connection
        factories: dict[str, Callable[[], asyncio.Protocol]] = {
            "all": front, "gateway": self.gateway_only,
            "admin": lambda: _AdminGate(self.admin_open, lambda: front.limits, connect)}
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
        await asyncio.gather(*(_finish(c, self.shutdown_timeout) for c in lean),
                             *([server.shutdown(self.shutdown_timeout)] if server is not None else []))
        if self.front is not None:
            self.front.connections.clear()


async def _finish(conn: HttpProtocol, timeout: float) -> None:
    """A lean connection's request finishes within ``timeout``, else it is cancelled (uvicorn's
    server does this, not its protocol); then the connection closes."""
    task = conn.task
    if task is not None:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), timeout)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    conn.close()


def raise_open_files(max_connections: int) -> None:
    """Each connection is a file descriptor, and a service's soft limit is often 1,024
    (systemd's default): raised toward the hard limit, so that the caps on open
    connections, not the limit, decide who is refused; a warning when even the hard
    limit is below them."""
    want = 2 * max_connections + 1024  # both listeners full, and the engines, logs and state file
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            _log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < max_connections + 256:
        _log.warning("the open-files limit is %d, below max_connections (%d): connections beyond it fail at the "
                     "accept (raise LimitNOFILE, or ulimit -n, or lower max_connections)", soft, max_connections)
