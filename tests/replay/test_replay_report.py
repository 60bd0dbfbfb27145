"""What a replay says (ondemand/replay/report.py): the JSON in exactly its documented shape and
the same bytes for the same inputs, and the table (its page: test_replay_page.py, from these
results)."""
from __future__ import annotations

import orjson
import pytest

from ondemand.model import Deployment, Mode, State
from ondemand.replay import report
from ondemand.replay.run import replay
from ondemand.replay.sketch import Sketch
from ondemand.replay.types import Box, Costs, Policy, Replayed, Request

BOX = Box(gpus=(80.0, 80.0), host_gib=512)
POLICIES = [Policy.parse(p) for p in ("current", "ttl=300", "always-on")]
FIELDS = {"requests", "served", "failed", "timed_out", "refused", "rejected", "wait_slo_met", "wait_s", "slo_met",
          "ttft_s", "waited", "cold_starts", "wakes", "sleeps", "stops", "prewarms", "prewarm_hits", "gpu_hours",
          "gpu_gib_hours"}


def deps() -> list[Replayed]:
    return [Replayed(Deployment(id=i + 1, name=n, served_name=n.upper(), engine="vllm", model=n, memory_gib=gib,
                                gpu_count=1, mode=Mode.ON_DEMAND, state=State.STOPPED), Costs())
            for i, (n, gib) in enumerate([("a", 60), ("b", 60), ("c", 60)])]


def results():
    reqs = [Request(0, "a", 1000, 100), Request(10, "b", 1000, 100), Request(20, "c", 1000, 100),
            Request(1000, "a", 1000, 100)]
    return replay(reqs, deps(), BOX, POLICIES)


def test_percentiles_are_linear_between_the_nearest_ranks():
    """Of the sketch (sketch.py): exact here, each rank's value alone in its bucket or the least
    or greatest (the bound's tests: test_replay_sketch.py)."""
    assert Sketch().quantile(0.5) is None
    assert Sketch([3.0]).quantile(0.99) == 3.0
    assert Sketch([1.0, 2.0, 3.0, 4.0]).quantile(0.5) == 2.5
    assert Sketch([float(i) for i in range(101)]).quantile(0.99) == pytest.approx(99.0)


def test_the_json_has_exactly_the_documented_shape():
    """Under current, c (at 20 s) waits for a's idle timeout and takes a's GPU; a, asleep there,
    wakes on its own GPU only (a wake keeps its GPUs), so at 1000 s it waits for c's idle timeout
    in turn: c ends at 726.65 s, is put to sleep at 1326.7 s (2 s), a wakes (3 s): its first token at
    1331.7 s, its last at 1333.7 s, the longest of the three policies'."""
    doc = report.to_json(results(), BOX, requests=4, models=3)
    assert set(doc) == {"trace", "box", "policies"}
    assert doc["trace"] == {"requests": 4, "duration_s": 1333.7, "models": 3}
    assert doc["box"] == {"gpus": [80.0, 80.0]}
    assert list(doc["policies"]) == ["current", "ttl=300", "always-on"]  # as typed, in their order
    for body in doc["policies"].values():
        assert set(body) == FIELDS | {"per_deployment"}
        assert set(body["ttft_s"]) == set(body["wait_s"]) == {"p50", "p90", "p99", "max"}
        assert set(body["waited"]) == {"ready", "wake", "cold", "queue"}
        assert list(body["per_deployment"]) == ["a", "b", "c"]
        for one in body["per_deployment"].values():
            assert set(one) == FIELDS
    always = doc["policies"]["always-on"]
    # Two of the three 60 GiB models fit on 2 x 80 GiB: c's request is refused.
    assert (always["requests"], always["served"], always["failed"], always["slo_met"]) == (4, 3, 1, 0.75)
    assert (always["refused"], always["timed_out"], always["rejected"], always["wait_slo_met"]) == (1, 0, 0, 0.75)
    assert always["wait_s"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    assert always["per_deployment"]["c"]["ttft_s"] == {"p50": None, "p90": None, "p99": None, "max": None}
    current = doc["policies"]["current"]
    assert (current["cold_starts"], current["wakes"], current["sleeps"]) == (3, 1, 3)
    # a's two TTFTs, 60.2 and 331.7 s (the sketch's least and greatest: exact), interpolated to
    # 195.95, 304.55 and 328.985 s; percentiles are given to 3 significant digits, max to the ms.
    assert current["per_deployment"]["a"]["ttft_s"] == {"p50": 196.0, "p90": 305.0, "p99": 329.0, "max": 331.7}
    # GPU 0 held from 0 s, GPU 1 from 10 s, both to the end; a held 60 GiB until its sleep's call
    # ended, then 2, and 60 again from its wake.
    assert current["gpu_hours"] == round((1333.7 + 1323.7) / 3600, 3)
    assert current["per_deployment"]["a"]["gpu_gib_hours"] == round(
        (60 * 664.25 + 2 * (1328.5 - 664.25) + 60 * (1333.7 - 1328.5)) / 3600, 3)


def test_a_warm_up_is_said_in_the_trace_and_the_hit_rate_in_the_table():
    doc = report.to_json(results(), BOX, requests=4, models=3, measured_from_s=500)
    assert doc["trace"] == {"requests": 4, "duration_s": 1333.7, "models": 3, "measured_from_s": 500}
    assert (report.hit_rate(0, 0), report.hit_rate(7, 9)) == ("-", "7/9 (78 %)")
    assert report.table(results(), 5.0).splitlines()[1].split()[-2] == "-"  # no pre-warm: fixed warmth


def test_the_same_inputs_give_the_same_bytes():
    one = report.json_bytes(report.to_json(results(), BOX, 4, 3))
    assert one == report.json_bytes(report.to_json(results(), BOX, 4, 3))
    assert orjson.loads(one)["policies"]["ttl=300"]["stops"] == 3


def test_the_table_has_a_row_a_policy():
    text = report.table(results(), 5.0)
    lines = text.splitlines()
    assert lines[0].split()[:7] == ["policy", "wait", "≤", "5", "s", "failed", "GiB-h"]
    assert [ln.split()[0] for ln in lines[1:]] == ["current", "ttl=300", "always-on"]
    assert "75.0 %" in lines[3]
    md = report.markdown(results(), 5.0).splitlines()
    assert md[0].startswith("| policy | wait ≤ 5 s | failed | GiB-h | requests |") and md[1].startswith("| --- | ---: |") and len(md) == 5
