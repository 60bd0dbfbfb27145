"""The answers that stream: the views' Server-Sent Events (``/api/events``) and an engine's
log (``/api/deployments/{id}/logs``, its tail and its follow)."""
from __future__ import annotations

import asyncio
import contextlib

import orjson
from aiohttp import web

from ..engines.backends import BackendError
from ..engines.deployer import Deployer
from ..errors import OndemandError
from ..events import Resync, ViewPublished
from ..model import State
from .fields import field_error
from .wire import app_parts, deployment_id


async def events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: one ``deployment`` event per change (the view). A reader that fell
    behind gets ``resync`` (every view, as a list) and then every view again as ``deployment``
    events, instead of the events it missed."""
    app_mod, app = app_parts(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    bus = app[app_mod.BUS]

    async def all_views(resync: bool) -> None:
        views = [app_mod.view(app, dep) for dep in app[app_mod.DEPLOYER].all()]
        if resync:
            await resp.write(b"event: resync\ndata: " + orjson.dumps(views) + b"\n\n")
        for v in views:
            await resp.write(b"event: deployment\ndata: " + orjson.dumps(v) + b"\n\n")
    with bus.stream(ViewPublished) as queue:
        await all_views(False)  # the current views first
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), 15)
            except asyncio.TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if isinstance(event, Resync):
                await all_views(True)
            else:
                await resp.write(b"event: deployment\ndata: " + orjson.dumps(event.view) + b"\n\n")


# GET /api/deployments/{id}/logs: the default and the largest tail.
LOGS_TAIL = 100
LOGS_MAX_TAIL = 10000
# How often a follow looks whether a start waiting at the start-up gate has its engine yet.
LOGS_ENGINE_POLL_S = 0.1


def _logs_query(request: web.Request) -> tuple[int, bool]:
    raw_tail = request.query.get("tail", str(LOGS_TAIL))
    # ASCII digits, a few: "¹" passed isdigit() and 5,000 digits int(), both then raised (a 500).
    if not (raw_tail.isascii() and raw_tail.isdigit() and len(raw_tail) <= 6) or int(raw_tail) > LOGS_MAX_TAIL:
        raise field_error("tail", f"whole lines, 0 to {LOGS_MAX_TAIL}")
    follow = request.query.get("follow", "0")
    if follow not in ("0", "1", "true", "false"):
        raise field_error("follow", "1 or 0")
    return int(raw_tail), follow in ("1", "true")


async def _engine_or_not_starting(deployer: Deployer, dep_id: int) -> None:
    """Wait while the deployment is starting but its engine is not made yet (its start waits
    at the start-up gate): a follow then begins with that run instead of ending at once."""
    while True:
        dep = deployer.get(dep_id)
        if dep is None or dep.state is not State.STARTING or deployer.base_url(dep_id) is not None:
            return
        await asyncio.sleep(LOGS_ENGINE_POLL_S)


async def deployment_logs(request: web.Request) -> web.StreamResponse:
    """The engine's log as text/plain: the last ``tail`` lines, and with ``follow=1`` what
    the running engine writes until its log ends or the client hangs up."""
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    tail, follow = _logs_query(request)
    deployer = app[app_mod.DEPLOYER]
    if follow:
        await _engine_or_not_starting(deployer, dep_id)
    dep = deployer.get(dep_id)
    if dep is None:
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8", "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff"})
    # Closed in every case, a hang-up (the handler's cancellation) included: the
    # backend's follower or Docker's stream goes with it, and no task is left.
    async with contextlib.aclosing(deployer.backend.logs(dep, tail=tail, follow=follow)) as stream:
        try:
            first = await anext(stream, b"")
        except BackendError as exc:
            raise OndemandError(503, "logs_unavailable", f"cannot read the log of {dep.name}: {exc}") from exc
        await resp.prepare(request)
        try:
            await resp.write(first)
            async for chunk in stream:
                await resp.write(chunk)
        except BackendError as exc:  # the answer has begun: say so in the text, then end it
            await resp.write(f"\n[ondemand: the log broke off: {exc}]\n".encode())
        except ConnectionResetError:
            return resp
    await resp.write_eof()
    return resp
