"""The replay in virtual time (ondemand/replay/run.py): the policies and whole replays, cases whose
answers follow by hand, each through ondemand's own controller (what the world and the requests'
edge decide on their own: test_replay_world.py, test_replay_flights.py; the clock:
test_replay_clock.py). The helpers here are theirs too. The costs are the defaults unless a case
says otherwise: a cold start 60 s, a level-1 wake 3 s, level 2 10 s, a sleep 2 s, prefill 5000
and decode 50 tokens/s, 16 at once. A request of 1000 tokens in and 100 out is therefore 0.2 s of
prefill and 2 s of decode; the reaper looks every 15 s."""
from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import time

import pytest

from ondemand.control import scheduler as schedulers
from ondemand.control.scheduler import SeedScheduler
from ondemand.model import Deployment, KeepWarm, Mode, State
from ondemand.replay.run import Run, configure, replay
from ondemand.replay.types import Box, Costs, Policy, Replayed, Request

BOX = Box(gpus=(80.0,), host_gib=512)
DEFAULTS = Costs()


def dep(i: int, name: str, gib: float, *, costs: Costs = DEFAULTS, **kw) -> Replayed:
    d = Deployment(id=i, name=name, served_name=name.upper(), engine="vllm", model=f"org/{name}", memory_gib=gib,
                   gpu_count=1, mode=Mode.ON_DEMAND, state=State.STOPPED).replace(**kw)
    return Replayed(d, costs)


def run(deps, reqs, policy="current", box=BOX, slo_s=5.0):
    [result] = replay(reqs, deps, box, [Policy.parse(policy)], slo_s=slo_s, keep=True)
    return result


def req(at: float, model: str = "a", tokens_in: int = 1000, tokens_out: int = 100, stream: bool = True) -> Request:
    return Request(at, model, tokens_in, tokens_out, stream)


THREE = [req(0), req(10), req(1000)]


class CountingScheduler:
    """The seed scheduler, counting make-room's choices: a second scheduler, for the wiring."""

    def __init__(self) -> None:
        self.seed = SeedScheduler()
        self.queue = self.seed.queue
        self.victims_asked = 0
        made.append(self)

    def __getattr__(self, name):
        return getattr(self.seed, name)

    def victims(self, candidates, fit):
        self.victims_asked += 1
        return self.seed.victims(candidates, fit)


made: list[CountingScheduler] = []


def test_current_cold_start_then_asleep_then_a_wake():
    """The first request starts it; the second, at 10 s, waits for the same start; at 60 s both
    prefill together, sharing the engine's prefill (0.4 s for the two). Their ends at 62.4 s begin
    the 600 s idle timeout; the reaper's step at 675 s puts
    it to sleep (level 1: a vLLM recipe on discrete GPUs), the call takes 2 s; at 1000 s a request
    wakes it in 3 s. It held 40 GiB until 677 s, then the 2 GiB residue, then 40 GiB again."""
    r = run([dep(1, "a", 40)], THREE)
    t = r.total
    assert t.ttfts == pytest.approx([60.4, 50.4, 3.2])
    assert (t.requests, t.served, t.failed, t.slo_met) == (3, 3, 0, 1)
    assert t.waited == {"ready": 0, "wake": 1, "cold": 2, "queue": 0}
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (1, 1, 1, 0)
    assert r.end_s == pytest.approx(1005.2)
    assert t.gpu_seconds == pytest.approx(1005.2)
    assert t.gpu_gib_seconds == pytest.approx(40 * 677 + 2 * (1000 - 677) + 40 * 5.2)
    assert r.per_deployment["a"].ttfts == t.ttfts
    assert [(round(at, 3), gpu, name, gib) for at, gpu, name, gib in r.memory] == [
        (0.0, 0, "a", 40.0), (677.0, 0, "a", 2.0), (1000.0, 0, "a", 40.0)]


def test_ttl_stops_and_starts_cold_again():
    """ttl=300: stopped at the reaper's step after 362.2 s (375 s), never asleep; the third
    request starts it cold again."""
    r = run([dep(1, "a", 40)], THREE, "ttl=300")
    t = r.total
    assert t.ttfts == pytest.approx([60.4, 50.4, 60.2])
    assert t.waited == {"ready": 0, "wake": 0, "cold": 3, "queue": 0}
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (2, 0, 0, 1)
    assert t.gpu_seconds == pytest.approx(375 + 62.2)
    assert t.gpu_gib_seconds == pytest.approx(40 * (375 + 62.2))


