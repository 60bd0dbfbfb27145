"""A request's admission (ondemand/control/): the controller alone refuses, and what it lets in
gets a ticket with the deployment, its engine's address and its slot, all read in the one step
of the verdict. The core's rules on core_doubles' recording fake and virtual clock; the
same against a real deployer and engines; and through the gateway, where the deployment changes
while a request's body is still on its way."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import orjson
import pytest
from core_doubles import Clock, Effects, Req, make, start
from helpers import controller_env, wait_for

from ondemand.control.ticket import Waits, Want
from ondemand.control.verdicts import Refusal
from ondemand.model import Mode, Role, State


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def refusal(c, dep_id: int, want: Want) -> Refusal:
    with pytest.raises(Refusal) as exc:
        c.admit(dep_id, want)
    return exc.value


# --- the ticket: the deployment as read in the step of the verdict ------------------------

def test_a_ticket_carries_the_deployment_as_read_in_the_step_of_the_grant(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    ticket = c.admit(1, Want.TRAFFIC)
    assert ticket.waits is None and ticket.holds_slot and c.inflight(1) == 1 and ticket.dep is fx.deps[1]
    # Changed since: the next ticket has the deployment as it is now; the one out keeps what it
    # was given (a value, never looked up again), and gives its slot back once.
    fx.set(1, max_inflight=5)
    later = c.admit(1, Want.TRAFFIC)
    assert later.dep is fx.deps[1] and later.dep.max_inflight == 5 and ticket.dep.max_inflight is None
    ticket.release()
    ticket.release()
    later.release()
    assert c.inflight(1) == 0 and not ticket.holds_slot


def test_a_ticket_that_waits_holds_nothing_and_the_grant_reads_the_deployment_again(world):
    c, fx, clock = make(world)
    fx.add(1)
    first = c.admit(1, Want.TRAFFIC)
    assert first.waits is Waits.START and not first.holds_slot and first.dep.state is State.STOPPED
    assert c.inflight(1) == 0 and c.waiting() == 0 and fx.taken("admit") == []  # took nothing, joined nothing
    r = Req(c, 1)
    start(fx, c, 1)
    ticket = r.take()
    assert ticket.dep is fx.deps[1] and ticket.dep.state is State.READY and ticket.holds_slot
    r.leave()
    ticket.release()
    assert c.inflight(1) == 0


def test_a_deployment_removed_before_the_grant_gives_no_ticket(world):
    c, fx, clock = make(world)
    fx.add(1)
    r = Req(c, 1)
    fx.remove(1)
    assert r.code() == "not_found"
    no = refusal(c, 1, Want.TRAFFIC)
    assert (no.status, no.code, no.message, no.deployment) == (404, "not_found", "Not found", "")


def test_a_drained_deployment_lets_nobody_in_until_the_drain_ends(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY)
    drained = []
    c.drain(1, lambda: drained.append(1))
    ticket = c.admit(1, Want.TRAFFIC)
    assert ticket.waits is Waits.DRAIN and not ticket.holds_slot and c.inflight(1) == 0


def test_an_always_on_deployment_and_a_models_route_are_let_in_without_a_slot(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, mode=Mode.ALWAYS_ON)
    fx.add(2, state=State.READY)
    for dep_id, want in ((1, Want.TRAFFIC), (2, Want.MODEL), (2, Want.LIST), (2, Want.HEALTH)):
        ticket = c.admit(dep_id, want)
        assert ticket.waits is None and not ticket.holds_slot and ticket.dep is fx.deps[dep_id], (dep_id, want)
    assert c.inflight(1) == c.inflight(2) == 0 and c.status(1)["last_request_at"] is None


# --- the refusals, in the order of the gateway's checks ------------------------------------

# (what the deployment is, what the request wants) -> the refusal's code, or what it is given
SCREEN = [
    (dict(state=State.STOPPED, role=Role.DECISION, mode=Mode.ALWAYS_ON), Want.LIST, "not_on_demand"),
    (dict(state=State.PLANNED), Want.LIST, "ticket"),  # the list is answered from the record
    (dict(state=State.PLANNED), Want.MODEL, "ondemand_planned"),
    (dict(state=State.PLANNED), Want.HEALTH, "ondemand_planned"),
    (dict(state=State.PLANNED), Want.TRAFFIC, "ondemand_planned"),
    (dict(state=State.ASLEEP), Want.MODEL, "ondemand_not_ready"),
    (dict(state=State.FAILED), Want.HEALTH, "ticket"),  # a health check is answered in every state
    (dict(state=State.STOPPED, mode=Mode.ALWAYS_ON), Want.HEALTH, "ticket"),
    (dict(state=State.STOPPED, mode=Mode.ALWAYS_ON), Want.TRAFFIC, "not_on_demand"),
    (dict(state=State.STOPPED, mode=Mode.ALWAYS_ON, pending_mode=Mode.ALWAYS_ON), Want.TRAFFIC, "waits"),
    (dict(state=State.STOPPED), Want.TRAFFIC, "waits"),
]


@pytest.mark.parametrize("fields, want, given", SCREEN)
def test_the_refusals_that_need_no_wait_come_in_the_order_of_the_checks(world, fields, want, given):
    c, fx, clock = make(world)
    fx.add(1, **fields)
    if given in ("ticket", "waits"):
        ticket = c.admit(1, want)
        assert (ticket.waits is not None) == (given == "waits") and not ticket.holds_slot
        assert c.screen(1, want) is fx.deps[1]
        return
    for no in (refusal(c, 1, want), pytest.raises(Refusal, c.screen, 1, want).value):
        # Named for the request's records, and met before its body is read.
        assert no.code == given and no.deployment == "d1" and no.before_body
    assert c.inflight(1) == 0 and c.waiting() == 0 and fx.taken("admit") == []


def test_busy_is_refused_in_the_step_that_would_grant(world):
    c, fx, clock = make(world)
    fx.add(1, state=State.READY, max_inflight=1)
    held = c.admit(1, Want.TRAFFIC)
    no = refusal(c, 1, Want.TRAFFIC)
    assert no.code == "ondemand_busy" and no.deployment == "d1" and not no.before_body  # its body was read
    assert c.inflight(1) == 1 and c.busy_total(1) == 1
    held.release()


# --- against the real deployer: the address of the engine that runs now --------------------

@contextlib.contextmanager
def _taken(base_url: str):
    """The port of ``base_url`` bound by someone else (nobody listens there): an engine started
    now gets another one, and a request sent to the old address is refused."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old engine's TIME_WAIT
        s.bind(("127.0.0.1", int(base_url.rsplit(":", 1)[1])))
        yield


