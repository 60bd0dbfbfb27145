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
  the lines are put in arrival order as they stream: the file is read twice, first to check
  every line and to find the longest duration and the most a line's ``time`` falls behind an
  earlier one's; then a request is held only until no later line can arrive before it (those
  that arrived within the longest request's duration of the latest end: memory does not grow
  with the log's length). The log holds no token counts: the input is
  its body's bytes over ``BYTES_PER_TOKEN``, and the output what its deployment decodes in the
  time the request spent in the engine (``duration_s`` less ``queued_s``).

Time starts at the first request. A row without a model goes to deployment *i* with probability
``weight``\\ *i* / Σ ``weight``, drawn from ``random.Random(seed)`` in row order, so the same
inputs give the same requests.

Numbers beyond what a trace can mean are bad rows, not replayed: a token count above
``MAX_TOKENS`` (the access log's too: its body's bytes, and what its engine time decodes), an
arrival more than ``MAX_SPAN_S`` (ten years) after the first, a line longer than
``MAX_LINE_BYTES``, and in the access log a duration that is not a finite number of seconds
within the same ten years. Each line is read with that bound, never whole: an endless line
(``/dev/zero``) is refused at its first MiB. ``Trace.check`` reads everything once before the replay and
raises ``TraceError`` (``FILE:LINE: what is wrong``) at the first bad row; iterating a ``Trace``
then yields its requests.
"""
from __future__ import annotations

import _csv
import bisect
import csv
import dataclasses
import datetime
import heapq
import itertools
import math
import random
import re
from collections.abc import Iterator, Sequence
from typing import TextIO

import orjson

from .types import Replayed, Request

BYTES_PER_TOKEN = 4  # a request body's JSON per prompt token, roughly (English text, its envelope)
MAX_TOKENS = 10_000_000  # a request's tokens in or out: far beyond any context window or answer
MAX_SPAN_S = 10 * 365.25 * 86400  # the latest arrival after the first: ten years
MAX_LINE_BYTES = 1 << 20  # a line, its end included (a row of the Azure traces is ~40 bytes)
_SHOWN = 40  # the characters of a bad value an error quotes
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
            raise ValueError(f"timestamp {_shown(text)} is neither ISO 8601 nor seconds") from None
        y, mo, d, h, mi, s, frac, zone = m.groups()
        tz = datetime.timezone.utc
        if zone and zone != "Z":
            sign = -1 if zone[0] == "-" else 1
            digits = zone[1:].replace(":", "")
            tz = datetime.timezone(sign * datetime.timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
        try:
            when = datetime.datetime(int(y), int(mo), int(d), int(h or 0), int(mi or 0), int(s or 0), tzinfo=tz)
        except ValueError as exc:
            raise ValueError(f"timestamp {_shown(text)}: {exc}") from None
        return when.timestamp() + (float("0." + frac) if frac else 0.0)
    if not math.isfinite(value):
        raise ValueError(f"timestamp {_shown(text)} is not a finite number of seconds")
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
                while line := fh.readline(MAX_LINE_BYTES + 1):  # bounded as every read (module doc)
                    if line.strip():
                        return line.lstrip().startswith("{")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read it: {exc.strerror or exc}") from None
        return False

    def error(self, line: int, what: str) -> TraceError:
        return TraceError(f"{self.path}:{line}: {what}")

    def _lines(self, fh: TextIO) -> Iterator[str]:
        """The file's lines, each read with its bound: a longer one is an error, and is never
        held whole (at most MAX_LINE_BYTES + 1 characters of it are read)."""
        line = 0
        while text := fh.readline(MAX_LINE_BYTES + 1):
            line += 1
            # Characters first (cheap), then bytes for a line that may hold more than one per character.
            if len(text) > MAX_LINE_BYTES or (len(text) > MAX_LINE_BYTES // 4
                                              and len(text.encode()) > MAX_LINE_BYTES):
                raise self.error(line, f"a line longer than {MAX_LINE_BYTES >> 20} MiB")
            yield text

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
                        tokens_out = self._decoded(name, tokens_out, line)
                    yield Request(round(at - first, 6), name, tokens_in, tokens_out, stream, line)
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read it: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise TraceError(f"{self.path}: not UTF-8 text ({exc.reason})") from None

    def _decoded(self, name: str, engine_s: float, line: int) -> int:
        """The output tokens ``name`` decodes in ``engine_s`` (the access log's engine time)."""
        tokens = max(0, round(self._decode[name] * engine_s))
        if tokens > MAX_TOKENS:
            raise self.error(line, f"{engine_s:g} s in the engine is {tokens:,} output tokens at {name}'s decode "
                                   f"speed, more than {MAX_TOKENS:,}")
        return tokens

    def _csv_rows(self, fh: TextIO) -> Iterator[_Row]:
        reader = csv.reader(self._lines(fh))
        try:
            yield from self._csv_records(reader)
        except csv.Error as exc:  # a field past csv's own limit (131,072 characters), a stray NUL
            raise self.error(reader.line_num, f"not a CSV row: {exc}") from None

    def _csv_records(self, reader: _csv.Reader) -> Iterator[_Row]:
        header = next(reader, None)
        if header is None:
            raise self.error(1, "empty: a CSV trace starts with a header row")
        where = self._columns([h.strip().lower() for h in header])
        previous, first = -math.inf, None
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
            first = at if first is None else first
            if at - first > MAX_SPAN_S:
                raise self.error(line, f"timestamp {_shown(row[where['timestamp']].strip())} is more than ten "
                                       "years after the first row's")
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

    def _json_rows(self, fh: TextIO) -> Iterator[_Row]:
        """The access log's requests in arrival order, streamed (module doc): a first read checks
        every line and finds how far a line's arrival may come before an earlier line's (the
        longest duration, and the most a line's ``time`` falls behind one before it); the second
        holds a row only until no line after it can arrive earlier."""
        longest, lag, latest = 0.0, 0.0, -math.inf
        for end, duration, _ in self._json_records(fh):
            longest = max(longest, duration)
            lag = max(lag, latest - end)
            latest = max(latest, end)
        fh.seek(0)
        # A later line arrives no earlier than the latest end so far less lag and longest; a second
        # more keeps the float rounding of those sums on the safe side.
        behind = lag + longest + 1.0
        held: list[_Row] = []  # a heap in (arrival, line) order: the requests a later line may precede
        first: _Row | None = None
        latest = -math.inf
        for end, _, row in self._json_records(fh):
            heapq.heappush(held, row)
            latest = max(latest, end)
            while held and held[0][0] <= latest - behind:
                row = heapq.heappop(held)
                first = first or row
                yield self._within_span(row, first)
        while held:
            row = heapq.heappop(held)
            first = first or row
            yield self._within_span(row, first)

    def _within_span(self, row: _Row, first: _Row) -> _Row:
        if row[0] - first[0] > MAX_SPAN_S:
            raise self.error(row[1], f"arrives more than ten years after the first request (line {first[1]})")
        return row

    def _json_records(self, fh: TextIO) -> Iterator[tuple[float, float, _Row]]:
        """Each model-traffic line of the log, in the file's order: its ``time``, its duration, its
        row; TraceError at the first line that is no access log line."""
        for line, text in enumerate(self._lines(fh), 1):
            if not text.strip():
                continue
            try:
                rec = orjson.loads(text)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
                if rec.get("method") != "POST" or rec.get("route") not in TRAFFIC or not rec.get("deployment"):
                    continue  # not model traffic, or for no deployment that existed
                duration = _number(rec, "duration_s", MAX_SPAN_S, "seconds (ten years)")
                queued = _number(rec, "queued_s", MAX_SPAN_S, "seconds (ten years)") \
                    if rec.get("queued_s") is not None else 0.0
                bytes_in = _number(rec, "bytes_in", MAX_TOKENS * BYTES_PER_TOKEN, f"bytes ({MAX_TOKENS:,} tokens)")
                end = seconds(str(rec["time"]))
            except (ValueError, KeyError, orjson.JSONDecodeError) as exc:
                what = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc)
                raise self.error(line, f"not an access log line: {what}") from None
            yield end, duration, (end - duration, line, str(rec["deployment"]), int(bytes_in) // BYTES_PER_TOKEN,
                                  max(0.0, duration - queued), True)

    def _model(self, model: str, line: int, rng: random.Random) -> str:
        if model:
            name = self._names.get(model)
            if name is None:
                raise self.error(line, f"model {_shown(model)} is served by no deployment")
            return name
        if not self._cum:
            raise self.error(line, "the row names no model, and no deployment has a weight to give it one")
        return self._pick_names[bisect.bisect_right(self._cum, rng.random() * self._cum[-1])]


def _shown(value: object) -> str:
    """A value as an error quotes it: whole when short, else its beginning and its length."""
    if isinstance(value, str) and len(value) > _SHOWN:
        return f"{value[:_SHOWN]!r}... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= 2 * _SHOWN else f"{text[:_SHOWN]}... ({len(text):,} characters)"


def _count(text: str, column: str) -> int:
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{column} {_shown(text)} is not a whole number of tokens")
    # The digits are counted before int() reads them: a count of thousands of digits is refused as it is.
    if len(text.lstrip("0")) > len(str(MAX_TOKENS)) or int(text) > MAX_TOKENS:
        raise ValueError(f"{column} {_shown(text)} is more than {MAX_TOKENS:,} tokens")
    return int(text)


def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE or low == "":
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"stream {_shown(text)} is neither true nor false")


def _number(rec: dict[str, object], key: str, most: float, unit: str) -> float:
    """A number of the access log: finite, 0 or more, at most ``most`` (of ``unit``)."""
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} {_shown(value)} is not a number of 0 or more")
    if value > most:
        raise ValueError(f"{key} {value!r} is more than {most:,.0f} {unit}")
    return float(value)
