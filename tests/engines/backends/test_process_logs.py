"""The process backend's engine logs: the copier that reads the engine's pipe, rotation by
size (small limits through the constructor), and live followers across rotations. What every
backend's logs() does is test_backend_contract's."""
from __future__ import annotations

import asyncio
import logging
import os

import pytest
from helpers import wait_for

from ondemand.engines.backends.logs import RUN_MARKER, LogRun, RotatingLog, read_tail
from ondemand.engines.backends.process import ProcessBackend
from ondemand.model import Deployment

# Numbered lines of 40 bytes each ("line 000123 " padded), then exit 0.
LINES = ("import sys\n"
         "for i in range({n}): sys.stdout.write('line %06d '.ljust(39, 'x') % i + '\\n')\n"
         "sys.stdout.flush()\n")


def dep(n: int, name: str = "r") -> Deployment:
    return Deployment(id=1, name=name, served_name="m", engine="vllm",
                      command=("python", "-c", LINES.format(n=n)))


def kept(log_dir, name="r", keep=3) -> list[str]:
    """Every line of the kept files, oldest file first."""
    files = [log_dir / f"{name}.log.{i}" for i in range(keep, 0, -1)] + [log_dir / f"{name}.log"]
    return [line for f in files if f.exists() for line in f.read_text().splitlines()]


def numbers(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("line ")]


async def test_rotates_by_size_keeping_three_and_loses_no_line_in_between(tmp_path):
    b = ProcessBackend(tmp_path, log_max_bytes=4000, log_keep=3)
    try:
        engine = await b.start(dep(2000))  # 80 KB through a 4 KB file
        assert await asyncio.wait_for(b.wait_exit(engine), 20) == 0
    finally:
        await b.close()
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.glob("r.log*")) == ["r.log", "r.log.1", "r.log.2", "r.log.3"]
    for p in logs.glob("r.log*"):
        assert p.stat().st_size < 4000 + 60  # rotated at the first line end past the limit
        assert p.read_text().endswith("\n") and p.read_text().startswith(("line ", RUN_MARKER))
    got = numbers(kept(logs))
    assert got == list(range(got[0], 2000)), "a contiguous run of whole lines up to the last"
    assert len(got) >= 3 * 4000 // 40


async def test_a_new_run_starts_in_a_new_file_when_the_old_one_is_full(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "r.log").write_text("earlier\n" * 200)  # 1600 bytes: over the limit already
    b = ProcessBackend(tmp_path, log_max_bytes=1000, log_keep=2)
    try:
        engine = await b.start(dep(10))
        assert await asyncio.wait_for(b.wait_exit(engine), 20) == 0
    finally:
        await b.close()
    assert (logs / "r.log.1").read_text() == "earlier\n" * 200
    now = (logs / "r.log").read_text()
    assert now.startswith(RUN_MARKER) and numbers(now.splitlines()) == list(range(10))


async def test_a_follower_sees_every_line_across_rotations(tmp_path):
    b = ProcessBackend(tmp_path, log_max_bytes=2000, log_keep=1)
    slow = ("import sys, time\n"
            "for i in range(300):\n"
            "    sys.stdout.write('line %06d '.ljust(39, 'x') % i + '\\n'); sys.stdout.flush()\n"
            "    time.sleep(0.002) if i % 50 == 0 else None\n")
    d = Deployment(id=1, name="r", served_name="m", engine="vllm", command=("python", "-c", slow))
    try:
        engine = await b.start(d)
        out = b""
        async for chunk in b.logs(d, tail=10_000, follow=True):
            out += chunk
        assert await asyncio.wait_for(b.wait_exit(engine), 20) == 0
    finally:
        await b.close()
    assert numbers(out.decode().splitlines()) == list(range(300))  # only 2 files kept, all 300 seen
    assert numbers(kept(tmp_path / "logs", keep=1))[-1] == 299


