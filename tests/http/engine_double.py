"""An engine double for the tests of the engine side of ondemand/http/ (``pool.py``,
``connection.py``) and of what passes through it: a raw asyncio HTTP/1.1 server on loopback
that counts its connections and answers exactly as each test scripts; the pools' one request
(``fetch``), and a whole ondemand whose deployment is reached at the double (``gateway_to``)."""
from __future__ import annotations

import asyncio
import contextlib

JSON = b"Content-Type: application/json\r\n"  # the pool takes the header lines, encoded (forward.request_lines)


class Engine:
    """An HTTP/1.1 engine double on loopback. ``answer(req, writer)`` writes the answer
    (an async function of the test's); it returns False to close the connection."""

    def __init__(self, answer=None):
        self.answer = answer or ok_answer
        self.accepted = 0
        self.open = 0            # connections open right now (server side)
        self.closed_by_peer = 0  # connections the gateway closed (EOF seen while reading)
        self.requests: list[dict] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.accepted += 1
        conn = self.accepted  # this connection's number (a later accept must not renumber it)
        self.open += 1
        self.writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_peer += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ")
                headers = [tuple(x.split(": ", 1)) for x in lines[1:] if x]
                length = int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
                body = await reader.readexactly(length) if length else b""
                req = dict(method=method, target=target, headers=headers, body=body, raw=head, conn=conn,
                           reader=reader)
                self.requests.append(req)
                if await self.answer(req, writer) is False:
                    return
        finally:
            self.open -= 1
            writer.close()


async def ok_answer(req, writer, body=b'{"ok": true}'):
    if req["method"] == "HEAD":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
    await writer.drain()


async def fetch(ups, url, method="POST", target="/v1/chat/completions", body=b"{}", dep=1, headers=JSON):
    """One request through the pools ``ups`` (an ``Upstreams``): status, headers and the whole body."""
    lease = ups.open(dep, url)
    try:
        r = await lease.request(method, target, headers, body)
        try:
            return r.status, r.headers, await r.read()
        finally:
            r.release()
    finally:
        lease.end()


def pool_of(ups, dep=1):
    """Deployment ``dep``'s traffic pool (a ``pool.Pool``), which must be there."""
    p = ups.pool(dep)
    assert p is not None, f"no pool for deployment {dep}"
    return p


# --- through the gateway ------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def gateway_to(tmp_path, engine):
    """A running ondemand whose deployment ``a`` is ready and reached at the engine double:
    (server, an aiohttp session, the deployment's chat URL, its id)."""
    import aiohttp
    from helpers import FAKES, run_app
    async with run_app(tmp_path) as server:
        # started as a stand-in that is ready at once (the simulator's start is most of a test)
        a = await server.add("a", command=["python", str(FAKES / "ready_engine.py"), "{port}"])
        await server.deployer.restart(a)
        server.deployer.engine(a).base_url = engine.url
        async with aiohttp.ClientSession() as http:
            yield server, http, server.gw(a, "chat/completions"), a


async def not_ours(req, writer):
    """The deployer's own requests (metrics, health) are not the gateway's: a plain 404."""
    if req["target"].startswith("/v1/"):
        return False
    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    return True


def gateway_requests(eng):
    return [r for r in eng.requests if r["target"].startswith("/v1/")]
