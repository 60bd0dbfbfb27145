"""``replay --live``: the virtual world checked against the real process. The same requests go
through a real ``ondemand serve`` on loopback, engines simulated by ``ondemand sim-engine``
processes (the process backend, a static budget), every duration divided by the speed; the
counts of cold starts, wakes and queued requests must be the virtual replay's, and the TTFT p50
within 20 % of it. The pure parts (what a request waited for, the comparison) are tested fast."""
from __future__ import annotations

import pytest

from ondemand.model import Deployment, KeepWarm, Mode, State
from ondemand.replay.live import Server, disagreements, start_kind
from ondemand.replay.run import configure, replay
from ondemand.replay.sketch import Sketch
from ondemand.replay.types import Box, Costs, Policy, PolicyResult, Replayed, Request, Tally
from ondemand.state.store import Store

BOX = Box(gpus=(80.0,), host_gib=512)


def test_a_request_waited_for_the_start_under_way_else_the_next():
    changes = [(10.0, "stopped", "starting"), (20.0, "starting", "ready"), (50.0, "ready", "asleep"),
               (70.0, "asleep", "starting"), (73.0, "starting", "ready")]
    assert start_kind(changes, 5.0) == "cold"  # stopped: the start that came next
    assert start_kind(changes, 15.0) == "cold"  # the start under way
    assert start_kind(changes, 60.0) == "wake"  # asleep: the wake that came next
    assert start_kind(changes, 71.0) == "wake"


async def test_the_live_server_gets_adaptive_warmth_and_what_was_learned_at_its_speed(tmp_path):
    """An adaptive deployment keeps keep_warm and its learned gaps (divided by the speed), and the
    minimum idle timeout, its plans' floor, is divided as every duration is."""
    learned = Replayed(Deployment(id=1, name="a", served_name="A", engine="vllm", model="m", memory_gib=40,
                                  gpu_count=1, mode=Mode.ON_DEMAND, state=State.STOPPED, keep_warm=KeepWarm.ADAPTIVE),
                       Costs(), gaps=(1800.0, 1790.0))
    server = Server(tmp_path, BOX, speed=2.0)
    config = server.write_files().read_text()
    assert "min_idle_timeout_s = 30\n" in config and "ondemand_idle_timeout_s = 300\n" in config
    await server.seed([learned])
    store = await Store.open(server.state / "ondemand.db")
    try:
        [row] = await store.deployments()
        assert row["keep_warm"] == "adaptive"
        assert await store.idle_gaps() == {row["id"]: [900.0, 895.0]}
    finally:
        await store.close()


def tally(cold: int, wakes: int, queued: int, ttfts: list[float]) -> Tally:
    t = Tally(cold_starts=cold, wakes=wakes, ttft=Sketch(ttfts))
    t.waited["queue"] = queued
    return t


def result(per: dict[str, Tally]) -> PolicyResult:
    total = Tally(cold_starts=sum(t.cold_starts for t in per.values()), wakes=sum(t.wakes for t in per.values()),
                  ttft=Sketch())
    for t in per.values():
        total.ttft.merge(t.ttft)
    total.waited["queue"] = sum(t.waited["queue"] for t in per.values())
    return PolicyResult(Policy.parse("current"), total, per)


def test_the_comparison_names_each_difference_deployment_by_deployment():
    virtual = result({"a": tally(2, 2, 1, [1.0, 1.0]), "b": tally(1, 0, 0, [2.0])})
    assert disagreements(virtual, result({"a": tally(2, 2, 1, [1.15, 1.1]), "b": tally(1, 0, 0, [9.0])})) == []
    assert disagreements(virtual, result({"a": tally(3, 1, 0, [1.3]), "b": tally(1, 0, 0, [])})) == [
        "a: cold starts 3 live, 2 virtual", "a: wakes 1 live, 2 virtual", "a: queued 0 live, 1 virtual",
        "TTFT p50 1.300 s live, 1.000 s virtual (+30 %)"]
    # The same totals, another split: a start counted on the wrong deployment is a disagreement.
    swapped = result({"a": tally(1, 2, 1, [1.0, 1.0]), "b": tally(2, 0, 0, [2.0])})
    assert disagreements(virtual, swapped) == ["a: cold starts 1 live, 2 virtual", "b: cold starts 2 live, 1 virtual"]
    assert disagreements(virtual, result({"a": tally(2, 2, 1, [1.0, 1.0])})) == ["b: not in the live run"]