async def test_a_follower_that_hangs_up_is_forgotten_and_the_engine_runs_on(tmp_path):
    b = ProcessBackend(tmp_path)
    d = Deployment(id=1, name="r", served_name="m", engine="vllm",
                   command=("python", "-c", "import time\nprint('up', flush=True)\ntime.sleep(30)"))
    try:
        engine = await b.start(d)
        stream = b.logs(d, tail=5, follow=True)
        assert b"up" in await asyncio.wait_for(stream.__anext__(), 10) or \
            b"up" in await asyncio.wait_for(stream.__anext__(), 10)
        assert b.followers("r") == 1
        await stream.aclose()
        assert b.followers("r") == 0
        assert engine.ref.returncode is None
        await b.stop(engine, 5)
        await asyncio.wait_for(b.wait_exit(engine), 10)
    finally:
        await b.close()


def test_read_tail_spans_files_newest_last(tmp_path):
    log = RotatingLog(tmp_path / "x.log", max_bytes=10, keep=2)
    for i in range(6):
        log.write(f"l{i}\n".encode())  # 3 bytes a line: a file holds four lines
    log.close()
    paths = [tmp_path / "x.log", tmp_path / "x.log.1", tmp_path / "x.log.2"]
    assert read_tail(paths, 3) == b"l3\nl4\nl5\n"
    assert read_tail(paths, 100) == b"l0\nl1\nl2\nl3\nl4\nl5\n"
    assert read_tail(paths, 0) == b""


def test_a_line_longer_than_the_limit_is_not_cut_until_it_ends(tmp_path):
    log = RotatingLog(tmp_path / "x.log", max_bytes=10, keep=1)
    log.write(b"0123456789abc")  # over the limit, mid-line
    log.write(b"def\n")  # the same line goes on in the same file
    log.write(b"next\n")  # a new line in a new file
    log.close()
    assert (tmp_path / "x.log.1").read_bytes() == b"0123456789abcdef\n"
    assert (tmp_path / "x.log").read_bytes() == b"next\n"


async def test_the_last_lines_of_an_engine_are_in_the_file_when_wait_exit_returns(tmp_path):
    b = ProcessBackend(tmp_path)
    try:
        engine = await b.start(dep(500))
        assert await asyncio.wait_for(b.wait_exit(engine), 20) == 0
        # No wait_for here: wait_exit itself waits for the copier.
        assert numbers((await b.log_tail(engine, dep(500), lines=1)).splitlines()) == [499]
    finally:
        await b.close()
    await wait_for(lambda: not b.tasks, what="no copier left")


async def test_a_log_that_cannot_be_written_is_said_once_a_minute_with_the_count(tmp_path, caplog):
    # /dev/full: every write fails with ENOSPC, as on a full disk (D5: one chatty engine put a
    # warning per chunk, 11,500 lines, into ondemand's own log).
    if not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full")
    (tmp_path / "r.log").symlink_to("/dev/full")

    class Counted(RotatingLog):
        writes = 0

        def write(self, data: bytes) -> None:
            Counted.writes += 1  # the copier's reads may join chunks: the count is of its writes
            super().write(data)
    now = [1000.0]
    run = LogRun(Counted(tmp_path / "r.log"), clock=lambda: now[0])
    follower = run.follow()
    pipe = asyncio.StreamReader()
    copier = asyncio.ensure_future(ProcessBackend._copy(pipe, run))

    async def feed(n: int) -> None:
        for i in range(n):
            pipe.feed_data(f"line {i}\n".encode())
            await asyncio.sleep(0)  # one read, one write each
    caplog.set_level(logging.WARNING, "ondemand.engines.backends.process")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot write the log" in r.getMessage()]
    await feed(500)
    assert len(said()) == 1 and "No space left on device" in said()[0] and "r.log" in said()[0]
    now[0] += 59.9
    await feed(100)
    assert len(said()) == 1  # still within the minute
    now[0] += 0.2
    await feed(1)
    assert Counted.writes > 2 and len(said()) == 2
    assert said()[1].endswith(f"({Counted.writes - 2} more since the last such line)"), said()
    pipe.feed_eof()
    await asyncio.wait_for(copier, 10)
    # The file lost them; the live reader did not (the copier drained the pipe to its end).
    out = b"".join([c async for c in follower.chunks()])
    assert out.count(b"\n") == 601 and run.ended
