"""The caps on open connections (ondemand/http/caps.py): at a cap the connection idle longest
gives way to a new one, and a new one is refused only when every connection holds a whole
request in progress (issue 40: two addresses holding 2,048 idle connections each kept
LiteLLM, /healthz and the admin API out). The rules on their own first, then floods of
silent, refused and slow connections from several loopback addresses against a whole server,
on one listener and with ``admin_listen``, bounded to a few dozen connections and seconds."""
import asyncio
import contextlib

from helpers import free_port, run_app, wait_for

from ondemand.http.caps import UNCOUNTED, OpenConnections
from ondemand.http.limits import Limits


class Conn:
    def __init__(self, name: str):
        self.name = name
        self.gave_way = False

    def give_way(self) -> None:
        self.gave_way = True


def test_at_max_connections_the_connection_idle_longest_gives_way():
    caps, limits = OpenConnections(), Limits(max_connections=3, max_connections_per_peer=3)
    a, b, c = Conn("a"), Conn("b"), Conn("c")
    seats = {conn.name: caps.admit(peer, limits, conn) for conn, peer in ((a, "10.0.0.1"), (b, "10.0.0.2"),
                                                                         (c, "10.0.0.1"))}
    seats["a"].busy = True   # a request ...
    seats["a"].rest()        # ... answered: a is now the newest idle
    seats["b"].busy = True   # b holds a request in progress
    d = Conn("d")
    assert caps.admit("10.0.0.3", limits, d) is not None
    assert (a.gave_way, b.gave_way, c.gave_way) == (False, False, True)  # c: idle longest, not busy b
    assert (caps.total, caps.count("10.0.0.1"), caps.gave_way) == (3, 1, 1)
    seats["c"].release()  # its close, later: counted once
    assert caps.total == 3
    assert caps.admit("10.0.0.4", limits, Conn("e")) is not None and a.gave_way  # then a
    seats["d"] = None
    for seat in caps.idle:  # d and e: both busy now, as b is
        seat.busy = True
    assert caps.admit("10.0.0.5", limits, Conn("f")) is None  # every one holds a request: refused
    assert caps.total == 3 and not b.gave_way
    seats["b"].rest()  # b's answer is out: it gives way to the next
    assert caps.admit("10.0.0.5", limits, Conn("g")) is not None and b.gave_way


def test_at_max_connections_per_peer_the_peers_own_idle_connection_gives_way():
    """A peer's flood only churns its own connections; one whose connections are all busy is
    refused; another peer is not touched."""
    caps, limits = OpenConnections(), Limits(max_connections=10, max_connections_per_peer=2)
    other = Conn("other")
    caps.admit("10.0.0.9", limits, other)
    first, second = Conn("first"), Conn("second")
    caps.admit("10.0.0.1", limits, first)
    s2 = caps.admit("10.0.0.1", limits, second)
    third = Conn("third")
    assert caps.admit("10.0.0.1", limits, third) is not None
    assert (first.gave_way, second.gave_way, other.gave_way) == (True, False, False)
    assert (caps.total, caps.count("10.0.0.1")) == (3, 2)
    for seat in list(caps.idle):
        if seat.peer == "10.0.0.1":
            seat.busy = True
    assert caps.admit("10.0.0.1", limits, Conn("fourth")) is None
    assert caps.admit("10.0.0.2", limits, Conn("else")) is not None  # another peer still gets in
    s2.release()
    assert caps.count("10.0.0.1") == 1


def test_the_admin_socket_is_not_counted_and_a_released_peer_is_forgotten():
    caps, limits = OpenConnections(), Limits(max_connections=1, max_connections_per_peer=1)
    assert caps.admit("", limits, Conn("local")) is UNCOUNTED and caps.total == 0
    seat = caps.admit("10.0.0.1", limits, Conn("a"))
    seat.release()
    seat.release()
    assert (caps.total, caps.peers, caps.idle) == (0, {}, {})


# --- floods against a whole server ------------------------------------------------------------

FLOODERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
# Four flooders at their per-peer cap hold more than the listener's cap; heads are given a
# minute, so that silent and slow connections stay for the whole test unless they give way.
LIMITS = Limits(max_connections=24, max_connections_per_peer=8, head_timeout_s=60)


def _port(server) -> int:
    return int(server.url.split(":")[2].split("/")[0])


async def _open(port: int, peer: str, first: bytes):
    """A connection from ``peer`` that sends ``first`` and then nothing, and never reads."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(peer, 0))
    if first:
        writer.write(first)
    return writer


async def _status(port: int, raw: bytes) -> int:
    """``raw`` on a new connection (from 127.0.0.1, LiteLLM's and the admin's address here)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        line = await asyncio.wait_for(reader.readline(), 10)
        assert line, "closed without an answer (at the accept)"
        return int(line.split()[1])
    finally:
        writer.close()


