"""The world a replay's controller lives in (ondemand/replay/world.py): the box, the deployer
and the engines on the virtual clock. Its ledger alone, booked by hand; then cases whose answers
follow by hand, each through ondemand's own controller (test_replay_run.py's helpers and costs:
a cold start 60 s, a level-1 wake 3 s, level 2 10 s, a sleep 2 s), for what the world itself
decides: the always-on placed before the trace, a sleep's level under the host reserve, a sleep
whose call is still out holding its memory (and a victim's own request then waking it back), the
start-up gate of each GPU."""
from __future__ import annotations

import pytest
from test_replay_run import THREE, dep, req, run

from ondemand.replay.clock import VirtualClock
from ondemand.replay.types import Box, Costs, Tally
from ondemand.replay.world import Ledger


def test_the_ledger_books_each_engines_gpus_and_gib_over_time_and_the_boxs_gpus():
    """a holds 40 GiB on GPU 0 from 0 s, 2 GiB from 10 s, nothing from 30 s; b 10 GiB on each of
    GPUs 0 and 1 from 5 s to the end at 40 s. GPU 0 had memory on it 40 s, GPU 1 35 s; a change
    of nothing is not a change. Without ``drawn`` the totals are the same and no timeline is kept."""
    for drawn in (True, False):
        clock, box = VirtualClock(), Tally()
        tallies = {"a": Tally(), "b": Tally()}
        ledger = Ledger(2, clock, tallies, box, drawn)
        ledger.hold("a", {0: 40.0})
        clock.run_until(5)
        ledger.hold("b", {0: 10.0, 1: 10.0})
        clock.run_until(10)
        ledger.hold("a", {0: 2.0})
        ledger.hold("a", {0: 2.0})  # the same again: no change
        clock.run_until(30)
        ledger.hold("a", {})
        clock.run_until(40)
        ledger.close()
        assert (tallies["a"].gpu_seconds, tallies["a"].gpu_gib_seconds) == (30, 40 * 10 + 2 * 20)
        assert (tallies["b"].gpu_seconds, tallies["b"].gpu_gib_seconds) == (2 * 35, 20 * 35)
        assert (box.gpu_seconds, box.gpu_gib_seconds) == (40 + 35, 440 + 700)
        assert ledger.timeline == ([(0, 0, "a", 40.0), (5, 0, "b", 10.0), (5, 1, "b", 10.0), (10, 0, "a", 2.0),
                                    (30, 0, "a", 0.0)] if drawn else [])


def test_the_ledger_books_up_to_a_measured_window_and_from_it():
    """``book`` at the window's start: what was held before is counted, and the tallies reset
    then (as run.py's ``_measure`` does) count from there."""
    clock, box = VirtualClock(), Tally()
    tallies = {"a": Tally()}
    ledger = Ledger(1, clock, tallies, box)
    ledger.hold("a", {0: 40.0})
    clock.run_until(100)
    ledger.book()
    assert tallies["a"].gpu_gib_seconds == 4000
    tallies["a"].reset()
    box.reset()
    clock.run_until(130)
    ledger.close()
    assert (tallies["a"].gpu_seconds, tallies["a"].gpu_gib_seconds, box.gpu_seconds) == (30, 1200, 30)


def test_always_on_refuses_what_does_not_fit_beside_the_others():
    """50 + 50 GiB on one 80 GiB GPU: the first in the file is placed, the second fails and
    every request for it is refused (failed, no TTFT), counted against the SLO."""
    r = run([dep(1, "a", 50), dep(2, "b", 50)], [req(0), req(1, "b"), req(2, "b")], "always-on")
    assert (r.total.requests, r.total.served, r.total.failed, r.total.slo_met) == (3, 1, 2, 1)
    assert (r.per_deployment["b"].failed, r.per_deployment["b"].ttfts) == (2, [])


def test_the_host_reserve_makes_a_level_two_sleep_whose_wake_is_longer():
    """40 GiB of weights would leave 512 - 40 < 500 GiB of host memory: level 2, a 10 s wake."""
    r = run([dep(1, "a", 40)], THREE, box=Box(gpus=(80.0,), host_gib=512, host_reserve_gib=500))
    assert r.total.ttfts == pytest.approx([60.4, 50.4, 10.2])


