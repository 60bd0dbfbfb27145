"""The replay's clairvoyant reference (ondemand/replay/clairvoyant.py): small traces whose best
choice follows by hand, each through ondemand's own controller with the reference's parts plugged
in. Each case fails when its rule is broken (the docstring says what the broken rule would give).
The costs are the defaults unless a case says otherwise (test_replay_run.py's): a cold start 60 s,
a level-1 wake 3 s, a sleep 2 s; a request of 1000 tokens in and 100 out is 0.2 s of prefill and
2 s of decode. An engine that cannot sleep (llama.cpp) is stopped instead: its rest is due when its
next request is at least its cold start away."""
from __future__ import annotations

import dataclasses
import time

import pytest
from test_replay_run import BOX, cpu_limit, dep, outcome, req, run

from ondemand.model import IdleAction, KeepWarm, Mode, Priority, State
from ondemand.replay.run import Run, configure, replay
from ondemand.replay.types import Box, Costs, Policy, Request

CLAIRVOYANT = Policy.parse("clairvoyant")
TWO_GPUS = Box(gpus=(80.0, 80.0), host_gib=512)
STOPS = {"engine": "llamacpp"}  # no sleep API: its rest is a stop


def memory(result):
    return [(round(at, 3), gpu, name, gib) for at, gpu, name, gib in result.memory]


def test_the_policy_is_parsed_with_or_without_a_floor():
    assert Policy.parse("clairvoyant") == Policy("clairvoyant", "clairvoyant")
    assert Policy.parse("clairvoyant=60") == Policy("clairvoyant=60", "clairvoyant", 60)
    for bad in ("clairvoyant=0", "clairvoyant=1.5", "clairvoyant="):
        with pytest.raises(ValueError, match="whole seconds"):
            Policy.parse(bad)


def test_every_deployment_is_on_demand_and_stopped_numbered_by_name():
    """Always on or not, every model starts stopped and on demand, fixed warmth (the reference's
    own), put to sleep when it rests; ids follow the names, so the core's ties fall by name."""
    deps = [dep(1, "zeta", 10, mode=Mode.ALWAYS_ON, keep_warm=KeepWarm.ADAPTIVE, idle_action=IdleAction.STOP,
                priority=Priority.HIGH), dep(2, "alpha", 10)]
    out = {r.deployment.name: r.deployment for r in configure(deps, CLAIRVOYANT, BOX)}
    assert (out["alpha"].id, out["zeta"].id) == (1, 2)
    z = out["zeta"]
    assert (z.mode, z.state, z.keep_warm, z.idle_action) == (Mode.ON_DEMAND, State.STOPPED, KeepWarm.FIXED,
                                                             IdleAction.SLEEP)
    [result] = replay([req(0, "zeta")], deps, BOX, [CLAIRVOYANT], keep=True)
    assert result.total.waits == pytest.approx([60.0])  # started by its request, not ready before


def test_it_rests_at_once_and_is_awake_again_at_its_next_arrival():
    """Requests at 0 and 1000 s: the first waits for the start (60 s) and ends at 62.2 s; the
    next is 937.8 s away, more than a sleep and a wake (5 s), so it sleeps at once (not at the
    reaper's step, 75 s: its 40 GiB until the sleep's call ends, 64.2 s), and is woken at 997 s,
    ready as the second arrives: its wait is 0. The early start counts no request and queues
    nothing."""
    r = run([dep(1, "a", 40)], [req(0), req(1000)], "clairvoyant")
    t = r.total
    assert t.waits == pytest.approx([60.0, 0.0])
    assert (t.requests, t.cold_starts, t.wakes, t.sleeps, t.stops) == (2, 1, 1, 1, 0)
    assert t.waited == {"ready": 1, "wake": 0, "cold": 1, "queue": 0}
    assert memory(r) == [(0.0, 0, "a", 40.0), (64.2, 0, "a", 2.0), (997.0, 0, "a", 40.0)]
    assert r.queue == [(0.0, 0)]


