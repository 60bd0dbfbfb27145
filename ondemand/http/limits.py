"""The bounds on what one client may make the server hold, in one frozen object.

Built once (``app.build_app``) and read by both stacks: the lean front applies every one of
them itself, and aiohttp's connections get theirs from :meth:`Limits.aiohttp_args` and
:meth:`Limits.client_max_size`. Before issue 23 the numbers were written twice (module
constants and aiohttp's ``handler_args``) and drifted (the admin body limit was one byte off).
Imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # Python 3.10 (DGX OS): aiohttp depends on async-timeout there
    from async_timeout import timeout

__all__ = ["Limits", "MiB", "READ_SIZE", "timeout"]

MiB = 2 ** 20
# The one size of a read, a write worth coalescing and a body's buffer before reading pauses.
READ_SIZE = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Limits:
    max_line_size: int = 8190          # the request line (aiohttp's default): an overlong path is 400
    max_field_size: int = 65536        # one header, name and value
    max_headers: int = 128             # header lines (aiohttp's default)
    max_head_bytes: int = 128 * 1024   # request line and headers together, while they arrive
    head_timeout_s: float = 10.0       # a request head, from its first byte; a connection's first, from the accept
    keepalive_timeout_s: float = 300.0  # an idle keep-alive connection; LiteLLM's own is 120 s
    # The rest of a body after an early answer (a 401, a 413 ...) is read and dropped for this long
    # and at most this much, so that a client that sends its whole body before it reads (httpx, the
    # OpenAI SDK) gets the answer rather than a reset (issue 40); then a closing connection closes.
    lingering_s: float = 1.0
    linger_max_bytes: int = 64 * MiB
    gateway_max_body: int = 16 * MiB   # a gateway request's body
    admin_max_body: int = 16 * MiB     # an admin request's body
    body_timeout_s: float = 60.0       # a whole body, from the handler's first read (both stacks)
    high_water: int = READ_SIZE        # request body bytes buffered before reading pauses
    max_connections: int = 4096        # open connections on one TCP listener (config: max_connections)
    max_connections_per_peer: int = 2048  # of them from one client IP (config: max_connections_per_peer)

    @classmethod
    def of(cls, cfg: Any) -> Limits:
        """The bounds the configuration sets (its keys of the same names); the rest as above."""
        body = cfg.max_body_mib * MiB
        return cls(head_timeout_s=cfg.head_timeout_s, body_timeout_s=cfg.body_timeout_s,
                   keepalive_timeout_s=cfg.keepalive_timeout_s, max_head_bytes=cfg.max_head_kib * 1024,
                   gateway_max_body=body, admin_max_body=body, max_connections=cfg.max_connections,
                   max_connections_per_peer=cfg.max_connections_per_peer)

    def aiohttp_args(self) -> dict[str, Any]:
        """aiohttp's ``RequestHandler`` options for a connection handed to it."""
        return {"max_line_size": self.max_line_size, "max_field_size": self.max_field_size,
                "max_headers": self.max_headers, "keepalive_timeout": self.keepalive_timeout_s,
                "lingering_time": self.lingering_s}

    def client_max_size(self) -> int:
        """aiohttp's ``client_max_size`` refuses a body *over* it: the limit itself is allowed."""
        return self.admin_max_body
