"""The answers every route shares: ``Reply`` (what a route returns), JSON, text, an empty answer,
and an error in vLLM's shape (or as ``SimError.body`` says, SGLang's shapes)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

JSON: Mapping[str, str] = {"Content-Type": "application/json"}
TEXT: Mapping[str, str] = {"Content-Type": "text/plain; charset=utf-8"}


class Reply:
    """An answer: its status, header lines and body. ``STREAMED``: the route answered on the
    request's ``Call`` itself (a stream), and nothing more is sent."""
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int = 200, body: bytes = b"", headers: Mapping[str, str] | None = None):
        self.status, self.body, self.headers = status, body, headers or {}


STREAMED = Reply(0)


class SimError(Exception):
    """An error answer: vLLM's shape, or ``body`` as it is (SGLang's shapes)."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None,
                 body: Any = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.body = status, message, type, param, body


def error(status: int, message: str, type: str, param: str | None = None) -> Reply:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return Reply(status, orjson.dumps(body), JSON)


def answer(obj: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(obj), JSON)


def text(body: str, status: int = 200) -> Reply:
    return Reply(status, body.encode(), TEXT)


def empty(status: int = 200) -> Reply:
    """No body and no Content-Type (a 200 of ``/health``, ``/sleep``; the 204 of a clear)."""
    return Reply(status)
