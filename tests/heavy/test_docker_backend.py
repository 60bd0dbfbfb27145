"""The docker backend against a real Docker engine (``make test-docker``), no doubles: what only
the docker backend does (labels, published ports, networks, GPUs, /dev/shm, replacing a stale or
exited container, a foreign container of that name). The Backend contract it shares with the
process backend (start, stop, wait_exit, log_tail, adopt, remove) is test_backend_contract's.

Engines are the engine simulator in the locally built image ``ondemand-sim-engine:latest``
(``make engine-image``), on a user-defined network made for this run (the ``docker_env``
fixture, tests/docker_real.py). Everything the tests create (containers ``ondemand-t<run>-*``,
the network) is removed at the end, also on failure.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from docker_real import IMAGE, RUN, containers_named, deployment, inspect
from docker_real import docker as _docker

from ondemand.engines.backends import BackendError
from ondemand.engines.backends.docker import LABEL_HASH, LABEL_ID, LABEL_MANAGED, LABEL_NAME, DockerBackend

pytestmark = pytest.mark.docker

READY_S = 20.0


@pytest.fixture(scope="session")
def idle_container(docker_env):
    """A container on the run's network that only sleeps: a place to call engines by name from."""
    name = f"ondemand-t{RUN}-idle"
    out = _docker("run", "-d", "--name", name, "--network", docker_env["network"], "--entrypoint", "python3",
                  IMAGE, "-c", "import time; time.sleep(600)")
    return {"name": name, "id": out.stdout.strip()}


@pytest.fixture
async def backends(docker_env):
    """Make DockerBackends on the run's network (GPU-less); all are closed at the end."""
    made: list[DockerBackend] = []

    def make(**kw) -> DockerBackend:
        kw.setdefault("docker_url", None)
        kw.setdefault("network", docker_env["network"])
        kw.setdefault("gpus", False)
        kw.setdefault("in_container", False)
        made.append(DockerBackend(**kw))
        return made[-1]
    yield make
    for b in made:
        await b.close()


async def answers(base_url: str, within: float = READY_S) -> int:
    """Poll GET /v1/models until it is 200; returns the status (or the last one seen)."""
    deadline = time.monotonic() + within
    status = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(base_url + "/v1/models") as resp:
                    status = resp.status
                    if status == 200:
                        return status
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
    return status


async def test_the_container_it_makes_and_removes(docker_env, backends):
    """Labels, the port published on 127.0.0.1 only, the network, no GPU, the /dev/shm size;
    after remove the container is gone, and its exit code with it."""
    backend = backends()
    dep = deployment(docker_env)
    engine = await backend.start(dep)
    assert engine.deployment_id == dep.id and engine.name == dep.name and not engine.adopted
    assert engine.base_url.startswith("http://127.0.0.1:")
    info = inspect(f"ondemand-{dep.name}")
    assert info is not None and info["Id"] == engine.ref
    labels = info["Config"]["Labels"]
    assert labels[LABEL_MANAGED] == "true" and labels[LABEL_ID] == str(dep.id)
    assert labels[LABEL_NAME] == dep.name and labels[LABEL_HASH] == backend.config_hash(dep, backend.as_given(dep))
    bindings = info["HostConfig"]["PortBindings"]["8000/tcp"]
    assert [b["HostIp"] for b in bindings] == ["127.0.0.1"]  # never on another address
    assert info["HostConfig"]["NetworkMode"] == docker_env["network"]
    assert not info["HostConfig"].get("DeviceRequests")  # gpus=False
    # /dev/shm is the configured size (default 16 GiB), not Docker's 64 MiB.
    assert info["HostConfig"]["ShmSize"] == 16 * 2**30
    assert _docker("exec", engine.ref, "df", "-k", "/dev/shm").stdout.split()[-5] == str(16 * 2**20)

    await backend.stop(engine, 5)
    assert inspect(engine.ref) is not None  # an exited container stays, for its log
    await backend.remove(dep)
    assert inspect(engine.ref) is None
    await backend.stop(engine, 5)  # gone: fine too
    assert await backend.wait_exit(engine) is None  # gone: no exit code left


