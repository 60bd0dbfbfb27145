"""The access log as a trace streams (ondemand/replay/trace.py): its requests come in arrival
order, as if every line had been read and sorted, while only those a later line may still
precede are held, so memory does not grow with the log's length."""
from __future__ import annotations

import tracemalloc

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from ondemand.model import Deployment
from ondemand.replay.trace import Trace
from ondemand.replay.types import Costs, Replayed

DEPS = [Replayed(Deployment(id=1, name="m0", served_name="Org/M0"), Costs(decode_tokens_per_s=40))]


def line(end: float, duration: float, bytes_in: int = 400) -> str:
    return orjson.dumps({"time": end, "method": "POST", "route": "chat/completions", "deployment": "m0",
                         "status": 200, "bytes_in": bytes_in, "duration_s": duration}).decode() + "\n"


# A line's end moves on from the one before, or falls a little behind it (the log's writes race);
# durations from nothing to a long generation.
STEPS = st.lists(st.tuples(st.floats(-5.0, 30.0), st.floats(0.0, 600.0), st.integers(0, 4000)),
                 min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_requests_come_in_arrival_order_as_a_sort_of_the_whole_log_gives(tmp_path_factory, steps):
    end, lines, rows = 1_000_000.0, [], []
    for n, (step, duration, bytes_in) in enumerate(steps, 1):
        end += step
        lines.append(line(end, duration, bytes_in))
        rows.append((end - duration, n, bytes_in // 4))
    path = tmp_path_factory.mktemp("log") / "access.jsonl"
    path.write_text("".join(lines))
    rows.sort()
    want = [(round(at - rows[0][0], 6), n, tokens) for at, n, tokens in rows]
    assert [(r.at_s, r.line, r.input_tokens) for r in Trace(str(path), DEPS)] == want


def _peak_bytes(path: str) -> tuple[int, int]:
    """The peak of traced memory while the trace's requests are counted, not kept."""
    tracemalloc.start()
    try:
        n = sum(1 for _ in Trace(path, DEPS))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return n, peak


def test_memory_does_not_grow_with_the_logs_length(tmp_path):
    """2,000 lines and 20,000 of the same traffic (a request a second, each 3 s long, every
    tenth ending out of order): the larger holds the same few requests at a time. Read whole and
    sorted, the 18,000 more cost some 5 MB."""
    sizes = []
    for count in (2_000, 20_000):
        path = tmp_path / f"{count}.jsonl"
        path.write_text("".join(line(1000.0 + i + (0.5 if i % 10 == 0 else 0.0), 3.0) for i in range(count)))
        n, peak = _peak_bytes(str(path))
        assert n == count
        sizes.append(peak)
    assert sizes[1] - sizes[0] < 64 << 10, sizes
