"""Tiered warmth end to end: the whole ondemand (process backend), the fake nvidia-smi with
its GPUs, and engine simulators that sleep as vLLM's sleep mode does (``--sleep-gpu-mib``: what
an asleep engine keeps on its GPUs; ``--host-mib``: the host memory a level-1 sleeper really
holds; level 2 answers garbage until its weights are reloaded). BEHAVIOUR.md, "Tiered warmth"."""
from __future__ import annotations

import asyncio

import pytest
from helpers import FAKES, wait_for
from test_gpu_placement import FAKE, add, ask, box, claimed

# A host with plenty of memory: a level-1 sleep is never made level 2 by what this machine has free
# (the host reserve has its own test, with a meminfo of its own).
FAKE_MEMINFO = str(FAKES / "meminfo")

pytestmark = pytest.mark.server(**{"budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE, "budget.capacity_gib": "",
                                   "metrics_interval_s": 0.1, "reap_interval_s": 3600,
                                   "budget.host_reserve_gib": 0, "budget.meminfo_path": FAKE_MEMINFO})


async def sleeper(server, name: str, gib: float, *extra: str, residue_gib: float = 2, **kw) -> int:
    """A deployment that sleeps when idle (``idle_action`` sleep unless given), keeping
    ``residue_gib`` on its GPU asleep."""
    kw.setdefault("idle_action", "sleep")
    kw.setdefault("idle_timeout_s", 1)
    return await server.add(name, gib, "--gpu-mib", str(int(gib * 1024)), "--sleep-gpu-mib",
                            str(int(residue_gib * 1024)), *extra, gpu_count=1, **kw)


def pid(server, dep_id: int) -> int:
    return server.deployer.engine(dep_id).ref.pid


async def admin(server, http, dep_id: int, verb: str, body=None) -> dict:
    async with http.post(f"{server.url}/api/deployments/{dep_id}/{verb}", json=body,
                         headers=server.admin_headers()) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


async def engine_requests(server, dep_id: int) -> list[tuple[str, str]]:
    """(path, query) of what the engine simulator received, in order (not the probes and the
    metrics sampler's reads, which come at any time)."""
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(server.deployer.base_url(dep_id) + "/_sim/requests") as r:
        return [(q["path"], q.get("query", "")) for q in await r.json()
                if q["path"] not in ("/metrics", "/health", "/v1/models")]


async def _received(server, dep_id: int, path: str) -> bool:
    return path in [p for p, _ in await engine_requests(server, dep_id)]


async def audit_rows(server, dep_id: int, action: str) -> list[dict]:
    return [r for r in await server.deployer.store.audit(dep_id) if r["action"] == action]


@pytest.mark.server(reap_interval_s=0.2)
async def test_the_reaper_puts_an_idle_model_to_sleep_and_a_request_wakes_the_same_engine(fake_nvidia_smi, server,
                                                                                          http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, "--host-mib", "64")
    assert await ask(server, http, a) == (200, "")
    first = pid(server, a)
    assert server.deployer.get(a).wake_check == "tok0"  # the greedy one-token answer, recorded after the start
    await server.idle_for(1, a)  # its idle timeout on the controller's clock: the reaper's next step
    dep = await wait_for(lambda: (d := server.deployer.get(a)).state.value == "asleep" and d.host_gib and d,
                         timeout=15, what="the reaper's sleep and its measurement")
    assert dep.sleep_level == 1 and dep.asleep_gib == pytest.approx(2)  # what it keeps on its GPU, measured
    assert dep.host_gib > 0.06 and dep.sleep_host_gib >= 0.05  # the weights in host memory: it grew by ~64 MiB
    assert claimed(fake_nvidia_smi.apps) == {dep.gpus[0]: 2}
    from ondemand import app as app_mod
    assert server.app[app_mod.GATEWAY].upstreams.pool(a) is None  # its idle connections closed asleep
    rows = await audit_rows(server, a, "ondemand_sleep")
    assert rows and rows[0]["text"].startswith("Put to sleep after 0.02 min idle") and rows[0]["detail"]["level"] == 1
    assert await ask(server, http, a) == (200, "")
    assert server.state(a) == "ready" and pid(server, a) == first  # woken, not started again
    assert server.deployer.get(a).sleep_level is None and server.deployer.get(a).host_gib is None
    seen = [p for p, _ in await engine_requests(server, a)]
    assert seen[-3:] == ["/wake_up", "/v1/completions", "/v1/chat/completions"]  # wake, check, then the request
    events = [e["text"] for e in await server.deployer.store.events(a)]
    assert any(t.startswith("woken from sleep level 1 in ") for t in events)


