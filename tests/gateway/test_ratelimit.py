"""Failed key checks per peer (BEHAVIOUR.md, check 4, and "Key rotation": cleared on a change)."""
from __future__ import annotations

import pytest

from ondemand.gateway.ratelimit import FailureLimiter


class Clock:
    def __init__(self, t: float = 500.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_twenty_failures_block_with_retry_after_60():
    clock = Clock()
    lim = FailureLimiter(clock=clock)
    for _ in range(19):
        assert lim.retry_after("10.0.0.2") is None
        lim.fail("10.0.0.2")
        clock.t += 1
    assert lim.retry_after("10.0.0.2") is None
    lim.fail("10.0.0.2")
    assert lim.retry_after("10.0.0.2") == 60
    assert lim.retry_after("10.0.0.3") is None  # per peer


def test_blocked_for_the_rest_of_the_window_then_free():
    clock = Clock()
    lim = FailureLimiter(clock=clock)
    start = clock.t
    for _ in range(20):
        lim.fail("p")
    clock.t = start + 59.9
    assert lim.retry_after("p") == 60
    clock.t = start + 60.0
    assert lim.retry_after("p") is None
    lim.fail("p")  # a new window starts at this failure
    assert lim.retry_after("p") is None


def test_fixed_window_from_the_first_failure():
    clock = Clock()
    lim = FailureLimiter(clock=clock)
    start = clock.t
    for _ in range(19):
        lim.fail("p")
    clock.t = start + 61  # the window ended: its 19 failures are gone
    lim.fail("p")
    assert lim.retry_after("p") is None
    for _ in range(18):
        lim.fail("p")
    assert lim.retry_after("p") is None
    lim.fail("p")
    assert lim.retry_after("p") == 60


def test_clear_forgets_everything():
    lim = FailureLimiter(clock=Clock())
    for _ in range(25):
        lim.fail("a")
        lim.fail("b")
    assert lim.retry_after("a") == 60
    lim.clear()
    assert lim.retry_after("a") is None and lim.retry_after("b") is None and len(lim) == 0


def test_custom_limit_and_window():
    clock = Clock()
    lim = FailureLimiter(limit=2, window_s=10.0, clock=clock)
    lim.fail("p")
    lim.fail("p")
    assert lim.retry_after("p") == 10
    clock.t += 10
    assert lim.retry_after("p") is None
    with pytest.raises(ValueError):
        FailureLimiter(limit=0)


def test_expired_windows_are_pruned():
    clock = Clock()
    lim = FailureLimiter(clock=clock)
    for i in range(1023):
        lim.fail(f"10.0.{i // 256}.{i % 256}")
    assert len(lim) == 1023
    clock.t += 61
    lim.fail("fresh")  # the table reached its prune mark: the expired windows go
    assert len(lim) == 1


def test_memory_is_bounded_under_many_live_peers():
    clock = Clock()
    lim = FailureLimiter(clock=clock, max_peers=100)
    for i in range(10_000):
        lim.fail(i)
        assert len(lim) <= 100
    # The newest are kept; a blocked recent peer stays blocked.
    for _ in range(20):
        lim.fail("attacker")
    assert lim.retry_after("attacker") == 60
    assert len(lim) <= 100
