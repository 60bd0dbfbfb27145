"""The gateway's path check (BEHAVIOUR.md, check 2) and the rebuilt upstream path ("Forwarding")."""
from __future__ import annotations

import re
from urllib.parse import unquote

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from ondemand.errors import OndemandError
from ondemand.gateway.paths import _folds_to_bad, rebuild, split_checked

PREFIX = "/dgxmm/ondemand"


def test_plain_paths():
    assert split_checked(PREFIX + "/3/v1/chat/completions", PREFIX) == ["3", "v1", "chat", "completions"]
    assert split_checked(PREFIX, PREFIX) == []
    assert split_checked(PREFIX + "/1/v1/models/llama3:8b", PREFIX) == ["1", "v1", "models", "llama3:8b"]
    assert split_checked(PREFIX + "/1/v1/models/a%20b%C3%A9", PREFIX) == ["1", "v1", "models", "a bé"]
    assert split_checked(PREFIX + "/1/a%2eb/...", PREFIX) == ["1", "a.b", "..."]
    assert split_checked("/ondemand/1", "/ondemand") == ["1"]


BAD = {
    "dot segment": "/1/./v1",
    "dot-dot segment": "/1/../v1",
    "empty segment": "/1//v1",
    "trailing slash": "/1/v1/",
    "slash only": "/",
    "backslash": "/1/v1\\models",
    "query string": "/1/v1/models?x=1",
    "bare question mark": "/1/v1/models?",
    "fragment": "/1/v1#models",
    "NUL": "/1/v1\x00",
    "tab": "/1/v\t1",
    "newline": "/1/v1\n",
    "DEL": "/1/v1\x7f",
    "space": "/1/v 1",
    "non-ASCII raw": "/1/vé",
    "encoded slash": "/1/v1%2fmodels",
    "encoded slash upper": "/1/v1%2Fmodels",
    "encoded backslash": "/1/v1%5cmodels",
    "encoded backslash upper": "/1/v1%5Cmodels",
    "encoded hash": "/1/v1%23x",
    "encoded question mark": "/1/v1%3fx",
    "encoded question mark upper": "/1/v1%3Fx",
    "encoded NUL": "/1/v1%00",
    "encoded control": "/1/v1%0a",
    "encoded DEL": "/1/v1%7F",
    "encoded C1 control": "/1/v1%C2%85",
    "encoded dot": "/1/%2e/v1",
    "encoded dot upper": "/1/%2E/v1",
    "encoded dot-dot": "/1/%2e%2e/v1",
    "half-encoded dot-dot": "/1/.%2e/v1",
    "half-encoded dot-dot 2": "/1/%2E./v1",
    "malformed escape": "/1/v1%zz",
    "truncated escape": "/1/v1%2",
    "bare percent": "/1/v1%",
    "escape not UTF-8": "/1/v1%ff",
    "overlong UTF-8 slash": "/1/v1%c0%af",
    "fullwidth solidus (NFKC /)": "/1/v1/models/a%ef%bc%8fb",
    "fullwidth reverse solidus (NFKC \\)": "/1/v1/models/a%ef%bc%bcb",
    "small question mark (NFKC ?)": "/1/v1/models/a%ef%b9%96b",
    "fullwidth number sign (NFKC #)": "/1/v1/models/a%ef%bc%83b",
    "fullwidth full stops (NFKC ..)": "/1/v1/models/%ef%bc%8e%ef%bc%8e",
    "two dot leader (NFKC ..)": "/1/v1/models/%e2%80%a5",
    "one dot leader (NFKC .)": "/1/v1/models/%e2%80%a4",
    "double-encoded is fine but percent-percent": "/1/v1%%32f",
    "no slash after prefix": "X/1",
    "query right after prefix": "?a=1",
}


@pytest.mark.parametrize("tail", BAD.values(), ids=BAD.keys())
def test_named_bad_cases_are_invalid_path(tail):
    with pytest.raises(OndemandError) as e:
        split_checked(PREFIX + tail, PREFIX)
    assert e.value.status == 400 and e.value.code == "invalid_path"
    assert e.value.envelope()["error"]["code"] == "invalid_path"


@pytest.mark.parametrize("raw", [
    "/dgxmm/%6Fndemand/1/v1/models",  # an encoded prefix routes in aiohttp; not ours to accept
    "http://h/dgxmm/ondemand/1/v1/models",  # absolute-form target
    "//dgxmm/ondemand/1",
    "/dgxmm/x/../ondemand/1",
])
def test_prefix_must_be_literal(raw):
    with pytest.raises(OndemandError) as e:
        split_checked(raw, PREFIX)
    assert e.value.code == "invalid_path"


