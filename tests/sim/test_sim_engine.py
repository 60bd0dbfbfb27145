"""The engine double (ondemand/sim/engine.py): real servers on 127.0.0.1, port 0, spoken to over
HTTP, or processes of their own. Here the process (its exit at start, SIGTERM, its journal),
sleep and wake as vLLM and SGLang do them (sim/memory.py), and the load of --load-weights
(sim/phases.py); the routes, the generation, the failures after the start and the options each
have a file of their own (test_sim_routes.py, test_sim_generation.py, test_sim_faults.py,
test_sim_options.py), the lean front test_sim_lean.py."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import aiohttp
from sim_helpers import CHAT, GARBAGE, TOKS, awake, call, content, simulator, spawn, sse, started, state

from ondemand.sim.engine import SimServer, main, parse_args


async def test_sleep_and_wake_up(sim):
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    async with sim.post("/sleep?level=1") as r:
        assert r.status == 200
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    async with sim.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
    async with sim.get("/health") as r:
        assert r.status == 200
    async with sim.post("/wake_up") as r:
        assert r.status == 200
    async with sim.get("/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": False}
    async with sim.post("/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200


def test_exit_at_start_in_process(capsys):
    assert main(["--fail", "exit-at-start"]) == 3
    assert "exit-at-start" in capsys.readouterr().err


async def test_exit_at_start_subprocess():
    proc = await spawn("--fail", "exit-at-start")
    _, err = await asyncio.wait_for(proc.communicate(), 5)
    assert proc.returncode == 3 and b"exit-at-start" in err


async def test_sigterm_stops_cleanly():
    proc = await spawn()
    try:
        await started(proc)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_journal_records_requests_and_the_inflight_at_sigterm(tmp_path):
    """--journal: boot, each request's path and header names (no values), its end, and at
    SIGTERM the generation requests still in flight; the file outlives the process."""
    journal = tmp_path / "journal.jsonl"
    proc = await spawn("--journal", str(journal), "--token-delay", "0.5", "--tokens", "20")
    try:
        port = await started(proc)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                              headers={"Authorization": "Bearer sk-secret", "X-Other": "v"}) as r:
                assert r.status == 200
            stream = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "stream": True})
            await stream.content.readline()  # it is being generated now
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            stream.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = journal.read_text()
    assert "sk-secret" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [e["ev"] for e in lines[:3]] == ["boot", "req", "end"]
    assert {e["pid"] for e in lines} == {proc.pid}
    assert "authorization" in lines[1]["h"] and "x-other" in lines[1]["h"]
    assert lines[1]["path"] == "/v1/chat/completions"
    sigterm = [e for e in lines if e["ev"] == "sigterm"]
    assert len(sigterm) == 1 and sigterm[0]["inflight"] == 1


# -- sleep levels (issue 22) ------------------------------------------------------------------


async def test_level_1_keeps_the_weights(sim):
    assert await content(sim) == TOKS
    await call(sim, "POST", "/sleep")  # level 1 by default
    assert await state(sim) == {"sleeping": {"weights": True, "kv_cache": True}, "level": 1, "garbage": False,
                                "wakes": 0, "sleeps": 1}
    await call(sim, "POST", "/v1/chat/completions", 503, json=CHAT)
    await call(sim, "POST", "/v1/completions", 503, json={"prompt": "x"})
    for path in ("/health", "/v1/models", "/metrics"):  # as vLLM: they answer while asleep
        await call(sim, "GET", path)
    await call(sim, "POST", "/sleep?level=1")  # asleep already: nothing changes
    assert (await state(sim))["sleeps"] == 1
    await call(sim, "POST", "/wake_up")
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert await state(sim) == awake(wakes=1, sleeps=1)
    assert await content(sim) == TOKS  # the same deterministic answer


async def test_level_2_answers_garbage_until_the_weights_are_reloaded(sim):
    await call(sim, "POST", "/sleep?level=2")
    await call(sim, "POST", "/wake_up?tags=weights")
    st = await state(sim)
    assert st["sleeping"] == {"weights": False, "kv_cache": True} and st["level"] == 2 and st["garbage"]
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": True}
    await call(sim, "POST", "/v1/chat/completions", 503, json=CHAT)  # the KV cache still sleeps
    assert await call(sim, "POST", "/collective_rpc", json={"method": "reload_weights"}) == {"results": [None]}
    assert not (await state(sim))["garbage"]
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": True}
    await call(sim, "POST", "/wake_up?tags=kv_cache")
    await call(sim, "POST", "/reset_prefix_cache")
    assert await call(sim, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert await content(sim) == TOKS
    # A plain wake after level 2, without the reload: 200, but garbage, in every generation route.
    await call(sim, "POST", "/sleep?level=1")
    await call(sim, "POST", "/sleep?level=2")  # deeper: the weights are dropped after all
    assert (await state(sim))["level"] == 2
    await call(sim, "POST", "/wake_up")
    assert await content(sim) == GARBAGE
    body = await call(sim, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert body["choices"][0]["text"] == "garbage0 garbage1"
    req = {**CHAT, "stream": True, "max_tokens": 2}
    events = sse((await call(sim, "POST", "/v1/chat/completions", json=req)).decode())
    assert [json.loads(d)["choices"][0]["delta"]["content"] for _, d in events[1:-1]] == ["garbage0", " garbage1"]
    await call(sim, "POST", "/collective_rpc", json={"method": "reload_weights"})
    assert await content(sim) == TOKS
    assert await state(sim) == awake(wakes=3, sleeps=3)


async def test_sleep_and_rpc_errors(sim):
    for level in ("0", "3", "x", ""):
        err = (await call(sim, "POST", f"/sleep?level={level}", 400))["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == "level"
    assert not (await state(sim))["sleeping"]["weights"]
    await call(sim, "POST", "/collective_rpc", 400, json={"method": "explode"})
    await call(sim, "POST", "/collective_rpc", 400, json={})
    await call(sim, "POST", "/sleep?level=2")
    await call(sim, "POST", "/wake_up?tags=gpu", 400)
    await call(sim, "POST", "/collective_rpc", 400, json={"method": "reload_weights"})  # the weights sleep
    await call(sim, "POST", "/wake_up?tags=kv_cache&tags=weights")
    assert (await state(sim))["sleeping"] == {"weights": False, "kv_cache": False}
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk"):
        await call(sim, "POST", path, 404, json={})  # SGLang's routes are not vLLM's


async def test_sleep_and_wake_delays():
    async with simulator(sleep_delay=0.2, wake_delay=0.3) as s:
        t0 = time.monotonic()
        await call(s, "POST", "/sleep")
        assert time.monotonic() - t0 >= 0.2
        t0 = time.monotonic()
        waking = asyncio.ensure_future(call(s, "POST", "/wake_up"))
        await asyncio.sleep(0.1)
        assert (await state(s))["sleeping"]["weights"]  # still waking
        await waking
        assert time.monotonic() - t0 >= 0.3
        assert await state(s) == awake(wakes=1, sleeps=1)


async def test_wake_garbage_is_for_good():
    async with simulator(fail="wake-garbage") as s:
        assert await content(s) == TOKS
        await call(s, "POST", "/sleep")
        await call(s, "POST", "/wake_up")
        assert await content(s) == GARBAGE
        await call(s, "POST", "/collective_rpc", json={"method": "reload_weights"})
        assert await content(s) == GARBAGE
        assert (await state(s))["garbage"]


async def test_sglang_flavor():
    async with simulator(flavor="sglang") as s:
        assert await call(s, "GET", "/health") == b""
        assert (await call(s, "GET", "/v1/models"))["data"][0]["id"] == "demo"
        assert "sglang:num_running_reqs" in (await call(s, "GET", "/metrics")).decode()
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/collective_rpc")):
            await call(s, method, path, 404)  # vLLM's routes are not SGLang's
        assert await call(s, "POST", "/release_memory_occupation", json={}) is None
        assert await state(s) == {"sleeping": {"weights": True, "kv_cache": True}, "level": 2, "garbage": True,
                                  "wakes": 0, "sleeps": 1}  # no --enable-weights-cpu-backup: level 2
        await call(s, "POST", "/v1/chat/completions", 503, json=CHAT)
        body = await call(s, "POST", "/update_weights_from_disk", 400, json={"model_path": "org/m"})
        assert body["success"] is False  # the weights still sleep
        await call(s, "POST", "/release_memory_occupation", 400)  # no body: FastAPI's 400
        assert await call(s, "POST", "/resume_memory_occupation", json={}) is None
        assert await content(s) == GARBAGE
        body = await call(s, "POST", "/update_weights_from_disk", json={"model_path": "org/m"})
        assert body["success"] is True and body["message"]
        assert await content(s) == TOKS
        assert await state(s) == awake(wakes=1, sleeps=1)
    async with simulator(flavor="sglang", weights_cpu_backup=True, fail="wake-fails") as s:
        await call(s, "POST", "/release_memory_occupation", json={})
        assert (await state(s))["level"] == 1 and not (await state(s))["garbage"]
        assert "wake-fails" in (await call(s, "POST", "/resume_memory_occupation", 400, json={}))["error"]["message"]


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_host_mib_is_real_memory_while_asleep_at_level_1():
    host = 64
    proc = await spawn("--host-mib", str(host))
    try:
        port = await started(proc)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            before = vm_rss_mib(proc.pid)
            await call(s, "POST", "/sleep?level=1")
            asleep = vm_rss_mib(proc.pid)
            assert asleep - before >= 0.8 * host, (before, asleep)
            await call(s, "POST", "/wake_up")
            woken = vm_rss_mib(proc.pid)
            assert asleep - woken >= host / 2, (asleep, woken)
            await call(s, "POST", "/sleep?level=2")  # level 2 keeps no copy
            assert vm_rss_mib(proc.pid) - woken < host / 2
    finally:
        proc.kill()
        await proc.wait()


async def test_sleep_gpu_mib_and_the_journal(tmp_path):
    apps, journal = tmp_path / "apps", tmp_path / "journal.jsonl"
    env = {**os.environ, "FAKE_NVIDIA_SMI_APPS": str(apps), "CUDA_VISIBLE_DEVICES": "0,3"}
    proc = await spawn("--gpu-mib", "1000", "--sleep-gpu-mib", "150", "--journal", str(journal), env=env)
    try:
        port = await started(proc)
        file = apps / str(proc.pid)
        assert file.read_text() == "0 1000\n3 1000\n"
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            await call(s, "POST", "/sleep?level=2")
            assert file.read_text() == "0 150\n3 150\n"
            await call(s, "POST", "/wake_up?tags=weights")
            assert file.read_text() == "0 150\n3 150\n"  # the KV cache still sleeps
            await call(s, "POST", "/wake_up?tags=kv_cache")
            assert file.read_text() == "0 1000\n3 1000\n"
        assert sorted(p.name for p in apps.iterdir()) == [str(proc.pid)]  # no temporary file left
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 5) == 0
        assert not file.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    marks = [(e["ev"], e.get("level"), e.get("tags")) for e in lines if e["ev"] in ("sleep", "wake")]
    assert marks == [("sleep", 2, None), ("wake", None, ["weights"]), ("wake", None, ["kv_cache"])]
    assert all(e["pid"] == proc.pid and "t" in e for e in lines)


async def test_load_weights_reads_the_checkpoint_and_is_ready_only_after(tmp_path, capfd):
    """--load-weights: the load lasts at least the read of the weight files. The one file here is
    a FIFO the test holds open: until it closes it, the read goes on and the engine answers 503;
    the lines after the load, and readiness, come after the read."""
    model = tmp_path / "tiny"
    model.mkdir()
    fifo = model / "model.safetensors"
    os.mkfifo(fifo)
    opts = parse_args(["--load-weights", str(model), "--served-model-name", "demo", "--startup-delay", "0.3",
                       "--weights-delay", "0.1", "--compile-delay", "0.1"])
    assert opts.weights_path == str(model) and opts.model == "demo"
    server = SimServer(dataclasses.replace(opts, port=0), shutdown_timeout=0.1)
    port = await server.start()
    writer = None
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            writer = await asyncio.to_thread(open, fifo, "wb")  # the reader has opened it: the load began
            writer.write(b"\0" * 4096)
            await asyncio.sleep(0.6)  # past the whole --startup-delay: still loading, the read goes on
            async with s.get("/v1/models") as r:
                assert r.status == 503
            assert "Loading weights took" not in capfd.readouterr().err
            writer.close()
            began = time.monotonic()
            while True:
                async with s.get("/v1/models") as r:
                    if r.status == 200:
                        break
                assert time.monotonic() - began < 5
                await asyncio.sleep(0.02)
            # Ready the startup delay after the start, moved by the read's excess over --weights-delay.
            assert time.monotonic() - began >= 0.1
            err = capfd.readouterr().err
            assert "Loading weights took" in err and err.index("Loading weights took") < err.index("Starting vLLM API")
    finally:
        if writer is not None and not writer.closed:
            writer.close()
        await server.stop()