def test_sleep_ttl_sleeps_after_its_seconds():
    r = run([dep(1, "a", 40)], THREE, "sleep-ttl=300")
    t = r.total
    assert t.ttfts == pytest.approx([60.4, 50.4, 3.2])
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops) == (1, 1, 1, 0)
    assert t.gpu_gib_seconds == pytest.approx(40 * 377 + 2 * (1000 - 377) + 40 * 5.2)


def test_always_on_is_ready_when_the_trace_begins():
    r = run([dep(1, "a", 40)], THREE, "always-on")
    t = r.total
    assert t.ttfts == pytest.approx([0.2, 0.2, 0.2])
    assert t.waited == {"ready": 3, "wake": 0, "cold": 0, "queue": 0}
    assert (t.cold_starts, t.wakes, t.sleeps, t.stops, t.slo_met) == (0, 0, 0, 0, 3)
    assert t.gpu_gib_seconds == pytest.approx(40 * 1002.2)


def test_fixed_sets_the_idle_timeout_of_every_on_demand_deployment():
    r = run([dep(1, "a", 40)], THREE, "fixed=60")
    assert r.total.ttfts == pytest.approx([60.4, 50.4, 3.2])  # asleep at the step after 122.4 s: 135 s
    assert r.total.gpu_gib_seconds == pytest.approx(40 * 137 + 2 * (1000 - 137) + 40 * 5.2)
    d = configure([dep(1, "a", 40), dep(2, "b", 40, mode="always_on")], Policy.parse("fixed=60"), BOX)
    assert [(x.deployment.idle_timeout_s, x.deployment.mode) for x in d] == [(60, Mode.ON_DEMAND),
                                                                             (None, Mode.ALWAYS_ON)]


def test_two_models_that_cannot_share_the_gpu():
    """b (50 GiB) arrives at 100 s while a (50 GiB) holds the GPU, idle for only 37.8 s: b queues
    for memory. The queue looks again every 15 s and just after a's idle timeout runs out (62.2 +
    600 + 0.05 s): make-room puts a to sleep (2 s), the freed memory settles, b starts cold (60 s)."""
    r = run([dep(1, "a", 50), dep(2, "b", 50)], [req(0), req(100, "b")])
    b = r.per_deployment["b"]
    assert b.ttfts == pytest.approx([662.25 + 2 + 60 + 0.2 - 100])
    assert b.waited == {"ready": 0, "wake": 0, "cold": 0, "queue": 1}
    assert (r.total.sleeps, r.total.cold_starts, r.total.stops) == (1, 2, 0)
    assert r.queue == [(0.0, 0), (100.0, 1), (pytest.approx(724.25), 0)]  # out of the queue with its slot


def test_the_replay_runs_the_scheduler_its_box_names(monkeypatch):
    """The box's ``scheduler`` key chooses the controller's scheduler in each run: one made per
    policy, asked for make-room's victims; the same answers as the seed scheduler's."""
    monkeypatch.setitem(schedulers.SCHEDULERS, "counting", lambda slo_s: CountingScheduler())
    made.clear()
    box = dataclasses.replace(BOX, scheduler="counting")
    deps, reqs = [dep(1, "a", 50), dep(2, "b", 50)], [req(0), req(100, "b")]
    [current, fixed] = replay(reqs, deps, box, [Policy.parse("current"), Policy.parse("fixed=600")], keep=True)
    assert len(made) == 2 and all(s.victims_asked >= 1 for s in made)
    assert current.per_deployment["b"].ttfts == pytest.approx([662.25 + 2 + 60 + 0.2 - 100])
    assert current.per_deployment["b"].ttfts == run(deps, reqs).per_deployment["b"].ttfts
    assert fixed.per_deployment["b"].ttfts == current.per_deployment["b"].ttfts


def test_a_request_queues_for_memory_behind_a_busy_model():
    """a's one request decodes 5000 tokens (100 s); b needs the GPU: it waits until a is idle for
    its full timeout after that (a: 60 + 0.2 + 100 = 160.2 s, then 600 s)."""
    r = run([dep(1, "a", 50), dep(2, "b", 50)], [req(0, tokens_out=5000), req(70, "b")])
    assert r.per_deployment["b"].ttfts == pytest.approx([760.25 + 2 + 60 + 0.2 - 70])


