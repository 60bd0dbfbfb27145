"""The header parsers both stacks and the gateway share (ondemand/http/headers.py): the bearer
token, its bytes as they came, and the bounded cache of decoded short headers."""
from __future__ import annotations

import pytest
from multidict import CIMultiDict

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
