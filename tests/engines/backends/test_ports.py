"""The ports the process backend gives its engines (ondemand/engines/backends/ports.py): drawn
below the kernel's ephemeral range, reserved against the other pickers (this process's, another
process's) until the engine binds the port, its engine is gone or the hold lapses. Real sockets
on 127.0.0.1 and real ``flock``s; the process backend's own use of them (a running engine holds
no reservation, a cancelled start releases its port) is test_backend_contract.py's."""
from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys

from helpers import wait_for

from ondemand.engines.backends import ports


def test_engine_ports_are_drawn_below_the_kernels_ephemeral_range(tmp_path):
    """The process backend's port for an engine binds, and lies below the ephemeral range, where
    neither a bind to 0 nor an outgoing connection's local end can take it before the engine
    binds it (a busy-core run lost a start to that: the engine's port answered as another's)."""
    top = ports.ephemeral_start()
    picked = {ports.free_port(rng=random.Random(seed)) for seed in range(20)}
    assert all(ports.ENGINE_PORTS_FROM <= p < top for p in picked) and len(picked) > 1
    held = socket.socket()
    held.bind(("127.0.0.1", ports.free_port(rng=random.Random(1))))  # taken: the pick goes on
    try:
        assert ports.free_port(rng=random.Random(1)) != held.getsockname()[1]
    finally:
        held.close()
    squeezed = tmp_path / "range"
    squeezed.write_text("20100\t60999\n")  # the range as the kernel writes it
    assert ports.ephemeral_start(squeezed) == 20100
    assert ports.ephemeral_start(tmp_path / "missing") == 32768


def test_a_picked_port_is_reserved_against_other_pickers_until_it_lapses(tmp_path):
    """Two pickers that draw the same port before either engine binds it: the second, in this
    process or another, gets another port (a busy-core run lost a start to that: two workers'
    engines on one port, one start checked against the other's engine). The reservation lapses."""
    held = tmp_path / "held"
    mine, theirs, later = (ports.Reservations(held, hold_s=60) for _ in range(3))
    lapsing = ports.Reservations(held, hold_s=0)
    try:
        first = ports.free_port(rng=random.Random(3), reservations=mine)
        assert ports.free_port(rng=random.Random(3), reservations=theirs) != first
        other = subprocess.run(
            [sys.executable, "-c", "import random, pathlib; from ondemand.engines.backends import ports; "
             "print(ports.free_port(rng=random.Random(3), "
             f"reservations=ports.Reservations(pathlib.Path({str(held)!r}))))"],
            capture_output=True, text=True, check=True, timeout=30)
        assert int(other.stdout) != first
        mine.close()  # released (or lapsed): the port is anyone's again
        assert ports.free_port(rng=random.Random(3), reservations=later) == first
        later.close()
        assert ports.free_port(rng=random.Random(3), reservations=lapsing) == first
        assert ports.free_port(rng=random.Random(3), reservations=lapsing) == first  # its own, lapsed: taken again
    finally:
        for r in (mine, theirs, later, lapsing):
            r.close()
    unmade = ports.Reservations(tmp_path / "file" / "held")
    (tmp_path / "file").write_text("")  # the directory cannot be made: a pick as before
    assert ports.free_port(rng=random.Random(3), reservations=unmade) == first


async def test_a_reservation_ends_once_its_port_listens_its_engine_is_gone_or_it_lapses():
    """``release_when_bound``: a picked port stays reserved while nothing listens on it and its
    engine runs, and the reservation ends as soon as something listens there (``listening``:
    that bind keeps the port from the other pickers now), as soon as its engine is gone
    (``running()`` False), and at the latest when the hold lapses. Reserved where every picker
    of this user looks, so no other worker's engine is given the ports bound here."""
    held, other = ports.Reservations(hold_s=60), ports.Reservations(hold_s=60)
    lapsing = ports.Reservations(hold_s=0.3)  # for a port never bound by an engine that runs on
    polls = 0

    def running(alive: list[bool]):
        def ask() -> bool:
            nonlocal polls
            polls += 1
            return alive[0]
        return ask

    async def watched(port: int, alive: list[bool], reservations: ports.Reservations) -> asyncio.Task:
        """The watch of ``port``, once it has polled a few times: still reserved then."""
        start = polls
        watch = asyncio.ensure_future(ports.release_when_bound(port, running(alive), reservations, every_s=0.01))
        await wait_for(lambda: polls >= start + 3 or watch.done(), what="the watch's polls")
        assert not watch.done() and reservations.holds(port) and other.take(port) is False
        return watch

    server = None
    try:
        port = ports.free_port(reservations=held)
        assert not await ports.listening(port)
        watch = await watched(port, [True], held)
        server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", port)
        await asyncio.wait_for(watch, 5)  # it listens: released, long before the 60 s hold
        assert await ports.listening(port) and not held.holds(port)
        assert other.take(port) is True  # anyone's to reserve again (its bind keeps it now)
        other.release(port)

        port, alive = ports.free_port(reservations=held), [True]
        watch = await watched(port, alive, held)
        alive[0] = False  # its engine is gone before it bound the port
        await asyncio.wait_for(watch, 5)
        assert not held.holds(port) and other.take(port) is True
        other.release(port)

        port = ports.free_port(reservations=lapsing)  # never bound, still running: the hold lapses
        watch = await watched(port, [True], lapsing)
        await asyncio.wait_for(watch, 5)
        assert not lapsing.holds(port) and not await ports.listening(port)
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
        for r in (held, other, lapsing):
            r.close()
