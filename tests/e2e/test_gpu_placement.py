"""GPU placement end to end: the whole ondemand (process backend), the fake nvidia-smi
with N GPUs, and engine simulators that "allocate" memory on the GPUs of their
CUDA_VISIBLE_DEVICES (``--gpu-mib``), as a real engine would. What nvidia-smi reads is
what the engines hold, so an engine placed on the wrong GPU shows as memory where it
should not be (BEHAVIOUR.md, "GPU placement")."""
from __future__ import annotations

import asyncio
import json
import pathlib
import random
import sys

import pytest
from helpers import FAKES, wait_for
from test_cli import cli, write_config

FAKE = str(FAKES / "nvidia-smi")
GIB_MIB = 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

pytestmark = pytest.mark.server(**{"budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE, "budget.capacity_gib": "",
                                   "metrics_interval_s": 0.1})


def box(fake_nvidia_smi, gpus: int = 8, total_gib: int = 80, used: dict[int, int] | None = None) -> None:
    """``gpus`` GPUs of ``total_gib``; ``used``: GiB that processes not ours hold on some."""
    used = used or {}
    fake_nvidia_smi(*(f"{total_gib * GIB_MIB}, {used.get(i, 0) * GIB_MIB}" for i in range(gpus)))


def claimed(apps: pathlib.Path) -> dict[int, int]:
    """GiB the live engine simulators hold per GPU (the fake's processes directory)."""
    out: dict[int, int] = {}
    for f in apps.iterdir():
        if f.name.isdigit() and pathlib.Path(f"/proc/{f.name}").exists():
            try:
                text = f.read_text()
            except FileNotFoundError:  # the simulator exited between the listing and the read
                continue
            for line in text.split("\n"):
                if line.strip():
                    gpu, mib = line.split()
                    out[int(gpu)] = out.get(int(gpu), 0) + int(mib) // GIB_MIB
    return out


async def add(server, name: str, gib: float, *, uses_gib: float | None = None, **kw) -> int:
    """A deployment whose simulator uses ``uses_gib`` (default: what it declares) in all."""
    count = kw.get("gpu_count") or 1
    per_gpu_mib = int((gib if uses_gib is None else uses_gib) * GIB_MIB / count)
    return await server.add(name, gib, "--gpu-mib", str(per_gpu_mib), **kw)


async def ask(server, http, dep_id: int) -> tuple[int, str]:
    body = {**CHAT, "model": server.deployer.get(dep_id).served_name}
    async with http.post(server.gw(dep_id, "chat/completions"), json=body, headers=server.auth()) as r:
        body = await r.json()
        return r.status, (body.get("error") or {}).get("code", "")


def gpus(server, dep_id: int) -> tuple[int, ...]:
    return server.deployer.get(dep_id).gpus


async def test_two_60_gib_single_gpu_models_land_on_different_gpus(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi)
    a = await add(server, "a", 60, gpu_count=1)
    b = await add(server, "b", 60, gpu_count=1)
    assert await ask(server, http, a) == (200, "")
    assert await ask(server, http, b) == (200, "")
    assert (gpus(server, a), gpus(server, b)) == ((0,), (1,))
    assert claimed(fake_nvidia_smi.apps) == {0: 60, 1: 60}  # each engine saw only its GPU
    assert server.state(a) == "ready"  # nothing was stopped to make room
    views = {v["id"]: v for v in await (await http.get(f"{server.url}/api/deployments",
                                                       headers=server.admin_headers())).json()}
    assert views[a]["gpus"] == [0] and views[b]["gpus"] == [1]


async def test_a_two_gpu_model_gets_two_gpus_that_each_have_its_half_free(fake_nvidia_smi, server, http):
    # Processes not ours hold memory: GPUs 1, 2, 5 and 6 have less than 50 GiB free; of
    # 0, 3, 4 and 7, GPUs 3 and 4 are the fullest that still fit (best fit).
    box(fake_nvidia_smi, used={0: 0, 1: 40, 2: 35, 3: 25, 4: 28, 5: 79, 6: 31, 7: 10})
    big = await add(server, "big", 100, gpu_count=2)
    assert await ask(server, http, big) == (200, "")
    assert gpus(server, big) == (3, 4)
    assert claimed(fake_nvidia_smi.apps) == {3: 50, 4: 50}


