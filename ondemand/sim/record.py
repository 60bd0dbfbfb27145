"""What the simulator records: the last requests in memory (``GET /_sim/requests``) and the
journal that outlives the process (``--journal FILE``; engine's doc says its lines)."""
from __future__ import annotations

import base64
import collections
import os
import time
from typing import Any

import orjson

# One recorded request: (time, method, path, query, raw headers, body, raw path as received).
Recorded = tuple[float, str, str, str, tuple[tuple[bytes, bytes], ...], bytes, str]


class Journal:
    """``--journal FILE``: events as JSON lines, each appended with one write."""

    def __init__(self, path: str | None, model: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else -1
        self.model = model
        self.pid = os.getpid()

    def write(self, ev: str, **fields: Any) -> None:
        if self.fd >= 0:
            os.write(self.fd, orjson.dumps({"ev": ev, "pid": self.pid, "t": time.time(), **fields}) + b"\n")


def listing(record: collections.deque[Recorded]) -> list[dict[str, Any]]:
    """The recorded requests as ``GET /_sim/requests`` lists them."""
    return [{"time": t, "method": m, "path": p, "raw_path": rp, "query": q,
             "headers": [[k.decode("utf-8", "replace"), v.decode("utf-8", "replace")] for k, v in h],
             "body": b.decode("utf-8", "replace"), "body_b64": base64.b64encode(b).decode()}
            for t, m, p, q, h, b, rp in record]
