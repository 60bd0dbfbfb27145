"""Header names and parsers both stacks and the gateway share (one of each, issue 23).
Imports nothing of ours."""
from __future__ import annotations

from collections.abc import Mapping

HEALTH_HEADER = "x-dgxmm-health-check"  # LiteLLM's health checks carry it (BEHAVIOUR.md)
ID_HEADER = "X-Request-Id"


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None. Returned as bytes-safe text: a
    header llhttp or aiohttp decoded with ``surrogateescape`` may hold any byte, and callers
    compare with :func:`token_bytes` (issue 23: one non-UTF-8 byte made the admin check raise)."""
    auth = headers.get("Authorization")
    if auth is None or auth[:7].lower() != "bearer ":
        return None
    return auth[7:].strip()


def token_bytes(token: str) -> bytes:
    """A presented token's bytes, as they came (surrogates back to the bytes they stand for)."""
    return token.encode("utf-8", "surrogateescape")


_DECODED: dict[tuple[bytes, bytes], tuple[str, str]] = {}  # short headers, as decoded before
DECODED_MAX = 1024   # at most this many, of at most DECODED_BYTES each: half a MiB
DECODED_BYTES = 256  # (any client adds to it: the head is decoded before any check)


def decoded(pair: tuple[bytes, bytes]) -> tuple[str, str]:
    """A header's name and value as text (``surrogateescape``: every byte as it came). Clients
    send the same headers again and again: a short one is decoded once."""
    got = _DECODED.get(pair)
    if got is None:
        name, value = pair
        got = (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        if len(name) + len(value) <= DECODED_BYTES:
            if len(_DECODED) >= DECODED_MAX:
                _DECODED.clear()
            _DECODED[pair] = got
    return got
