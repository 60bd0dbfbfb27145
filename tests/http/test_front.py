"""ondemand/http/front.py: ``Route`` and ``Front``, a lean front served on loopback by the event
loop's own server with a handler of the test's (no aiohttp, no ondemand app around it): the route's
prefix, its requests handed to the handler with the front's Server line, a target outside it
refused when there is no hand-off, the peer policy at the accept on a gateway-only front (and
none on a front that hands off), and a connection's seat in the count of open ones."""
import asyncio

from helpers import wait_for
from raw_http import parse_answers

from ondemand.http.front import Front, Route
from ondemand.http.limits import Limits


async def serve(route: Route, hand_off=None):
    front = Front(route, Limits(), hand_off, server="front-test/1")
    server = await asyncio.get_running_loop().create_server(front, "127.0.0.1", 0)
    return front, server, server.sockets[0].getsockname()[1]


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_a_routes_prefix_is_one_path_segment_with_or_without_its_slash():
    async def handle(call):
        pass
    assert Route("/dgxmm/ondemand", handle, lambda: 1).prefix == b"/dgxmm/ondemand/"
    assert Route("/dgxmm/ondemand/", handle, lambda: 1).prefix == b"/dgxmm/ondemand/"
    assert Route("/", handle, lambda: 1).prefix == b"/"


async def test_the_routes_requests_reach_its_handler_and_anything_else_is_refused():
    seen = []

    async def handle(call):
        seen.append((call.method, call.raw_path))
        await call.send(200, {"Content-Type": "text/plain"}, b"hello", close=True)
    front, server, port = await serve(Route("/gw", handle, lambda: 1024))
    try:
        [(status, headers, body)] = parse_answers(await exchange(port, b"GET /gw/a?b=1 HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert (status, body) == (200, b"hello") and headers["server"] == "front-test/1"
        assert seen == [("GET", "/gw/a?b=1")]
        for target in (b"/gwx", b"/gw", b"/other/a"):  # "/gw" alone or a longer segment: outside
            [(status, headers, _)] = parse_answers(await exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert status == 404 and headers["connection"] == "close", target
        assert len(seen) == 1
        await wait_for(lambda: front.open.total == 0 and not front.connections, what="every connection closed")
    finally:
        server.close()
        await server.wait_closed()


async def test_the_peer_policy_closes_at_the_accept_on_a_front_that_hands_nothing_off():
    async def handle(call):
        await call.send(204, {}, b"")
    refused = Route("/gw", handle, lambda: 1024, allows=lambda ip: ip != "127.0.0.1")
    front, server, port = await serve(refused)
    try:
        assert await exchange(port, b"GET /gw/a HTTP/1.1\r\nHost: x\r\n\r\n") == b""  # closed, nothing answered
        assert front.open.total == 0 and not front.connections
    finally:
        server.close()
        await server.wait_closed()
    # A front that hands off to aiohttp serves the admin API too: the policy is not for it.
    handing_off = Front(refused, Limits(), lambda: None, server="x")
    assert handing_off.hand_off and handing_off.allows is None


async def test_an_accepted_connection_holds_its_seat_until_it_ends():
    release = asyncio.Event()

    async def handle(call):
        await release.wait()
        await call.send(200, {}, b"ok", close=True)
    front, server, port = await serve(Route("/gw", handle, lambda: 1024))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /gw/a HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_for(lambda: front.connections, what="the connection accepted")
        assert front.open.total == 1 and len(front.connections) == 1
        release.set()
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"ok")
        await wait_for(lambda: front.open.total == 0, what="the seat given back")
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
