"""The other proxies the proxy benchmark runs beside the gateway, in front of the same engine:
nginx (when installed), a bare aiohttp proxy (scripts/bare_proxy.py) and a relay of bytes
(scripts/byte_relay.py), one worker each."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .load import Target
from .procs import ROOT, Procs, child_env, children, free_port

NGINX_CONF = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    upstream engine {{ server {upstream}; keepalive 256; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


async def start_others(procs: Procs, tmp: Path, engine_url: str, results: dict[str, Any]) -> list[Target]:
    """nginx (when installed: ``scripts/heavy/nginx.sh``), a bare aiohttp proxy and a relay of
    bytes, each in front of the same engine, one worker each: what a proxy costs without
    ondemand's checks, and (the relay) without HTTP at all."""
    out: list[Target] = []
    json_h = {"Content-Type": "application/json"}
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        results["others_note"] = "nginx is not installed (scripts/heavy/nginx.sh): left out"
    else:
        port = free_port()
        conf = tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=engine_url.split("://", 1)[1]))
        master = procs.spawn("nginx", [nginx, "-c", str(conf), "-p", str(tmp)],
                                  tmp / "nginx.log", child_env())
        await wait_port(port, master)
        worker = children(master.pid)
        out.append(Target("nginx", f"http://127.0.0.1:{port}/v1/chat/completions", json_h,
                          worker[0] if worker else master.pid))
    for name, script in (("bare aiohttp", "bare_proxy.py"), ("byte relay", "byte_relay.py")):
        port = free_port()
        proc = procs.spawn(name, [sys.executable, str(ROOT / "scripts" / script), "--port", str(port),
                                       "--upstream", engine_url], tmp / f"{script[:-3]}.log", child_env())
        await wait_port(port, proc)
        out.append(Target(name, f"http://127.0.0.1:{port}/v1/chat/completions", json_h, proc.pid))
    return out

async def wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not listen on {port} (exit {proc.poll()})")
        await asyncio.sleep(0.05)