async def test_make_room_puts_awake_engines_to_sleep_before_it_stops_asleep_ones(fake_nvidia_smi, server, http):
    """One 80 GiB GPU. a and b asleep (2 GiB each), c awake and idle (40, known to keep 2
    asleep). d needs 76: sleeping c frees 38, not enough; then the asleep engines are stopped,
    least recently used first: a only. c sleeps, a stops, b stays asleep."""
    box(fake_nvidia_smi, gpus=1)
    a, b, c = [await sleeper(server, n, g) for n, g in (("a", 30), ("b", 30), ("c", 40))]
    for dep_id in (a, b, c):
        assert await ask(server, http, dep_id) == (200, "")
        await admin(server, http, dep_id, "sleep")
    assert await ask(server, http, c) == (200, "")  # awake again; its last sleep kept 2 GiB
    assert server.deployer.get(c).asleep_gib == pytest.approx(2)
    assert claimed(fake_nvidia_smi.apps) == {0: 44}
    d = await add(server, "d", 76, gpu_count=1)
    await server.idle_for(1.3, c)  # c idle for its full timeout
    assert await ask(server, http, d) == (200, "")
    states = {n: server.state(i) for n, i in (("a", a), ("b", b), ("c", c), ("d", d))}
    assert states == {"a": "stopped", "b": "asleep", "c": "asleep", "d": "ready"}
    assert claimed(fake_nvidia_smi.apps) == {0: 80}
    texts = {r["deployment_id"]: r["text"] for r in await server.deployer.store.audit() if r["action"] == "ondemand_sleep"}
    assert texts[c].startswith("Put to sleep to make room for D") and texts[a].startswith("Stopped (asleep) to make room")


async def test_a_busy_engine_is_never_put_to_sleep_and_a_higher_priority_one_is_never_a_victim(fake_nvidia_smi,
                                                                                               server, http):
    box(fake_nvidia_smi, gpus=1)
    busy = await sleeper(server, "busy", 30, "--token-delay", "0.5", "--tokens", "8")
    vip = await sleeper(server, "vip", 30, priority="high")
    assert await ask(server, http, vip) == (200, "")
    body = {"model": "BUSY", "messages": [{"role": "user", "content": "hi"}]}
    long = asyncio.ensure_future(http.post(server.gw(busy, "chat/completions"), json=body, headers=server.auth()))
    await wait_for(lambda: server.controller.inflight(busy) == 1, what="the long request in flight")
    await server.idle_for(1.2, vip)  # vip idle past its timeout; busy still in flight
    new = await add(server, "new", 40, gpu_count=1)
    status, code = await asyncio.wait_for(_ask_with_timeout(server, http, new), 10)
    assert (status, code) == (503, "ondemand_queue_timeout")
    assert server.state(busy) == "ready" and server.state(vip) == "ready"
    async with await long as r:
        assert r.status == 200


async def _ask_with_timeout(server, http, dep_id):
    server.controller.queue_timeout_s = 2
    return await ask(server, http, dep_id)


