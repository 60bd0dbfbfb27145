"""The simulator's server: its routes on ondemand's lean front (``http/front.py``,
``http/protocol.py``, ``http/cycle.py``), not on aiohttp.

A simulator starts for every engine start of the tests, the demo and a live replay (about 375
in one ``make test``), and on aiohttp most of each start was aiohttp's import (its client,
connector, tracing, attrs, yarl: about 0.1 s of CPU in 0.16). The front imports none of it, and
already answers HTTP/1.1 as the gateway needs (keep-alive, pipelining, chunked bodies, Expect,
flow control both ways). What aiohttp's application did besides, this module does as it did:

- ``Request``: what a route sees of a ``Call``, decoded as aiohttp's request decoded it
  (yarl's rules, ``unquote``): ``path``, ``query_string``, ``query``, ``content_type``, the body
  by ``read``; ``match``, the part of the one route that has one (``/v1/models/{model}``).
- ``Router``: a route by path and method; a path none serves is 404 and a method its route does
  not take 405 (``NoRoute``), a GET route takes HEAD too.
- ``Listener``: the listening socket (aiohttp's bounds: ``LIMITS``), and aiohttp's lifecycle of
  a request: a route goes on when its client goes away once the request is in (aiohttp does not
  cancel handlers), and at the shutdown the routes in flight have a grace period, then are
  cancelled.
"""
from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

from multidict import CIMultiDictProxy, MultiDict

from ..http.cycle import BodyMalformed, BodyTooLarge, Call
from ..http.front import Front, Route
from ..http.limits import Limits, MiB
from ..http.refusals import refusal
from .replies import STREAMED, Reply, text

_log = logging.getLogger("ondemand.sim")

SOFTWARE = f"Python/{sys.version_info[0]}.{sys.version_info[1]} ondemand-simulator"  # the Server line
MAX_BODY = 256 * MiB  # aiohttp's client_max_size here: a body over it is 413
# aiohttp's bounds, as the simulator had them: a header line of 8,190 bytes, 75 s of keep-alive;
# no time bound on a head or a body (an hour here) and no cap on connections (a million here).
LIMITS = Limits(max_field_size=8190, keepalive_timeout_s=75.0, head_timeout_s=3600.0, body_timeout_s=3600.0,
                max_connections=1 << 20, max_connections_per_peer=1 << 20)

# A target that is not a path (absolute form, "*"): an engine's 404, not the gateway's (which
# names a gateway setting).
OUTSIDE = refusal(404, "not_found", "Not found: the request target is not a path")

_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")
QUERY_KEPT = "+&=;"  # escapes yarl's query_string keeps, so that the pairs stay apart


def unquote(raw: str, keep: str = "", plus: bool = False) -> str:
    """Percent-escapes decoded as yarl decodes them (aiohttp's ``request.path``; with ``keep="/%"``
    its router's ``path_safe``; with ``QUERY_KEPT`` and ``plus``, ``query_string``): a run of
    escapes as UTF-8, where an escape that is not part of a valid sequence stays as it came; a
    character in ``keep`` stays escaped (in upper case); with ``plus``, ``+`` is a space."""
    if plus:
        raw = raw.replace("+", " ")
    if "%" not in raw:
        return raw

    def run(m: re.Match[str]) -> str:
        escapes = m.group()
        data = bytes.fromhex(escapes.replace("%", ""))
        out, i = [], 0
        while i < len(data):
            b = data[i]
            n = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            try:
                ch = data[i:i + n].decode()
            except UnicodeDecodeError:
                out.append(escapes[3 * i:3 * i + 3])
                i += 1
                continue
            out.append(f"%{b:02X}" if ch in keep else ch)
            i += n
        return "".join(out)
    return _ESCAPES.sub(run, raw)


class Request:
    """A request as a route sees it (aiohttp's ``web.Request``, the part the routes used)."""
    __slots__ = ("call", "method", "raw_path", "path", "query_string", "match", "_raw", "_raw_query", "_body",
                 "_query")

    def __init__(self, call: Call):
        self.call = call
        self.method = call.method
        self.raw_path = call.raw_path  # the target as received
        # aiohttp's split: the query from the first "?" to a "#"; without one, the path ends at a "#".
        raw, question, rest = call.raw_path.partition("?")
        self._raw_query = rest.partition("#")[0] if question else ""
        self._raw = raw if question else raw.partition("#")[0]
        self.path = unquote(self._raw)
        self.query_string = unquote(self._raw_query, QUERY_KEPT, plus=True)
        self.match = ""  # the route's part (``/v1/models/{model}``), decoded
        self._body: bytes | None = None
        self._query: MultiDict[str] | None = None

    @property
    def path_safe(self) -> str:
        """The path the router matches: decoded but for ``%2F`` and ``%25``."""
        return unquote(self._raw, "/%")

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.call.headers

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return tuple(self.call.raw_headers)

    @property
    def content_type(self) -> str:
        """The media type, lower case, without its parameters (none sent: application/octet-stream)."""
        return self.call.headers.get("Content-Type", "application/octet-stream").partition(";")[0].strip().lower()

    @property
    def query(self) -> MultiDict[str]:
        if self._query is None:
            self._query = MultiDict(parse_qsl(self._raw_query, keep_blank_values=True))
        return self._query

    async def read(self) -> bytes:
        """The whole body (read once; at most ``MAX_BODY``)."""
        if self._body is None:
            body = self.call.body_now(MAX_BODY)
            self._body = body if body is not None else await self.call.body(MAX_BODY, LIMITS.body_timeout_s)
        return self._body