def dep(i: int, name: str, gib: float, costs: Costs) -> Replayed:
    return Replayed(Deployment(id=i, name=name, served_name=name.upper(), engine="vllm", model=f"org/{name}",
                               memory_gib=gib, gpu_count=1, mode=Mode.ON_DEMAND, state=State.STOPPED), costs)


# Three models on one 80 GiB GPU: a and b fit together, c needs nearly all of it. Over ten minutes
# of virtual time: a busy for two minutes, b beside it, c queued until make-room puts both away,
# then wakes of each in turn. Every decisive moment is tens of virtual seconds from the next, so a
# process start's second of real time (ten virtual ones at speed 10) moves no count. The prompts
# are long (8000 tokens: 1.6 s of prefill), so that the gateway's own milliseconds, multiplied by
# the speed as every duration is, stay well inside the TTFT's 20 %.
COSTS = Costs(cold_start_s=20, wake_s=3, sleep_s=1, prefill_tokens_per_s=5000, decode_tokens_per_s=50)
DEPS = [dep(1, "a", 40, COSTS), dep(2, "b", 30, COSTS), dep(3, "c", 70, COSTS)]
SLICE = ([Request(float(t), "a", 8000, 50) for t in range(0, 125, 5)] + [Request(30.0, "b", 8000, 50)]
         + [Request(60.0, "c", 8000, 50), Request(300.0, "a", 8000, 50), Request(400.0, "b", 8000, 50),
            Request(500.0, "c", 8000, 50), Request(590.0, "a", 8000, 50)])
SLICE.sort(key=lambda r: r.at_s)


@pytest.mark.slow  # a real serve and engine processes for a minute of real time (ten virtual minutes at speed 10)
async def test_a_ten_minute_slice_agrees_with_the_virtual_replay(tmp_path):
    from ondemand.replay.live import run_live
    policy = Policy.parse("fixed=60")
    [virtual] = replay(SLICE, DEPS, BOX, [policy])
    assert (virtual.total.cold_starts, virtual.total.wakes) >= (3, 2) and virtual.total.waited["queue"] >= 1
    live = await run_live(SLICE, configure(DEPS, policy, BOX), BOX, policy, speed=10, slo_s=5.0, workdir=tmp_path)
    assert (live.total.requests, live.total.failed) == (len(SLICE), 0)
    assert disagreements(virtual, live) == []


@pytest.mark.slow  # the command's --live: a real serve for a minute of real time
def test_the_command_checks_the_slice_live(tmp_path):
    from test_replay_cli import replay as command
    (tmp_path / "t.csv").write_text("timestamp,model,input_tokens,output_tokens\n" + "".join(
        f"{r.at_s},{r.model},{r.input_tokens},{r.output_tokens}\n" for r in SLICE))
    (tmp_path / "d.toml").write_text("".join(
        f'[[deployment]]\nname = "{r.deployment.name}"\nmemory_gib = {r.deployment.memory_gib:g}\n'
        "cold_start_s = 20\nwake_s = 3\nsleep_s = 1\n" for r in DEPS))
    r = command(str(tmp_path / "t.csv"), "--deployments", str(tmp_path / "d.toml"), "--gpus", "1x80",
                "--host-gib", "512", "--policy", "fixed=60", "--live", "--speed", "10")
    assert r.returncode == 0, r.stderr
    assert "fixed=60: the live run agrees" in r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:2] in (["fixed=60", "virtual"],
                                                                                    ["fixed=60", "live"])]
    assert [row[1] for row in rows] == ["virtual", "live"]
    assert rows[0][10:] == rows[1][10:]  # queued, cold starts, wakes, sleeps, stops: the same
