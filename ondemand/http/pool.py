"""The engines' connection pools: one per deployment, of ``connection.py``'s plain HTTP/1.1
connections.

At most 256 connections; 10 s to connect; 60 s to wait for a free connection when all 256 are
busy; no read or write timeout, because generation can be long. A request is one write (head
and body); the answer's head and chunked framing are parsed by llhttp through httptools' public
response parser (aiohttp's private ``HttpResponseParser`` before issue 23), and the body is
passed on as it arrives through a :class:`~.body.Body`, which pauses reading the engine's
socket while more than 128 KiB wait for a slow client. A connection goes back to the pool only
when the whole answer arrived, the whole request was sent and the engine allows keep-alive (no
``Connection: close``, no close-delimited body); otherwise (the client hung up, the engine broke
off) it is closed, which makes vLLM and llama.cpp cancel the generation. A request that finds
every connection busy waits in line (first come, first served) for a connection or for the slot
of one that closed. An idle connection the engine closes (uvicorn and llama.cpp do after 5 s)
leaves the pool at once, and one idle for more than 4 s is not reused (closed instead), so that
race hardly ever happens. A request whose reused connection closes within 1 s of the request
and before any byte of the answer (the engine closed it while the request was on its way) is
sent once more on a connection that never sat idle; a later close is the caller's
:class:`UpstreamError`, like any other failure: the engine may have worked on the request, and
a generation must not run twice. A connection closed with part of its request unsent is aborted
(reset), not closed after a flush that an engine no longer reading would never allow. When an
engine comes back on a new address, the old pool is closed only when its last stream ends: a
long generation must not be cut by a restart of a neighbour's engine on the same deployment id.

ondemand's own calls to an engine (readiness, the watchdog's probe, the sleep API, the wake
check, ``/metrics``) are made by the same client (:meth:`Upstreams.call`), each bounded by a
timeout of its own, on pools of their own beside the traffic's (at most 8 connections an
engine): a probe must never wait behind 256 long generations for a connection (the watchdog
would fail a busy engine), and an engine put to sleep keeps no traffic connection open.

No locks or shields: all of it runs on the event loop, and every await that a cancellation
(the client hanging up) can interrupt closes the connection or gives its slot back; a
connection or slot handed to a waiter that is cancelled in the same turn of the loop is passed
on to the next. Imports nothing of ours but this package.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

from .connection import EngineConnection as _Conn
from .connection import PayloadError, Response, Stale, UpstreamError
from .limits import READ_SIZE
from .limits import timeout as _timeout

__all__ = ["Pool", "Upstreams", "UpstreamError", "Response", "PayloadError"]

LIMIT = 256              # connections per deployment
CONNECT_TIMEOUT = 10.0   # seconds to open a TCP connection
POOL_TIMEOUT = 60.0      # seconds to wait for a free connection when all are busy
IDLE_MAX = 4.0           # seconds an idle connection is reused: below the 5 s keep-alive of uvicorn (vLLM)
                         # and of llama.cpp's server, so the engine hardly ever closes one we are about to use
STALE_WINDOW = 1.0       # a reused connection closed within this of the request, with no answer, was stale
CALLS_LIMIT = 8          # connections per engine for ondemand's own calls (probes, the sleep API, /metrics)


class Pool:
    """The connections to one engine address."""

    def __init__(self, base_url: str, limit: int = LIMIT, connect_timeout: float = CONNECT_TIMEOUT,
                 pool_timeout: float = POOL_TIMEOUT):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// engine address: {base_url!r}")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2]
        self.prefix_bytes = self.prefix.encode("utf-8", "surrogateescape")
        self.host_bytes = self.host_header.encode("utf-8", "surrogateescape")
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.pool_timeout = pool_timeout
        self.loop = asyncio.get_running_loop()
        self.size = 0                  # connections open or being opened (each holds a slot)
        self.conns: set[_Conn] = set()   # every open connection, idle or busy
        self.idle: list[_Conn] = []    # LIFO: the most recently used connection is the likeliest alive
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.streams = 0               # leases not yet ended
        self.retired = False
        self.closed = False

    # --- requests ---

    def _encode(self, method: str, target: str, lines: bytes, body: bytes | None) -> bytes | list[bytes]:
        """``lines``: the header lines, each ending CRLF, line breaks vetted by the caller
        (``forward.request_lines``); ``target`` printable ASCII (``paths.rebuild``)."""
        head = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%s" % (
            method.encode("ascii"), self.prefix_bytes, target.encode("ascii"), self.host_bytes, lines)
        if body is None:
            return head + b"\r\n"
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        if not body:
            return head
        return head + body if len(body) <= READ_SIZE else [head, body]

    async def request(self, method: str, target: str, lines: bytes, body: bytes | None) -> Response:
        """The answer's head; the caller must ``release()`` it. Raises :class:`UpstreamError`."""
        data = self._encode(method, target, lines, body)
        head_only = method == "HEAD"
        conn = self._idle_conn()  # the usual: no coroutine to wait for one
        if conn is not None:
            reused = True
        else:
            conn, reused = await self._acquire()  # a new connection, or a wait for one
        try:
            return await conn.exchange(data, head_only)
        except Stale:
            if not reused:
                raise
        # The engine closed the idle connection while the request was on its way: once more,
        # on a connection that did not sit idle.
        conn, _ = await self._acquire()
        return await conn.exchange(data, head_only)

    # --- connections ---

    async def _acquire(self) -> tuple[_Conn, bool]:
        """A connection when no idle one will do (the caller asked :meth:`_idle_conn` first):
        a new one on a free slot (False: not reused), else one handed back by a finished answer
        (True: it served before)."""
        if self.closed:
            raise UpstreamError("the engine's address changed")
        if self.size < self.limit:
            self.size += 1
            return await self._connect(), False
        waiter = self.loop.create_future()
        self.waiters.append(waiter)
        try:
            async with _timeout(self.pool_timeout):
                got = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._hand_on(waiter.result())  # handed a connection or a slot in the same turn: pass it on
            else:
                waiter.cancel()
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.TimeoutError):  # TimeoutError itself from 3.11
                raise UpstreamError(f"no free connection to the engine within {self.pool_timeout:g} s") from None
            raise
        if got is None:  # a slot: connect
            return await self._connect(), False
        return got, True

    def _idle_conn(self) -> _Conn | None:
        """The most recently used idle connection that is alive and not idle too long."""
        if self.closed:
            return None
        idle = self.idle
        if idle:
            now = self.loop.time()
            while idle:
                conn = idle.pop()
                if conn.alive():
                    if now - conn.idle_since <= IDLE_MAX:
                        return conn
                    conn.close()  # idle too long: the engine may close it any moment (its slot comes back)
        return None

    async def _connect(self) -> _Conn:
        """Open a connection on a slot the caller holds; the slot is passed on when this fails."""
        try:
            async with _timeout(self.connect_timeout):
                _tr, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except BaseException as exc:
            self._slot_free()
            if isinstance(exc, asyncio.TimeoutError):  # TimeoutError itself from 3.11
                raise UpstreamError(f"connect to {self.host}:{self.port} timed out after "
                                    f"{self.connect_timeout:g} s") from None
            if isinstance(exc, OSError):
                raise UpstreamError(str(exc) or repr(exc)) from None
            raise
        if self.closed or conn.transport is None:  # closed while connecting, by us or the engine
            conn.close()
            self._slot_free()  # connection_lost frees only the slots of registered connections
            raise Stale("the engine's address changed" if self.closed else "the engine closed the connection")
        self.conns.add(conn)
        return conn

    def _hand_on(self, got: _Conn | None) -> None:
        if got is None:
            self._slot_free()
        else:
            self.put_back(got)

    @property
    def stale_window(self) -> float:
        return STALE_WINDOW  # read when asked: tests shorten it

    def put_back(self, conn: _Conn) -> None:
        if self.closed:
            conn.close()
            return
        if not self._to_waiter(conn):
            conn.idle_since = self.loop.time()
            self.idle.append(conn)

    def _slot_free(self) -> None:
        """A connection closed (or never opened): its slot goes to the first waiter, else back."""
        if not self._to_waiter(None):
            self.size -= 1

    def _to_waiter(self, got: _Conn | None) -> bool:
        """``got`` (a connection, or None: a free slot) to the first waiter still waiting; False
        when none is."""
        waiters = self.waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(got)
                return True
        return False

    def lost(self, conn: _Conn) -> None:
        """connection_lost: called once per connection; a registered one gives its slot back."""
        if conn in self.conns:
            self.conns.discard(conn)
            try:
                self.idle.remove(conn)
            except ValueError:
                pass
            self._slot_free()

    def close(self) -> None:
        """Close every connection, busy ones too, and refuse new requests."""
        self.closed = True
        for w in self.waiters:
            if not w.done():
                w.set_exception(UpstreamError("the engine's address changed"))
        self.waiters.clear()
        self.idle.clear()
        for conn in list(self.conns):
            conn.close()


