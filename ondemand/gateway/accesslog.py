"""The access log (``access_log = text | json``): one line per gateway request, on stderr.

The event loop formats the line (a few microseconds) and appends it to a list; a
thread of its own wakes every ``interval_s``, takes the list whole and writes all
its lines in one write, so a slow terminal or pipe never holds up the loop (the idea of
logging's QueueHandler and QueueListener, without a LogRecord per request).
The thread does not wake per line: a thread waiting for the GIL makes the busy
event loop hand it over only at the 5 ms switch interval, which a wake-up per
request turned into milliseconds of added latency. A line holds
the request id, the peer, the deployment, the method and route, the status,
the bytes in (the body) and out (head included), the duration, the time
queued, and whether it waited for a start or for memory; never a header, so
never a key or a token. Values come from the request only after checks: the
request id is printable ASCII (``exchange``), the route one of the gateway's,
and the text format quotes any value with a space, a quote or an ``=``.
Imports the exchange only.
"""
from __future__ import annotations

import datetime
import threading
from typing import TextIO

import orjson

from .exchange import Exchange

FORMATS = ("off", "text", "json")


_second: list[object] = [-1, ""]  # the last whole second formatted, and its text


def _when(wall: float) -> str:
    """ISO 8601 in UTC with milliseconds; the date and time of a second are formatted once."""
    whole = int(wall)
    if _second[0] != whole:
        _second[:] = [whole, datetime.datetime.fromtimestamp(whole, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%S")]
    return f"{_second[1]}.{int((wall - whole) * 1000):03d}Z"


def fields(ex: Exchange, wall: float) -> dict[str, object]:
    return {"time": _when(wall), "request_id": ex.rid, "peer": ex.peer, "deployment": ex.deployment,
            "method": ex.method, "route": ex.route, "status": ex.status, "bytes_in": ex.bytes_in,
            "bytes_out": ex.bytes_out, "duration_s": round(ex.duration_s, 6),
            "queued_s": None if ex.queued_s is None else round(ex.queued_s, 6),
            "waited_start": ex.waited_start, "waited_memory": ex.waited_memory}


def json_line(ex: Exchange, wall: float) -> str:
    return orjson.dumps(fields(ex, wall)).decode() + "\n"


def _quoted(value: object) -> str:
    if value is None or value == "":
        return "-"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if any(c in text for c in ' "=\\') or not text.isprintable():
        return orjson.dumps(text).decode()
    return text


def text_line(ex: Exchange, wall: float) -> str:
    """``key=value`` pairs (logfmt), the time first."""
    f = fields(ex, wall)
    return " ".join(f"{k}={_quoted(v)}" for k, v in f.items()) + "\n"


class AccessLog:
    def __init__(self, fmt: str, stream: TextIO, interval_s: float = 0.1):
        if fmt not in ("text", "json"):
            raise ValueError(f"access log format {fmt!r}: text or json")
        self._line = json_line if fmt == "json" else text_line
        self._stream = stream
        self._interval_s = interval_s
        self._lines: list[str] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ondemand access log", daemon=True)
        self._thread.start()

    def write(self, ex: Exchange, wall: float) -> None:
        """From the event loop: never blocks (an append to a list the thread takes whole)."""
        self._lines.append(self._line(ex, wall))

    def _run(self) -> None:
        while True:
            closing = self._closing.wait(self._interval_s)
            # One swap, atomic under the GIL: the thread holds the GIL for a moment, not
            # for a get() per line (which made the busy loop hand it over at every switch).
            lines, self._lines = self._lines, []
            if lines:
                try:
                    self._stream.write("".join(lines))
                    self._stream.flush()
                except (OSError, ValueError):  # stderr closed or gone: the lines are lost, the server is not
                    pass
            if closing:
                return

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread."""
        self._closing.set()
        self._thread.join(timeout)