def test_lru_takes_a_model_in_a_lull_where_ttl_waits_for_its_timeout():
    """a (50 GiB) served at 0 s, b (50 GiB) asked at 100 s on one 80 GiB GPU. Under ttl=300 make-room
    may take a only once it has been idle its 300 s (at 362.2 s), so b waits for that, its stop
    and its cold start; under lru=300 (Ollama's rule) a, quiet, is stopped at once for b, and
    sleep-lru=300 puts it to sleep instead."""
    deps = [dep(1, "a", 50), dep(2, "b", 50)]
    reqs = [req(0), req(100, "b")]
    ttl, lru, sleep_lru = replay(reqs, deps, BOX, [Policy.parse(p) for p in ("ttl=300", "lru=300", "sleep-lru=300")],
                                 keep=True)
    assert ttl.per_deployment["b"].waits == pytest.approx([362.2 - 100 + 60], abs=0.1)  # woken as a's timeout ran out
    assert lru.per_deployment["b"].waits == pytest.approx([60.0])
    assert (lru.per_deployment["a"].stops, lru.per_deployment["a"].sleeps) == (1, 0)
    assert sleep_lru.per_deployment["b"].waits == pytest.approx([2.0 + 60.0])  # a's sleep call, then b's start
    assert (sleep_lru.per_deployment["a"].stops, sleep_lru.per_deployment["a"].sleeps) == (0, 1)


def test_seed_runs_the_seed_scheduler_whatever_the_box_says():
    box = dataclasses.replace(BOX, scheduler="seed")
    r = run([dep(1, "a", 40)], THREE, "seed", box=box)
    assert r.total.waits == pytest.approx([60.0, 50.0, 3.0])


def test_a_request_never_puts_a_model_of_higher_priority_away():
    """a (40 GiB, high) sleeps from 675 s, keeping 2 GiB; b (80 GiB, low) needs the whole GPU,
    which only stopping a would give: b waits until its deadline (900 s) and fails. The other way
    round (b high, a low), make-room stops the sleeper and b starts at once."""
    low_waits = run([dep(1, "a", 40, priority="high"), dep(2, "b", 80, priority="low")], [req(0), req(1000, "b")])
    b = low_waits.per_deployment["b"]
    assert (b.failed, b.waited["queue"], low_waits.total.stops) == (1, 1, 0)
    assert low_waits.end_s == pytest.approx(1900, abs=0.01)
    high_takes = run([dep(1, "a", 40, priority="low"), dep(2, "b", 80, priority="high")], [req(0), req(1000, "b")])
    assert (high_takes.per_deployment["b"].served, high_takes.total.stops) == (1, 1)
    assert high_takes.per_deployment["b"].ttfts == pytest.approx([60.2])


def test_an_asleep_model_is_stopped_to_make_room():
    """a sleeps (2 GiB kept); b needs the whole 80 GiB GPU: make-room stops the sleeper."""
    r = run([dep(1, "a", 40), dep(2, "b", 80)], [req(0), req(1000, "b")])
    assert (r.total.sleeps, r.total.stops, r.total.cold_starts) == (1, 1, 2)
    assert r.per_deployment["b"].ttfts == pytest.approx([60.2])
    assert r.per_deployment["b"].waited["queue"] == 0  # make-room found its victim: no notice, no queue


def test_the_same_inputs_give_the_same_results():
    deps = [dep(1, "a", 50), dep(2, "b", 50), dep(3, "c", 20)]
    reqs = [req(i * 37.5 % 900, "abc"[i % 3]) for i in range(60)]
    reqs.sort(key=lambda r: r.at_s)
    one, two = (replay(reqs, deps, BOX, [Policy.parse("current"), Policy.parse("ttl=60")]) for _ in range(2))
    assert [(r.total, r.per_deployment, r.memory, r.queue, r.end_s) for r in one] == [
        (r.total, r.per_deployment, r.memory, r.queue, r.end_s) for r in two]


def test_adaptive_sets_keep_warm_on_the_on_demand_deployments_only():
    a, b = configure([dep(1, "a", 40, idle_timeout_s=900), dep(2, "b", 20, mode=Mode.ALWAYS_ON)],
                     Policy.parse("adaptive"), BOX)
    assert (a.deployment.keep_warm, a.deployment.idle_timeout_s) == (KeepWarm.ADAPTIVE, 900)  # its bound as given
    assert b.deployment.keep_warm is KeepWarm.FIXED
    back, = configure([a], Policy.parse("fixed=300"), BOX)  # the other policies set fixed
    assert (back.deployment.keep_warm, back.deployment.idle_timeout_s) == (KeepWarm.FIXED, 300)


def test_a_policy_the_replay_cannot_run_is_named():
    with pytest.raises(ValueError, match=r"policy 'ttl=30': 30 s is below the box's min_idle_timeout_s \(60 s\)"):
        configure([dep(1, "a", 40)], Policy.parse("ttl=30"), BOX)


# --- idle spans: skipped, with the results stepping through them gives -------------------------

POLICIES = ["current", "always-on", "ttl=300", "sleep-ttl=300", "fixed=60", "fixed=1800", "adaptive"]
WEEK = 7 * 86400.0