async def test_best_fit_beside_a_foreign_process_and_a_pin(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=4, used={2: 45})
    small = await add(server, "small", 30, gpu_count=1)
    pinned = await add(server, "pinned", 30, gpu_count=1, gpu_ids=[3])
    assert await ask(server, http, small) == (200, "")
    assert gpus(server, small) == (2,)  # 35 GiB free beside the 45 GiB process: the tightest fit
    assert await ask(server, http, pinned) == (200, "")
    assert gpus(server, pinned) == (3,)  # its pin, though GPU 0 would be chosen otherwise
    assert claimed(fake_nvidia_smi.apps) == {2: 30, 3: 30}


async def test_a_process_that_took_a_gpu_just_before_the_request_is_seen(fake_nvidia_smi, server, http):
    """Issue 40: the fit check reads the GPUs after the request arrived. A reading taken a moment
    before it (here: just before, with no pause) misses a foreign process that filled GPU 0 since,
    and the model would be placed there and run out of memory; it goes to the free GPU 1."""
    box(fake_nvidia_smi, gpus=2)
    dep = await add(server, "m", 40, gpu_count=1)
    await server.deployer.budget.read(server.deployer.all())  # both GPUs free, a moment ago
    job = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        (fake_nvidia_smi.apps / str(job.pid)).write_text(f"0 {60 * GIB_MIB}\n")  # a job takes 60 GiB of GPU 0
        assert await ask(server, http, dep) == (200, "")
        assert gpus(server, dep) == (1,)
        assert claimed(fake_nvidia_smi.apps) == {0: 60, 1: 40}
    finally:
        job.kill()
        await job.wait()


async def test_does_not_fit_on_any_gpu_is_refused_at_once(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi)
    huge = await add(server, "huge", 90, gpu_count=1)  # 640 GiB free in all, 80 on any one GPU
    status, code = await ask(server, http, huge)
    assert (status, code) == (503, "does_not_fit")
    assert server.state(huge) == "stopped" and huge not in server.controller.queue


@pytest.mark.server(reap_interval_s=3600)  # no reaper: the victims stay until make-room takes them
async def test_make_room_on_a_two_gpu_box_stops_only_the_victim_on_the_chosen_gpu(fake_nvidia_smi, server, http):
    box(fake_nvidia_smi, gpus=2)
    old = await add(server, "old", 40, gpu_count=1, idle_timeout_s=1)
    full = await add(server, "full", 70, gpu_count=1, idle_timeout_s=1)
    assert await ask(server, http, old) == (200, "")
    assert await ask(server, http, full) == (200, "")
    assert (gpus(server, old), gpus(server, full)) == ((0,), (1,))
    # Both idle now; "old" is the least recently used. The newcomer (60 GiB on one GPU)
    # fits on GPU 0 once "old" is gone; "full" on GPU 1 frees nothing it could use.
    new = await add(server, "new", 60, gpu_count=1)
    await server.idle_for(1.2, old, full)  # past their idle timeouts, on the controller's clock
    assert await ask(server, http, new) == (200, "")
    assert server.state(old) == "stopped" and server.state(full) == "ready"
    assert gpus(server, new) == (0,) and gpus(server, old) == ()
    assert claimed(fake_nvidia_smi.apps) == {0: 60, 1: 70}


async def test_a_measured_footprint_larger_than_declared_is_used_by_the_next_fit_check(fake_nvidia_smi, server,
                                                                                      http):
    box(fake_nvidia_smi, gpus=1, used={0: 45})  # 35 GiB free
    liar = await add(server, "liar", 20, uses_gib=30, gpu_count=1)  # declares 20, uses 30
    assert await ask(server, http, liar) == (200, "")
    dep = await wait_for(lambda: (d := server.deployer.get(liar)).measured_gib and d, what="a measurement")
    assert dep.measured_gib == pytest.approx(30) and dep.over_declared
    events = [e["text"] for e in await server.deployer.store.events(liar)]
    assert any("more than the 20 GiB it declared" in t for t in events)
    async with http.post(f"{server.url}/api/deployments/{liar}/stop", headers=server.admin_headers()) as r:
        assert r.status == 200
    await wait_for(lambda: claimed(fake_nvidia_smi.apps) == {}, what="the engine's memory to be freed")
    box(fake_nvidia_smi, gpus=1, used={0: 55})  # 25 GiB free: its declared 20 would fit, its 30 does not
    async with http.post(f"{server.url}/api/deployments/{liar}/start", headers=server.admin_headers()) as r:
        body = await r.json()
        assert r.status == 409 and body["error"]["code"] == "insufficient_memory", body
        assert "30 GiB" in body["error"]["message"]


