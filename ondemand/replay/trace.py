"""The trace: the requests a replay sends, read from a CSV file or from ondemand's own JSON
access log, one at a time.

- **CSV**, a header row, columns by name (case ignored): ``timestamp`` (ISO 8601, or seconds),
  ``model`` (optional: a deployment's ``served_name`` or ``name``), ``input_tokens`` or
  ``ContextTokens``, ``output_tokens`` or ``GeneratedTokens``, ``stream`` (optional, true or
  false; true when absent). The Azure LLM inference traces of 2023 are read as they are. Rows
  come in time order (a row earlier than the one before it is an error) and are streamed.
- **JSON lines**: the access log (``access_log = "json"``), one line per gateway request. Only
  the model traffic is replayed (``POST`` to a generation route of a deployment that exists).
  A line is written when its request ends, so its arrival is ``time`` less ``duration_s``, and
  the lines are read whole and put in arrival order. The log holds no token counts: the input is
  its body's bytes over ``BYTES_PER_TOKEN``, and the output what its deployment decodes in the
  time the request spent in the engine (``duration_s`` less ``queued_s``).

Time starts at the first request. A row without a model goes to deployment *i* with probability
``weight``\\ *i* / Σ ``weight``, drawn from ``random.Random(seed)`` in row order, so the same
inputs give the same requests. ``Trace.check`` reads everything once before the replay and
raises ``TraceError`` (``FILE:LINE: what is wrong``) at the first bad row; iterating a ``Trace``
then yields its requests.
"""
from __future__ import annotations

import bisect
import csv
import dataclasses
import datetime
import itertools
import math
import random
import re
from collections.abc import Iterator, Sequence

import orjson

from .types import Replayed, Request

BYTES_PER_TOKEN = 4  # a request body's JSON per prompt token, roughly (English text, its envelope)
# The access log's routes that reach an engine (gateway/routes.py's TRAFFIC).
TRAFFIC = frozenset({"chat/completions", "completions", "embeddings", "responses", "messages",
                     "chat/completions/batch", "audio/transcriptions", "audio/translations", "rerank", "score"})
COLUMNS = {"timestamp": ("timestamp",), "model": ("model",), "input": ("input_tokens", "contexttokens"),
           "output": ("output_tokens", "generatedtokens"), "stream": ("stream",)}
_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?:[T ](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d+))?)?)?"
                  r"\s*(Z|[+-]\d{2}:?\d{2})?")


# (arrival, line, model as written, input tokens, output tokens or the engine's seconds, streamed)
_Row = tuple[float, int, str, int, "int | float", bool]


class TraceError(ValueError):
    """A row that cannot be replayed: ``FILE:LINE: what is wrong``."""


