"""The on-demand key: generating it, writing it, watching its file.

Owns ``ondemand_key_file`` (BEHAVIOUR.md, "Checks, in order", checks 3 and 5, and "Key rotation"): the key
LiteLLM presents as ``Authorization: Bearer`` on gateway routes. The file is the only source of
truth: ``key init`` / ``key rotate`` write it atomically with mode 0600, and the running gateway
picks a new key up without a restart through :class:`KeyWatcher`. Only fingerprints are ever
logged or shown, never the key. Imports nothing of ours.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Literal

from ..events import KeyRotated
from ..files import write_atomic

__all__ = ["generate_key", "fingerprint", "write_key_file", "read_key_file", "KeyWatcher"]

_log = logging.getLogger("ondemand.gateway.keys")

# A key file is a few dozen bytes; anything much larger is not a key file (a wrong path).
_MAX_KEY_FILE = 64 * 1024


def generate_key() -> str:
    """A new random key: 256 bits, URL-safe, recognisable by its ``odk-`` prefix."""
    return "odk-" + secrets.token_urlsafe(32)


def fingerprint(key: str | bytes) -> str:
    """The first 12 hex digits of a SHA-256: the key's (``dgxmm_key_fp``, ``key show``) and
    the LiteLLM entries' parameters' (BEHAVIOUR.md, "Fingerprints"). The one such function."""
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).hexdigest()[:12]


def write_key_file(path: str | os.PathLike[str], key: str) -> None:
    """Write ``key`` to ``path`` atomically, readable by the owner only (``files.write_atomic``:
    mode 0600 from its creation, never wider; a reader sees the old key or the new one)."""
    write_atomic(path, (key + "\n").encode("utf-8"), 0o600)


def read_key_file(path: str | os.PathLike[str]) -> str | None:
    """The key in ``path``, stripped; ``None`` when the file is missing, empty or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_FILE + 1)
    except OSError:
        return None
    if len(data) > _MAX_KEY_FILE:
        return None
    try:
        key = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return key or None


Check = Literal["ok", "previous", "bad"]


class KeyWatcher:
    """The current key, re-read when its file changes.

    BEHAVIOUR.md, check 3: the file is checked at most once a second and re-read when its inode,
    mtime or size changed; a rotated key replaces the old one without a restart, a file that went
    missing or empty fails closed (``current()`` is ``None``: 503 ondemand_not_configured).
    "Key rotation": for ``previous_grace_s`` after a change the key that was current before it is
    recognised (``check`` says ``"previous"``) so LiteLLM, which keeps sending it until it reloads
    the re-registered entries, gets 401 without being counted as a failed attempt.

    ``publish`` gets a ``KeyRotated`` event after every change of the key (a new key, a
    removal); the app subscribes the LiteLLM sync trigger and the rate limiter's ``clear``.
    """

    STAT_INTERVAL_S = 1.0

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic,
                 previous_grace_s: float = 300.0, logger: logging.Logger | None = None,
                 publish: Callable[[object], None] | None = None):
        self.path = os.fspath(path)
        self.publish = publish
        self._clock = clock
        self._grace = previous_grace_s
        self._log = logger or _log
        self._next_stat = float("-inf")
        self._looked_at = float("-inf")
        self._sig: tuple[int, int, int] | None = None
        self._key: str | None = None
        self._key_b: bytes | None = None
        self._prev_b: bytes | None = None
        self._prev_until = float("-inf")
        self._fp: str | None = None
        # None: not looked yet; the first look logs either way, later ones only on a transition.
        self._configured: bool | None = None

    # -- hot path -----------------------------------------------------------------------------

    def current(self) -> str | None:
        """The key, or ``None`` when it is not configured. Stats the file at most once a second."""
        now = self._clock()
        if now >= self._next_stat:
            self._look(now)
        return self._key

    def check(self, presented: str | None) -> Check:
        """``"ok"`` for the current key, ``"previous"`` for the one before it within the grace
        period after a change, else ``"bad"`` (also when no key is configured).

        A key that would be ``"bad"`` makes the file be looked at once more first: a client
        that read a rotated key from the file a moment before our once-a-second look is not
        refused, nor counted as a failed attempt (with 20 of those the limiter would refuse
        its whole address, LiteLLM's included). The limiter refuses a peer's 21st failure
        before its key is checked, so this costs at most 20 stats a minute per address.

        Comparisons are constant-time (``hmac.compare_digest`` on bytes).
        """
        now = self._clock()
        if now >= self._next_stat:
            self._look(now)
        verdict = self._compare(presented, now)
        if verdict == "bad" and presented is not None and self._looked_at < now:
            self._look(now)
            verdict = self._compare(presented, now)
        return verdict

    def _compare(self, presented: str | None, now: float) -> Check:
        key_b = self._key_b
        if key_b is None or presented is None:
            return "bad"
        # surrogatepass: a header aiohttp decoded with surrogateescape still encodes, never raises.
        p = presented.encode("utf-8", "surrogatepass")
        if hmac.compare_digest(p, key_b):
            return "ok"
        prev = self._prev_b
        if prev is not None and now < self._prev_until and hmac.compare_digest(p, prev):
            return "previous"
        return "bad"

    @property
    def fingerprint(self) -> str | None:
        """The current key's fingerprint (as of the last look), for ``GET /api/host``."""
        self.current()
        return self._fp

    # -- the file -----------------------------------------------------------------------------

    def _look(self, now: float) -> None:
        self._next_stat = now + self.STAT_INTERVAL_S
        self._looked_at = now
        try:
            st = os.stat(self.path)
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            sig = None
        if sig is not None and sig == self._sig:
            return
        key = read_key_file(self.path) if sig is not None else None
        # Remember the signature only for a key actually read: a file that is there but empty or
        # unreadable (permissions: chmod changes no mtime) is retried on the next look.
        self._sig = sig if key is not None else None
        self._set(key, now)

    def _set(self, key: str | None, now: float) -> None:
        old = self._key
        configured = key is not None
        if configured != self._configured:
            if key is not None:
                self._log.info("ondemand key configured (fingerprint %s) from %s", fingerprint(key), self.path)
            else:
                self._log.warning("ondemand key not configured: %s is missing, empty or unreadable; "
                                  "gateway requests get 503 ondemand_not_configured", self.path)
        first = self._configured is None
        self._configured = configured
        if key == old:
            return
        if key is not None and old is not None:
            self._log.info("ondemand key rotated: %s -> %s", fingerprint(old), fingerprint(key))
        if old is not None:
            # The key LiteLLM may still be sending; its grace runs from this change. Across a
            # removal (A -> none -> B) A stays "previous" and its grace restarts when B arrives.
            self._prev_b = self._key_b
        if key is not None:
            self._prev_until = now + self._grace
        self._key = key
        self._key_b = key.encode("utf-8") if key is not None else None
        self._fp = fingerprint(key) if key is not None else None
        if first:
            return  # loading the key at start is not a change: nothing to sync or clear
        if self.publish is not None:
            self.publish(KeyRotated())