def test_a_request_too_long_for_its_engine_leaves_the_early_start_be():
    """As above, with a request too long for the engine (max_model_len 4096) at 998 s, while the
    early start for the one at 1000 s is out: it is rejected at once and is no arrival (the
    reference's arrivals and the edge ask one rule, ``types.fits_engine``), and the second request
    still finds the engine awake."""
    a = dep(1, "a", 40, costs=Costs(max_model_len=4096))
    r = run([a], [req(0), req(998, tokens_in=4000, tokens_out=200), req(1000)], "clairvoyant")
    t = r.total
    assert (t.rejected, t.wakes) == (1, 1)
    assert t.waits == pytest.approx([60.0, 0.0])


def test_it_stays_awake_when_its_next_arrival_is_nearer_than_a_sleep_and_a_wake():
    """The next request 3.8 s after the first ended (a sleep and a wake take 5 s): awake."""
    r = run([dep(1, "a", 40)], [req(0), req(66)], "clairvoyant")
    assert r.total.waits == pytest.approx([60.0, 0.0])
    assert (r.total.sleeps, r.total.wakes) == (0, 0)
    assert memory(r) == [(0.0, 0, "a", 40.0)]


def test_an_engine_that_cannot_sleep_is_stopped_and_started_in_time():
    """llama.cpp: its rest is a stop, due when its next request is at least a cold start away:
    stopped at 62.2 s, started at 940 s, ready at 1000 s; with the next request 50 s away (less
    than its cold start), it stays up."""
    far = run([dep(1, "a", 40, **STOPS)], [req(0), req(1000)], "clairvoyant")
    assert far.total.waits == pytest.approx([60.0, 0.0])
    assert (far.total.stops, far.total.cold_starts) == (1, 2)
    assert memory(far) == [(0.0, 0, "a", 40.0), (62.2, 0, "a", 0.0), (940.0, 0, "a", 40.0)]
    near = run([dep(1, "a", 40, **STOPS)], [req(0), req(112.2)], "clairvoyant")
    assert (near.total.stops, near.total.cold_starts) == (0, 1)


def test_the_victim_is_the_one_whose_next_arrival_is_furthest():
    """Three models of 35 GiB on 80 GiB (two fit), that stop rather than sleep. a and b stay up
    between their requests (each gap shorter than their 100 s cold start); at 259 s c (a 1 s
    start) must take one of them, both idle: b, whose next request (320 s) is after a's (300 s),
    though b was used last (least recently used would take a) and its name comes after a's.
    c is ready as its request arrives; a is never put away."""
    slow = Costs(cold_start_s=100)
    deps = [dep(1, "a", 35, costs=slow, **STOPS), dep(2, "b", 35, costs=slow, **STOPS),
            dep(3, "c", 35, costs=Costs(cold_start_s=1), **STOPS)]
    reqs = [req(0, "a"), req(150, "a"), req(200, "b"), req(210, "b"), req(240, "a"), req(250, "b"), req(260, "c"),
            req(300, "a"), req(320, "b")]
    r = run(deps, reqs, "clairvoyant")
    assert memory(r)[:4] == [(0.0, 0, "a", 35.0), (100.0, 0, "b", 35.0), (259.0, 0, "b", 0.0), (259.0, 0, "c", 35.0)]
    assert r.per_deployment["c"].waits == [0.0]
    assert r.per_deployment["a"].waits == pytest.approx([100.0, 0.0, 0.0, 0.0])


