"""An engine answer's body (``ondemand/http/body.py``): reads told once, flow control, and the
pipe that hands a read straight to the client while the gateway's pump waits. The source is
the engine connection's side (pause and resume reading), recorded here; the rest is the real
class on the running loop."""
import asyncio

import pytest

from ondemand.http.body import Body, PayloadError


class Source:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False


class Sink:
    """The client's side of the pipe: takes a read when ``open``, as Call.write_now does."""
    def __init__(self, open: bool = True) -> None:
        self.open = open
        self.got: list[bytes] = []

    def __call__(self, data: bytes) -> bool:
        if self.open:
            self.got.append(data)
        return self.open


async def _waiting(body: Body) -> asyncio.Task[bytes]:
    """A reader parked in readany (as the pump is between reads)."""
    reader = asyncio.ensure_future(body.readany())
    await asyncio.sleep(0)
    assert not reader.done()
    return reader


async def test_a_read_is_one_part_and_wakes_the_reader_once():
    body = Body(Source(), 64)
    reader = await _waiting(body)
    body.arrived([b"data: 1\n\n", b"data: 2\n\n"])  # two chunks of one engine read
    assert await reader == b"data: 1\n\ndata: 2\n\n"


async def test_while_the_reader_waits_a_read_goes_to_the_sink_and_the_reader_sleeps_on():
    body, sink = Body(Source(), 64), Sink()
    body.pipe(sink)
    reader = await _waiting(body)
    body.arrived([b"a", b"b"])
    body.arrived([b"c"])
    await asyncio.sleep(0)
    assert sink.got == [b"ab", b"c"] and not reader.done() and body.buffered == 0
    body.feed_eof()
    assert await reader == b""  # the end still comes through the reader


async def test_a_read_the_sink_refuses_wakes_the_reader_with_it():
    body, sink = Body(Source(), 64), Sink(open=False)  # the client's buffer is full, or it is gone
    body.pipe(sink)
    reader = await _waiting(body)
    body.arrived([b"x", b"y"])
    assert sink.got == [] and await reader == b"xy"


async def test_no_sink_while_the_reader_is_busy_so_order_holds():
    """A read that comes while the reader still writes the one before (it is not waiting)
    queues behind it, whatever the sink would take: the client gets the bytes in order."""
    body, sink = Body(Source(), 64), Sink(open=False)
    body.pipe(sink)
    reader = await _waiting(body)
    body.arrived([b"1"])            # refused: the reader is woken with it
    sink.open = True                # the client drained meanwhile
    body.arrived([b"2"])            # the reader has not run yet: queued, not piped
    assert sink.got == []
    assert await reader == b"12"
    reader = await _waiting(body)   # waiting again: now the pipe takes the next read
    body.arrived([b"3"])
    assert sink.got == [b"3"] and not reader.done()
    reader.cancel()


async def test_pipe_none_ends_the_pipe():
    body, sink = Body(Source(), 64), Sink()
    body.pipe(sink)
    body.pipe(None)
    reader = await _waiting(body)
    body.arrived([b"z"])
    assert sink.got == [] and await reader == b"z"


async def test_a_cancelled_reader_is_no_longer_waiting():
    """The pump cancelled (the client hung up) leaves no reader behind: a later read is
    queued, not piped to a client that is gone."""
    body, sink = Body(Source(), 64), Sink()
    body.pipe(sink)
    reader = await _waiting(body)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    body.arrived([b"late"])
    assert sink.got == [] and body.buffered == 4


async def test_reading_pauses_past_the_high_water_mark_and_resumes_below_the_low():
    source = Source()
    body = Body(source, 4)  # high: 8
    body.pipe(Sink(open=False))
    body.arrived([b"12345"])
    assert not source.paused
    body.arrived([b"6789"])
    assert source.paused and body.buffered == 9
    assert await body.read(6) == b"123456" and source.paused is False  # 3 left: under the low mark


async def test_what_arrived_before_the_engine_broke_off_comes_first():
    body = Body(Source(), 64)
    body.arrived([b"last words"])
    body.set_exception(PayloadError("cut"))
    assert await body.readany() == b"last words"
    with pytest.raises(PayloadError):
        await body.readany()


async def test_take_now_and_read_now():
    body = Body(Source(), 64)
    assert body.take_now() == b""
    body.arrived([b"he", b"ad"])
    assert body.take_now() == b"head" and body.take_now() == b""
    body.arrived([b"rest"])
    body.feed_eof()
    assert body.read_now() == b"rest" and body.at_eof()
