"""A stand-in engine that only has to become ready: ``GET /health`` and ``GET /v1/models``
(listing NAME, the served name readiness asks for) answer 200, anything else 404. Standard
library only, so it starts in milliseconds (the engine simulator imports aiohttp first): for
tests that point the deployment at an engine double once it is ready.

    python ready_engine.py PORT [NAME]
"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        ok = self.command == "GET" and self.path in ("/v1/models", "/health")
        body = (b'{"object": "list", "data": [{"id": "%s", "object": "model"}]}' % NAME.encode()) if ok else b""
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_HEAD = _answer

    def log_message(self, *args):
        pass


NAME = sys.argv[2] if len(sys.argv) > 2 else "A"
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