async def test_a_wrong_wake_answer_stops_the_engine_and_starts_it_cold(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, "--fail", "wake-garbage")
    assert await ask(server, http, a) == (200, "")
    first = pid(server, a)
    await admin(server, http, a, "sleep")
    assert await ask(server, http, a) == (200, "")
    assert pid(server, a) != first and server.state(a) == "ready"
    rows = await audit_rows(server, a, "ondemand_wake_failed")
    assert len(rows) == 1 and rows[0]["detail"]["result"] == "mismatch"
    assert "garbage" in rows[0]["detail"]["reason"] and "'tok0'" in rows[0]["detail"]["reason"]
    assert server.controller.backoff_left(a) == 0  # a failed wake is no failed start
    assert server.deployer.get(a).wake_check == "tok0"  # recorded again after the cold start


@pytest.mark.server(**{"deployer.wake_timeout_s": 1})
async def test_a_wake_that_hangs_times_out_and_starts_cold(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, "--fail", "wake-hangs")
    assert await ask(server, http, a) == (200, "")
    first = pid(server, a)
    await admin(server, http, a, "sleep")
    assert await ask(server, http, a) == (200, "")
    assert pid(server, a) != first
    rows = await audit_rows(server, a, "ondemand_wake_failed")
    assert rows[0]["detail"]["result"] == "failed" and "within 1 s" in rows[0]["detail"]["reason"]


@pytest.mark.server(reap_interval_s=0.2)
async def test_a_level_2_sleeper_reloads_its_weights_in_vllms_order(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, idle_action="sleep2")
    assert await ask(server, http, a) == (200, "")
    first = pid(server, a)
    await server.idle_for(1, a)
    dep = await wait_for(lambda: (d := server.deployer.get(a)).state.value == "asleep" and d, timeout=15,
                         what="the reaper's level-2 sleep")
    assert dep.sleep_level == 2
    assert await ask(server, http, a) == (200, "")
    assert pid(server, a) == first
    seen = [f"{p}?{q}" if q else p for p, q in await engine_requests(server, a)]
    i = seen.index("/sleep?level=2")
    assert seen[i + 1:] == ["/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache",
                            "/reset_prefix_cache", "/v1/completions", "/v1/chat/completions"]
    assert not await audit_rows(server, a, "ondemand_wake_failed")

    async def wakes():  # the start history's rows, written by a task of their own
        return [(kind, level) for kind, _, level in (await server.deployer.store.starts(20)).get(a, [])
                if kind == "wake"]
    assert await wait_for(wakes, what="the wake in the state file") == [("wake", 2)]  # with its level

    async def sleeps():  # the sleep's call too, so that a restart keeps how long it held the memory
        return [(kind, level) for kind, _, level in (await server.deployer.store.starts(20)).get(a, [])
                if kind == "sleep"]
    assert await wait_for(sleeps, what="the sleep in the state file") == [("sleep", 2)]


async def test_a_sleep_raced_by_a_request_wakes_it_and_never_lets_the_sleeper_answer(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, "--sleep-delay", "0.5")
    assert await ask(server, http, a) == (200, "")
    sleeping = asyncio.ensure_future(server.deployer.sleep(a))
    await wait_for(lambda: server.state(a) == "asleep", what="the mark to asleep")
    answers = await asyncio.gather(*(ask(server, http, a) for _ in range(5)))
    assert answers == [(200, "")] * 5  # each waited for the wake, which waited for the sleep call
    assert await sleeping == 1
    seen = [p for p, _ in await engine_requests(server, a)]
    assert seen.index("/sleep") < seen.index("/wake_up") < seen.index("/v1/chat/completions", seen.index("/sleep"))


