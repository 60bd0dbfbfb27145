"""The gateway: ``{base_path}/ondemand/{id}/v1/...``, what LiteLLM calls
instead of the engine.

Requests come as an ``http.Call`` from the lean front, the one way in; answers go out
through it. Each request goes through one pipeline, in the order of BEHAVIOUR.md, "Checks,
in order": the checks (the peer guard, ``peers.PeerGuard``, before the gateway, by
``app._gateway_route``; the raw path, a configured key, the rate limit on failed keys, the
key, the route, the declared body size), the body (read and parsed), the admission (the
controller's verdict: a refusal, or a ticket with the deployment, its engine's address and
its slot; a request that must wait for a start or for memory waits there), and the answer
(``answers``: plain, the notice prepended, or the notice streamed before the engine's SSE).
The gateway never reads the deployer: what it knows of the deployment is the ticket's. The
refusals that need no wait come before the body when the body is not here yet (and before a
``100 Continue``); when it came with the head (the usual), the admission's one step gives them.
Unknown routes answer 404 after the key check, so nothing about the routes
is learnt without the key; the engine is never called for them.

Hang-ups: the lean front cancels a request's handler when its client goes away
(``connection_lost``): a pending wait (the controller removes the waiter) or the
upstream request (its connection is closed). The slot is released in ``finally``;
when the wait runs in a task of its own (the streaming notice), a slot it grants
after the hang-up is released by a done callback.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..control.admission import Admission, Refusal, Ticket, Waits, Want
from ..errors import OndemandError, internal_error
from ..http.cycle import BodyMalformed, BodyTooLarge, Call
from ..http.headers import HEALTH_HEADER, bearer
from ..http.limits import Limits
from ..http.pool import Upstreams
from ..model import Deployment, State, parse_id
from . import answers, notice
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
_JSON_UTF8 = {"Content-Type": "application/json; charset=utf-8"}  # as aiohttp's json_response says
ROUTES_REMEMBERED = 1024  # checked (method, path)s kept with their route and upstream target
# A request whose client went away before its answer was written (nginx's code).
CLIENT_GONE = 499


def _no_observer(ex: Exchange) -> None:
    pass


# A request held for these must not be sent again at once: the OpenAI SDKs retry
# 5xx answers unless told otherwise, and each retry would wait or start again.
_NO_RETRY = frozenset({"start_failed", "does_not_fit", "ondemand_queue_timeout", "ondemand_stopped",
                       "ondemand_not_configured", "not_on_demand", "ondemand_planned"})


# A refused request ends its connection (issue 40: refused clients held theirs for the keep-alive
# time, and filled the cap): only a request that passed the checks keeps one. A 429 ondemand_busy
# (max_inflight) or a 404 of an unknown deployment came with the key: those keep theirs.
_ENDS_CONNECTION = frozenset({"invalid_api_key", "rate_limited"})


async def send_error(call: Call, err: OndemandError) -> None:
    """An error in the documented form; a ``Connection: close`` of the error, a 400 or a refused
    key closes the connection."""
    headers = {k: v for k, v in err.headers.items() if k != "Connection"}
    if err.code in _NO_RETRY:
        headers["x-should-retry"] = "false"
    headers["Content-Type"] = answers.JSON
    close = err.status == 400 or err.code in _ENDS_CONNECTION or err.headers.get("Connection") == "close"
    await call.send(err.status, headers, err.body(), close=close)


def _err(status: int, code: str, message: str, **kw: Any) -> OndemandError:
    return OndemandError(status, code, message, **kw)


def _not_found() -> OndemandError:
    return OndemandError(404, "not_found", "Not found")


def _release_when_granted(task: asyncio.Future[Ticket]) -> None:
    """A slot granted to a request that is gone is released at once."""
    def done(t: asyncio.Future[Ticket]) -> None:
        if not t.cancelled() and t.exception() is None:
            t.result().release()
    task.add_done_callback(done)


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


def _route(segs: list[str], method: str) -> tuple[int, str, Want]:
    """{id}/v1/<route>: the deployment id, the route, and what it asks of the deployment."""
    dep_id = parse_id(segs[0]) if len(segs) >= 3 and segs[1] == "v1" else None
    if dep_id is None:  # (canonical decimal only: "03" was deployment 3)
        raise _not_found()
    route = "/".join(segs[2:])
    if method == "POST" and route in TRAFFIC:
        want = Want.TRAFFIC
    elif route == "models" and method == "GET":
        want = Want.LIST
    elif len(segs) == 4 and segs[2] == "models" and method in ("GET", "HEAD"):
        want = Want.MODEL
    else:
        raise _not_found()
    return dep_id, route, want


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


def _model_list(dep: Deployment) -> bytes:
    return orjson.dumps({"object": "list", "data": [{
        "id": dep.served_name, "object": "model", "created": int(dep.created_at), "owned_by": "dgxmm"}]})


class Gateway:
    def __init__(self, *, controller: Admission, keys: KeyWatcher, limiter: FailureLimiter, upstreams: Upstreams,
                 base_path: str, max_body: int = Limits.gateway_max_body,
                 clock: Callable[[], float] = time.monotonic, finished: Callable[[Exchange], None] = _no_observer,
                 start_eta: Callable[[int], float | None] = lambda dep_id: None,
                 start_phase: Callable[[int], str | None] = lambda dep_id: None,
                 queue_place: Callable[[int], tuple[int, int] | None] = lambda dep_id: None,
                 body_timeout_s: float = Limits.body_timeout_s):
        """``controller``: the admission, the only one that reads the deployments for a request.
        ``finished(exchange)`` hears of every request once its answer's last byte is
        written (or its client went away): the metrics and the access log. ``start_eta``:
        how long a deployment's start takes (its history; while it starts, what is left),
        ``start_phase``, that start's phase in words, and ``queue_place``, its place in the
        memory queue, for the queued notice."""
        self.controller = controller
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
        self._routes: dict[tuple[str, str], tuple[int, str, Want, str]] = {}

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
            if isinstance(err, Refusal):  # the controller's: the deployment as it read it
                ex.deployment = err.deployment or ex.deployment
                if err.before_body:
                    ex.bytes_in = 0  # refused before its body is read (checks 7 to 9): none counted
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

    def _target(self, call: Call, peer: str) -> tuple[int, str, Want, str]:
        """Checks 2 to 5 (the path, the key, the route): the deployment id, the route, what it
        asks of the deployment and the upstream path (the checked path rebuilt). A path that
        passed them once is remembered with its method (LiteLLM sends a handful), so the next
        request on it skips the parse; the key is checked every time, before the route is known."""
        key = (call.method, call.raw_path)
        known = self._routes.get(key)
        if known is not None:
            self._check_key(call, peer)
            return known
        segs = split_checked(call.raw_path, self.prefix)
        self._check_key(call, peer)
        dep_id, route, want = _route(segs, call.method)
        known = (dep_id, route, want, rebuild(segs[1:]))
        if len(self._routes) >= ROUTES_REMEMBERED:  # only a key's holder adds: bounded all the same
            self._routes.clear()
        self._routes[key] = known
        return known

    def _too_large(self) -> OndemandError:
        return _err(413, "request_too_large", f"The request body is larger than {self.max_body // 2**20} MiB")

    async def _read_body(self, call: Call) -> bytes:
        """Counted while it arrives (chunked too), and timed: the whole of it within
        ``body_timeout_s``, else 408 and the connection closes."""
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

    # --- the pipeline: checks, body, admission, answer ---------------------------------

    async def _handle(self, call: Call, ex: Exchange) -> None:
        dep_id, route, want, path = self._target(call, ex.peer or "?")
        ex.route = route
        length = call.content_length
        if length is not None and length > self.max_body:
            raise self._too_large()
        if want is Want.TRAFFIC:
            if HEALTH_HEADER not in call.headers:
                return await self._traffic(call, ex, dep_id, route, path)
            want = Want.HEALTH
        ticket = self.controller.admit(dep_id, want)
        dep = ticket.dep
        ex.deployment = dep.name
        if want is Want.LIST:
            return await call.send(200, _JSON_UTF8, _model_list(dep))
        if want is Want.HEALTH:
            ex.health = True
            return await self._health(call, dep, route)
        return await answers.plain(call, self.upstreams, ticket, path, None)  # a model's route, while ready

    async def _traffic(self, call: Call, ex: Exchange, dep_id: int, route: str, path: str) -> None:
        """A traffic request: its body, its admission, its answer."""
        body = call.body_now(self.max_body)  # the usual: it came with the head
        if body is None:  # on its way: the refusals come first (and no 100 Continue for them)
            ex.deployment = self.controller.screen(dep_id, Want.TRAFFIC).name
            body = await self._read_body(call)
        ex.bytes_in = len(body)
        try:
            parsed = None if route in MULTIPART else _json_object(body)
        except OndemandError:
            # A refusal comes before a fault of the body.
            ex.deployment = self.controller.screen(dep_id, Want.TRAFFIC).name
            raise
        ticket = self.controller.admit(dep_id, Want.TRAFFIC)
        ex.deployment = ticket.dep.name
        if ticket.waits is None:  # ready (or always on and ready): the hot path
            try:
                return await answers.plain(call, self.upstreams, ticket, path, body)
            finally:
                ticket.release()
        ex.waited_start = ticket.waits is Waits.START
        how = notice.mode(route, parsed)
        if how == notice.STREAM_NOTICE:
            return await self._stream_queued(call, ex, ticket.dep, route, path, body)
        # The wait as it stood when the request queued, as the streaming notice tells it.
        queued: list[notice.Wait] = []

        def on_queued() -> None:
            ex.memory_wait()
            queued.append(self._wait_of(dep_id))
        ticket = await self._wait(ex, dep_id, on_queued)
        try:
            if how == notice.PREPEND and ex.waited_memory:
                return await answers.prepended(call, self.upstreams, ticket, path, body, route,
                                               queued[0] if queued else notice.UNKNOWN)
            return await answers.plain(call, self.upstreams, ticket, path, body)
        finally:
            ticket.release()

    def _wait_of(self, dep_id: int) -> notice.Wait:
        return notice.Wait(self.start_eta(dep_id), self.queue_place(dep_id), self.start_phase(dep_id))

    async def _wait(self, ex: Exchange, dep_id: int, on_queued: Callable[[], None]) -> Ticket:
        """The controller's ticket for a request that waits, noting how long it waited for it."""
        ticket = await self.controller.wait(dep_id, arrival=ex.arrival, on_queued=on_queued)
        if ex.waited_start or ex.waited_memory:
            ex.queued_s = self.clock() - ex.arrival
        return ticket

    async def _health(self, call: Call, dep: Deployment, route: str) -> None:
        """LiteLLM's health checks are answered here, never forwarded, in every state:
        the header is no secret, and a forwarded one would run without a slot."""
        if dep.state is State.FAILED:
            raise _err(503, "ondemand_not_ready", f"{dep.served_name} failed: {dep.state_reason or ''}")
        answer = health_answer(route, dep.served_name)
        if answer is None:
            raise _err(503, "ondemand_health_unsupported", f"no health answer for /v1/{route}")
        await call.send(200, {"Content-Type": answers.JSON, STATE_HEADER: dep.state.value}, orjson.dumps(answer))

    async def _stream_queued(self, call: Call, ex: Exchange, dep: Deployment, route: str, path: str,
                             body: bytes) -> None:
        """A streaming request that waits: when it queues for memory, the notice goes out at
        once (the answer's head with it), and the engine's SSE bytes follow."""
        queued = asyncio.Event()

        def on_queued() -> None:
            ex.memory_wait()
            queued.set()
        # A child task, awaited or cancelled below (not a background task): the notice
        # must go out while the wait goes on.
        acq = asyncio.ensure_future(self._wait(ex, dep.id, on_queued))  # noqa: TID251
        ticket = None
        try:
            # A child too: asyncio.wait takes futures, and this one is cancelled just below.
            q = asyncio.ensure_future(queued.wait())  # noqa: TID251
            try:
                await asyncio.wait((acq, q), return_when=asyncio.FIRST_COMPLETED)
            finally:
                q.cancel()
            if acq.done():
                ticket = acq.result()  # raises the controller's error as a plain answer
                return await answers.plain(call, self.upstreams, ticket, path, body)
            # Queued for memory: tell the person now, then wait.
            await call.start(200, _SSE_HEADERS)
            await call.write(notice.queued_chunk(route, dep.served_name, self._wait_of(dep.id)))
            try:
                ticket = await acq
            except OndemandError as err:
                return await answers.error_events(call, err.envelope())
            return await answers.after_notice(call, self.upstreams, ticket, path, body)
        finally:
            if ticket is not None:
                ticket.release()
            else:
                if not acq.done():
                    acq.cancel()
                _release_when_granted(acq)
