"""The replay's engine (replay/engine.py) batches as vLLM's does: a KV cache that admits a
request while its context fits, prefill shared by the engine, decode per request bounded per
engine. Each case by hand, on the virtual clock."""
from __future__ import annotations

import pytest

from ondemand.replay.clock import VirtualClock
from ondemand.replay.engine import Engine
from ondemand.replay.types import Costs


class Job:
    def __init__(self, name: str, input_tokens: int, output_tokens: int, log: list):
        self.name = name
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.log = log

    def first_token(self, at: float) -> None:
        self.log.append((round(at, 6), self.name, "first"))

    def ended(self, at: float) -> None:
        self.log.append((round(at, 6), self.name, "end"))


def run(costs: Costs, jobs: list[tuple[float, str, int, int]]) -> list[tuple[float, str, str]]:
    """Each job (arrival, name, input, output) enters at its arrival; what happened, in order."""
    clock = VirtualClock()
    engine = Engine(costs, clock)
    log: list = []
    for at, name, i, o in jobs:
        clock.call_later(at, lambda n=name, i=i, o=o: engine.enter(Job(n, i, o, log)))
    clock.run_while(lambda: True)
    assert engine.idle() and engine.kv_used == 0
    return log


def test_one_request_prefills_at_the_engines_rate_then_decodes_at_its_own():
    log = run(Costs(prefill_tokens_per_s=1000, decode_tokens_per_s=10), [(0, "a", 500, 20)])
    assert log == [(0.5, "a", "first"), (2.5, "a", "end")]


def test_requests_prefilling_together_share_the_engines_prefill():
    """Two 1,000-token prompts at 1,000 tokens/s: both take 2 s (not 1 s each, alone)."""
    log = run(Costs(prefill_tokens_per_s=1000, decode_tokens_per_s=10),
              [(0, "a", 1000, 10), (0, "b", 1000, 10)])
    assert log[:2] == [(2.0, "a", "first"), (2.0, "b", "first")]
    # One that arrives half-way gets the engine's half until the first is done, then all of it.
    log = run(Costs(prefill_tokens_per_s=1000, decode_tokens_per_s=10),
              [(0, "a", 1000, 10), (0.5, "b", 1000, 10)])
    firsts = [(t, n) for t, n, what in log if what == "first"]
    assert firsts == [(1.5, "a"), (2.0, "b")]


def test_a_request_waits_inside_the_engine_until_its_context_fits_in_the_kv_cache():
    costs = Costs(prefill_tokens_per_s=1e9, decode_tokens_per_s=10, kv_tokens=100)
    log = run(costs, [(0, "a", 40, 20), (0, "b", 40, 20), (0, "c", 10, 10)])
    # a (60) fits; b (60) does not beside it and waits, and c waits behind b (first come, first served)
    assert [x for x in log if x[1] == "a"] == [(0.0, "a", "first"), (2.0, "a", "end")]
    assert (2.0, "b", "first") in log and (2.0, "c", "first") in log
    assert log[-1] == (4.0, "b", "end")


def test_a_request_larger_than_the_cache_runs_alone():
    costs = Costs(prefill_tokens_per_s=1e9, decode_tokens_per_s=10, kv_tokens=100)
    log = run(costs, [(0, "big", 150, 10), (0, "small", 10, 10)])
    assert log == [(0.0, "big", "first"), (1.0, "big", "end"), (1.0, "small", "first"), (2.0, "small", "end")]


def test_decode_is_bounded_by_the_engine_as_a_whole():
    """Four requests decoding at 50 tokens/s each, on an engine that decodes 100 in all: 25 each."""
    costs = Costs(prefill_tokens_per_s=1e9, decode_tokens_per_s=50, decode_batch_tokens_per_s=100)
    log = run(costs, [(0, n, 1, 50) for n in "abcd"])
    assert sorted(t for t, _, what in log if what == "end") == [pytest.approx(2.0)] * 4
    # Alone it decodes at its own 50 tokens/s: the engine's bound does not bind.
    assert run(costs, [(0, "a", 1, 50)])[-1] == (1.0, "a", "end")


def test_max_concurrency_bounds_the_requests_running_at_once():
    costs = Costs(prefill_tokens_per_s=1e9, decode_tokens_per_s=10, max_concurrency=1)
    log = run(costs, [(0, "a", 1, 10), (0, "b", 1, 10)])
    assert [x for x in log if x[2] == "end"] == [(1.0, "a", "end"), (2.0, "b", "end")]


def test_a_request_with_no_output_ends_with_its_prefill():
    log = run(Costs(prefill_tokens_per_s=100, decode_tokens_per_s=10), [(0, "a", 100, 0)])
    assert log == [(1.0, "a", "first"), (1.0, "a", "end")]


def test_many_requests_in_logarithmic_time():
    """10,000 requests at once on one engine: the phases' heaps keep each event O(log n)."""
    import time
    costs = Costs(prefill_tokens_per_s=10000, decode_tokens_per_s=50, kv_tokens=10**9, max_concurrency=10**6)
    t0 = time.process_time()
    log = run(costs, [(i * 0.001, f"r{i}", 100, 20) for i in range(10_000)])
    assert len(log) == 20_000
    assert time.process_time() - t0 < 5  # a quadratic engine takes minutes here
