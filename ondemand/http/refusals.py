"""The server's own refusals (malformed HTTP, bounds, misdirected requests): the documented
JSON error, ready to write, the lean front's checks of a request head, and the once-a-minute log
line for malformed requests. Imports nothing of ours but ``errors``,
``http.limits`` and ``ratelog``."""
from __future__ import annotations

import logging
from http import HTTPStatus

from multidict import MultiMapping

from ..errors import OndemandError, internal_error, misdirected, upgrade_refused
from ..ratelog import OnceAMinute
from .limits import Limits

_log = logging.getLogger("ondemand.http")
_REASONS = {s.value: s.phrase for s in HTTPStatus}


def refusal(status: int, code: str, message: str) -> bytes:
    """A whole answer that closes the connection, with the error in the documented form."""
    return refused(OndemandError(status, code, message))


def refused(err: OndemandError) -> bytes:
    """:func:`refusal` of an error already made (``errors.internal_error()``, say)."""
    body = err.body()
    return (f"HTTP/1.1 {err.status} {_REASONS.get(err.status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# llhttp reads a request line without a version as HTTP/0.9 (issue 40: it was answered so).
NO_VERSION = refusal(400, "invalid_request", "The request line has no HTTP version")
LINE_TOO_LONG = refusal(400, "invalid_request", "The request line is too long")
GATEWAY_ONLY = refusal(404, "not_found", "Not found: this listener serves the gateway only (the admin API is on "
                       "admin_listen)")
PIPELINED = refused(misdirected("A request that is not the gateway's, pipelined behind a gateway request"))
UPGRADE = refused(upgrade_refused())
INTERNAL_ERROR = refused(internal_error())


def header_too_large(limits: Limits) -> bytes:
    return refusal(400, "invalid_request", f"A request header is over {limits.max_field_size} bytes, or there are "
                   f"over {limits.max_headers} of them")


def head_late(limits: Limits) -> bytes:
    return refusal(408, "request_timeout", f"The request head did not arrive within {limits.head_timeout_s:g} s")


def unfinished_head(limits: Limits, size: int, version: str, line: list[bytes] | None) -> bytes | None:
    """The refusal of a request head still arriving after a read (``size`` bytes so far), or None
    while it may go on: 431 past ``max_head_bytes``; 400 for a request line without an HTTP
    version. llhttp takes one for HTTP/0.9 and waits for headers, and says so (``version``) only
    from the byte after the line, so ``line``, the head's bytes while they may be its request
    line alone, is looked at too (a bare ``GET /`` waited for the head timeout); a caller gives it
    only with a read that brought a line break, so a line sent a byte at a time is not joined at
    every byte."""
    if size > limits.max_head_bytes:
        return refusal(431, "headers_too_large", f"The request head is larger than {limits.max_head_bytes // 1024} KiB")
    if version == "0.9":
        return NO_VERSION
    if line is not None and line_without_version(line):
        return NO_VERSION
    return None


def line_without_version(line: list[bytes]) -> bool | None:
    """Of a head's bytes while they may be its request line alone (empty lines before it
    allowed): True once the line has ended with no HTTP version, False once it has ended with
    one, None while it goes on. The lean front and the admin listener ask it alike."""
    first, end, _ = b"".join(line).lstrip(b"\r\n").partition(b"\n")
    if not end:
        return None
    return not first.rstrip(b"\r").rpartition(b" ")[2].startswith(b"HTTP/")


class Refuse(Exception):
    """Raised in a parser callback: answer this (after the answers owed) and close."""

    def __init__(self, answer: bytes):
        super().__init__()
        self.answer = answer


def check_head(upgrade: bool, headers: MultiMapping[str]) -> None:
    """A request head the lean front parsed but refuses: :class:`Refuse`."""
    if upgrade:  # (issue 23) aiohttp lost what followed an Upgrade with a body
        raise Refuse(UPGRADE)
    codings = headers.getall("Transfer-Encoding", ())
    if codings and (len(codings) > 1 or codings[0].strip().lower() != "chunked"):
        # llhttp lets "identity" through (issue 23); BEHAVIOUR.md: 400, never forwarded.
        raise Refuse(refusal(400, "invalid_request", "Transfer-Encoding other than one chunked is not accepted"))


class RefusalLog(OnceAMinute):
    """Malformed requests, from either stack: one warning a minute at most, with the count,
    so that no client can flood the log (aiohttp logged each with its traceback)."""

    def note(self, peer: str, why: str, status: int = 400) -> None:
        more = self.due()
        if more is None:
            return
        first = why.strip().splitlines()[0] if why.strip() else ""
        _log.warning("refused a malformed request from %s (%d): %s%s", peer, status, first, more)


REFUSALS = RefusalLog()
