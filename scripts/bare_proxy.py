#!/usr/bin/env python3
"""A bare aiohttp reverse proxy, for the benchmark's side-by-side only (not part of ondemand).

What a minimal proxy on the same stack costs: aiohttp's application (one catch-all route,
no middleware), aiohttp's ClientSession to the engine with keep-alive, the answer streamed
back chunk by chunk. No checks, no queue, no key: the floor ondemand's checks sit on.

    python3 scripts/bare_proxy.py --port 9000 --upstream http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "host", "content-length"})


def build(upstream: str) -> web.Application:
    app = web.Application(client_max_size=16 * 2**20)

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app["http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        yield
        await app["http"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with request.app["http"].request(request.method, upstream + request.rel_url.raw_path_qs,
                                               data=body, headers=headers) as up:
            out = web.StreamResponse(status=up.status,
                                     headers={k: v for k, v in up.headers.items() if k.lower() not in HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    a = ap.parse_args()
    import uvloop
    web.run_app(build(a.upstream.rstrip("/")), host="127.0.0.1", port=a.port, access_log=None,
                print=None, backlog=4096, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
