"""A replay's requests at the gateway's edge (ondemand/replay/flights.py): what each request
waited for and how long, its TTFT, and how it ended (served, refused at once, timed out in the
queue, rejected at its arrival), tallied for its deployment and the box. Cases whose answers
follow by hand, each through ondemand's own controller (test_replay_run.py's helpers and costs:
a cold start 60 s, a wake 3 s, 1000 tokens in and 100 out are 0.2 s of prefill and 2 s of
decode)."""
from __future__ import annotations

import pytest
from test_replay_run import THREE, dep, req, run

from ondemand.replay.types import Box, Costs


def test_a_requests_wait_is_what_the_scheduling_cost_it():
    """wait_s runs from arrival to the moment a ready engine takes the request: the cold start's
    60 s for the first, 50 s for the second (it came at 10 s), the wake's 3 s for the third; the
    TTFT adds the prefill. Only the wake's wait meets a 5 s SLO."""
    r = run([dep(1, "a", 40)], THREE)
    t = r.total
    assert t.waits == pytest.approx([60.0, 50.0, 3.0])
    assert (t.wait_slo_met, t.timed_out, t.refused, t.rejected) == (1, 0, 0, 0)
    assert r.per_deployment["a"].waits == t.waits


def test_inside_a_busy_engine_requests_wait_their_turn():
    """One at a time in the engine: the second waits for the first's 2.2 s; it waited for nothing
    at the gateway (ready), its wait is inside the engine."""
    r = run([dep(1, "a", 40, costs=Costs(max_concurrency=1))], [req(0), req(0), req(0.5)], "always-on")
    assert r.total.ttfts == pytest.approx([0.2, 2.4, 4.6 - 0.5])
    assert r.total.waited["ready"] == 3


def test_a_non_streamed_request_gets_its_first_token_with_its_last():
    r = run([dep(1, "a", 40)], [req(0, stream=False)], "always-on")
    assert r.total.ttfts == pytest.approx([2.2])


def test_max_inflight_refuses_at_once():
    """One request at a time through the gateway: the second, while the first decodes 5000
    tokens (100 s), is refused at once (429, counted failed); an always-on deployment's requests
    take no slot, so its limit never refuses (the gateway's rule)."""
    r = run([dep(1, "a", 40, max_inflight=1)], [req(0, tokens_out=5000), req(70)])
    assert (r.total.served, r.total.failed, r.total.waited["ready"]) == (1, 1, 1)
    r = run([dep(1, "a", 40, max_inflight=1)], [req(0, tokens_out=5000), req(70)], "always-on")
    assert (r.total.served, r.total.failed) == (2, 0)


def test_a_request_that_times_out_in_the_queue_waited_until_its_deadline():
    """b waits for memory behind a busy a (decoding 100 s); with a 30 s queue timeout its request
    times out at 100 s: timed out, its wait the 30 s to its deadline."""
    box = Box(gpus=(80.0,), host_gib=512, queue_timeout_s=30)
    r = run([dep(1, "a", 50), dep(2, "b", 50)], [req(0, tokens_out=5000), req(70, "b")], box=box)
    b = r.per_deployment["b"]
    assert (b.timed_out, b.refused, b.failed, b.served) == (1, 0, 1, 0)
    assert b.waits == pytest.approx([30.0]) and b.waited["queue"] == 1


def test_a_request_longer_than_max_model_len_is_rejected_at_its_arrival():
    """As vLLM answers a request whose input and output exceed max_model_len: at once, starting
    nothing; counted apart from the failures, and out of the wait SLO's denominator."""
    r = run([dep(1, "a", 40, costs=Costs(max_model_len=4096))], [req(0, tokens_in=4000, tokens_out=100), req(5)])
    t = r.total
    assert (t.requests, t.rejected, t.failed, t.served, t.cold_starts) == (2, 1, 0, 1, 1)
    assert t.waits == pytest.approx([60.0]) and t.waited["cold"] == 1  # the second started it
    r = run([dep(1, "a", 40, costs=Costs(max_model_len=4096))], [req(0, tokens_in=4000, tokens_out=100)])
    assert (r.total.rejected, r.total.cold_starts, r.end_s) == (1, 0, 0.0)