Handler = Callable[[Request], Awaitable[Reply]]


class NoRoute(Exception):
    """No route takes the request: 404, or 405 with the methods its path takes (``allowed``)."""

    def __init__(self, status: int, reason: str, allowed: frozenset[str] = frozenset()):
        super().__init__(reason)
        self.status, self.reason, self.allowed = status, reason, allowed

    def reply(self) -> Reply:
        """aiohttp's own answer (``/_sim/*`` had it): ``404: Not Found`` as text, 405 with Allow."""
        r = text(f"{self.status}: {self.reason}", self.status)
        if self.allowed:
            r.headers = {**r.headers, "Allow": ",".join(sorted(self.allowed))}
        return r


class Router:
    """The routes by path, then method. A path may end in one part, ``/{name}``: it matches one
    segment (no ``/``, ``{`` or ``}``), which the route reads decoded as ``request.match``."""

    def __init__(self) -> None:
        self.paths: dict[str, dict[str, Handler]] = {}
        self.parts: dict[str, dict[str, Handler]] = {}  # "/v1/models/" for "/v1/models/{model}"

    def add(self, method: str, path: str, handler: Handler) -> None:
        prefix, brace, _ = path.partition("{")
        methods = (self.parts if brace else self.paths).setdefault(prefix if brace else path, {})
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def resolve(self, request: Request) -> Handler:
        """The request's route (``request.match`` set), else ``NoRoute``."""
        path = request.path_safe
        methods = self.paths.get(path)
        if methods is None:
            prefix, _, part = path.rpartition("/")
            methods = self.parts.get(prefix + "/") if part and not any(c in part for c in "{}") else None
            if methods is None:
                raise NoRoute(404, "Not Found")
            request.match = part.replace("%2F", "/").replace("%25", "%")
        handler = methods.get(request.method)
        if handler is None:
            raise NoRoute(405, "Method Not Allowed", frozenset(methods))
        return handler


class Listener:
    """``handle`` served on the lean front: ``listen``, then ``stop`` (the requests in flight get
    ``shutdown_timeout``, then are cancelled)."""

    def __init__(self, handle: Handler, shutdown_timeout: float = 0.5):
        self.handle = handle
        self.shutdown_timeout = shutdown_timeout
        self.front: Front | None = None
        self.server: asyncio.AbstractServer | None = None
        self.running: set[asyncio.Task[None]] = set()  # the requests' own tasks (``_serve``)

    async def listen(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on ``host:port`` (0: a free port); the port."""
        self.front = Front(Route("/", self._serve, lambda: MAX_BODY), LIMITS, None, server=SOFTWARE,
                           outside=OUTSIDE)
        self.server = await asyncio.get_running_loop().create_server(self.front, host, port, backlog=backlog)
        port_: int = self.server.sockets[0].getsockname()[1]
        return port_

    async def _serve(self, call: Call) -> None:
        """The front's task for a request: its answer runs in a task of its own, which goes on
        when the client goes away once its request is in (the front cancels this one then);
        while the body is still coming, it ends with it (aiohttp's ``read`` raised then)."""
        task = asyncio.get_running_loop().create_task(self._answer(call))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not call.complete:
                task.cancel()
            raise

    async def _answer(self, call: Call) -> None:
        try:
            reply = await self.handle(Request(call))
        except BodyTooLarge:
            reply = text(f"Maximum request body size {MAX_BODY} exceeded", 413)
        except BodyMalformed as e:
            reply = text(f"400: Bad Request ({e})", 400)
        except ConnectionError:
            return  # the client went away while its body came
        except Exception:
            _log.exception("ondemand simulator: error handling %s %s", call.method, call.raw_path)
            if call.started:
                call.abort()
                return
            reply = text("500 Internal Server Error\n\nServer got itself in trouble", 500)
        if reply is not STREAMED:
            try:
                await call.send(reply.status, reply.headers, reply.body)
            except ConnectionError:
                pass  # the client went away

    async def stop(self) -> None:
        """aiohttp's shutdown: the listener closes, idle connections close, the requests in
        flight get the grace period, then the rest are cancelled and every connection closes."""
        if self.server is not None:
            self.server.close()
        await asyncio.sleep(0)  # the requests accepted before the close begin first
        conns = list(self.front.connections) if self.front is not None else []
        for conn in conns:
            conn.shutdown_begin()
        pending = self.running | {conn.task for conn in conns if conn.task is not None}
        if pending:
            await asyncio.wait(pending, timeout=self.shutdown_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self.front.connections) if self.front is not None else []:
            conn.close()

