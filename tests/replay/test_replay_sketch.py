"""The replay's quantile sketch (ondemand/replay/sketch.py): every quantile within its stated
relative error of the exact one (zeros, ties and tiny values included), the count, least and
greatest exact, merges that give the sketch of both, and a tally whose memory does not grow
with the requests it counts."""
from __future__ import annotations

import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ondemand.replay.sketch import RELATIVE_ACCURACY, TINY, Sketch
from ondemand.replay.types import Tally


def exact(values: list[float], q: float) -> float:
    """The quantile the report meant before the sketch: linear between the nearest ranks of the
    sorted values."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def within_bound(estimate: float, true: float) -> bool:
    # The bound, and a hair for the float arithmetic of the interpolation (1e-12 of the value).
    return abs(estimate - true) <= RELATIVE_ACCURACY * true + TINY + 1e-12 * true


# Seconds as the replay meets them: exact zeros, tiny values, ties, and a spread over decades.
SECONDS = st.one_of(st.just(0.0), st.sampled_from([60.0, 60.2, 3.2, 0.2, 900.0]),
                    st.floats(min_value=0.0, max_value=1e-8),
                    st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False))


@settings(max_examples=300, deadline=None)
@given(st.lists(SECONDS, min_size=1, max_size=400), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8))
def test_every_quantile_is_within_the_relative_error_of_the_exact_one(values, qs):
    s = Sketch(values)
    assert (s.count, s.min, s.max) == (len(values), min(values), max(values))
    for q in [*qs, 0.0, 0.5, 0.9, 0.99, 1.0]:
        got, want = s.quantile(q), exact(values, q)
        assert got is not None and within_bound(got, want), (q, got, want)


@settings(max_examples=100, deadline=None)
@given(st.lists(SECONDS, min_size=1, max_size=200), st.lists(SECONDS, max_size=200))
def test_a_merge_is_the_sketch_of_both(a, b):
    merged = Sketch(a)
    merged.merge(Sketch(b))
    both = Sketch(a + b)
    assert (merged.count, merged.min, merged.max) == (both.count, both.min, both.max)
    assert merged._counts == both._counts and merged._offset == both._offset  # the same buckets
    for q in (0.0, 0.25, 0.5, 0.9, 0.99, 1.0):
        got = merged.quantile(q)
        assert got is not None and within_bound(got, exact(a + b, q))


def test_ties_zeros_and_the_ends_are_exact():
    """A bucket of one value many times gives that value (the cold start's 60 s); zeros give 0;
    the least and the greatest are the values themselves."""
    s = Sketch([0.0] * 50 + [60.0] * 100 + [60.2] * 10 + [0.2004, 0.2005])
    assert s.quantile(0.0) == 0.0 and s.quantile(0.3) == 0.0
    assert s.quantile(0.5) == pytest.approx(60.0, rel=1e-12) and s.quantile(0.9) == pytest.approx(60.0, rel=1e-12)
    assert s.quantile(1.0) == 60.2
    assert Sketch([7.5]).quantile(0.5) == 7.5
    assert Sketch().quantile(0.5) is None


def test_values_it_cannot_take_are_refused():
    for bad in (-1.0, -1e-300, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite values of 0 or more"):
            Sketch().add(bad)


def test_ranks_in_one_pass_are_the_quantiles_ranks():
    values = [random.Random(1).lognormvariate(0, 2) for _ in range(1000)]
    s = Sketch(values)
    ordered = sorted(values)
    ranks = [0, 1, 10, 500, 998, 999]
    for k, got in zip(ranks, s.at_ranks(ranks), strict=True):
        assert within_bound(got, ordered[k])
    with pytest.raises(IndexError):
        list(s.at_ranks([1000]))


def _feed(tally: Tally, n: int) -> None:
    """n TTFTs and waits spread over 1 ms .. 1000 s (their span reached in the first hundred),
    and a wait of nothing every other time."""
    for i in range(n):
        x = 10 ** (-3 + 6 * ((i * 0.6180339887) % 1.0))
        tally.add_ttft(x)
        tally.add_wait(0.0 if i % 2 else x)


def _peak_bytes(n: int) -> int:
    tracemalloc.start()
    try:
        tally = Tally()
        _feed(tally, n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tally.ttft.count == tally.wait.count == n
    return peak


def test_a_tallys_memory_does_not_grow_with_the_requests():
    """10,000 requests and 100,000 over the same span of values: the same buckets, so the same
    memory, within a KiB (the arrays before held 8 bytes a value each: 1.4 MB more). The span
    itself, 1 ms to 1000 s, is two runs of 2,771 buckets of 8 bytes."""
    small, large = _peak_bytes(10_000), _peak_bytes(100_000)
    assert large - small < 1024, (small, large)
    assert small < 2 * 2771 * 16 + 16_384  # both sketches' runs, and the tally itself


def test_a_tally_that_keeps_its_values_keeps_them_through_a_reset():
    t = Tally.keeping(True)
    t.add_ttft(1.5)
    t.add_wait(0.0)
    assert (t.ttfts, t.waits, t.ttft.count) == ([1.5], [0.0], 1)
    t.reset()
    assert (t.ttfts, t.waits, t.ttft.count) == ([], [], 0)
    assert Tally().ttfts is None and Tally.keeping(False).waits is None
