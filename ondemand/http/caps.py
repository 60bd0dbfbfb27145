"""The caps on open connections, checked at the accept (issue 29): :class:`OpenConnections`.

A connection costs a file descriptor from its accept, whatever it sends; before the caps,
20,000 silent ones used up the server's descriptors and LiteLLM's requests, ``/healthz`` and the
admin API were reset. Each TCP listener counts its own (``Limits.max_connections``, and
``Limits.max_connections_per_peer`` for one client IP); one over a cap is closed at once, before a
byte is read. The admin socket (a local owner's) is not counted. Imports nothing of ours but
this package.
"""
from __future__ import annotations

import asyncio
import logging

from .limits import Limits
from .refusals import OnceAMinute

_log = logging.getLogger("ondemand.http")


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The client IP of a TCP transport; ``""`` for anything else (the admin socket)."""
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else ""


class OpenConnections:
    """One listener's open connections, overall and by peer."""

    def __init__(self) -> None:
        self.total = 0
        self.by_peer: dict[str, int] = {}
        self._log = OnceAMinute()

    def admit(self, peer: str, limits: Limits) -> bool:
        """Count a connection just accepted from ``peer``, or refuse it (False: close it)."""
        if not peer:
            return True  # not a network peer: the admin socket, 0600, its owner's
        n = self.by_peer.get(peer, 0)
        if n >= limits.max_connections_per_peer:
            self.refused(peer, f"it has {n} open, max_connections_per_peer")
            return False
        if self.total >= limits.max_connections:
            self.refused(peer, f"{self.total} are open, max_connections")
            return False
        self.total += 1
        self.by_peer[peer] = n + 1
        return True

    def release(self, peer: str) -> None:
        """One :meth:`admit` counted is closed."""
        if not peer:
            return
        n = self.by_peer.get(peer, 0) - 1
        if n > 0:
            self.by_peer[peer] = n
        else:
            self.by_peer.pop(peer, None)
        self.total -= 1

    def refused(self, peer: str, why: str) -> None:
        more = self._log.due()
        if more is not None:
            _log.warning("closed a connection from %s at the accept: %s%s", peer, why, more)