def test_a_busy_model_is_never_put_away():
    """a (50 GiB) decodes 5000 tokens from 60.2 s to 160.2 s; b (50 GiB, no room beside it)
    arrives at 100 s, its early start at 40 s found a starting. However far a's next request
    (none), it is not put away while its request is in flight: at 160.2 s it rests (its sleep's
    call frees the memory at 162.2 s) and b starts: b waits 122.2 s."""
    r = run([dep(1, "a", 50), dep(2, "b", 50)], [req(0, "a", tokens_out=5000), req(100, "b")], "clairvoyant")
    assert r.per_deployment["b"].waits == pytest.approx([122.2])
    assert memory(r) == [(0.0, 0, "a", 50.0), (162.2, 0, "a", 2.0), (162.2, 0, "b", 50.0)]


def test_an_early_start_never_delays_an_arrived_request():
    """b (40 GiB) decodes 10,000 tokens until 260.2 s; r (50 GiB) arrives at 10 s and waits for
    it, 40 GiB free beside b. x (40 GiB), due at 280 s, would start at 220 s in those 40 GiB: it
    waits instead, since r arrived before, and r starts once b rests (262.2 s): r waits 312.2 s
    (with x started early, r would wait until x's request had ended too: 334.2 s)."""
    deps = [dep(1, "b", 40), dep(2, "r", 50), dep(3, "x", 40)]
    r = run(deps, [req(0, "b", tokens_out=10000), req(10, "r"), req(280, "x")], "clairvoyant")
    assert r.per_deployment["r"].waits == pytest.approx([312.2])
    assert ("x", 220.0) not in [(name, round(at, 3)) for at, _, name, gib in r.memory if gib]


def test_a_victim_is_not_woken_by_a_later_request_before_the_one_it_makes_room_for():
    """One GPU, r and v of 50 GiB. v, idle from 62.2 s and due again at 80 s (a sleep and a wake
    take 23 s: it stays up), is put to sleep for r's early start, r's request arriving at 70 s;
    v's sleep takes 20 s. v's own request, at 80 s, mid-sleep, waits for r, which came first: r
    starts once the sleep has freed the memory (waits 72.2 s), v after r rests (69.4 s). (A wake in
    the middle of the sleep would have served v first, 5.2 s, and kept r waiting 97.4 s.)"""
    r = run([dep(1, "r", 50), dep(2, "v", 50, costs=Costs(sleep_s=20))], [req(0, "v"), req(70, "r"), req(80, "v")],
            "clairvoyant")
    assert r.per_deployment["r"].waits == pytest.approx([72.2])
    assert r.per_deployment["v"].waits == pytest.approx([60.0, 69.4])


def test_ties_by_name():
    """a and b (50 GiB each, one at a time) are both due at 100 s; the file lists b first (id
    1), but a's name comes first: a starts early and is ready at 100 s, b waits for a's request
    and its rest (64.2 s). Victims due at the same moment: on two GPUs, a (45 GiB, GPU 0) and b
    (45 GiB, GPU 1), both idle and due at 240 s; c (50 GiB, due at 200 s, a 1 s start) needs
    either GPU: a's goes, the first name's (b's, the file's first, if ties went by id)."""
    r = run([dep(1, "b", 50), dep(2, "a", 50)], [req(100, "a"), req(100, "b")], "clairvoyant")
    assert r.per_deployment["a"].waits == [0.0]
    assert r.per_deployment["b"].waits == pytest.approx([64.2])
    slow = Costs(cold_start_s=100)
    deps = [dep(1, "b", 45, costs=slow, **STOPS), dep(2, "a", 45, costs=slow, **STOPS),
            dep(3, "c", 50, costs=Costs(cold_start_s=1), **STOPS)]
    reqs = [req(0, "a"), req(100, "b"), req(150, "a"), req(160, "b"), req(200, "c"), req(240, "a"), req(240, "b")]
    r = run(deps, reqs, "clairvoyant", box=TWO_GPUS)
    assert memory(r)[:4] == [(0.0, 0, "a", 45.0), (0.0, 1, "b", 45.0), (199.0, 0, "a", 0.0), (199.0, 0, "c", 50.0)]