def test_an_engine_that_cannot_sleep_at_level_two_is_stopped_instead():
    """SGLang started for level 1 (idle_action sleep) cannot sleep at level 2: the host reserve
    makes the reaper's sleep a stop."""
    r = run([dep(1, "a", 40, engine="sglang", idle_action="sleep")], THREE,
            box=Box(gpus=(80.0,), host_gib=512, host_reserve_gib=500))
    assert (r.total.sleeps, r.total.stops, r.total.cold_starts) == (0, 1, 2)


def test_a_wake_waits_for_its_sleeps_own_call():
    """Asleep at 675 s, its sleep call out until 677 s: a request at 676 s wakes it after that."""
    r = run([dep(1, "a", 40)], [req(0), req(676)])
    assert r.total.ttfts == pytest.approx([60.2, 677 + 3 + 0.2 - 676])


def test_a_victims_memory_is_free_only_when_its_sleep_has_ended():
    """a (60 GiB) idle is put to sleep for b (60 GiB); its sleep's call takes 10 s. c (60 GiB),
    arriving 1 s into that sleep, must not take the memory mid-sleep (a marked asleep holds all of
    it until the call ends, as nvidia-smi would show): b, the head, starts when the sleep ends."""
    slow = Costs(sleep_s=10)
    deps = [dep(1, "a", 60, costs=slow, idle_timeout_s=60), dep(2, "b", 60), dep(3, "c", 60)]
    # a's request ends at 62.2 s: idle for its 60 s at 122.2 s, before the reaper's step at 135 s.
    r = run(deps, [req(0), req(125, "b"), req(126, "c")])
    b = r.per_deployment["b"]
    assert b.waits == pytest.approx([10.0 + 60.0], abs=0.2)  # the sleep's 10 s, then its cold start
    assert r.per_deployment["c"].waited["queue"] == 1  # c waited for memory behind b


@pytest.mark.parametrize("policy", ["seed", "cost"])
def test_a_victims_own_request_during_its_sleep_wakes_it_back_before_the_head(policy):
    """a (60 GiB) idle is put to sleep for b (60 GiB) at 125 s; its sleep's call takes 10 s. A
    request of a's own at 126 s wakes it when the call ends (135 + 3 s): the hold for b begins
    only when the call reports (design.md, invariant 5), so b waits, queued, until a has idled out
    again (its request ends at 140.2 s, its 60 s at 200.2 s), then a's second sleep and b's cold
    start: 200.25 + 10 + 60 - 125."""
    slow = Costs(sleep_s=10)
    deps = [dep(1, "a", 60, costs=slow, idle_timeout_s=60), dep(2, "b", 60)]
    r = run(deps, [req(0), req(125, "b"), req(126, "a")], policy)
    a, b = r.per_deployment["a"], r.per_deployment["b"]
    assert a.waits == pytest.approx([60.0, 135 + 3 - 126])
    assert (a.sleeps, a.wakes) == (2, 1)
    assert b.waits == pytest.approx([200.25 + 10 + 60 - 125])
    assert b.waited["queue"] == 1


@pytest.mark.parametrize("policy", ["seed", "cost"])
def test_a_sleep_the_reaper_began_is_waited_for_not_stopped_and_its_end_offers_the_memory(policy):
    """a (60 GiB) is put to sleep by the reaper at 135 s, its call 10 s long; b (22 GiB) arrives
    at 136 s and does not fit beside a's memory until the call ends. a is no victim mid-call (it
    was stopped, 2 cold starts), and b starts the moment the call ends (not at the queue's next
    look): 145 + 60 - 136."""
    slow = Costs(sleep_s=10)
    r = run([dep(1, "a", 60, costs=slow, idle_timeout_s=60), dep(2, "b", 22)], [req(0), req(136, "b")], policy)
    a, b = r.per_deployment["a"], r.per_deployment["b"]
    assert (a.sleeps, a.stops, a.cold_starts) == (1, 0, 1)
    assert b.waits == pytest.approx([145 + 60 - 136]) and b.waited["queue"] == 1


def test_starts_on_one_gpu_pass_its_start_up_gate_one_at_a_time():
    """a and b fit together on the GPU, but one engine starts there at a time: b's start begins
    when a is ready."""
    r = run([dep(1, "a", 30), dep(2, "b", 30)], [req(0), req(1, "b")])
    assert r.per_deployment["b"].ttfts == pytest.approx([120.2 - 1])
    two = run([dep(1, "a", 30), dep(2, "b", 30)], [req(0), req(1, "b")], box=Box(gpus=(40.0, 40.0), host_gib=512))
    assert two.per_deployment["b"].ttfts == pytest.approx([60.2])  # another GPU: its own gate
