"""Flow control of one connection (ondemand/http/flow_control.py) on a real loopback
transport: reading resumes only when no reason to pause is left, and a writer waiting for the
transport to drain wakes when it resumes, or fails when the connection is lost. Through the
server (a slow client, a big body: test_cycle.py; pipelining: test_protocol.py) and through
the engine's connections (a slow reader: test_connection.py)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from ondemand.http.flow_control import BODY, PIPELINE, FlowControl


@contextlib.asynccontextmanager
async def transport():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    t, _ = await loop.create_connection(asyncio.Protocol, *server.sockets[0].getsockname()[:2])
    try:
        yield t
    finally:
        t.close()
        server.close()
        await server.wait_closed()


async def test_reading_resumes_only_when_every_reason_to_pause_is_gone():
    async with transport() as t:
        flow = FlowControl(t)
        flow.pause_reading(BODY)
        flow.pause_reading(PIPELINE)
        assert flow.read_paused and not t.is_reading()
        flow.resume_reading(BODY)
        assert flow.read_paused and not t.is_reading()  # the pipelined request still waits
        flow.resume_reading(BODY)  # a reason not held: nothing changes
        assert not t.is_reading()
        flow.resume_reading(PIPELINE)
        assert not flow.read_paused and t.is_reading()


async def test_a_writer_waits_while_writing_is_paused_and_goes_on_when_it_resumes():
    async with transport() as t:
        flow = FlowControl(t)
        await flow.drain()  # not paused: at once
        flow.pause_writing()
        assert not flow.writable
        writers = [asyncio.ensure_future(flow.drain()) for _ in range(2)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in writers)
        flow.resume_writing()
        await asyncio.wait_for(asyncio.gather(*writers), 5)  # both, on the one resume
        assert flow.writable


async def test_a_lost_connection_fails_its_waiting_writer_and_every_later_drain():
    async with transport() as t:
        flow = FlowControl(t)
        flow.pause_writing()
        writer = asyncio.ensure_future(flow.drain())
        await asyncio.sleep(0)
        flow.connection_lost()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(writer, 5)
        with pytest.raises(ConnectionResetError):
            await flow.drain()
        assert not flow.writable
        flow.pause_reading()  # a lost connection's transport is left alone
        flow.resume_reading()
        assert not flow.read_paused