@contextlib.contextmanager
def cpu_limit(seconds: float):
    """Fail (TimeoutError) after ``seconds`` of this process's CPU: a replay that steps through
    years of virtual time is stopped here instead of running for hours."""
    def over(signum, frame):
        raise TimeoutError(f"more than {seconds} s of CPU")
    old = signal.signal(signal.SIGPROF, over)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def runs(reqs, deps, box, policies=POLICIES, *, step_idle: bool, measure_from_s: float = 0.0) -> list[Run]:
    out = [Run(p, configure(deps, p, box), box, 5.0, measure_from_s, step_idle=step_idle)
           for p in map(Policy.parse, policies)]
    for r in reqs:
        for one in out:
            one.arrive(r)
    return out


def outcome(results) -> list:
    """All a policy's result says (its JSON and its page are made of these)."""
    return [(r.policy.name, r.total, r.per_deployment, r.memory, r.queue, r.end_s) for r in results]


def test_a_week_of_quiet_replays_as_fast_as_a_minute():
    """Two requests a week apart, four 10^8 s apart (three years), and one that decodes 10^7
    tokens (2.3 days) beside one more: each under every policy, in well under a second of CPU
    (stepping every 15 s, the gaps of 10^8 s ran for hours)."""
    deps = [dep(1, "a", 40), dep(2, "b", 20)]
    deps_long = [dep(1, "a", 40, costs=Costs(max_model_len=10**8)), dep(2, "b", 20)]
    traces = [[req(0), req(WEEK)], [req(i * 1e8, "ab"[i % 2]) for i in range(4)],
              [req(0, tokens_out=10_000_000), req(60, "b")]]
    with cpu_limit(5):
        began = time.process_time()
        results = [replay(reqs, deps_long if i == 2 else deps, BOX, [Policy.parse(p) for p in POLICIES], keep=True)
                   for i, reqs in enumerate(traces)]
        took = time.process_time() - began
    assert took < 0.5, f"{took:.2f} s of CPU"
    week = {r.policy.name: r for r in results[0]}
    assert week["current"].total.ttfts == pytest.approx([60.2, 3.2])  # asleep all week, then woken
    assert week["ttl=300"].total.ttfts == pytest.approx([60.2, 60.2])  # stopped: a cold start again
    assert week["current"].end_s == pytest.approx(WEEK + 5.2)
    assert [r.total.cold_starts for r in results[1]] == [2, 0, 4, 2, 2, 2, 2]  # ttl=300 stops; the others sleep


@pytest.mark.parametrize("box", [BOX, Box(gpus=(80.0,), host_gib=512, sleep_timeout_s=3600, reap_interval_s=7.3,
                                          host_reserve_gib=440)], ids=["defaults", "sleep-timeout-odd-period"])
@pytest.mark.parametrize("measure_from_s", [0.0, 30_000.0])
def test_skipping_idle_spans_gives_what_stepping_through_them_gives(box, measure_from_s):
    """A day of three models that do not fit together (50 + 30 + 40 GiB on 80): one called
    every half hour (adaptive warmth learns it and pre-warms it), one in bursts, one rarely,
    hours of quiet between, queues for memory; sleeps stopped after an hour, a reaper period
    that is no whole number of seconds. Every policy gives the same results, to the last
    timeline entry, whether the idle spans are skipped or stepped through, with far fewer steps."""
    rng = random.Random(5)
    reqs = [req(k * 1800 + rng.uniform(-20, 20), "a") for k in range(48)]
    for burst in (3000, 20_000, 21_000, 60_000, 61_000):
        reqs += [req(burst + rng.uniform(0, 120), "b", tokens_out=rng.randint(10, 3000)) for _ in range(12)]
    reqs += [req(at, "c") for at in (5000, 5001, 40_000, 86_000)]
    reqs.sort(key=lambda r: r.at_s)
    deps = [dep(1, "a", 50), dep(2, "b", 30), dep(3, "c", 40, idle_timeout_s=900, priority="high")]
    stepped = runs(reqs, deps, box, step_idle=True, measure_from_s=measure_from_s)
    skipped = runs(reqs, deps, box, step_idle=False, measure_from_s=measure_from_s)
    results = [one.finish() for one in skipped]
    assert outcome(results) == outcome(one.finish() for one in stepped)
    # The cases the skip must not disturb: pre-warms, queues for memory, sleeps stopped.
    assert results[-1].total.prewarms > 5 and sum(r.total.waited["queue"] for r in results) > 0
    assert sum(one.reap_steps for one in skipped) < sum(one.reap_steps for one in stepped) / 3
