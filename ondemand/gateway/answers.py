"""The answer kinds: how a let-in request's answer comes from its engine to its client. Each
owns its exchange with the engine (``_exchange``: the request on the deployment's pool, to
the ticket's upstream target; the answer's connection given back when read to its end, else
closed, which stops the engine's generation):

- ``plain``: the engine's answer as it is: whole when it is here already, else streamed read by
  read (BEHAVIOUR.md, "Forwarding");
- ``prepended``: a non-streaming answer of a request that queued for memory, with the queued
  notice in front of its text (a 200 JSON answer; any other goes as ``plain``);
- ``after_notice``: the engine's SSE bytes after the queued notice that the gateway streamed
  already; whatever goes wrong then (an engine not reached, an error answer, an answer broken
  off) arrives as SSE error events, since the answer's head went out with the notice.

An engine not reached before any of its answer went out is 502 ``ondemand_upstream_error``.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ..control.admission import Ticket
from ..errors import OndemandError
from ..http.cycle import Call
from ..http.forward import request_lines, response_lines
from ..http.limits import READ_SIZE
from ..http.pool import PayloadError, UpstreamError, Upstreams
from ..http.pool import Response as UpstreamResponse
from . import notice

JSON = "application/json"
_ENGINES: dict[str, str] = {}  # an engine's answer: its own header lines only (forward.response_lines)
_EMPTY_BODY = frozenset({204, 304})

Answer = Callable[[Call, UpstreamResponse], Awaitable[None]]


def unreachable(why: str) -> OndemandError:
    return OndemandError(502, "ondemand_upstream_error", f"The engine could not be reached: {why}")


def plain(call: Call, upstreams: Upstreams, ticket: Ticket, path: str, body: bytes | None) -> Awaitable[None]:
    """The engine's answer as it is (no coroutine of its own: the hot path's)."""
    return _exchange(call, upstreams, ticket, path, body, relay)


async def prepended(call: Call, upstreams: Upstreams, ticket: Ticket, path: str, body: bytes,
                    route: str, wait: notice.Wait) -> None:
    """A non-streaming answer with the queued notice in front of its text."""
    async def with_notice(call: Call, up: UpstreamResponse) -> None:
        if up.status != 200 or up.content_type != JSON:
            return await relay(call, up)
        try:
            raw = await up.read()
        except PayloadError as exc:
            raise unreachable(f"the engine broke off its answer: {exc}") from None
        data = notice.prepend(route, raw, ticket.dep.served_name, wait)
        await call.send(200, _ENGINES, data, lines=response_lines(up.raw_headers))
    await _exchange(call, upstreams, ticket, path, body, with_notice)


async def after_notice(call: Call, upstreams: Upstreams, ticket: Ticket, path: str, body: bytes) -> None:
    """The engine's SSE bytes after the queued notice (the answer's head is out already)."""
    try:
        await _exchange(call, upstreams, ticket, path, body, into_stream)
    except OndemandError as err:  # the engine was not reached: nothing of it went out
        await error_events(call, err.envelope())


async def _exchange(call: Call, upstreams: Upstreams, ticket: Ticket, path: str, body: bytes | None,
                    answer: Answer) -> None:
    """The request to the ticket's engine, and ``answer`` given its answer's head."""
    base = ticket.base
    if base is None:
        raise unreachable("the engine has no address")
    lease = upstreams.open(ticket.dep.id, base)
    try:
        try:
            up = await lease.request(call.method, path, request_lines(call.raw_headers, call.rid), body)
        except (UpstreamError, ValueError) as exc:
            raise unreachable(f"the engine did not answer: {exc}") from None
        try:
            await answer(call, up)
        finally:
            up.release()  # back to the pool when read to the end, else closed (the engine stops)
    finally:
        lease.end()


async def relay(call: Call, up: UpstreamResponse) -> None:
    """The engine's answer to the client: whole when it is here already, else streamed."""
    content = up.content
    if content.is_eof() and call.method != "HEAD" and up.status not in _EMPTY_BODY:
        # The whole answer is here already (a short one usually is): head and body in one write.
        return await call.send(up.status, _ENGINES, content.read_now(), reason=up.reason,
                               lines=response_lines(up.raw_headers))
    # What came with the head goes out with ours (one write, not two); the rest as it comes.
    await call.start(up.status, _ENGINES, reason=up.reason, length=up.content_length,
                     lines=response_lines(up.raw_headers), body=content.take_now())
    if call.method == "HEAD":
        return await call.end()
    await pump(call, up)


async def into_stream(call: Call, up: UpstreamResponse) -> None:
    """The engine's SSE bytes after the queued notice; an engine error becomes an SSE error."""
    if up.status == 200:
        return await pump(call, up)
    raw = b""
    content = up.content
    try:
        while len(raw) < READ_SIZE and not content.at_eof():  # read() gives what arrived, not all
            raw += await content.read(READ_SIZE - len(raw))
    except PayloadError as exc:
        return await error_events(call, unreachable(f"the engine broke off its answer: {exc}").envelope())
    try:
        error = orjson.loads(raw)
        if not isinstance(error, dict) or "error" not in error:
            raise ValueError
    except ValueError:
        error = {"error": {"message": raw.decode("utf-8", "replace")[:2000] or f"engine answered {up.status}",
                           "type": "server_error", "code": up.status}}
    await error_events(call, error)


async def error_events(call: Call, error: dict[str, Any]) -> None:
    """An error in an SSE answer already begun: its event, then the stream's end."""
    await call.write(notice.error_events(error))
    await call.end()


async def pump(call: Call, up: UpstreamResponse) -> None:
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
