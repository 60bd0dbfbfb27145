"""One gateway request as the metrics and the access log see it, and its request id.

The gateway fills an ``Exchange`` in as the request goes (its deployment once
known, whether it waited for a start or for memory, its status, its bytes) and
hands it on when the answer's last byte is written. Imports nothing of ours.

The request id is the client's ``x-request-id``, else LiteLLM's
``x-litellm-call-id``, else a new one; a value that is not printable ASCII of
at most 128 characters is never taken (it would end up in log lines), and the
next source is used instead.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping

MAX_ID = 128
ID_HEADERS = ("x-request-id", "x-litellm-call-id")


def valid_id(value: str) -> bool:
    """Printable ASCII (space to ``~``), 1 to 128 characters."""
    return 0 < len(value) <= MAX_ID and value.isascii() and value.isprintable()


_PREFIX = os.urandom(8).hex()  # this process's: ids stay unique across restarts and boxes
_count = itertools.count(1)


def new_id() -> str:
    """A new id: this process's random prefix and a counter (32 hex digits, as a uuid4's
    hex), unique without a system call per request."""
    return f"{_PREFIX}{next(_count):016x}"


def request_id(headers: Mapping[str, str]) -> str:
    for name in ID_HEADERS:
        value = headers.get(name)
        if value is not None and valid_id(value):
            return value
    return new_id()


class Exchange:
    """What happened to one gateway request. ``deployment`` is the deployment's
    name, empty until the request named an existing one (never a name from the
    client: the metrics' labels stay bounded)."""
    __slots__ = ("rid", "method", "peer", "arrival", "deployment", "route", "status", "bytes_in", "bytes_out",
                 "duration_s", "queued_s", "waited_start", "waited_memory", "health")

    def __init__(self, rid: str, method: str, peer: str, arrival: float):
        self.rid = rid
        self.method = method
        self.peer = peer
        self.arrival = arrival  # monotonic clock
        self.deployment = ""
        self.route = ""
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0  # written to the client, head included
        self.duration_s = 0.0  # arrival to the last byte
        self.queued_s: float | None = None  # arrival to slot, when it waited
        self.waited_start = False  # the deployment was not ready when it arrived
        self.waited_memory = False  # it was queued for GPU memory
        self.health = False  # a health check answered by the gateway

    def memory_wait(self) -> None:
        """The controller's ``on_queued``: queued for memory."""
        self.waited_memory = True
