"""The access log (access_log = json | text): one line per gateway request, written by a
thread of its own, with no secret in it."""
import io
import math

import aiohttp
import orjson
from helpers import run_app

from ondemand.gateway.accesslog import AccessLog, text_line
from ondemand.gateway.exchange import Exchange

CHAT = {"model": "A", "messages": [{"role": "user", "content": "hello"}]}


def access_lines(err: str) -> list[dict]:
    return [orjson.loads(line) for line in err.splitlines() if line.startswith("{")]


async def test_access_log_json_one_line_per_request(tmp_path, capsys):
    async with run_app(tmp_path, access_log="json") as server, aiohttp.ClientSession() as http:
        a = await server.add("a", 10, "--startup-delay", "0.2")
        body = orjson.dumps(CHAT)
        async with http.post(server.gw(a, "chat/completions"), data=body,
                             headers={**server.auth(), "x-request-id": "r1", "Content-Type": "application/json"}) as r:
            assert r.status == 200
            size = len(await r.read())
        async with http.post(server.gw(a, "chat/completions"), json=CHAT,
                             headers={"Authorization": "Bearer odk-wrong", "x-request-id": "r2"}) as r:
            assert r.status == 401
        async with http.get(server.gw(a, "models"), headers=server.auth()) as r:
            generated = r.headers["x-request-id"]
    err = capsys.readouterr().err  # the server is closed: its log thread wrote everything
    lines = access_lines(err)
    assert [line["request_id"] for line in lines] == ["r1", "r2", generated]
    first, refused, models = lines
    assert set(first) == {"time", "request_id", "peer", "deployment", "method", "route", "status", "bytes_in",
                          "bytes_out", "duration_s", "queued_s", "waited_start", "waited_memory"}
    assert first["peer"] == "127.0.0.1" and first["deployment"] == "a" and first["route"] == "chat/completions"
    assert first["method"] == "POST" and first["status"] == 200 and first["bytes_in"] == len(body)
    assert first["bytes_out"] > size  # the body and the head
    assert first["waited_start"] is True and first["waited_memory"] is False
    assert 0.2 <= first["queued_s"] <= first["duration_s"]
    assert first["time"].endswith("Z")
    assert refused["status"] == 401 and refused["deployment"] == "" and refused["queued_s"] is None
    assert models["status"] == 200 and models["route"] == "models" and models["bytes_in"] == 0
    assert "odk-" not in err and server.key not in err  # no key, right or wrong


async def test_access_log_text(tmp_path, capsys):
    async with run_app(tmp_path, access_log="text") as server, aiohttp.ClientSession() as http:
        a = await server.add("a")
        async with http.get(server.gw(a, "models"), headers={**server.auth(), "x-request-id": 'q "x"=1'}) as r:
            assert r.status == 200
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("time=")]
    assert ' request_id="q \\"x\\"=1" ' in line
    assert " deployment=a " in line and " route=models " in line and " status=200 " in line
    assert " queued_s=- " in line and " waited_start=false " in line


def test_access_log_text_quotes_what_could_split_a_line():
    ex = Exchange("a=b c", "GET", "::1", 0.0)
    ex.route = "models"
    ex.status = 200
    line = text_line(ex, 0.0)
    assert line.count("\n") == 1 and line.startswith("time=1970-01-01T00:00:00.000Z ")
    assert 'request_id="a=b c"' in line and " peer=::1 " in line and " deployment=- " in line


def test_access_log_writes_from_its_thread_and_flushes_at_close():
    out = io.StringIO()
    log = AccessLog("json", out)
    for i in range(100):
        ex = Exchange(f"r{i}", "POST", "10.0.0.1", 0.0)
        ex.duration_s = math.pi
        log.write(ex, 0.0)
    log.close()
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert [line["request_id"] for line in lines] == [f"r{i}" for i in range(100)]
    assert lines[0]["duration_s"] == round(math.pi, 6)


def test_the_time_is_iso_8601_utc_with_milliseconds_as_datetime_would_write_it():
    import datetime

    from ondemand.gateway.accesslog import _when
    for wall in (0.5, 1796057180.0, 1796057180.999, 1796057181.0425, 1796057181.0425, 1796057999.7):
        want = datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).isoformat(
            timespec="milliseconds").replace("+00:00", "Z")
        assert _when(wall) == want
