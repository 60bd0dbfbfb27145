"""The gateway: ``{base_path}/ondemand/{id}/v1/...``, what LiteLLM calls
instead of the engine.

Requests come as an ``http.Call`` from the lean front, the one way in; answers go out
through it. The checks run in the order of BEHAVIOUR.md, "Checks, in order": the peer guard
(``peers.PeerGuard``, before the gateway, by ``app._gateway_route``), the raw path, a configured key, the
rate limit on failed keys, the key, the body size, the deployment. Then a
traffic request takes a slot from the controller (which may start the model,
make room or queue) and is streamed to the engine and back, chunk by chunk.
Unknown routes answer 404 after the key check, so nothing about the routes
is learnt without the key; the engine is never called for them.

Hang-ups: the lean front cancels a request's handler when its client goes away
(``connection_lost``): a pending ``acquire`` (the controller removes
the waiter) or the upstream request (its connection is closed). The slot is
released in ``finally``; when ``acquire`` runs in a task of its own (the
streaming notice), a slot it grants after the hang-up is released by a done
callback.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..control.admission import Admission
from ..control.controller import Slot
from ..engines.deployer import Deployer
from ..errors import OndemandError, internal_error
from ..http.cycle import BodyMalformed, BodyTooLarge, Call
from ..http.forward import request_lines, response_lines
from ..http.headers import HEALTH_HEADER, bearer
from ..http.limits import READ_SIZE, Limits
from ..http.pool import PayloadError, UpstreamError, Upstreams
from ..http.pool import Response as UpstreamResponse
from ..model import Deployment, Role, State
from . import notice
from .exchange import Exchange, request_id
from .keys import KeyWatcher
from .paths import rebuild, split_checked
from .ratelimit import FailureLimiter

log = logging.getLogger("ondemand.gateway.routes")

# The body's bounds are Limits' (http/limits.py): the whole body within body_timeout_s of the handler
# starting to read it (one trickled byte by byte, or a chunked one the parser gave up on, would hold its
# connection and handler for ever); read before a slot is taken, so it never holds a slot.
TRAFFIC = frozenset({
    "chat/completions", "completions", "embeddings", "responses", "messages", "chat/completions/batch",
    "audio/transcriptions", "audio/translations", "rerank", "score"})
MULTIPART = frozenset({"audio/transcriptions", "audio/translations"})
STATE_HEADER = "x-dgxmm-ondemand-state"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_JSON = "application/json"
_JSON_UTF8 = {"Content-Type": "application/json; charset=utf-8"}  # as aiohttp's json_response says
_ENGINES: dict[str, str] = {}  # an engine's answer: its own header lines only (forward.response_lines)
_NO_NOTICE = object()  # _answer_with: no queued notice to prepend
_EMPTY_BODY = frozenset({204, 304})
ROUTES_REMEMBERED = 1024  # checked (method, path)s kept with their route and upstream target
# A request whose client went away before its answer was written (nginx's code).
CLIENT_GONE = 499


def _no_observer(ex: Exchange) -> None:
    pass


# A request held for these must not be sent again at once: the OpenAI SDKs retry
# 5xx answers unless told otherwise, and each retry would wait or start again.
_NO_RETRY = frozenset({"start_failed", "does_not_fit", "ondemand_queue_timeout", "ondemand_stopped",
                       "ondemand_not_configured", "not_on_demand", "ondemand_planned"})


async def send_error(call: Call, err: OndemandError) -> None:
    """An error in the documented form; a ``Connection: close`` of the error closes the connection."""
    headers = {k: v for k, v in err.headers.items() if k != "Connection"}
    if err.code in _NO_RETRY:
        headers["x-should-retry"] = "false"
    headers["Content-Type"] = _JSON
    await call.send(err.status, headers, err.body(), close=err.headers.get("Connection") == "close")


def _err(status: int, code: str, message: str, **kw: Any) -> OndemandError:
    return OndemandError(status, code, message, **kw)


def _not_found() -> OndemandError:
    return OndemandError(404, "not_found", "Not found")


def _release_when_granted(task: asyncio.Future[Slot]) -> None:
    """A slot granted to a request that is gone is released at once."""
    def done(t: asyncio.Future[Slot]) -> None:
        if not t.cancelled() and t.exception() is None:
            t.result().release()
    task.add_done_callback(done)


async def _pump(call: Call, up: UpstreamResponse) -> None:
    """The engine's bytes to the client as they come, read by read, unbuffered: straight from
    the engine connection's read while the client can take them (the pipe), else through here
    (the client's buffer is full: write and wait for it to drain)."""
    content = up.content
    content.pipe(call.write_now)
    try:
        async for chunk in content.iter_any():
            if content.at_eof():  # the last of it: with the answer's end, in one write
                return await call.end(chunk)
            await call.write(chunk)
        await call.end()  # a client gone after the last chunk fails here (found by the soak)
    except ConnectionResetError:
        return  # the client went away; the caller closes the engine connection
    except PayloadError:
        # The engine broke off mid-answer: so do we, rather than end the answer cleanly.
        call.abort()
    finally:
        content.pipe(None)


def health_answer(route: str, served: str) -> dict[str, Any] | None:
    now = int(time.time())
    if route == "chat/completions":
        return {"id": "ondemand-health", "object": "chat.completion", "created": now, "model": served,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    if route == "completions":
        return {"id": "ondemand-health", "object": "text_completion", "created": now, "model": served,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    if route == "responses":
        return {"id": "resp_ondemand_health", "object": "response", "created_at": now, "status": "completed",
                "model": served, "output": [], "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}
    if route == "messages":
        return {"id": "msg_ondemand_health", "type": "message", "role": "assistant", "model": served,
                "content": [], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}
    if route == "embeddings":
        return {"object": "list", "model": served, "data": [{"object": "embedding", "index": 0, "embedding": []}],
                "usage": {"prompt_tokens": 0, "total_tokens": 0}}
    return None


def _route(segs: list[str], method: str) -> tuple[int, str, str]:
    """{id}/v1/<route>: the deployment id, the route, and its kind (traffic, models, model)."""
    if len(segs) < 3 or segs[1] != "v1" or not segs[0].isdigit() or not segs[0].isascii():
        raise _not_found()
    dep_id = int(segs[0])
    route = "/".join(segs[2:])
    if method == "POST" and route in TRAFFIC:
        kind = "traffic"
    elif route == "models" and method == "GET":
        kind = "models"
    elif len(segs) == 4 and segs[2] == "models" and method in ("GET", "HEAD"):
        kind = "model"
    else:
        raise _not_found()
    return dep_id, route, kind


def _json_object(body: bytes) -> dict[str, Any]:
    """A JSON route's body, parsed: every JSON route takes an object."""
    if not body:  # the engine would refuse it too: no reason to start one for it
        raise _err(400, "invalid_json", "The request body is empty: a JSON object is expected")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _err(400, "invalid_json", "The request body is not valid JSON") from None
    if not isinstance(parsed, dict):  # null too
        raise _err(400, "invalid_json", "The request body must be a JSON object")
    return parsed


class Gateway:
    def __init__(self, *, controller: Admission, deployer: Deployer, keys: KeyWatcher,
                 limiter: FailureLimiter, upstreams: Upstreams, base_path: str, max_body: int = Limits.gateway_max_body,
                 clock: Callable[[], float] = time.monotonic, finished: Callable[[Exchange], None] = _no_observer,
                 start_eta: Callable[[int], float | None] = lambda dep_id: None,
                 start_phase: Callable[[int], str | None] = lambda dep_id: None,
                 queue_place: Callable[[int], tuple[int, int] | None] = lambda dep_id: None,
                 body_timeout_s: float = Limits.body_timeout_s):
        """``finished(exchange)`` hears of every request once its answer's last byte is
        written (or its client went away): the metrics and the access log. ``start_eta``:
        how long a deployment's start takes (its history; while it starts, what is left),
        ``start_phase``, that start's phase in words, and ``queue_place``, its place in the
        memory queue, for the queued notice."""
        self.controller = controller
        self.deployer = deployer
        self.keys = keys
        self.limiter = limiter
        self.upstreams = upstreams
        self.prefix = base_path + "/ondemand"
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.clock = clock
        self.finished = finished
        self.start_eta, self.start_phase = start_eta, start_phase
        self.queue_place = queue_place
        self._routes: dict[tuple[str, str], tuple[int, str, str, str]] = {}

    async def handle(self, call: Call) -> None:
        """Answer one gateway request."""
        ex = Exchange(request_id(call.headers), call.method, call.peer, self.clock())
        call.rid = ex.rid
        ex.status = CLIENT_GONE  # unless an answer is written to its end below
        try:
            await self._answer(call, ex)
            if call.status:
                ex.status = call.status
        except ConnectionResetError:  # the client went away first (found by the soak)
            pass
        finally:
            ex.duration_s = self.clock() - ex.arrival
            ex.bytes_out = call.bytes_out
            self.finished(ex)

    async def _answer(self, call: Call, ex: Exchange) -> None:
        try:
            await self._handle(call, ex)
        except OndemandError as err:
            if err.status >= 500:
                log.info("%s %s: %d %s (request %s)", call.method, call.raw_path, err.status, err.code, ex.rid)
            if call.status:  # an answer went out already (cannot be: errors come before one)
                raise
            await send_error(call, err)
        except ConnectionResetError:
            raise
        except Exception:
            # A defect of ours: logged with its traceback, answered in the documented form
            # when nothing of an answer went out yet (else the connection is cut).
            log.exception("%s %s failed (request %s)", call.method, call.raw_path, ex.rid)
            if call.status or call.bytes_out:
                raise
            await send_error(call, internal_error())

    # --- the checks -------------------------------------------------------------

    def _check_key(self, call: Call, peer: str) -> None:
        if self.keys.current() is None:
            raise _err(503, "ondemand_not_configured",
                       "The on-demand gateway has no key configured (ondemand_key_file)")
        retry = self.limiter.retry_after(peer)
        if retry is not None:
            raise _err(429, "rate_limited", "Too many failed key checks; try again later",
                       headers={"Retry-After": str(retry)})
        presented = bearer(call.headers)
        verdict = self.keys.check(presented)
        if verdict == "ok":
            return
        if verdict == "bad":  # the previous key, just rotated, does not count (BEHAVIOUR.md, "Key rotation")
            self.limiter.fail(peer)
        raise _err(401, "invalid_api_key", "Invalid API key for the on-demand gateway")

    def _target(self, call: Call, peer: str) -> tuple[int, str, str, str]:
        """Checks 2 to 4 (the path, the key, the route): the deployment id, the route, its
        kind and the upstream target (the checked path rebuilt). A path that passed them
        once is remembered with its method (LiteLLM sends a handful), so the next request on
        it skips the parse; the key is checked every time, before the route is known."""
        key = (call.method, call.raw_path)
        known = self._routes.get(key)
        if known is not None:
            self._check_key(call, peer)
            return known
        segs = split_checked(call.raw_path, self.prefix)
        self._check_key(call, peer)
        dep_id, route, kind = _route(segs, call.method)
        known = (dep_id, route, kind, rebuild(segs[1:]))
        if len(self._routes) >= ROUTES_REMEMBERED:  # only a key's holder adds: bounded all the same
            self._routes.clear()
        self._routes[key] = known
        return known

    async def _handle(self, call: Call, ex: Exchange) -> None:
        dep_id, route, kind, target = self._target(call, ex.peer or "?")
        ex.route = route
        length = call.content_length
        if length is not None and length > self.max_body:
            raise self._too_large()
        dep = self.deployer.get(dep_id)
        if dep is None:
            raise _not_found()
        ex.deployment = dep.name
        if dep.role is Role.DECISION:
            raise _err(503, "not_on_demand", f"{dep.served_name} is not served through the on-demand gateway")
        if kind == "models":
            body = orjson.dumps({"object": "list", "data": [{
                "id": dep.served_name, "object": "model", "created": int(dep.created_at), "owned_by": "dgxmm"}]})
            return await call.send(200, _JSON_UTF8, body)
        if dep.state is State.PLANNED:  # not registered in LiteLLM: nothing to wait for
            raise _err(503, "ondemand_planned",
                       f"{dep.served_name} is planned: an administrator has to start it first")
        if kind == "model":
            if dep.state is not State.READY:
                raise _err(503, "ondemand_not_ready", f"{dep.served_name} is {dep.state}")
            return await self._forward(call, dep, target, None, route)

        if HEALTH_HEADER in call.headers:
            ex.health = True
            return await self._health(call, dep, route)
        # A pending start to always on (a switch, a start after ondemand's restart) is waited
        # for like an on-demand start: LiteLLM lists the gateway entry until it is ready.
        on_demand = dep.on_demand or dep.pending_mode is not None
        if not on_demand and dep.state is not State.READY:
            raise _err(503, "not_on_demand", f"{dep.served_name} is always on and is {dep.state}")

        body = await self._read_body(call)
        ex.bytes_in = len(body)
        parsed = None if route in MULTIPART else _json_object(body)
        if not on_demand:
            return await self._forward(call, dep, target, body, route)
        how = notice.mode(route, parsed)
        if how == notice.STREAM_NOTICE:
            return await self._stream_with_notice(call, ex, dep, target, body, route)
        # The wait as it stood when the request queued, as the streaming notice tells it.
        queued: list[notice.Wait] = []

        def on_queued() -> None:
            ex.memory_wait()
            queued.append(self._wait(dep_id))
        slot = await self._acquire(ex, dep_id, on_queued)
        try:
            return await self._forward(call, dep, target, body, route,
                                       prepend=how == notice.PREPEND and ex.waited_memory,
                                       wait=queued[0] if queued else notice.UNKNOWN)
        finally:
            slot.release()

    def _wait(self, dep_id: int) -> notice.Wait:
        return notice.Wait(self.start_eta(dep_id), self.queue_place(dep_id), self.start_phase(dep_id))

    async def _acquire(self, ex: Exchange, dep_id: int, on_queued: Callable[[], None]) -> Slot:
        """The controller's slot, noting whether (and how long) the request waited for it."""
        dep = self.deployer.get(dep_id)
        # Read in the same step as the controller's try_take (no await between): not ready
        # now means this request waits for a start.
        ex.waited_start = dep is None or dep.state is not State.READY
        slot = None if ex.waited_start else self.controller.take_now(dep_id)  # no coroutine when ready
        if slot is None:
            slot = await self.controller.acquire(dep_id, arrival=ex.arrival, on_queued=on_queued)
        if ex.waited_start or ex.waited_memory:
            ex.queued_s = self.clock() - ex.arrival
        return slot

    def _too_large(self) -> OndemandError:
        return _err(413, "request_too_large", f"The request body is larger than {self.max_body // 2**20} MiB")

    async def _read_body(self, call: Call) -> bytes:
        """Counted while it arrives (chunked too), and timed: the whole of it within
        ``body_timeout_s``, else 408 and the connection closes."""
        body = call.body_now(self.max_body)
        if body is not None:
            return body
        try:
            return await call.body(self.max_body, self.body_timeout_s)
        except BodyTooLarge:
            raise self._too_large() from None
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11
            raise _err(408, "request_timeout", f"The request body did not arrive within {self.body_timeout_s:g} s",
                       headers={"Connection": "close"}) from None
        except BodyMalformed as exc:  # a malformed chunked body, found while reading it
            raise _err(400, "invalid_body", f"The request body is malformed: {exc}",
                       headers={"Connection": "close"}) from None

    async def _health(self, call: Call, dep: Deployment, route: str) -> None:
        """LiteLLM's health checks are answered here, never forwarded, in every state:
        the header is no secret, and a forwarded one would run without a slot."""
        if dep.state is State.FAILED:
            raise _err(503, "ondemand_not_ready", f"{dep.served_name} failed: {dep.state_reason or ''}")
        answer = health_answer(route, dep.served_name)
        if answer is None:
            raise _err(503, "ondemand_health_unsupported", f"no health answer for /v1/{route}")
        await call.send(200, {"Content-Type": _JSON, STATE_HEADER: dep.state.value}, orjson.dumps(answer))

    # --- streaming with the queued notice -----------------------------------------

    async def _stream_with_notice(self, call: Call, ex: Exchange, dep: Deployment, target: str,
                                  body: bytes, route: str) -> None:
        # Ready (the common case): the slot at once, with no task and no wait for the notice.
        slot = self.controller.take_now(dep.id)
        if slot is not None:
            try:
                return await self._forward(call, dep, target, body, route)
            finally:
                slot.release()
        queued = asyncio.Event()

        def on_queued() -> None:
            ex.memory_wait()
            queued.set()
        # A child task, awaited or cancelled below (not a background task): the notice
        # must go out while the acquire still waits.
        acq = asyncio.ensure_future(self._acquire(ex, dep.id, on_queued))  # noqa: TID251
        slot = None
        try:
            if not acq.done():
                # A child too: asyncio.wait takes futures, and this one is cancelled just below.
                q = asyncio.ensure_future(queued.wait())  # noqa: TID251
                try:
                    await asyncio.wait((acq, q), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    q.cancel()
            if acq.done():
                slot = acq.result()  # raises the controller's error as a plain answer
                return await self._forward(call, dep, target, body, route)
            # Queued for memory: tell the person now, then wait.
            await call.start(200, _SSE_HEADERS)
            await call.write(notice.queued_chunk(route, dep.served_name, self._wait(dep.id)))
            try:
                slot = await acq
            except OndemandError as err:
                await call.write(notice.error_events(err.envelope()))
                return await call.end()
            return await self._forward(call, dep, target, body, route, started=True)
        finally:
            if slot is not None:
                slot.release()
            elif not acq.done():
                acq.cancel()
                _release_when_granted(acq)
            else:
                _release_when_granted(acq)

    # --- forwarding -----------------------------------------------------------------

    async def _forward(self, call: Call, dep: Deployment, target: str, body: bytes | None,
                       route: str, *, prepend: bool = False, wait: notice.Wait = notice.UNKNOWN,
                       started: bool = False) -> None:
        base = self.deployer.base_url(dep.id)
        if base is None:
            return await self._upstream_failed(call, started, "the engine has no address")
        lease = self.upstreams.open(dep.id, base)
        try:
            try:
                lines = request_lines(call.raw_headers, call.rid)
                up = await lease.request(call.method, target, lines, body)
            except (UpstreamError, ValueError) as exc:
                return await self._upstream_failed(call, started, f"the engine did not answer: {exc}")
            try:
                if started:
                    return await self._into_started(call, up)
                await self._answer_with(call, up, route, dep, wait if prepend else _NO_NOTICE)
            finally:
                up.release()  # back to the pool when read to the end, else closed (the engine stops)
        finally:
            lease.end()

    async def _answer_with(self, call: Call, up: UpstreamResponse, route: str, dep: Deployment,
                           wait: notice.Wait | object) -> None:
        """The engine's answer to the client: whole when it is here already, else streamed."""
        content = up.content
        if wait is not _NO_NOTICE and up.status == 200 and up.content_type == _JSON:
            try:
                raw = await up.read()
            except PayloadError as exc:
                return await self._upstream_failed(call, False, f"the engine broke off its answer: {exc}")
            data = notice.prepend(route, raw, dep.served_name, wait)  # type: ignore[arg-type]
            return await call.send(200, _ENGINES, data, lines=response_lines(up.raw_headers))
        if content.is_eof() and call.method != "HEAD" and up.status not in _EMPTY_BODY:
            # The whole answer is here already (a short one usually is): head and body in one write.
            return await call.send(up.status, _ENGINES, content.read_now(), reason=up.reason,
                                   lines=response_lines(up.raw_headers))
        # What came with the head goes out with ours (one write, not two); the rest as it comes.
        await call.start(up.status, _ENGINES, reason=up.reason, length=up.content_length,
                         lines=response_lines(up.raw_headers), body=content.take_now())
        if call.method == "HEAD":
            return await call.end()
        await _pump(call, up)

    async def _into_started(self, call: Call, up: UpstreamResponse) -> None:
        """The engine's SSE bytes after the queued notice; an engine error becomes an SSE error."""
        if up.status != 200:
            raw = b""
            content = up.content
            try:
                while len(raw) < READ_SIZE and not content.at_eof():  # read() gives what arrived, not all
                    raw += await content.read(READ_SIZE - len(raw))
            except PayloadError as exc:
                return await self._upstream_failed(call, True, f"the engine broke off its answer: {exc}")
            try:
                error = orjson.loads(raw)
                if not isinstance(error, dict) or "error" not in error:
                    raise ValueError
            except ValueError:
                error = {"error": {"message": raw.decode("utf-8", "replace")[:2000] or f"engine answered {up.status}",
                                   "type": "server_error", "code": up.status}}
            await call.write(notice.error_events(error))
            return await call.end()
        await _pump(call, up)

    async def _upstream_failed(self, call: Call, started: bool, why: str) -> None:
        err = _err(502, "ondemand_upstream_error", f"The engine could not be reached: {why}")
        if not started:
            raise err
        await call.write(notice.error_events(err.envelope()))
        await call.end()
