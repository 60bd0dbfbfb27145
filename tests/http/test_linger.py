"""What a client still sends after its answer (ondemand/http/linger.py), on real loopback
connections: the answer's end is a half-close (the client reads it all, then EOF), what follows
is dropped, and the connection closes at the first of its bounds (time or bytes). Through the
server, with httpx's whole-body-first sends: test_protocol.py, test_aio.py and test_hostile.py."""
from __future__ import annotations

import asyncio
import contextlib

from ondemand.http.limits import Limits
from ondemand.http.linger import Linger


class Ending(asyncio.Protocol):
    """A server connection that answers at once and ends: ``Linger.ending`` after the answer."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.linger: Linger | None = None
        self.dropped = 0
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        transport.write(b"the answer")
        self.linger = Linger.ending(transport, self.limits, asyncio.get_running_loop())

    def data_received(self, data):
        self.dropped += len(data)
        self.linger.dropped(len(data))

    def connection_lost(self, exc):
        self.linger.cancel()
        if not self.lost.done():
            self.lost.set_result(asyncio.get_running_loop().time())


@contextlib.asynccontextmanager
async def ending(limits: Limits):
    """(the server's protocol, the client's reader and writer)."""
    loop = asyncio.get_running_loop()
    made: list[Ending] = []
    server = await loop.create_server(lambda: made.append(Ending(limits)) or made[-1], "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    try:
        yield made, reader, writer
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_the_answer_arrives_whole_then_eof_and_what_follows_is_dropped_until_the_time_bound():
    async with ending(Limits(lingering_s=0.3)) as (made, reader, writer):
        assert await asyncio.wait_for(reader.read(), 5) == b"the answer"  # then EOF: half-closed
        t0 = asyncio.get_running_loop().time()
        writer.write(b"x" * 1000)  # the client's rest: read and dropped, not answered with a reset
        await writer.drain()
        lost_at = await asyncio.wait_for(made[0].lost, 5)
        assert made[0].dropped == 1000
        assert lost_at - t0 < 2  # closed at its time bound, not left open


async def test_past_its_byte_bound_the_connection_closes_at_once():
    async with ending(Limits(lingering_s=30, linger_max_bytes=4096)) as (made, reader, writer):
        assert await asyncio.wait_for(reader.read(), 5) == b"the answer"
        writer.write(b"x" * 4096)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            writer.write(b"x" * 64 * 1024)  # one byte past would do
            await writer.drain()
        await asyncio.wait_for(made[0].lost, 5)  # long before its 30 s
        assert made[0].dropped > 4096


async def test_a_closing_transport_does_not_linger():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    transport, _ = await loop.create_connection(asyncio.Protocol, *server.sockets[0].getsockname()[:2])
    try:
        transport.close()
        assert Linger.ending(transport, Limits(), loop) is None
    finally:
        server.close()
        await server.wait_closed()
