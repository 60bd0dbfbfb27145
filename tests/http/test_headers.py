"""The header parsers both stacks and the gateway share (ondemand/http/headers.py): the bearer
token, its bytes as they came (through a whole server too: a non-UTF-8 admin token), and the
bounded cache of decoded short headers."""
from __future__ import annotations

import logging

import pytest
from multidict import CIMultiDict
from raw_http import error_code, parse_answers, talk

from ondemand.app import TELEMETRY
from ondemand.http import headers
from ondemand.http.headers import bearer, decoded, token_bytes


@pytest.mark.parametrize("value, token", [
    ("Bearer sk-1", "sk-1"), ("bearer sk-1", "sk-1"), ("BEARER  sk-1 ", "sk-1"),
    ("Basic dXNlcg==", None), ("Bearer", None), ("sk-1", None), (None, None),
])
def test_the_bearer_token_is_read_from_the_authorization_header_alone(value, token):
    h = CIMultiDict() if value is None else CIMultiDict({"authorization": value})
    assert bearer(h) == token


def test_a_token_with_a_byte_that_is_no_utf8_keeps_its_bytes():
    raw = b"Bearer sk-\xff\x80"
    name, value = decoded((b"Authorization", raw))
    token = bearer({name: value})
    assert token is not None and token_bytes(token) == b"sk-\xff\x80"  # compared as bytes, never raises
    assert token_bytes("sk-plain") == b"sk-plain"


@pytest.mark.parametrize("path", ["/dgxmm/api/host", "/dgxmm/metrics", "/dgxmm/api/deployments"])
async def test_a_non_utf8_admin_token_is_401_counted_without_a_traceback(server, path, caplog):
    """Issue 23: one such byte made the admin check raise (a 500 and a traceback)."""
    registry = server.app[TELEMETRY].registry
    failures = registry.get_sample_value("ondemand_auth_failures_total")
    raw = f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + b"Authorization: Bearer \xff\r\n\r\n"
    with caplog.at_level(logging.DEBUG):
        [answer] = parse_answers(await talk(server, raw, timeout=2, want=1))
    assert answer[0] == 401 and error_code(answer) == "invalid_admin_token"
    assert registry.get_sample_value("ondemand_auth_failures_total") == failures + 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_short_headers_are_decoded_once_and_the_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(headers, "_DECODED", {})
    monkeypatch.setattr(headers, "DECODED_MAX", 3)
    first = decoded((b"Content-Type", b"application/json"))
    assert first == ("Content-Type", "application/json")
    assert decoded((b"Content-Type", b"application/json")) is first  # the same, decoded once
    long = (b"X-Long", b"a" * headers.DECODED_BYTES)
    assert decoded(long) == ("X-Long", "a" * headers.DECODED_BYTES) and long not in headers._DECODED
    for i in range(10):  # any client adds to it: it never grows past its bound
        decoded((b"X-%d" % i, b"v"))
        assert len(headers._DECODED) <= 3