async def test_a_ticket_has_the_address_of_the_engine_running_at_its_grant(tmp_path, store):
    async with controller_env(tmp_path, store) as env:
        a = await env.add("a", 10)
        always = await env.add("b", 10, mode="always_on")
        async with await env.acquire(a) as ticket:  # waited for its start: the address at the grant
            assert ticket.base == env.deployer.base_url(a) and ticket.dep.state is State.READY
            first = ticket.base
        async with await env.acquire(a) as ticket:  # ready: the address in the step of the verdict
            assert ticket.base == first
        await env.deployer.stop(a)
        assert env.admission.admit(a, Want.TRAFFIC).base is None  # it waits: no address to go to
        with _taken(first):
            async with await env.acquire(a) as ticket:  # started again, on another port
                assert ticket.base == env.deployer.base_url(a) != first
        await env.deployer.restart(always)
        ticket = env.admission.admit(always, Want.TRAFFIC)
        assert ticket.base == env.deployer.base_url(always) and not ticket.holds_slot
        assert env.admission.admit(a, Want.MODEL).base == env.deployer.base_url(a)
        assert env.admission.admit(a, Want.LIST).base is None  # answered from the record
        assert env.controller.inflight(a) == env.controller.inflight(always) == 0


# --- through the gateway: the deployment changes while the body is on its way ---------------

CHAT = orjson.dumps({"model": "A", "messages": [{"role": "user", "content": "hello"}]})


def _port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


def _head(server, dep_id: int, body: bytes = CHAT) -> bytes:
    return (f"POST /dgxmm/ondemand/{dep_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n").encode()


async def _status(reader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    length = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")]
    return int(head.split(b" ")[1]), await reader.readexactly(length[0]) if length else b""


@contextlib.asynccontextmanager
async def _body_on_its_way(server, dep_id: int):
    """A request whose head is in and past the refusals: the gateway asked for its body (100)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    try:
        writer.write(_head(server, dep_id))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        yield reader, writer
    finally:
        writer.close()


async def _forwarded(server, dep_id: int) -> list:
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep_id) + "/_sim/requests") as r:
        return [x for x in await r.json() if x["path"] == "/v1/chat/completions"]


async def test_restarted_on_a_new_address_while_the_body_arrives_it_is_forwarded_to_the_new_engine(server):
    a = await server.add("a")
    await server.deployer.restart(a)
    old = server.deployer.base_url(a)
    async with _body_on_its_way(server, a) as (reader, writer):
        await server.deployer.stop(a)
        with _taken(old):
            await server.deployer.restart(a)  # a new engine, on another port
            assert server.deployer.base_url(a) != old and server.state(a) == "ready"
            writer.write(CHAT)
            status, _ = await _status(reader)  # the old address would refuse it: 502
    assert status == 200 and len(await _forwarded(server, a)) == 1  # the new engine answered it
    assert server.controller.inflight(a) == 0


async def test_removed_while_the_body_arrives_it_is_404_and_nothing_is_forwarded(server):
    a = await server.add("a")
    await server.deployer.restart(a)
    async with _body_on_its_way(server, a) as (reader, writer):
        await server.deployer.remove(a)
        writer.write(CHAT)
        status, body = await _status(reader)
    assert status == 404 and orjson.loads(body)["error"]["code"] == "not_found"
    assert server.controller.inflight(a) == 0 and server.controller.waiting() == 0


async def test_stopped_while_the_body_arrives_it_waits_for_the_start_it_makes(server):
    a = await server.add("a")
    await server.deployer.restart(a)
    async with _body_on_its_way(server, a) as (reader, writer):
        await server.deployer.stop(a)
        writer.write(CHAT)
        status, _ = await _status(reader)
        assert status == 200 and server.state(a) == "ready"
    await wait_for(lambda: server.controller.inflight(a) == 0, what="the slot given back")


async def test_a_refused_request_is_answered_before_its_body_is_asked_for(server):
    """Planned, and an always-on deployment not ready: refused at once, no 100 Continue."""
    planned = await server.add("p", state="planned")
    always = await server.add("ao", mode="always_on")
    for dep_id, code in ((planned, "ondemand_planned"), (always, "not_on_demand")):
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
        try:
            writer.write(_head(server, dep_id))
            status, body = await _status(reader)
            assert status == 503 and orjson.loads(body)["error"]["code"] == code
        finally:
            writer.close()
