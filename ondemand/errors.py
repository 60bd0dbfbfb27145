"""Errors that carry data, and the one function that renders them.

Every error a client or an admin sees is an ``OndemandError``: HTTP status, a
stable ``code`` (the names of the README's error table: ``invalid_path``,
``ondemand_queue_full`` ...), the OpenAI ``type``, the client's message and
extra headers. ``detail`` is for the log only. Imports nothing of ours.
"""
from __future__ import annotations

import logging
from typing import Any

import orjson

# OpenAI's error types by status, as its SDKs map them.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class OndemandError(Exception):
    """An error with everything needed to answer it."""

    def __init__(self, status: int, code: str, message: str, *,
                 headers: dict[str, str] | None = None, detail: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.detail = detail
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def body(self) -> bytes:
        return orjson.dumps(self.envelope())

    def __repr__(self) -> str:
        return f"OndemandError({self.status}, {self.code!r}, {self.message!r})"


def not_found(message: str = "Not found") -> OndemandError:
    return OndemandError(404, "not_found", message)


def internal_error(status: int = 500) -> OndemandError:
    """The one 500 of both stacks: a defect of ours, its traceback in the log, not in the answer
    (``status``: aiohttp's 504 for a handler that timed out says the same)."""
    return OndemandError(status, "internal_error", "ondemand failed on this request; see its log")


def upgrade_refused() -> OndemandError:
    """Nothing here switches protocols: an Upgrade is refused on either stack (what follows it
    would be taken for the new protocol's, and the requests pipelined behind it lost)."""
    return OndemandError(400, "invalid_request", "ondemand switches to no other protocol (Upgrade)")


def misdirected(what: str) -> OndemandError:
    """RFC 9110's 421: a request for the other stack than its connection's (a connection
    belongs to one stack); the client may retry it on a connection of its own."""
    return OndemandError(421, "misdirected_request", f"{what}: send it on a connection of its own")


class InsufficientMemory(Exception):
    """The deployer's fit check said no: ``need`` GiB does not fit in ``free`` (summed
    over the GPUs). ``fit`` (a ``placement.Fit``) says per GPU what make-room needs."""

    def __init__(self, need: float, free: float, capacity: float, fit: Any = None, message: str | None = None):
        super().__init__(message or f"needs {need:g} GiB, {free:g} GiB free of {capacity:g} GiB on-demand capacity")
        self.need = need
        self.free = free
        self.capacity = capacity
        self.fit = fit


class BudgetError(Exception):
    """The memory budget could not be read (nvidia-smi missing, failing or too slow ...)."""


class StateFileError(Exception):
    """The state file cannot be written (its disk is full, read-only, failing): nothing of
    the change was written (SQLite rolled it back); the message says which file and why."""


def log_unwritten(log: logging.Logger, exc: BaseException, what: str, *args: Any) -> None:
    """A background write to the state file failed (``what % args`` says which): a
    ``StateFileError`` (a full disk) is one line with its message; anything else is a defect of
    ours, logged with its traceback."""
    if isinstance(exc, StateFileError):
        log.error(what + ": %s", *args, exc)
    else:
        log.error(what, *args, exc_info=exc)


class DeployerError(Exception):
    """A deployer operation that could not be done (bad state, backend error)."""


class DeploymentBusy(DeployerError):
    """An edit of a deployment that is not stopped, failed or planned (or whose
    engine still runs): stop it first."""


class NameTaken(DeployerError):
    """Another deployment already has this name (names are unique)."""


class ConfigError(Exception):
    """A configuration key is unknown or out of range; the message names it."""


class StartupError(Exception):
    """The server cannot start; the message says why and what to do."""
