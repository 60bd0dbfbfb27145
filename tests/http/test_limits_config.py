"""The HTTP bounds are configuration keys (http/limits.py, ``Limits.of``): each is validated as
every key, in the file, the environment and the overrides, with the documented one-line error;
and the server keeps what they say, on a real socket, on both stacks (the lean front's gateway
and aiohttp's admin side). test_limits.py checks the head timeout and the body size."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers import run_app

from ondemand import config
from ondemand.errors import ConfigError
from ondemand.http.limits import Limits

# key, a value out of its range, and what the error says is allowed.
BAD = [
    ("head_timeout_s", 301, "seconds, 0.5 to 300"),
    ("body_timeout_s", 0.5, "seconds, 1 to 3600"),
    ("keepalive_timeout_s", 3601, "seconds, 1 to 3600"),
    ("max_head_kib", 63, "KiB, 64 to 1024"),
    ("max_body_mib", 0, "MiB, 1 to 1024"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD)
def test_a_bound_out_of_range_or_not_a_number_is_the_documented_config_error(tmp_path, key, value, allowed):
    with pytest.raises(ConfigError, match=rf"^configuration key {key} = {value!r} is not allowed: {allowed}"):
        config.load(env={}, overrides={key: value})
    with pytest.raises(ConfigError, match=rf"^configuration key {key} = 'soon' is not allowed: {allowed}"):
        config.load(env={f"ONDEMAND_{key.upper()}": "soon"})
    toml = tmp_path / "ondemand.toml"
    toml.write_text(f"{key} = true\n")  # a boolean is no number
    with pytest.raises(ConfigError, match=rf"^configuration key {key} = True is not allowed: {allowed}"):
        config.load(toml, env={})
    # Each row of the documented table says the same (README, Configuration).
    assert dict((k, a) for k, _, a in config.describe())[key].startswith(allowed)


def test_the_bounds_come_from_the_environment_and_the_file(tmp_path):
    toml = tmp_path / "ondemand.toml"
    toml.write_text("keepalive_timeout_s = 20\nmax_head_kib = 256\n")
    cfg = config.load(toml, env={"ONDEMAND_BODY_TIMEOUT_S": "7.5", "ONDEMAND_MAX_BODY_MIB": "2"})
    limits = Limits.of(cfg)
    assert (limits.keepalive_timeout_s, limits.max_head_bytes, limits.body_timeout_s) == (20, 256 * 1024, 7.5)
    assert limits.gateway_max_body == limits.admin_max_body == limits.client_max_size() == 2 * 2**20
    assert limits.aiohttp_args()["keepalive_timeout"] == 20  # aiohttp's connections keep the same


async def _idle_close_after(port: int, request: bytes) -> tuple[bytes, float]:
    """Send one request, read its answer's head, then wait for the server to close the idle
    keep-alive connection: the head and how long the connection stayed open after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        t0 = time.monotonic()
        while await asyncio.wait_for(reader.read(65536), 10):  # the answer's body, then the close
            pass
        return head, time.monotonic() - t0
    finally:
        writer.close()


async def test_a_lower_keepalive_timeout_closes_an_idle_connection_sooner_on_both_stacks(tmp_path):
    """keepalive_timeout_s = 1: an idle connection after an answer is closed after about a second
    (the default is 300 s), whether the lean front answered it (a gateway request) or aiohttp
    (/healthz)."""
    async with run_app(tmp_path, keepalive_timeout_s=1) as server:
        port = int(server.url.rpartition(":")[2].split("/")[0])
        gateway = (b"GET /dgxmm/ondemand/1/v1/models HTTP/1.1\r\nHost: x\r\n"
                   b"Authorization: Bearer " + server.key.encode() + b"\r\n\r\n")
        healthz = b"GET /dgxmm/healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        for request in (gateway, healthz):
            head, idle = await _idle_close_after(port, request)
            assert head.startswith(b"HTTP/1.1 ") and b"connection: close" not in head.lower(), head
            assert 0.8 <= idle < 4, (request, idle)


async def test_a_lower_body_timeout_answers_a_slow_gateway_body_sooner(tmp_path):
    """body_timeout_s = 1: a body that stops coming is 408 after about a second (default 60 s),
    and the connection is closed."""
    async with run_app(tmp_path, body_timeout_s=1) as server:
        port = int(server.url.rpartition(":")[2].split("/")[0])
        dep = await server.add("a")  # stopped: the body is read before anything starts it
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"POST /dgxmm/ondemand/{dep}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n".encode() +
                         b"Authorization: Bearer " + server.key.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
            t0 = time.monotonic()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            waited = time.monotonic() - t0
            assert head.startswith(b"HTTP/1.1 408 "), head
            assert 0.8 <= waited < 4, waited
            assert b"request_timeout" in await asyncio.wait_for(reader.read(), 15)  # then closed
        finally:
            writer.close()