async def test_after_a_restart_start_takes_the_running_one_and_an_older_configuration_goes(docker_env, backends):
    # (adopt after a restart is the contract's: test_backend_contract)
    dep = deployment(docker_env)
    first = await backends().start(dep)
    assert await answers(first.base_url) == 200

    restarted = backends()  # a new ondemand: nothing in memory
    again = await restarted.start(dep)  # running already: taken, not duplicated
    assert again.ref == first.ref and again.adopted
    assert containers_named(f"ondemand-{dep.name}") == [first.ref]

    # A container made from an older configuration is not served: stopped and removed.
    changed = dep.replace(args=(*dep.args, "--tokens", "4"))
    assert await restarted.adopt(changed) is None
    assert inspect(first.ref) is None


async def test_starting_again_replaces_an_exited_container(docker_env, backends):
    # (the exit code, the log tail and no adoption of an exited one are the contract's)
    backend = backends()
    dep = deployment(docker_env, "--fail", "exit-at-start")
    engine = await backend.start(dep)
    assert await asyncio.wait_for(backend.wait_exit(engine), READY_S) == 3

    # Starting it again replaces the exited container of ours.
    fixed = dep.replace(args=tuple(a for a in dep.args if a not in ("--fail", "exit-at-start")))
    engine2 = await backend.start(fixed)
    assert engine2.ref != engine.ref and inspect(engine.ref) is None
    assert await answers(engine2.base_url) == 200
    await backend.stop(engine2, 5)