class Upstreams:
    """The connection pools of the engines, by deployment id."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._current: dict[int, Pool] = {}
        self._calls: dict[int, Pool] = {}  # ondemand's own calls' pools
        self._retired: set[Pool] = set()

    def open(self, dep_id: int, base_url: str) -> _Lease:
        return self._lease(self._current, dep_id, base_url, self.limit)

    def pool(self, dep_id: int, *, calls: bool = False) -> Pool | None:
        """The deployment's pool now, of its traffic (``calls``: of ondemand's own calls), for a
        look at its connections (open, idle, waiters, streams); None when it has none."""
        return (self._calls if calls else self._current).get(dep_id)

    def _lease(self, pools: dict[int, Pool], dep_id: int, base_url: str, limit: int) -> _Lease:
        up = pools.get(dep_id)
        if up is None or up.base_url != base_url:
            if up is not None:
                self._retire(up)
            up = pools[dep_id] = Pool(base_url, limit)
        up.streams += 1
        return _Lease(self, up)

    def _retire(self, up: Pool) -> None:
        up.retired = True
        if up.streams == 0:
            up.close()
        else:
            self._retired.add(up)

    def _ended(self, up: Pool) -> None:
        up.streams -= 1
        if up.retired and up.streams == 0:
            self._retired.discard(up)
            up.close()

    async def call(self, dep_id: int, base_url: str, method: str, target: str, *, body: bytes | None = None,
                   lines: bytes = b"", timeout: float | None = None) -> tuple[int, bytes]:
        """One small exchange of ondemand's own with an engine, on its calls' pool, its answer
        read whole: (status, body). ``timeout`` bounds all of it, the wait for a connection too
        (None: nothing does; a sleep call may take minutes). Raises :class:`UpstreamError`,
        :class:`PayloadError` or ``asyncio.TimeoutError``."""
        lease = self._lease(self._calls, dep_id, base_url, CALLS_LIMIT)
        try:
            async with _timeout(timeout):
                resp = await lease.request(method, target, lines, body)
                try:
                    # Read as it comes: a body past the high-water mark would pause a whole read.
                    parts = [part async for part in resp.content.iter_any()]
                finally:
                    resp.release()
        finally:
            lease.end()
        return resp.status, b"".join(parts)

    def forget(self, dep_id: int) -> None:
        """The deployment was removed (or put to sleep): close its pools once idle."""
        for pools in (self._current, self._calls):
            up = pools.pop(dep_id, None)
            if up is not None:
                self._retire(up)

    async def close(self) -> None:
        ups = [*self._current.values(), *self._calls.values(), *self._retired]
        self._current.clear()
        self._calls.clear()
        self._retired.clear()
        for up in ups:
            up.close()
        await asyncio.sleep(0)  # the transports' connection_lost runs on the next turn of the loop


class _Lease:
    """One stream's use of a pool; ``end()`` exactly once (idempotent), after its answer's ``release()``."""
    __slots__ = ("_owner", "_up", "_ended")

    def __init__(self, owner: Upstreams, up: Pool):
        self._owner = owner
        self._up = up
        self._ended = False

    @property
    def base_url(self) -> str:
        return self._up.base_url

    def request(self, method: str, target: str, lines: bytes, body: bytes | None
                ) -> Coroutine[Any, Any, Response]:
        """``await`` it for the answer's head (a :class:`Response`); raises :class:`UpstreamError`.
        ``lines``: the request's header lines, each ending CRLF (``forward.request_lines``)."""
        return self._up.request(method, target, lines, body)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._owner._ended(self._up)
