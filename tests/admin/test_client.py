"""The command line's client of the admin API (``admin/client.py``): HTTP/1.1 over the Unix
socket without aiohttp, against a real socket server that answers as aiohttp's does (a length,
or chunks as a followed log comes), closes early, or refuses."""
from __future__ import annotations

import asyncio
import sys

import pytest

from ondemand import config
from ondemand.admin import client


def cfg_at(tmp_path):
    return config.load(env={}, overrides={"state_dir": str(tmp_path)})


async def serve(tmp_path, answer):
    """A Unix socket server at the admin socket's path: ``answer(head, writer)`` replies."""
    cfg = cfg_at(tmp_path)
    heads: list[bytes] = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        await answer(head, writer)
        writer.close()
    server = await asyncio.start_unix_server(handle, path=str(cfg.admin_socket))
    return cfg, server, heads


async def test_a_request_sends_its_json_and_reads_a_sized_answer(tmp_path):
    async def answer(head, writer):
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{\"id\": 7}")
    cfg, server, heads = await serve(tmp_path, answer)
    async with server:
        status, body = await client.request(cfg, "POST", "/deployments", {"name": "a"})
    assert (status, body) == (201, {"id": 7})
    assert heads[0].startswith(b"POST /dgxmm/api/deployments HTTP/1.1\r\n") and b"Content-Length: 12\r\n" in heads[0]


async def test_a_followed_log_is_written_as_each_chunk_arrives(tmp_path):
    sent = asyncio.Event()
    seen: list[bytes] = []

    async def answer(head, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"6\r\nline 1\r\n")
        await writer.drain()
        await sent.wait()  # the second line only once the first was written out
        writer.write(b"7\r\n\nline 2\r\n0\r\n\r\n")
    cfg, server, _ = await serve(tmp_path, answer)

    def write(chunk: bytes) -> None:
        seen.append(chunk)
        sent.set()
    async with server:
        await asyncio.wait_for(client.stream(cfg, "/deployments/1/logs?follow=1", write), 5)
    assert seen == [b"line 1", b"\nline 2"]


async def test_an_error_is_refused_with_its_json(tmp_path):
    async def answer(head, writer):
        body = b'{"error": {"code": "not_found", "message": "no deployment 9"}}'
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    cfg, server, _ = await serve(tmp_path, answer)
    written: list[bytes] = []
    async with server:
        with pytest.raises(client.Refused) as err:
            await client.stream(cfg, "/deployments/9/logs", written.append)
        assert await client.request(cfg, "GET", "/deployments/9") == (
            404, {"error": {"code": "not_found", "message": "no deployment 9"}})
    assert err.value.status == 404 and err.value.body["error"]["code"] == "not_found" and written == []


async def test_no_socket_or_a_close_before_an_answer_is_no_server(tmp_path):
    with pytest.raises(client.NoServer, match="does not exist"):
        await client.request(cfg_at(tmp_path), "GET", "/host")

    async def answer(head, writer):
        pass  # closed without a word
    cfg, server, _ = await serve(tmp_path, answer)
    async with server:
        with pytest.raises(client.NoServer, match="closed before an answer"):
            await client.request(cfg, "GET", "/host")


def test_the_command_line_imports_no_aiohttp():
    """Half of a command's start was aiohttp's import (a CA bundle read included)."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import sys, ondemand.cli, ondemand.admin.client, ondemand.cli.status; "
                          "print('aiohttp' in sys.modules)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
