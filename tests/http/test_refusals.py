"""The server's own refusals (ondemand/http/refusals.py) as bytes on the wire: a whole answer
that closes, in the documented JSON form; the checks of a request head still arriving and of a
parsed one; the once-a-minute log of malformed requests; and on the wire of a running server,
on both stacks, refusals in the documented JSON. The refusals of each stack in the order of
its answers: test_protocol.py, test_aio.py and test_hostile.py."""
from __future__ import annotations

import logging

import orjson
import pytest
from multidict import CIMultiDict
from raw_http import admin, error_code, parse_answers, talk

from ondemand.errors import OndemandError
from ondemand.http import refusals
from ondemand.http.limits import Limits
from ondemand.http.refusals import RefusalLog, Refuse, check_head, refusal, refused, unfinished_head


def parse(answer: bytes) -> tuple[str, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines)}
    assert int(headers["content-length"]) == len(body)  # whole: the client reads it to its end
    return status, headers, orjson.loads(body)


def test_a_refusal_is_a_whole_json_answer_that_closes_the_connection():
    status, headers, body = parse(refusal(413, "body_too_large", "The body is over 16 MiB"))
    assert status == "HTTP/1.1 413 Request Entity Too Large"
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert body["error"]["code"] == "body_too_large" and body["error"]["message"] == "The body is over 16 MiB"
    assert body == orjson.loads(OndemandError(413, "body_too_large", "The body is over 16 MiB").body())


def test_a_status_http_does_not_name_still_gets_a_reason_phrase():
    assert refused(OndemandError(599, "x", "y")).startswith(b"HTTP/1.1 599 Error\r\n")


def test_the_head_refusals_say_which_bound_was_passed():
    limits = Limits(max_field_size=100, max_headers=7, head_timeout_s=2.5)
    assert "over 100 bytes, or there are over 7" in parse(refusals.header_too_large(limits))[2]["error"]["message"]
    status, _, body = parse(refusals.head_late(limits))
    assert status.startswith("HTTP/1.1 408") and body["error"]["code"] == "request_timeout"
    assert "within 2.5 s" in body["error"]["message"]


@pytest.mark.parametrize("line, refused_", [
    ([b"GET / HTTP/1.1\r\n"], False),
    ([b"GET /", b" HTTP/1.1\r\nHo"], False),  # the line in pieces, then the headers begin
    ([b"GET /"], False),  # the line is not over yet: the version may still come
    ([b"\r\nGET / HTTP/1.1\r\n"], False),  # an empty line before the request is allowed
    ([b"GET /\r\n"], True),  # a line without a version: HTTP/0.9, which nothing here serves
    ([b"GET /\n"], True),
    ([b"GET / FTP/1.0\r\n"], True),
])
def test_a_request_line_without_an_http_version_is_400_once_the_line_is_over(line, refused_):
    got = unfinished_head(Limits(), sum(map(len, line)), "1.1", line)
    assert (got is refusals.NO_VERSION) is refused_ and (got is None) is not refused_


def test_a_head_still_arriving_past_its_bound_is_431_and_llhttps_http_0_9_is_400():
    limits = Limits(max_head_bytes=2048)
    assert unfinished_head(limits, 2048, "1.1", None) is None  # the bound itself is allowed
    status, _, body = parse(unfinished_head(limits, 2049, "1.1", None))
    assert status.startswith("HTTP/1.1 431") and body["error"]["code"] == "headers_too_large"
    assert "larger than 2 KiB" in body["error"]["message"]
    assert unfinished_head(limits, 10, "0.9", None) is refusals.NO_VERSION


@pytest.mark.parametrize("codings, ok", [
    ((), True), (("chunked",), True), ((" Chunked ",), True),
    (("identity",), False), (("gzip, chunked",), False), (("chunked", "chunked"), False),
])
def test_only_one_chunked_transfer_encoding_is_accepted(codings, ok):
    headers = CIMultiDict([("Transfer-Encoding", c) for c in codings])
    if ok:
        check_head(False, headers)
        return
    with pytest.raises(Refuse) as err:
        check_head(False, headers)
    status, _, body = parse(err.value.answer)
    assert status.startswith("HTTP/1.1 400") and body["error"]["code"] == "invalid_request"


def test_an_upgrade_is_refused_whatever_its_headers():
    with pytest.raises(Refuse) as err:
        check_head(True, CIMultiDict())
    assert err.value.answer is refusals.UPGRADE


def test_malformed_requests_are_logged_at_most_once_a_minute_with_the_count(caplog):
    now = [0.0]
    log = RefusalLog(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "ondemand.http"):
        log.note("10.0.0.1", "Invalid method\nmore lines of a traceback")
        for _ in range(5):
            log.note("10.0.0.2", "flood")
        now[0] = 60.0
        log.note("10.0.0.3", "Header value too long", status=431)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a malformed request from 10.0.0.1 (400): Invalid method",
                     "refused a malformed request from 10.0.0.3 (431): Header value too long (5 more since the last such line)"]


@pytest.mark.parametrize("raw", [
    b"POST /dgxmm/api/deployments HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /dgxmm/ondemand%2F1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
])
@pytest.mark.parametrize("after_admin", [False, True])
async def test_refusals_are_the_documented_json(server, raw, after_admin):
    """First on a connection (the lean front's parser) or after an admin request (aiohttp's)."""
    answers = parse_answers(await talk(server, (admin(server) if after_admin else b"") + raw, timeout=5,
                                       want=1 + after_admin))
    assert len(answers) == 1 + after_admin and 400 <= answers[-1][0] < 500, answers
    assert error_code(answers[-1])