async def test_base_url_by_name_from_another_container(docker_env, backends, idle_container):
    backend = backends(in_container=True)
    dep = deployment(docker_env)
    engine = await backend.start(dep)
    assert engine.base_url == f"http://ondemand-{dep.name}:8000"
    assert not inspect(engine.ref)["HostConfig"].get("PortBindings")  # nothing published

    probe = ("import sys, urllib.request\n"
             "try: print(urllib.request.urlopen(sys.argv[1] + '/v1/models', timeout=2).status)\n"
             "except Exception as e: print('no', e)")
    deadline = time.monotonic() + READY_S
    out = ""
    while time.monotonic() < deadline:
        proc = await asyncio.create_subprocess_exec(
            "docker", "exec", idle_container["name"], "python3", "-c", probe, engine.base_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out = (await proc.communicate())[0].decode().strip()
        if out == "200":
            break
        await asyncio.sleep(0.3)
    assert out == "200"

    # After a restart inside the container the same name-based address is adopted.
    engine2 = await backends(in_container=True).adopt(dep)
    assert engine2 is not None and engine2.base_url == engine.base_url
    await backend.stop(engine, 5)


async def test_detect_in_container(docker_env, backends, idle_container):
    assert await backends(in_container=None, own_container_id=idle_container["id"][:12]).in_container()
    assert not await backends(in_container=None, own_container_id=None).in_container()
    assert not await backends(in_container=None, own_container_id="0123456789ab").in_container()


async def test_unknown_image_is_a_helpful_error(docker_env, backends):
    dep = deployment(docker_env, image=f"ondemand-no-such-image-{RUN}:latest")
    with pytest.raises(BackendError, match="load it locally") as err:
        await backends().start(dep)
    assert "no registry" in str(err.value) and dep.image in str(err.value)
    assert containers_named(f"ondemand-{dep.name}") == []


async def start_or_no_gpu(backend, dep):
    """The engine where Docker can give GPUs; else None, after checking that start said so
    and left nothing behind."""
    try:
        return await backend.start(dep)
    except BackendError as exc:
        assert "nvidia" in str(exc) or "gpu" in str(exc).lower()
        assert containers_named(f"ondemand-{dep.name}") == []
        return None


async def test_gpu_request(docker_env, backends):
    """gpus=True asks for every GPU; where Docker cannot give one, start says so and leaves nothing."""
    backend = backends(gpus=True)
    dep = deployment(docker_env)
    engine = await start_or_no_gpu(backend, dep)
    if engine is not None:  # a machine with GPUs
        requests = inspect(engine.ref)["HostConfig"]["DeviceRequests"]
        assert requests == [{"Driver": "nvidia", "Count": -1, "DeviceIDs": None,
                             "Capabilities": [["gpu"]], "Options": {}}]
        await backend.stop(engine, 5)


async def test_device_ids_reach_docker(docker_env, backends):
    """A deployment placed on GPUs 2 and 5: real dockerd accepts the create request and keeps
    the device request with exactly those IDs (starting it needs the NVIDIA runtime: where
    there is none, start says so and leaves nothing). With gpu_count 0 it asks for no GPU
    and starts anywhere."""
    from ondemand.engines import dockerapi
    from ondemand.engines.backends.docker import container_name
    backend = backends(gpus=True)
    dep = deployment(docker_env, gpu_count=2, gpus=[2, 5])
    config = await backend.create_request(dep, backend.as_given(dep))
    docker = dockerapi.client(None)
    try:
        container = await docker.containers.create(config, name=container_name(dep))
        try:
            info = inspect(container.id)
            assert info["HostConfig"]["DeviceRequests"] == [
                {"Driver": "nvidia", "Count": 0, "DeviceIDs": ["2", "5"], "Capabilities": [["gpu"]], "Options": None}]
            assert "NVIDIA_VISIBLE_DEVICES=2,5" in info["Config"]["Env"]
        finally:
            await container.delete(force=True)
    finally:
        await docker.close()
    engine = await start_or_no_gpu(backend, dep)
    if engine is not None:  # a machine with GPUs
        await backend.stop(engine, 5)
    none = deployment(docker_env, gpu_count=0)
    engine = await backend.start(none)
    try:
        info = inspect(engine.ref)
        assert not info["HostConfig"].get("DeviceRequests")
        assert "NVIDIA_VISIBLE_DEVICES=void" in info["Config"]["Env"]
        assert await answers(engine.base_url) == 200
    finally:
        await backend.stop(engine, 5)


async def test_missing_network_is_an_error(docker_env, backends):
    dep = deployment(docker_env)
    with pytest.raises(BackendError, match=f"network ondemand-nonet-{RUN} does not exist"):
        await backends(network=f"ondemand-nonet-{RUN}").start(dep)
    assert containers_named(f"ondemand-{dep.name}") == []


async def test_a_foreign_container_of_that_name_is_left_alone(docker_env, backends):
    dep = deployment(docker_env)
    name = f"ondemand-{dep.name}"
    foreign = _docker("create", "--name", name, IMAGE).stdout.strip()
    backend = backends()
    with pytest.raises(BackendError, match="not made by ondemand"):
        await backend.start(dep)
    assert await backend.adopt(dep) is None
    await backend.remove(dep)
    assert inspect(foreign) is not None


async def test_unreachable_docker_is_a_backend_error(docker_env, backends):
    backend = backends(docker_url=f"unix:///nonexistent-{RUN}/docker.sock")
    dep = deployment(docker_env)
    with pytest.raises(BackendError, match="unreachable"):
        await backend.start(dep)
    with pytest.raises(BackendError, match="unreachable"):
        await backend.adopt(dep)


async def test_deployer_with_docker_starts_and_adopts_after_a_restart(docker_env, backends, tmp_path):
    """The deployer over the docker backend: a start through the start-up gate, and an
    ondemand restart that finds the container running and adopts it instead of starting
    a second one."""
    from ondemand.control.budget import Budget
    from ondemand.engines.deployer import Deployer
    from ondemand.state.store import Store

    store = await Store.open(tmp_path / "ondemand.db")
    try:
        row = deployment(docker_env)
        fields = {k: v for k, v in row.as_dict().items() if k not in ("id", "state", "created_at", "updated_at")}
        d1 = Deployer(store, backends(), Budget("static", 10), start_timeout_s=READY_S)
        await d1.load()
        dep = await d1.create({**fields, "state": "stopped"})
        await d1.restart(dep.id)
        first = d1.engine(dep.id).ref
        assert d1.get(dep.id).state == "ready"
        await d1.close(stop_engines=False)  # ondemand goes away; the container stays

        d2 = Deployer(store, backends(), Budget("static", 10), start_timeout_s=READY_S)
        await d2.load()
        try:
            assert d2.get(dep.id).state == "ready"
            assert d2.engine(dep.id).ref == first and d2.engine(dep.id).adopted
            assert await answers(d2.base_url(dep.id)) == 200
            assert containers_named(f"ondemand-{row.name}") == [first]
            await d2.remove(dep.id)
            assert containers_named(f"ondemand-{row.name}") == []
        finally:
            await d2.close(stop_engines=True)
    finally:
        await store.close()


async def test_shm_size_zero_leaves_dockers_default(docker_env, backends):
    backend = backends(shm_size_gib=0)
    dep = deployment(docker_env)
    engine = await backend.start(dep)
    try:
        assert inspect(engine.ref)["HostConfig"]["ShmSize"] == 64 * 2**20  # Docker's own default
    finally:
        await backend.stop(engine, 5)
        await backend.remove(dep)