async def test_host_and_status_show_each_gpu_and_its_holders(fake_nvidia_smi, server, http, tmp_path):
    box(fake_nvidia_smi, gpus=2, used={1: 70})  # 10 GiB free on GPU 1: too little
    a = await add(server, "a", 20, gpu_count=1)
    assert await ask(server, http, a) == (200, "")
    host = await (await http.get(f"{server.url}/api/host", headers=server.admin_headers())).json()
    g = host["budget"]["gpus"]
    assert host["budget"]["per_gpu"] is True and [x["index"] for x in g] == [0, 1]
    assert g[1]["deployments"] == [] and g[1]["used"] == 70 and g[1]["capacity"] == 80
    assert g[0]["deployments"] == ["a"] and g[0]["used"] == 20 and g[0]["free"] == 60
    assert g[0]["uuid"].startswith("GPU-")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("status", config=cfg)
    assert rc == 0, err
    assert "GPU 0: 20.0 of 80 GiB used, 60.0 free; held by a" in out
    assert "GPU 1: 70.0 of 80 GiB used, 10.0 free; held by -" in out
    # The command line sets the GPU fields: a pin alone sets the count.
    rc, out, err = await cli("deploy", "add", "b", "--command", "ondemand sim-engine --port {port}", "--gpu-ids", "1",
                             "--mode", "on_demand", "--json", config=cfg)
    assert rc == 0, err
    view = json.loads(out)
    assert (view["gpu_count"], view["gpu_ids"], view["gpus"]) == (1, [1], [])
    rc, out, err = await cli("deploy", "set", str(view["id"]), "--gpu-ids", "any", "--gpu-count", "0", "--json",
                             config=cfg)
    assert rc == 0, err
    assert (json.loads(out)["gpu_count"], json.loads(out)["gpu_ids"]) == (0, None)


@pytest.mark.slow
@pytest.mark.server(ondemand_queue_timeout_s=20, reap_interval_s=0.3)
async def test_seeded_simulation_never_overfills_a_gpu(fake_nvidia_smi, server, http):
    """12 models of mixed sizes and GPU counts on an 8 x 80 GiB box, random traffic: no GPU
    is ever over its capacity (as the fake nvidia-smi reads what the engines hold), and every
    request is answered or fails with a documented error."""
    rng = random.Random(11)
    box(fake_nvidia_smi)
    shapes = [(70, 1), (60, 1), (40, 1), (30, 1), (20, 1), (120, 2), (100, 2), (60, 2), (200, 4), (10, 0),
              (50, 1), (150, 2)]
    ids = []
    for i, (gib, count) in enumerate(shapes):
        ids.append(await add(server, f"m{i}", gib, gpu_count=count, idle_timeout_s=1,
                             uses_gib=gib if count else 0))
    worst: dict[int, int] = {}
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            for gpu, gib in claimed(fake_nvidia_smi.apps).items():
                worst[gpu] = max(worst.get(gpu, 0), gib)
            await asyncio.sleep(0.02)

    outcomes: dict[tuple[int, str], int] = {}

    async def client(n: int) -> None:
        for _ in range(n):
            dep_id = rng.choice(ids)
            key = await ask(server, http, dep_id)
            outcomes[key] = outcomes.get(key, 0) + 1
            await asyncio.sleep(rng.random() * 0.3)

    watcher = asyncio.ensure_future(watch())
    await asyncio.gather(*(client(8) for _ in range(6)))
    done.set()
    await watcher
    assert max(worst.values()) <= 80, worst
    documented = {(200, ""), (503, "ondemand_queue_timeout")}
    assert set(outcomes) <= documented, outcomes
    assert outcomes.get((200, ""), 0) >= 24, outcomes
    assert all(server.controller.inflight(i) == 0 and server.controller.waiting(i) == 0 for i in ids)


# --- what each backend gives the engine ----------------------------------------------------


