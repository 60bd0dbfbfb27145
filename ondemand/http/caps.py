"""The caps on open connections, checked at the accept (issues 29 and 40): :class:`OpenConnections`
and each counted connection's :class:`Seat`.

A connection costs a file descriptor from its accept, whatever it sends; before the caps,
20,000 silent ones used up the server's descriptors and LiteLLM's requests, ``/healthz`` and the
admin API were reset. Each TCP listener counts its own (``Limits.max_connections``, and
``Limits.max_connections_per_peer`` for one client IP). The admin socket (a local owner's) is not
counted.

At a cap, idle connections give way (as nginx drains its keep-alive connections when it runs
out; issue 40: two addresses holding 2,048 idle connections each kept every other client out):
a new connection closes the connection that has been idle longest (between two requests, with no
byte yet, with a request head still incomplete, or answered and draining), and is closed at once
only when every connection holds a whole request in progress. At ``max_connections_per_peer``
the one that gives way is the same peer's (so a peer's flood only churns its own connections,
and LiteLLM's own pool is never refused because it grew), at ``max_connections`` anyone's.

A connection tells its seat when a whole request arrives (``seat.busy = True``, an attribute set)
and when it rests after the answer (:meth:`Seat.rest`: two dict moves, the price on the hot path
of finding the oldest idle connection in O(1)): a busy seat stays in the idle order until a cap
reaches it, which drops it then (so each give-way is O(1) too, spread over the seats it skips). Imports nothing of ours
but this package and ``ratelog``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ..ratelog import OnceAMinute
from .limits import Limits

_log = logging.getLogger("ondemand.http")


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The client IP of a TCP transport; ``""`` for anything else (the admin socket)."""
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else ""


class Yields(Protocol):
    """A connection that can give way: closed at once, with nothing owed to its client."""

    def give_way(self) -> None: ...


class Seat:
    """One counted connection: its place in its listener's count and in the idle order.
    ``conn``: the connection that holds it now (a hand-off passes the seat on)."""
    __slots__ = ("open", "peer", "conn", "busy", "mine")

    def __init__(self, open_: OpenConnections | None, peer: str, conn: Yields | None, mine: _Peer | None):
        self.open = open_   # None once released
        self.peer = peer
        self.conn = conn
        self.busy = False   # a whole request is in progress
        self.mine = mine    # the peer's count and idle order

    def rest(self) -> None:
        """Idle from now: it gives way after those idle longer."""
        self.busy = False
        open_ = self.open
        if open_ is not None:
            idle = open_.idle
            idle.pop(self, None)
            idle[self] = None
            idle = self.mine.idle  # type: ignore[union-attr]  # counted: it has one
            idle.pop(self, None)
            idle[self] = None

    def release(self) -> None:
        """The connection closed: its count is given back (once)."""
        if self.open is not None:
            self.open.release(self)


# The admin socket's connections: not counted, never asked to give way.
UNCOUNTED = Seat(None, "", None, None)


class _Peer:
    __slots__ = ("count", "idle")

    def __init__(self) -> None:
        self.count = 0
        self.idle: dict[Seat, None] = {}


class OpenConnections:
    """One listener's open connections, overall and by peer, and which of them are idle."""

    def __init__(self) -> None:
        self.total = 0
        self.peers: dict[str, _Peer] = {}
        self.idle: dict[Seat, None] = {}  # oldest first (dicts keep their order)
        self.gave_way = 0                 # connections closed for a new one, so far
        self._log = OnceAMinute()
        self._gave_log = OnceAMinute()

    def count(self, peer: str) -> int:
        mine = self.peers.get(peer)
        return 0 if mine is None else mine.count

    def admit(self, peer: str, limits: Limits, conn: Yields | None) -> Seat | None:
        """Count a connection just accepted from ``peer`` (idle: nothing came yet), when need
        be in place of an idle one; or refuse it (None: close it)."""
        if not peer:
            return UNCOUNTED  # not a network peer: the admin socket, 0600, its owner's
        mine = self.peers.get(peer)
        if mine is not None and mine.count >= limits.max_connections_per_peer \
                and not self._give_way(mine.idle, peer, "max_connections_per_peer"):
            self.refused(peer, f"its {mine.count} open are all busy, max_connections_per_peer")
            return None
        if self.total >= limits.max_connections and not self._give_way(self.idle, peer, "max_connections"):
            self.refused(peer, f"the {self.total} open are all busy, max_connections")
            return None
        mine = self.peers.get(peer)  # (a give-way may have emptied the peer's)
        if mine is None:
            mine = self.peers[peer] = _Peer()
        self.total += 1
        mine.count += 1
        seat = Seat(self, peer, conn, mine)
        seat.rest()
        return seat

    def _give_way(self, idle: dict[Seat, None], peer: str, cap: str) -> bool:
        """The connection of ``idle`` idle longest is closed; False when none of them is idle."""
        while idle:
            seat = next(iter(idle))
            self._unidle(seat)
            if seat.busy:
                continue  # dropped from the order here; back in it when it rests
            conn = seat.conn
            self.release(seat)
            self.gave_way += 1
            more = self._gave_log.due()
            if more is not None:
                _log.warning("at %s: closed an idle connection from %s for a new one from %s%s",
                             cap, seat.peer, peer, more)
            if conn is not None:
                conn.give_way()
            return True
        return False

    def _unidle(self, seat: Seat) -> None:
        self.idle.pop(seat, None)
        seat.mine.idle.pop(seat, None)  # type: ignore[union-attr]

    def release(self, seat: Seat) -> None:
        """A seat :meth:`admit` counted is given back."""
        if seat.open is not self:
            return
        seat.open = None
        self._unidle(seat)
        mine = seat.mine
        assert mine is not None
        mine.count -= 1
        if mine.count <= 0 and self.peers.get(seat.peer) is mine:
            del self.peers[seat.peer]
        self.total -= 1

    def refused(self, peer: str, why: str) -> None:
        more = self._log.due()
        if more is not None:
            _log.warning("closed a connection from %s at the accept: %s%s", peer, why, more)
