"""What the admin API's routes share: JSON answers and the error form (aiohttp's own refusals
in it too), and a request's parts: its deployment id, its JSON body, who asks (socket or token)."""
from __future__ import annotations

import socket
from types import ModuleType
from typing import Any

import orjson
from aiohttp import web

from ..errors import OndemandError
from ..http.aio import read_body
from ..http.server import LIMITS
from ..model import parse_id
from . import components

JSON = "application/json"


def json_answer(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS),
                        content_type=JSON)


def is_unix(request: web.BaseRequest) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


# aiohttp's own refusals (no route, wrong method, body over client_max_size),
# in the API's error form: scripts read error.code.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def http_error(exc: web.HTTPException, max_body: int) -> web.Response:
    code = _HTTP_CODES.get(exc.status, exc.reason.lower().replace(" ", "_"))
    allow = exc.headers.get("Allow")
    message = {405: f"{exc.reason}; allowed: {allow}", 413: f"The request body is larger than {max_body // 2**20} MiB"}
    err = OndemandError(exc.status, code, message.get(exc.status, exc.reason))
    return web.Response(status=exc.status, body=err.body(), content_type=JSON,
                        headers={"Allow": allow} if allow else None)


def refusal(err: OndemandError, *, close: bool = False) -> web.Response:
    """An error in the documented form; its ``Connection: close`` closes the connection."""
    headers = {k: v for k, v in err.headers.items() if k != "Connection"}
    resp = web.Response(status=err.status, body=err.body(), content_type=JSON, headers=headers or None)
    if close or err.headers.get("Connection") == "close":
        resp.force_close()
    return resp


def app_parts(request: web.Request) -> tuple[ModuleType, web.Application]:
    return components, request.app


def deployment_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    dep_id = parse_id(raw)
    if dep_id is None:
        raise OndemandError(404, "not_found", f"no deployment {raw[:40]!r}{'...' if len(raw) > 40 else ''}")
    app_mod, app = app_parts(request)
    if app[app_mod.DEPLOYER].get(dep_id) is None:
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    return dep_id


async def read_json(request: web.Request) -> dict[str, Any]:
    # A time limit as the gateway's (issue 23: an admin body could trickle for ever).
    raw = await read_body(request, request.app[LIMITS])
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        raise OndemandError(400, "invalid_json", "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OndemandError(400, "invalid_json", "the body must be a JSON object")
    return data


def caller(request: web.Request) -> str:
    return "socket" if is_unix(request) else "token"