def test_an_early_start_leaves_a_sleeper_needed_before_it_its_room():
    """One GPU. s (40 GiB) sleeps from 62.2 s; three of its requests come at 300-302 s. y
    (50 GiB, a 200 s start) is due at 400 s, so its early start is at 200 s: the 78 GiB free then
    include what s takes back to wake (a sleeper wakes only on its own GPUs), and s is needed
    first. y waits for it: s is woken at 297 s and serves its three at once; y starts when s
    rests again. (Placed at 200 s, y would have kept s's three waiting some 100 s each.)"""
    r = run([dep(1, "s", 40), dep(2, "y", 50, costs=Costs(cold_start_s=200))],
            [req(0, "s"), req(300, "s"), req(301, "s"), req(302, "s"), req(400, "y")], "clairvoyant")
    assert r.per_deployment["s"].waits == pytest.approx([60.0, 0.0, 0.0, 0.0])
    assert [round(at, 1) for at, _, name, gib in r.memory if name == "y" and gib] == [306.2]


def test_the_trace_is_read_ahead_from_any_iterable():
    """``replay`` is given a generator (the command line's trace is read as it goes): the
    clairvoyant run gets the whole list; a run made without it is refused."""
    [result] = replay((r for r in [req(0), req(1000)]), [dep(1, "a", 40)], BOX, [CLAIRVOYANT], keep=True)
    assert result.total.waits == pytest.approx([60.0, 0.0])
    with pytest.raises(ValueError, match="in advance"):
        Run(CLAIRVOYANT, configure([dep(1, "a", 40)], CLAIRVOYANT, BOX), BOX, 5.0)


def a_day() -> list[Request]:
    reqs = [req(k * 1800 + (k * 37) % 40, "a") for k in range(24)]
    for burst in (3000, 20_000, 21_000):
        reqs += [req(burst + i * 9.5, "b", tokens_out=100 + 250 * i) for i in range(12)]
    reqs += [req(at, "c") for at in (5000, 5001, 40_000)]
    return sorted(reqs, key=lambda r: r.at_s)


@pytest.mark.parametrize("measure_from_s", [0.0, 10_000.0])
@pytest.mark.parametrize("policy", ["clairvoyant", "clairvoyant=60"])
def test_skipping_idle_spans_gives_what_stepping_through_them_gives(measure_from_s, policy):
    """Three models that do not fit together (50 + 30 + 40 GiB on 80), a day of them: the
    reference's own steps (a rest at once or at its floor, an early start) change nothing in the
    run's skip of idle spans; the results are those of stepping, to the last timeline entry."""
    reqs = a_day()
    deps = [dep(1, "a", 50), dep(2, "b", 30), dep(3, "c", 40)]
    box = dataclasses.replace(BOX, reap_interval_s=7.3)
    pol = Policy.parse(policy)

    def one(step_idle: bool):
        r = Run(pol, configure(deps, pol, box), box, 5.0, measure_from_s, step_idle=step_idle,
                trace=reqs)
        for q in reqs:
            r.arrive(q)
        return r
    stepped, skipped = one(True), one(False)
    results = [skipped.finish()]
    assert outcome(results) == outcome([stepped.finish()])
    assert results[0].total.wakes > 5 and skipped.reap_steps < stepped.reap_steps / 3


def test_a_week_of_quiet_replays_as_fast_as_a_minute():
    """Requests a week apart and years apart: the reference steps only where something happens."""
    week = 7 * 86400.0
    with cpu_limit(5):
        began = time.process_time()
        a = run([dep(1, "a", 40)], [req(0), req(week)], "clairvoyant")
        b = run([dep(1, "a", 40), dep(2, "b", 20)], [req(i * 1e8, "ab"[i % 2]) for i in range(4)], "clairvoyant")
        took = time.process_time() - began
    assert took < 0.5, f"{took:.2f} s of CPU"
    assert a.total.waits == pytest.approx([60.0, 0.0])
    assert b.total.waits == pytest.approx([60.0, 0.0, 0.0, 0.0])  # each but the first started in time