async def test_a_stop_during_a_wake_wins_and_its_waiters_hear_it(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20, "--wake-delay", "5")
    assert await ask(server, http, a) == (200, "")
    await admin(server, http, a, "sleep")
    waiting = asyncio.ensure_future(ask(server, http, a))
    await wait_for(lambda: server.state(a) == "starting", what="the wake")
    await wait_for(lambda: _received(server, a, "/wake_up"), what="the wake call at the engine")
    await asyncio.wait_for(admin(server, http, a, "stop"), 5)  # it cancels the hung wake: no 5 s wait
    assert await waiting == (503, "ondemand_stopped")
    assert server.state(a) == "stopped" and claimed(fake_nvidia_smi.apps) == {}


@pytest.mark.server(**{"budget.host_reserve_gib": 16})
async def test_the_host_reserve_makes_a_level_1_sleep_level_2_or_a_stop(fake_nvidia_smi, server, http, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 20971520 kB\n")  # 32 GiB, 20 available
    server.deployer.budget.meminfo_path = str(meminfo)
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 10)  # predicted 10 GiB in host memory: 20 - 10 < 16
    assert await ask(server, http, a) == (200, "")
    view = await admin(server, http, a, "sleep")
    assert view["state"] == "asleep" and view["sleep_level"] == 2
    events = [e["text"] for e in await server.deployer.store.events(a)]
    assert any("level 2: host memory" in t for t in events)
    # SGLang started for level 1 (the CPU backup of its weights) cannot sleep at level 2: it stops.
    s = await server.add("s", 10, "--flavor", "sglang", "--enable-memory-saver", "--enable-weights-cpu-backup",
                         gpu_count=1, idle_action="sleep", engine="sglang", idle_timeout_s=1)
    assert await ask(server, http, s) == (200, "")
    await server.idle_for(1.2, s)
    assert server.controller.reap() == [s]
    await wait_for(lambda: server.state(s) == "stopped", what="the stop instead of a sleep")
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 31457280 kB\n")  # 30 available: level 1 fits
    assert await ask(server, http, s) == (200, "")
    await server.idle_for(1.2, s)
    server.controller.reap()
    dep = await wait_for(lambda: (d := server.deployer.get(s)).state.value == "asleep" and d, what="sglang asleep")
    assert dep.sleep_level == 1
    assert await ask(server, http, s) == (200, "")
    seen = [p for p, _ in await engine_requests(server, s)]
    assert "/release_memory_occupation" in seen and "/resume_memory_occupation" in seen


@pytest.mark.server(sleep_timeout_s=1, reap_interval_s=0.2)
async def test_an_engine_asleep_longer_than_sleep_timeout_s_is_stopped(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=8)
    a = await sleeper(server, "a", 20)
    assert await ask(server, http, a) == (200, "")
    await server.idle_for(1, a)
    await wait_for(lambda: server.state(a) == "asleep", timeout=10, what="the sleep")
    server.skip(1)  # asleep for its sleep_timeout_s
    await wait_for(lambda: server.state(a) == "stopped", timeout=10, what="the stop after sleep_timeout_s")
    rows = await audit_rows(server, a, "ondemand_sleep")
    assert any("min asleep (sleep_timeout_s)" in r["text"] for r in rows)
    assert claimed(fake_nvidia_smi.apps) == {}