async def test_the_process_backend_shows_the_engine_only_its_gpus(fake_nvidia_smi, tmp_path):
    from ondemand.engines.backends.process import ProcessBackend
    from ondemand.model import Deployment
    box(fake_nvidia_smi)
    backend = ProcessBackend(tmp_path)
    row = {"id": 1, "name": "p", "served_name": "P", "command": ["ondemand", "sim-engine", "--port", "{port}",
                                                                 "--gpu-mib", "1024"]}
    for fields, want in (({"gpu_count": 2, "gpus": [2, 6]}, {2: 1, 6: 1}),  # its two GPUs
                         ({"gpu_count": 0}, {}),  # no GPU at all
                         ({"gpu_count": None}, {0: 1})):  # every GPU: CUDA_VISIBLE_DEVICES untouched
        engine = await backend.start(Deployment.from_row({**row, **fields}))
        try:
            await wait_for(lambda e=engine: "serving" in _log(tmp_path), what="the simulator to serve")
            assert claimed(fake_nvidia_smi.apps) == want, fields
        finally:
            await backend.stop(engine, 5)
            await backend.wait_exit(engine)
            (tmp_path / "logs" / "p.log").unlink()


def _log(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "logs" / "p.log"
    return path.read_text() if path.exists() else ""


async def test_the_docker_backend_sends_the_device_ids(fake_nvidia_smi, tmp_path):
    """Against the Docker API double: the create request carries an nvidia device request
    with exactly the chosen GPUs, and the engine (a host process there) uses only those."""
    from docker_double import DockerDouble

    from ondemand.engines.backends.docker import DockerBackend
    from ondemand.model import Deployment
    box(fake_nvidia_smi)
    double = DockerDouble()
    double.add_network("dgxmm", [("172.30.0.0/16", "172.30.0.1")])
    double.add_image("sim:latest", [sys.executable, "-m", "ondemand.sim.engine"])
    async with double:
        backend = DockerBackend(docker_url=double.url, network="dgxmm", gpus=True, in_container=False)
        try:
            row = {"id": 1, "name": "d", "served_name": "D", "image": "sim:latest",
                   "args": ["--host", "127.0.0.1", "--port", "8000", "--gpu-mib", "2048"], "port": 8000}
            engine = await backend.start(Deployment.from_row({**row, "gpu_count": 2, "gpus": [3, 5]}))
            config = double._container(engine.ref)
            assert config["HostConfig"]["DeviceRequests"] == [
                {"Driver": "nvidia", "DeviceIDs": ["3", "5"], "Capabilities": [["gpu"]]}]
            assert "NVIDIA_VISIBLE_DEVICES=3,5" in config["Config"]["Env"]
            await wait_for(lambda: claimed(fake_nvidia_smi.apps) == {3: 2, 5: 2}, what="the engine's claim")
            await backend.stop(engine, 5)
            await backend.wait_exit(engine)
            engine = await backend.start(Deployment.from_row({**row, "id": 2, "name": "e", "gpu_count": 0}))
            config = double._container(engine.ref)
            assert "DeviceRequests" not in config["HostConfig"]
            assert "NVIDIA_VISIBLE_DEVICES=void" in config["Config"]["Env"]
            await backend.stop(engine, 5)
        finally:
            await backend.close()


async def test_a_recipe_without_memory_gib_books_the_engine_default_and_never_overfills(fake_nvidia_smi, server,
                                                                                          http):
    # Issue 29: it booked 0 GiB while vLLM took 0.9 of the GPU, so the next model placed beside it failed.
    box(fake_nvidia_smi, gpus=2)
    other = await add(server, "other", 30, gpu_count=1)
    assert await ask(server, http, other) == (200, "")
    assert gpus(server, other) == (0,)
    recipe = (await server.deployer.create({"name": "r", "served_name": "r", "engine": "vllm", "model": "org/none",
                                            "memory_gib": 0, "gpu_count": 1, "mode": "on_demand"})).id
    dep = server.deployer.get(recipe)
    assert (dep.memory_source, dep.footprint_gib) == ("engine_default", pytest.approx(72.0))
    async with http.get(f"{server.url}/api/deployments/{recipe}", headers=server.admin_headers()) as r:
        view = await r.json()
    assert view["memory_source"] == "engine_default" and view["memory_gib"] == pytest.approx(72.0)
    assert view["argv"][view["argv"].index("--gpu-memory-utilization") + 1] == "0.90"
    budget = server.deployer.budget
    reading = await budget.read(server.deployer.all())
    assert budget.check_fit(dep, server.deployer.all(), reading) == (1,)  # not beside "other" on GPU 0
    third = await add(server, "third", 30, gpu_count=1, gpu_ids=[1])
    assert await ask(server, http, third) == (200, "")
    reading = await budget.read(server.deployer.all())
    from ondemand.errors import InsufficientMemory
    with pytest.raises(InsufficientMemory):  # 50 GiB free on each GPU: 72 fits on neither
        budget.check_fit(server.deployer.get(recipe), server.deployer.all(), reading)