def _flood_kinds(server, dep: int, gateway: bool, admin: bool) -> dict[str, bytes]:
    """What each kind of flooding connection sends: nothing, a refused request (it then reads
    nothing and never closes), half a request head."""
    kinds = {"silent": b""}
    if gateway:
        kinds["refused by the gateway"] = (f"GET /dgxmm/ondemand/{dep}/v1/models HTTP/1.1\r\nHost: x\r\n"
                                           "Authorization: Bearer wrong\r\n\r\n").encode()
    if admin:
        kinds["refused by the admin API"] = b"GET /dgxmm/api/host HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n\r\n"
    kinds["slowloris"] = f"GET /dgxmm/ondemand/{dep}/v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ".encode()
    return kinds


def _requests(server, dep: int) -> dict[str, bytes]:
    return {
        "litellm": (f"GET /dgxmm/ondemand/{dep}/v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{server.key}\r\nConnection: close\r\n\r\n").encode(),
        "healthz": b"GET /dgxmm/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "admin": (f"GET /dgxmm/api/host HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
                  "Connection: close\r\n\r\n").encode(),
    }


async def _flood_and_serve(server, dep: int, listeners: list[tuple[int, object, bool, bool, list[str]]]) -> None:
    """Each kind of flood in turn on every listener (port, its count, whether it serves the
    gateway, the admin API, and which requests go there); after each, the requests are served
    on new connections while the cap is full."""
    held = []
    try:
        for port, caps, gateway, admin, _ in listeners:
            for kind, first in _flood_kinds(server, dep, gateway, admin).items():
                for peer in FLOODERS:
                    held += [await _open(port, peer, first) for _ in range(LIMITS.max_connections_per_peer)]
                if kind in ("silent", "slowloris"):  # they stay: the cap is full
                    await wait_for(lambda caps=caps: caps.total == LIMITS.max_connections, timeout=10,
                                   what=f"{kind}: full")
                for p, _, _, _, asks in listeners:
                    for name in asks:
                        assert await _status(p, _requests(server, dep)[name]) == 200, (kind, name)
                assert caps.total <= LIMITS.max_connections
            assert caps.gave_way > 0
    finally:
        for writer in held:
            writer.close()


async def test_a_flood_on_one_listener_leaves_litellm_healthz_and_the_admin_api_served(tmp_path):
    """And the page's event stream, a request in progress all along (aiohttp's), never gives way."""
    async with run_app(tmp_path, limits=LIMITS) as server:
        dep = await server.add("a")
        caps = server.http.front.open
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(server), local_addr=(FLOODERS[0], 0))
        try:
            writer.write(f"GET /dgxmm/api/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
                         "\r\n".encode())
            assert (await asyncio.wait_for(reader.readuntil(b'"a"'), 10)).startswith(b"HTTP/1.1 200")
            await _flood_and_serve(server, dep, [(_port(server), caps, True, True, ["litellm", "healthz", "admin"])])
            await server.add("b")  # its event still comes on the stream
            assert b'"b"' in await asyncio.wait_for(reader.readuntil(b'"b"'), 10)
        finally:
            writer.close()
        await wait_for(lambda: caps.total == 0, timeout=10, what="every connection closed")


async def test_a_flood_on_both_listeners_with_admin_listen_leaves_everyone_served(tmp_path):
    admin_port = free_port()
    async with run_app(tmp_path, limits=LIMITS, admin_listen=f"127.0.0.1:{admin_port}") as server:
        dep = await server.add("a")
        await _flood_and_serve(server, dep, [
            (_port(server), server.http.gateway_only.open, True, False, ["litellm"]),
            (admin_port, server.http.admin_open, False, True, ["healthz", "admin"])])


async def test_a_connection_is_refused_only_when_every_one_holds_a_request(tmp_path):
    """Connections whose requests are in progress (here: authorized, their bodies still on the
    way) never give way: a new connection is closed at the accept then, and gets in once one
    of them is answered."""
    async with run_app(tmp_path, limits=Limits(max_connections=4, max_connections_per_peer=4)) as server:
        dep = await server.add("a")
        port, caps = _port(server), server.http.front.open
        head = (f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                f"{server.key}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{").encode()
        busy = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)) for _ in range(4)]
        try:
            for _, writer in busy:
                writer.write(head)
            await wait_for(lambda: caps.total == 4 and not any(not s.busy for s in caps.idle), timeout=10,
                           what="four requests in progress")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at the accept
            writer.close()
            assert all(not w.is_closing() for _, w in busy) and caps.total == 4
            # One body ends: its request is answered (400: no JSON) and that connection ends.
            reader0, writer0 = busy[0]
            writer0.write(b" " * 999)
            assert (await asyncio.wait_for(reader0.readline(), 10)).startswith(b"HTTP/1.1 400")
            await wait_for(lambda: caps.total == 3, timeout=10, what="the answered one closed")
            litellm = _requests(server, dep)["litellm"]
            assert await _status(port, litellm) == 200
        finally:
            for _, writer in busy:
                writer.close()
