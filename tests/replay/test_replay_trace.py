"""The replay's trace (ondemand/replay/trace.py): CSV with the Azure traces' own columns or
named ones, ondemand's JSON access log, the seeded model assignment, and every bad row named
with its file and line."""
from __future__ import annotations

import collections

import orjson
import pytest

from ondemand.gateway.accesslog import json_line
from ondemand.gateway.exchange import Exchange
from ondemand.model import Deployment
from ondemand.replay.trace import Trace, TraceError, seconds
from ondemand.replay.types import Costs, Replayed


def deps(*weights: float) -> list[Replayed]:
    return [Replayed(Deployment(id=i + 1, name=f"m{i}", served_name=f"Org/M{i}"), Costs(decode_tokens_per_s=40),
                     w) for i, w in enumerate(weights)]


def write(tmp_path, text: str, name: str = "t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_azure_columns_are_read_as_they_are(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                           "2023-11-16 18:15:46.6805900,374,44\n"
                           "2023-11-16 18:15:50.9951690,396,109\n")
    reqs = list(Trace(path, deps(1)))
    assert [(r.at_s, r.model, r.input_tokens, r.output_tokens, r.stream, r.line) for r in reqs] == [
        (0.0, "m0", 374, 44, True, 2), (4.314579, "m0", 396, 109, True, 3)]


def test_named_columns_in_any_case_and_order_with_models_and_stream(tmp_path):
    path = write(tmp_path, "Stream,output_tokens,Model,timestamp,INPUT_TOKENS,extra\n"
                           "false,5,Org/M1,100.5,7,x\n"
                           "true,6,m0,101,8,y\n"
                           ",7,m1,102.25,9,z\n")
    reqs = list(Trace(path, deps(1, 1)))
    assert [(r.at_s, r.model, r.input_tokens, r.output_tokens, r.stream) for r in reqs] == [
        (0.0, "m1", 7, 5, False), (0.5, "m0", 8, 6, True), (1.75, "m1", 9, 7, True)]


def test_iso_timestamps_with_zones_and_fractions():
    assert seconds("1970-01-01T00:00:01Z") == 1.0
    assert seconds("1970-01-01 01:00:00+01:00") == 0.0
    assert seconds("1970-01-01T00:00:00.1234567") == pytest.approx(0.1234567)
    assert seconds("12.5") == 12.5


def test_rows_without_a_model_are_assigned_by_weight_the_same_way_for_the_same_seed(tmp_path):
    rows = "".join(f"{i},10,10\n" for i in range(4000))
    path = write(tmp_path, "timestamp,input_tokens,output_tokens\n" + rows)
    d = deps(6, 3, 1, 0)
    first = [r.model for r in Trace(path, d, seed=7)]
    assert first == [r.model for r in Trace(path, d, seed=7)]  # read again: the same requests
    assert first != [r.model for r in Trace(path, d, seed=8)]
    counts = collections.Counter(first)
    assert "m3" not in counts  # weight 0: never given a row
    assert counts["m0"] / 4000 == pytest.approx(0.6, abs=0.03)
    assert counts["m1"] / 4000 == pytest.approx(0.3, abs=0.03)
    assert counts["m2"] / 4000 == pytest.approx(0.1, abs=0.02)


def test_check_counts_the_requests_the_span_and_each_model(tmp_path):
    path = write(tmp_path, "timestamp,model,input_tokens,output_tokens\n10,m0,1,1\n12,m1,1,1\n40,m0,1,1\n")
    s = Trace(path, deps(1, 1)).check()
    assert (s.requests, s.span_s, s.models) == (3, 30.0, {"m0": 2, "m1": 1})


@pytest.mark.parametrize("text,line,says", [
    ("time,input_tokens,output_tokens\n1,2,3\n", 1, "no timestamp column (the header has: time, "),
    ("timestamp,input_tokens\n1,2\n", 1, "no output_tokens or generatedtokens column"),
    ("timestamp,input_tokens,output_tokens\n1,2,3\nyesterday,2,3\n", 3, "timestamp 'yesterday' is neither"),
    ("timestamp,input_tokens,output_tokens\n1,2,3\n2,-2,3\n", 3, "input_tokens '-2' is not a whole number"),
    ("timestamp,ContextTokens,GeneratedTokens\n1,2,3.5\n", 2, "GeneratedTokens '3.5' is not a whole number"),
    ("timestamp,input_tokens,output_tokens\n5,2,3\n4,2,3\n", 3, "earlier than the row before it"),
    ("timestamp,model,input_tokens,output_tokens\n1,m0,2,3\n2,gpt-9,2,3\n", 3,
     "model 'gpt-9' is served by no deployment"),
    ("timestamp,input_tokens,output_tokens,stream\n1,2,3,maybe\n", 2, "stream 'maybe' is neither"),
    ("timestamp,input_tokens,output_tokens\n1,2\n", 2, "2 columns, the header has 3"),
    ("", 1, "empty: a CSV trace starts with a header row"),
])
def test_a_bad_row_is_named_with_its_file_and_line(tmp_path, text, line, says):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as e:
        Trace(path, deps(1)).check()
    assert str(e.value).startswith(f"{path}:{line}: ")
    assert says in str(e.value)


