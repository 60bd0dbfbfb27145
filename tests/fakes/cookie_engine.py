"""An engine that sets a cookie on every answer and says which Cookie header it
received (the gateway must never carry one client's cookie to another request),
with a header of its own, its own Server, and a header named in Connection."""
import sys

from aiohttp import web


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "C", "object": "model"}]})


async def chat(request):
    resp = web.json_response({"cookie": request.headers.get("Cookie")},
                             headers={"X-Engine": "kept", "Server": "fake-engine/1.0",
                                      "Connection": "keep-alive, X-Hop", "X-Hop": "hop-by-hop"})
    resp.set_cookie("engine_session", "secret-of-the-first-user")
    return resp


app = web.Application()
app.router.add_get("/v1/models", models)
app.router.add_get("/health", models)
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