def test_double_encoding_is_one_level_only():
    # %252f decodes once to the literal text "%2f"; rebuild encodes the "%" again.
    segs = split_checked(PREFIX + "/1/a%252fb", PREFIX)
    assert segs == ["1", "a%2fb"]
    assert rebuild(segs) == "/1/a%252fb"


def test_rebuild():
    assert rebuild([]) == ""
    assert rebuild(["v1", "chat", "completions"]) == "/v1/chat/completions"
    assert rebuild(["v1", "models", "llama3:8b"]) == "/v1/models/llama3:8b"
    assert rebuild(["a b", "é", "x+y;z=1&q'"]) == "/a%20b/%C3%A9/x%2By%3Bz%3D1%26q%27"
    for bad in ("", ".", "..", "a/b", "a\\b", "a?b", "a#b", "a\x00", "\ud800", "a\uff0fb", "\u2025"):
        with pytest.raises(ValueError):
            rebuild(["v1", bad])


# -- properties -------------------------------------------------------------------------------

# Everything that matters to the check, plus arbitrary unicode; most tokens are harmless so that
# a good share of the generated paths is accepted and the round trip is exercised.
_GOOD = st.sampled_from(list("aAfF09zZ.:@;=+~-_") + ["%2e", "%2E", "%41", "%25", "%20", "%C3%A9",
                                                   "%e2%82%ac", "%F0%9F%98%80"])
_BAD = st.sampled_from(list("%/\\?# ") + ["%2f", "%2F", "%5c", "%00", "%23", "%3f", "%7f", "%c2%85",
                                         "%c0%af", "%e2%80", "%0", "%g0", "\x00", "\x1f", "\x7f",
                                         "\x85", "é", "\u2028", "\U0001f600"])
# Weighted (one_of draws its branches evenly): 1 in 10 bad, 1 in 10 any character.
_TOKEN = st.integers(0, 9).flatmap(lambda i: _BAD if i == 0 else st.characters() if i == 1 else _GOOD)
_structured = st.lists(st.lists(_TOKEN, min_size=1, max_size=4).map("".join), max_size=5).map(
    lambda segs: "".join("/" + seg for seg in segs))
_raw_tails = st.integers(0, 9).flatmap(
    lambda i: st.text(max_size=30) if i == 0 else st.text(max_size=30).map("/".__add__) if i == 1
    else _structured)

_ENCODED_SEP = re.compile(r"%(2f|5c|3f|23|00)", re.I)


def _is_dot_or_empty(seg: str) -> bool:
    return seg in ("", ".", "..")


@settings(max_examples=600, deadline=None)
@given(_raw_tails)
@example("/1/v1/a%2e%2eb")
@example("/%2e%2e%2f")
def test_random_paths_accepted_ones_round_trip(tail):
    raw = PREFIX + tail
    try:
        segs = split_checked(raw, PREFIX)
    except OndemandError as e:
        assert (e.status, e.code) == (400, "invalid_path")
        event("refused")
        return
    event("accepted")
    # What was accepted is clean, decoded...
    assert "?" not in raw and "#" not in raw and "\\" not in raw
    for seg in segs:
        assert not _is_dot_or_empty(seg)
        assert not any(c in seg for c in "/\\?#")
        assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in seg)
    # ...and each raw segment decodes to its segment.
    assert segs == [unquote(s, errors="strict") for s in tail[1:].split("/")] if tail else segs == []
    # The rebuilt path has no encoded separator and no dot or empty segment, decodes to the same
    # segments, and is itself accepted with the same result.
    rebuilt = rebuild(segs)
    assert _ENCODED_SEP.search(rebuilt) is None
    raw_parts = rebuilt.split("/")[1:]
    assert all(not _is_dot_or_empty(p) and not _is_dot_or_empty(unquote(p)) for p in raw_parts)
    assert [unquote(p, errors="strict") for p in raw_parts] == segs
    assert split_checked(PREFIX + rebuilt, PREFIX) == segs


# Cc: C0 and C1 controls and DEL; Cs: lone surrogates (no UTF-8 for them).
_segment = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\?#"),
                   min_size=1, max_size=12).filter(lambda s: not _is_dot_or_empty(s) and not _folds_to_bad(s))


@settings(max_examples=300, deadline=None)
@given(st.lists(_segment, max_size=6))
def test_any_clean_segments_survive_rebuild_and_check(segs):
    rebuilt = rebuild(segs)
    assert _ENCODED_SEP.search(rebuilt) is None
    assert split_checked(PREFIX + rebuilt, PREFIX) == segs