def test_a_row_without_a_model_when_no_deployment_has_a_weight(tmp_path):
    path = write(tmp_path, "timestamp,input_tokens,output_tokens\n1,2,3\n")
    with pytest.raises(TraceError, match=r":2: the row names no model, and no deployment has a weight"):
        Trace(path, deps(0)).check()


def test_an_unreadable_or_empty_trace(tmp_path):
    with pytest.raises(TraceError, match="cannot read it"):
        Trace(str(tmp_path / "none.csv"), deps(1)).check()
    with pytest.raises(TraceError, match="no request to replay"):
        Trace(write(tmp_path, "timestamp,input_tokens,output_tokens\n"), deps(1)).check()


def exchange(deployment: str, route: str = "chat/completions", method: str = "POST", *, duration: float,
             queued: float | None = None, bytes_in: int = 400) -> Exchange:
    ex = Exchange("rid", method, "10.0.0.1", 0.0)
    ex.deployment, ex.route, ex.status = deployment, route, 200
    ex.bytes_in, ex.duration_s, ex.queued_s = bytes_in, duration, queued
    return ex


def test_the_access_log_is_replayed_in_arrival_order(tmp_path):
    """Lines are written as requests end: the arrival is ``time`` less ``duration_s``. The
    input is the body's bytes / 4; the output is what the deployment decodes (40 tokens/s here)
    in the time the request spent in the engine (its duration less the time it queued)."""
    lines = [json_line(exchange("m0", duration=2.0, bytes_in=400), 1000.0),  # arrived 998
             json_line(exchange("m1", duration=10.0, queued=7.5, bytes_in=80), 1001.0),  # arrived 991
             json_line(exchange("m1", "models", "GET", duration=0.01), 1002.0),  # not model traffic
             json_line(exchange("", duration=0.01), 1003.0),  # named no deployment: a 404
             "\n"]
    path = write(tmp_path, "".join(lines), "access.log")
    reqs = list(Trace(path, deps(1, 1)))
    assert [(r.at_s, r.model, r.input_tokens, r.output_tokens, r.line) for r in reqs] == [
        (0.0, "m1", 20, 100, 2), (7.0, "m0", 100, 80, 1)]


def test_a_bad_access_log_line_is_named(tmp_path):
    good = json_line(exchange("m0", duration=1.0), 1000.0)
    for bad, says in [("{not json\n", "not an access log line"),
                      ('{"method": "POST", "route": "completions", "deployment": "m0"}\n', "no 'duration_s' field"),
                      (json_line(exchange("zz", duration=1.0), 1000.0), "model 'zz' is served by no deployment")]:
        path = write(tmp_path, good + bad, "a.jsonl")
        with pytest.raises(TraceError) as e:
            Trace(path, deps(1)).check()
        assert str(e.value).startswith(f"{path}:2: ") and says in str(e.value)


HEADER = "timestamp,input_tokens,output_tokens\n"