async def test_litellm_keeps_the_entrys_id_through_ready_asleep_ready(fake_nvidia_smi, tmp_path):
    """Through the whole ondemand and the LiteLLM double: the entry of a deployment that sleeps
    and wakes is patched in place (order 1 → 2 → 1, dgxmm_state ready → asleep → ready), never
    replaced: its LiteLLM id, and with it LiteLLM's spend, cooldown and health state, stay."""
    from helpers import run_app, two_pools
    from litellm_double import litellm_double
    box(fake_nvidia_smi, gpus=8)
    async with litellm_double("sk-m") as double:
        mk = tmp_path / "master.key"
        mk.write_text("sk-m\n")
        settings = {"budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE, "budget.capacity_gib": "",
                    "reap_interval_s": 3600, "budget.host_reserve_gib": 0, "budget.meminfo_path": FAKE_MEMINFO,
                    "litellm.url": double.url, "litellm.master_key_file": str(mk)}
        async with run_app(tmp_path, **settings) as server, two_pools() as http:
            a = await sleeper(server, "a", 20)

            def entry() -> tuple[str, int, str] | None:
                mine = [m for m in double.models if m["model_info"].get("dgxmm_id") == a]
                return (mine[0]["model_info"]["id"], mine[0]["litellm_params"]["order"],
                        mine[0]["model_info"]["dgxmm_state"]) if len(mine) == 1 else None
            first = await wait_for(entry, what="the cold entry")
            assert first[1:] == (3, "cold")
            assert await ask(server, http, a) == (200, "")
            await wait_for(lambda: entry() == (first[0], 1, "ready"), what="ready, patched in place")
            await admin(server, http, a, "sleep")
            await wait_for(lambda: entry() == (first[0], 2, "asleep"), what="asleep, patched in place")
            assert await ask(server, http, a) == (200, "")
            await wait_for(lambda: entry() == (first[0], 1, "ready"), what="awake again, the same id")
            assert not double.deletes  # never replaced


# --- issue 29: a sleeper nvidia-smi lists no process of; sleeps under way and the host reserve ---


async def test_a_sleeper_with_no_per_process_rows_is_stopped_for_room_and_the_request_served(fake_nvidia_smi,
                                                                                            server, http,
                                                                                            monkeypatch):
    """As in a container that cannot see the others' processes: nvidia-smi lists none of a's.
    Its residue is what it booked less the drop of GPU 0's used memory across its sleep call
    (40 - 38 = 2), so make-room counts stopping it as freeing 2, and d (79 of 80, 78 free) is
    served instead of waiting out its queue timeout."""
    monkeypatch.setenv("FAKE_NVIDIA_SMI_HIDE_APPS", "1")
    box(fake_nvidia_smi, gpus=1)
    a = await sleeper(server, "a", 40)
    assert await ask(server, http, a) == (200, "")
    await admin(server, http, a, "sleep")
    dep = await wait_for(lambda: (d := server.deployer.get(a)).asleep_gib is not None and d, what="a's residue")
    assert dep.measured_gib is None and dep.asleep_gib == pytest.approx(2, abs=0.01)
    d = await add(server, "d", 79, gpu_count=1)
    assert await asyncio.wait_for(ask(server, http, d), 20) == (200, "")
    assert server.state(a) == "stopped" and server.state(d) == "ready"


@pytest.mark.server(**{"budget.host_reserve_gib": 16, "reap_interval_s": 3600})
async def test_sleeps_the_reaper_starts_together_reserve_host_memory_against_each_other(fake_nvidia_smi, server,
                                                                                         http, tmp_path):
    """30 GiB available, 16 kept: one level-1 sleep of 8 leaves 22, two leave 14. Each alone would
    sleep at level 1; started together, the second counts the first's (still under way) and
    sleeps at level 2. The prediction is the booked size when no level-1 sleep was measured."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 31457280 kB\n")  # 32 GiB, 30 available
    server.deployer.budget.meminfo_path = str(meminfo)
    box(fake_nvidia_smi, gpus=8)
    a, b = [await sleeper(server, n, 8, "--sleep-delay", "0.3") for n in ("a", "b")]
    for dep_id in (a, b):
        assert await ask(server, http, dep_id) == (200, "")
    await server.idle_for(1.2, a, b)
    assert sorted(server.controller.reap()) == [a, b]
    await wait_for(lambda: server.state(a) == server.state(b) == "asleep", what="both asleep")
    assert sorted(server.deployer.get(i).sleep_level for i in (a, b)) == [1, 2]
    # One at a time, each sleeps at level 1: the reservation ended with the call.
    for dep_id in (a, b):
        assert await ask(server, http, dep_id) == (200, "")
        assert (await admin(server, http, dep_id, "sleep", {"level": 1}))["sleep_level"] == 1
