#!/usr/bin/env python3
"""A relay of bytes, for the benchmark's side-by-side only (not part of ondemand).

The floor of any proxy in Python on this loop: each client connection gets a connection of its
own to the engine, and bytes go across both ways as they come (uvloop, one ``asyncio.Protocol``
a side), with no HTTP at all: no parsing, no headers rule, no chunked framing, no checks. What
the gateway costs above it is its HTTP and its checks; what it costs beside direct is the
loopback hop itself. Flow control: a side whose peer's write buffer is full stops reading.

    python3 scripts/byte_relay.py --port 9000 --upstream http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import asyncio
import socket
from urllib.parse import urlsplit

import uvloop


class Side(asyncio.Protocol):
    """One end of the relay; ``peer`` is the other end once both are connected."""

    def __init__(self, peer: Side | None = None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []  # what the client sent before the engine connection was up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    # the peer's write buffer is this side's to respect
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def main(port: int, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    up = urlsplit(upstream)
    host, up_port = up.hostname or "127.0.0.1", up.port or 80

    class Client(Side):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            loop.create_task(self.connect())

        async def connect(self) -> None:
            try:
                _, engine = await loop.create_connection(lambda: Side(self), host, up_port)
            except OSError:
                if self.transport is not None:
                    self.transport.close()
                return
            self.peer = engine
            if self.transport is None:  # the client left meanwhile
                engine.transport.close()  # type: ignore[union-attr]
                return
            for data in self.early:
                engine.transport.write(data)  # type: ignore[union-attr]
            self.early.clear()

    server = await loop.create_server(Client, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the engine's base URL, http://host:port")
    args = ap.parse_args()
    uvloop.run(main(args.port, args.upstream))