@pytest.mark.parametrize("text,line,says", [
    (HEADER + "1,10000000,1\n2,10000001,1\n", 3, "input_tokens '10000001' is more than 10,000,000 tokens"),
    (HEADER + "1,1," + "9" * 4000 + "\n", 2, "output_tokens '9999999999999999999999999999999999999999'... "
                                             "(4,000 characters) is more than 10,000,000 tokens"),
    (HEADER + "1,\u00b2,1\n", 2, "input_tokens '\u00b2' is not a whole number"),  # a digit to isdigit(), not to int()
    (HEADER + "1,1,1\n" + f"{1 + 10 * 365.25 * 86400 + 1},1,1\n", 3, "is more than ten years after the first row's"),
    (HEADER + "1,1,1\n" + "9" * 400 + ",1,1\n", 3, "timestamp '9999999999999999999999999999999999999999'... "
                                                    "(400 characters) is not a finite number"),
    (HEADER + "1,1,1\n2,1,1," + "x" * 200_000 + "\n", 3, "not a CSV row: field larger than field limit"),
    ("timestamp,model,input_tokens,output_tokens\n1," + "m" * 200_000 + ",1,1\n", 2,
     "not a CSV row: field larger than field limit"),
    (HEADER + "1,1,1\n" + "2,1,1" + " " * (1 << 20) + "\n", 3, "a line longer than 1 MiB"),
    (HEADER + "1,1,1\n" + "2,1,1," + "\u20ac" * 400_000 + "\n", 3, "a line longer than 1 MiB"),  # 1.2 MB in 0.4 M characters
], ids=["tokens", "digits", "not-ascii", "ten-years", "timestamp", "field", "model", "line", "line-bytes"])
def test_numbers_and_lines_beyond_what_a_trace_can_mean_are_bad_rows(tmp_path, text, line, says):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as e:
        Trace(path, deps(1)).check()
    message = str(e.value)
    assert message.startswith(f"{path}:{line}: ") and says in message, message
    assert len(message) < 300  # one short line, whatever the value's length


def test_a_model_named_at_length_is_quoted_short(tmp_path):
    path = write(tmp_path, "timestamp,model,input_tokens,output_tokens\n1," + "m" * 100_000 + ",1,1\n")
    with pytest.raises(TraceError) as e:
        Trace(path, deps(1)).check()
    assert str(e.value) == f"{path}:2: model '{'m' * 40}'... (100,000 characters) is served by no deployment"


def test_an_endless_line_is_refused_at_its_first_mib(tmp_path):
    """A line without end (/dev/zero's, here 16 MiB of it) is read 1 MiB + 1 at a time and
    refused, never held (/dev/zero grew to gigabytes); without an extension, its first line
    decides the form."""
    import tracemalloc
    path = tmp_path / "zeros"
    with open(path, "wb") as fh:
        fh.truncate(16 << 20)  # sparse: no disk spent
    tracemalloc.start()
    try:
        with pytest.raises(TraceError) as e:
            Trace(str(path), deps(1)).check()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value) == f"{path}:1: a line longer than 1 MiB"
    assert peak < 4 << 20


def access_line(**fields) -> str:
    """A line of the access log (a request of m0 that ended at 1000 s after 1 s), with ``fields``."""
    rec = orjson.loads(json_line(exchange("m0", duration=1.0), 1000.0))
    rec.update(fields)
    return orjson.dumps(rec).decode() + "\n"


@pytest.mark.parametrize("bad,says", [
    (access_line(duration_s=1e308), "duration_s 1e+308 is more than 315,576,000 seconds (ten years)"),
    (access_line(queued_s=1e300), "queued_s 1e+300 is more than 315,576,000 seconds (ten years)"),
    (access_line(duration_s=1.0).replace('"duration_s":1.0', '"duration_s":1e999'), "not an access log line"),
    (access_line(bytes_in=40_000_004), "bytes_in 40000004 is more than 40,000,000 bytes (10,000,000 tokens)"),
    (access_line(duration_s=-1), "duration_s -1 is not a number of 0 or more"),
    (access_line(bytes_in=["x" * 100_000]), "bytes_in ['" + "x" * 38 + "... (100,004 characters) is not a number"),
    (access_line(duration_s=300_000.0), "300000 s in the engine is 12,000,000 output tokens at m0's decode speed"),
    (access_line(time=1000.0 + 11 * 365.25 * 86400), "arrives more than ten years after the first request (line 1)"),
    (access_line(time="9" * 400), "timestamp '9999999999999999999999999999999999999999'... (400 characters) is not a "
                                  "finite number of seconds"),
])
def test_an_access_log_number_beyond_what_it_can_mean_is_named(tmp_path, bad, says):
    path = write(tmp_path, access_line() + bad, "a.jsonl")
    with pytest.raises(TraceError) as e:
        Trace(path, deps(1)).check()
    assert str(e.value).startswith(f"{path}:2: ") and says in str(e.value), str(e.value)


def test_the_bounds_themselves_are_replayed(tmp_path):
    """10^7 tokens and an arrival ten years after the first are still a trace."""
    path = write(tmp_path, HEADER + f"0,10000000,10000000\n{10 * 365.25 * 86400},1,0000000000010000000\n")
    assert [(r.at_s, r.input_tokens, r.output_tokens) for r in Trace(path, deps(1))] == [
        (0.0, 10_000_000, 10_000_000), (315_576_000.0, 1, 10_000_000)]
