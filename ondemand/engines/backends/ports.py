"""The ports the process backend gives its engines (and the tests their servers).

A port is free when it binds; but the engine binds it later, when it has started, and in that
window another picker could take it. Two rules close the window:

- Ports are drawn from below the kernel's ephemeral range: a port the kernel hands out (a bind to
  0, or the local end of any outgoing connection) is never one an engine is about to bind.
- A picked port is reserved for ``RESERVE_S`` against the other pickers of this user on this host
  (another ondemand, a test suite's other workers, this very process) by an ``flock`` on a file
  of its own in a directory they share. Once the engine has bound it, its bind keeps it: a bound
  port fails the pick's own bind test. Without the reservation, two workers of a busy test run
  picked the same port within a few hundred milliseconds; one engine could not bind, and its
  start was checked against the other's engine ("the engine serves A, not a").

The process backend ends a reservation as soon as its engine accepts a connection on the port,
or is gone: it holds no file for a running engine. The reservation is best effort: where the
directory cannot be made, a pick is as before.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ENGINE_PORTS_FROM = 20000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Long enough for an engine to bind its port (vLLM and llama.cpp bind it before they load the
# model); a port left unbound that long is free to be picked again.
RESERVE_S = 120.0
TRIES = 64


def ephemeral_start(path: Path = EPHEMERAL) -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class Reservations:
    """The ports this process has picked and holds: an open file each, locked (``flock``, which
    another open of the same file cannot take, in this process or another), until its time."""

    def __init__(self, directory: Path | None = None, hold_s: float = RESERVE_S) -> None:
        self.directory = directory or Path(tempfile.gettempdir()) / f"ondemand-ports-{os.getuid()}"
        self.hold_s = hold_s
        self._held: dict[int, tuple[int, float]] = {}  # port -> (its locked file, until: monotonic)

    def take(self, port: int) -> bool | None:
        """Reserve ``port``: True, False when another picker holds it, None when reservations
        cannot be made here (the pick goes on without)."""
        self._lapse()
        try:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(self.directory / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[port] = (fd, time.monotonic() + self.hold_s)
        return True

    def holds(self, port: int) -> bool:
        return port in self._held

    def release(self, port: int) -> None:
        held = self._held.pop(port, None)
        if held is not None:
            os.close(held[0])

    def _lapse(self) -> None:
        now = time.monotonic()
        for port in [p for p, (_, until) in self._held.items() if until <= now]:
            self.release(port)

    def close(self) -> None:
        for port in list(self._held):
            self.release(port)


RESERVED = Reservations()


def free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None,
              reservations: Reservations | None = None) -> int:
    """A port free on ``host`` now, for an engine to bind, reserved for a while: a random one below
    the ephemeral range that no other picker holds and that binds (the first of 64 tries), else
    one the kernel picks."""
    held = reservations or RESERVED
    top = ephemeral_start()
    pick = rng or random.SystemRandom()
    if top - ENGINE_PORTS_FROM >= 1024:
        for _ in range(TRIES):
            port = pick.randrange(ENGINE_PORTS_FROM, top)
            if held.take(port) is False:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    held.release(port)
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        kernel: int = s.getsockname()[1]
        return kernel


async def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host``:``port``: a connection opened and closed at once (on
    loopback, microseconds; reading /proc/net/tcp cost about 9 ms of CPU with a busy test run's
    thousand sockets in it, at every poll of every start)."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def release_when_bound(port: int, running: Callable[[], bool], reservations: Reservations | None = None,
                             every_s: float = 0.2) -> None:
    """End ``port``'s reservation once something listens on it (that bind keeps it from the other
    pickers now), once its engine is gone (``running()`` False), or at the reservation's lapse."""
    held = reservations or RESERVED
    loop = asyncio.get_running_loop()
    until = loop.time() + held.hold_s
    try:
        while running() and loop.time() < until:  # polled: the kernel tells no one of a bind
            if await listening(port):
                break
            await asyncio.sleep(every_s)
    finally:
        held.release(port)
