"""A replay keeps the page's timelines (every change of memory and of the queue: they grow with
the trace) only when a page will draw them (ondemand/replay/run.py); the tallies' part is
test_replay_sketch.py's, the whole replay's is scripts/replay_memory.py's (bench/replay.md)."""
from __future__ import annotations

from collections.abc import Iterator

from test_replay_run import BOX, dep, req

from ondemand.replay.run import replay
from ondemand.replay.types import Policy, Request

POLICIES = [Policy.parse(p) for p in ("current", "ttl=60", "lru=60")]
DEPS = [dep(1, "a", 50), dep(2, "b", 50)]


def traffic(hours: int) -> Iterator[Request]:
    """a and b in turn on one GPU that holds one of them: bursts of a, then of b, each hour alike
    (a queue, make-room, cold starts: every part of a run at work), as a generator."""
    for h in range(hours):
        for k in range(120):
            at = h * 3600 + k * 30.0
            yield req(at, "a" if (k // 20) % 2 == 0 else "b", tokens_out=50 + (k * 37) % 200)


def test_without_timelines_the_results_are_the_same_but_the_timelines():
    """ondemand replay without --html: the same tallies, to the sketches' bits, and no timeline."""
    drawn = replay(traffic(2), DEPS, BOX, POLICIES)
    bare = replay(traffic(2), DEPS, BOX, POLICIES, timelines=False)
    for d, b in zip(drawn, bare, strict=True):
        assert (d.policy, d.total, d.per_deployment, d.end_s) == (b.policy, b.total, b.per_deployment, b.end_s)
        assert d.memory and d.queue and (b.memory, b.queue) == ([], [])
    assert len(drawn[0].queue) > 100  # current queues for memory at every turn
