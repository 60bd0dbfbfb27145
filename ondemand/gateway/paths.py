"""The gateway's path check, and the upstream path rebuilt from its segments.

BEHAVIOUR.md, "Checks, in order", check 2: "a ., .. or empty segment, \\, ?, #, a control character or an
encoded /, \\, #, ? or NUL is 400 invalid_path", and so is an escape that decodes to a segment whose
NFKC form would be one of those (a fullwidth solidus, a two dot leader). The check runs on the raw
request target, as the client sent it (aiohttp's ``request.raw_path``, query included) and before
any decoding, so that
nothing a decoder or a normaliser does (here or in the engine) can turn an accepted path into a
different one. "Forwarding": the upstream URL is "the checked path, rebuilt from its segments"
(:func:`rebuild`), never the client's bytes. Imports nothing of ours but the errors.
"""
from __future__ import annotations

import re
import unicodedata
from urllib.parse import quote, unquote_to_bytes

from ondemand.errors import OndemandError

__all__ = ["split_checked", "rebuild"]

# Raw characters refused anywhere after the prefix: everything outside printable ASCII (controls,
# space, DEL and non-ASCII: a request target is ASCII by RFC 3986, aiohttp's parser refuses most
# of these already) and the three the design names. "?" refuses any query string: the gateway
# routes take no query parameters.
# One negated class (printable ASCII minus '#', '?', '\'): an alternation is 3x slower.
_RAW_BAD = re.compile(r"[^!-\"$->@-\[\]-~]")
# "%" not followed by two hex digits.
_MALFORMED_PCT = re.compile(r"%(?![0-9A-Fa-f]{2})")
# Characters refused in a decoded segment: C0 and C1 controls (NUL included), DEL, and what
# must not come out of an escape: "/" (%2F), "\" (%5C), "?" (%3F), "#" (%23). Lone surrogates
# never come out of a strict UTF-8 decode; listed for rebuild(), which could not encode them.
_DECODED_BAD = re.compile(r"[\x00-\x1f\x7f-\x9f/\\?#\ud800-\udfff]")
_DOT_SEGMENTS = frozenset(("", ".", ".."))

# rebuild() leaves unreserved characters (always kept by quote: letters, digits, "-._~") and
# ":" and "@" (pchar; model names like llama3:8b stay readable) as they are and percent-encodes
# everything else, which every server decodes back to the same segment.
_SAFE = ":@"
_NEEDS_QUOTE = re.compile(r"[^A-Za-z0-9\-._~:@]")  # the fast path skips quote() (slow) for these


def _invalid(message: str, detail: str) -> OndemandError:
    return OndemandError(400, "invalid_path", message, detail=detail)


def split_checked(raw_path: str, prefix: str) -> list[str]:
    """The decoded segments of ``raw_path`` after ``prefix``, or 400 invalid_path.

    ``raw_path`` is the request target as received (percent-encoded, with any query string);
    ``prefix`` is the gateway prefix without a trailing slash (``/dgxmm/ondemand``). A path that
    does not begin with the literal prefix (an encoded prefix, an absolute-form target) is
    refused too: only the exact spelling is the gateway's.
    """
    n = len(prefix)
    if not raw_path.startswith(prefix):
        raise _invalid("Invalid request path", f"raw path {raw_path!r} does not start with {prefix!r}")
    if len(raw_path) == n:
        return []
    rest = raw_path[n:]
    if rest[0] != "/":
        raise _invalid("Invalid request path", f"raw path {raw_path!r}: no '/' after the prefix")
    bad = _RAW_BAD.search(rest)
    if bad is not None:
        raise _invalid("Invalid character in request path", f"raw path {raw_path!r}: {bad.group()!r}")
    segments = rest[1:].split("/")
    if "%" in rest:
        segments = [_decode(seg, raw_path) if "%" in seg else seg for seg in segments]
    elif "//" not in rest and "/." not in rest and rest[-1] != "/":
        return segments  # no empty segment, none starting with a dot: nothing more to check
    for seg in segments:
        if seg in _DOT_SEGMENTS:
            raise _invalid("Empty or dot segment in request path", f"raw path {raw_path!r}: segment {seg!r}")
    return segments


def _decode(seg: str, raw_path: str) -> str:
    if _MALFORMED_PCT.search(seg) is not None:
        raise _invalid("Malformed percent-encoding in request path", f"raw path {raw_path!r}")
    try:
        decoded = unquote_to_bytes(seg).decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid("Percent-encoding in request path is not UTF-8", f"raw path {raw_path!r}") from None
    bad = _DECODED_BAD.search(decoded)
    if bad is not None:
        raise _invalid("Invalid encoded character in request path", f"raw path {raw_path!r}: {bad.group()!r}")
    if _folds_to_bad(decoded):
        raise _invalid("Encoded character in request path that normalizes to a separator or a dot segment",
                       f"raw path {raw_path!r}: {decoded!r}")
    return decoded


def _folds_to_bad(seg: str) -> bool:
    """A segment whose compatibility form (NFKC) is a dot segment or holds what a decoded segment
    may not: fullwidth solidus, small question mark, two dot leader and their kin. No engine is
    known to normalize paths so, but one that did would see another path than the one checked."""
    if seg.isascii():
        return False
    folded = unicodedata.normalize("NFKC", seg)
    return folded in _DOT_SEGMENTS or _DECODED_BAD.search(folded) is not None


def rebuild(segments: list[str] | tuple[str, ...]) -> str:
    """``"/" + "/".join(encoded segments)``; ``""`` for no segments.

    Refuses (``ValueError``, a programming error) a segment :func:`split_checked` would not have
    produced, so the result never holds an encoded slash, an empty or a dot segment.
    """
    parts = []
    for seg in segments:
        if seg in _DOT_SEGMENTS or _DECODED_BAD.search(seg) is not None or _folds_to_bad(seg):
            raise ValueError(f"not a checked path segment: {seg!r}")
        parts.append(quote(seg, safe=_SAFE) if _NEEDS_QUOTE.search(seg) is not None else seg)
    return "/" + "/".join(parts) if parts else ""
