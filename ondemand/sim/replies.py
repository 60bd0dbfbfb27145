"""The answers every route shares: JSON, and an error in vLLM's shape (or as ``SimError.body``
says, SGLang's shapes)."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class SimError(Exception):
    """An error answer: vLLM's shape, or ``body`` as it is (SGLang's shapes)."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None,
                 body: Any = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.body = status, message, type, param, body


def error(status: int, message: str, type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def answer(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")