def seconds(text: str) -> float:
    """A timestamp as seconds: a number, or ISO 8601 (any digits of a second's fraction; no
    zone is UTC). Raises ValueError."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        m = _ISO.fullmatch(text)
        if m is None:
            raise ValueError(f"timestamp {text!r} is neither ISO 8601 nor seconds") from None
        y, mo, d, h, mi, s, frac, zone = m.groups()
        tz = datetime.timezone.utc
        if zone and zone != "Z":
            sign = -1 if zone[0] == "-" else 1
            digits = zone[1:].replace(":", "")
            tz = datetime.timezone(sign * datetime.timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
        try:
            when = datetime.datetime(int(y), int(mo), int(d), int(h or 0), int(mi or 0), int(s or 0), tzinfo=tz)
        except ValueError as exc:
            raise ValueError(f"timestamp {text!r}: {exc}") from None
        return when.timestamp() + (float("0." + frac) if frac else 0.0)
    if not math.isfinite(value):
        raise ValueError(f"timestamp {text!r} is not a finite number of seconds")
    return value


@dataclasses.dataclass(frozen=True)
class Summary:
    """What ``check`` found: the number of requests, the last arrival (s from the first), and
    how many requests each deployment gets (in the order first requested)."""
    requests: int
    span_s: float
    models: dict[str, int]


class Trace:
    """A trace file and the deployments its rows go to. Iterating it reads the file again:
    nothing is held between two reads, and each read yields the same requests."""

    def __init__(self, path: str, deployments: Sequence[Replayed], seed: int = 0):
        self.path = path
        self.seed = seed
        self._names: dict[str, str] = {}
        for r in deployments:  # a served name first: what clients send
            self._names.setdefault(r.deployment.name, r.deployment.name)
        for r in deployments:
            self._names[r.deployment.served_name] = r.deployment.name
        weighted = [(r.deployment.name, r.weight) for r in deployments if r.weight > 0]
        self._pick_names = [name for name, _ in weighted]
        self._cum = list(itertools.accumulate(w for _, w in weighted))
        self._decode = {r.deployment.name: r.costs.decode_tokens_per_s for r in deployments}
        self.json_lines = self._is_json_lines()

    def _is_json_lines(self) -> bool:
        if self.path.endswith((".jsonl", ".json", ".ndjson")):
            return True
        if self.path.endswith(".csv"):
            return False
        try:
            with open(self.path, encoding="utf-8-sig", errors="replace") as fh:
                for line in fh:
                    if line.strip():
                        return line.lstrip().startswith("{")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read it: {exc.strerror or exc}") from None
        return False

    def error(self, line: int, what: str) -> TraceError:
        return TraceError(f"{self.path}:{line}: {what}")

    def check(self) -> Summary:
        """Read every row once; raises TraceError at the first that cannot be replayed."""
        count, last = 0, 0.0
        models: dict[str, int] = {}
        for req in self:
            count += 1
            last = req.at_s
            models[req.model] = models.get(req.model, 0) + 1
        if count == 0:
            raise TraceError(f"{self.path}: no request to replay")
        return Summary(count, last, models)

    def __iter__(self) -> Iterator[Request]:
        rng = random.Random(self.seed)
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as fh:
                rows = self._json_rows(fh) if self.json_lines else self._csv_rows(fh)
                first: float | None = None
                for at, line, model, tokens_in, tokens_out, stream in rows:
                    first = at if first is None else first
                    name = self._model(model, line, rng)
                    if isinstance(tokens_out, float):  # the access log's engine time: what it decodes in it
                        tokens_out = max(0, round(self._decode[name] * tokens_out))
                    yield Request(round(at - first, 6), name, tokens_in, tokens_out, stream, line)
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read it: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise TraceError(f"{self.path}: not UTF-8 text ({exc.reason})") from None

    def _csv_rows(self, fh: Iterator[str]) -> Iterator[_Row]:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise self.error(1, "empty: a CSV trace starts with a header row")
        where = self._columns([h.strip().lower() for h in header])
        previous = -math.inf
        for row in reader:
            line = reader.line_num
            if not row or not any(c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise self.error(line, f"{len(row)} columns, the header has {len(header)}")
            try:
                at = seconds(row[where["timestamp"]])
                tokens_in = _count(row[where["input"]], header[where["input"]])
                tokens_out = _count(row[where["output"]], header[where["output"]])
                stream = _flag(row[where["stream"]]) if "stream" in where else True
            except ValueError as exc:
                raise self.error(line, str(exc)) from None
            if at < previous:
                raise self.error(line, "earlier than the row before it: a CSV trace is in time order")
            previous = at
            yield at, line, row[where["model"]].strip() if "model" in where else "", tokens_in, tokens_out, stream

    def _columns(self, names: list[str]) -> dict[str, int]:
        where = {}
        for key, accepted in COLUMNS.items():
            found = [i for i, n in enumerate(names) if n in accepted]
            if found:
                where[key] = found[0]
            elif key in ("timestamp", "input", "output"):
                raise self.error(1, f"no {' or '.join(accepted)} column (the header has: {', '.join(names)})")
        return where

    def _json_rows(self, fh: Iterator[str]) -> Iterator[_Row]:
        rows = []
        for line, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                rec = orjson.loads(text)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
                if rec.get("method") != "POST" or rec.get("route") not in TRAFFIC or not rec.get("deployment"):
                    continue  # not model traffic, or for no deployment that existed
                duration = _number(rec, "duration_s")
                engine_s = max(0.0, duration - (_number(rec, "queued_s") if rec.get("queued_s") is not None else 0.0))
                at = seconds(str(rec["time"])) - duration
                rows.append((at, line, str(rec["deployment"]), int(_number(rec, "bytes_in")) // BYTES_PER_TOKEN,
                             engine_s, True))
            except (ValueError, KeyError, orjson.JSONDecodeError) as exc:
                what = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc)
                raise self.error(line, f"not an access log line: {what}") from None
        rows.sort(key=lambda r: (r[0], r[1]))
        yield from rows

    def _model(self, model: str, line: int, rng: random.Random) -> str:
        if model:
            name = self._names.get(model)
            if name is None:
                raise self.error(line, f"model {model!r} is served by no deployment")
            return name
        if not self._cum:
            raise self.error(line, "the row names no model, and no deployment has a weight to give it one")
        return self._pick_names[bisect.bisect_right(self._cum, rng.random() * self._cum[-1])]


def _count(text: str, column: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise ValueError(f"{column} {text!r} is not a whole number of tokens")
    return int(text)


def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE or low == "":
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"stream {text!r} is neither true nor false")


def _number(rec: dict[str, object], key: str) -> float:
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} {value!r} is not a number of 0 or more")
    return float(value)
