"""A dockerd restart while an engine runs (real dockerd, ``make test-docker``; this module
runs last of the docker ones, as it restarts the engine under them): the engine's exit is
seen (dockerd stops its containers on the way down), the deployment is failed with the
reason, nothing is left half-adopted, and the next start makes a fresh container that serves. And while ondemand is down (issue 21, "After a reboot"): a removed
container, then a dockerd restart; the next ondemand starts the always-on deployment again.
The daemon is restarted for real: SIGTERM to dockerd, then scripts/heavy/docker-up.sh."""
import asyncio
import os
import pathlib
import signal
import subprocess
import time

import pytest
from docker_real import containers_named, deployment
from helpers import ROOT, wait_for

from ondemand.control.budget import Budget
from ondemand.engines.backends.docker import DockerBackend, container_name
from ondemand.engines.deployer import Deployer

pytestmark = pytest.mark.docker
PID_FILE = pathlib.Path("/var/run/docker.pid")


def restart_dockerd() -> None:
    pid = int(PID_FILE.read_text().strip())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    subprocess.run(["bash", str(ROOT / "scripts" / "heavy" / "docker-up.sh")], check=True, capture_output=True,
                   timeout=120)


async def test_a_dockerd_restart_while_an_engine_runs(docker_env, store):
    if not PID_FILE.exists():  # noqa: ASYNC240 (one stat before the test: nothing to wait for)
        pytest.skip("dockerd was not started here (no /var/run/docker.pid): not ours to restart")
    row = deployment(docker_env).as_dict()
    fields = {k: row[k] for k in ("name", "served_name", "engine", "image", "args", "port", "memory_gib", "mode")}
    backend = DockerBackend(docker_url=None, network=docker_env["network"], gpus=False, in_container=False)
    d = Deployer(store, backend, Budget("static", 24), start_timeout_s=30, stop_timeout_s=5)
    await d.load()
    try:
        dep = await d.create({**fields, "state": "stopped"})
        await d.restart(dep.id)
        first = d.engine(dep.id).ref
        await asyncio.to_thread(restart_dockerd)
        await wait_for(lambda: d.get(dep.id).state == "failed", timeout=60, what="the engine's end to be seen")
        assert "exited" in d.get(dep.id).state_reason
        await d.restart(dep.id)  # a fresh container, on the restarted daemon
        assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref != first
        assert len(containers_named(container_name(d.get(dep.id)))) == 1
    finally:
        await d.close(stop_engines=True)


async def test_an_always_on_engine_lost_while_ondemand_was_down_is_started_again(docker_env, store):
    """Issue 21, "After a reboot", on real dockerd: ondemand stops (docker engines keep running);
    while it is down the container is removed, then (next round) dockerd restarts and stops it;
    each time the ondemand started next adopts nothing, starts the always-on deployment again
    in a fresh container (the fit check, the gates) and it is ready."""
    if not PID_FILE.exists():  # noqa: ASYNC240 (one stat before the test: nothing to wait for)
        pytest.skip("dockerd was not started here (no /var/run/docker.pid): not ours to restart")
    row = deployment(docker_env).as_dict()
    fields = {k: row[k] for k in ("name", "served_name", "engine", "image", "args", "port", "memory_gib")}

    def ondemand() -> Deployer:
        backend = DockerBackend(docker_url=None, network=docker_env["network"], gpus=False, in_container=False)
        return Deployer(store, backend, Budget("static", 24), start_timeout_s=30, stop_timeout_s=5)

    d = ondemand()
    await d.load()
    try:
        dep = await d.create({**fields, "mode": "always_on", "state": "stopped"})
        await d.restart(dep.id)
        ref = d.engine(dep.id).ref
    finally:
        await d.close(stop_engines=False)  # as the app with the docker backend: the engine keeps running
    name = container_name(dep)
    for while_down in ("container removed", "dockerd restarted"):
        if while_down == "container removed":
            await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", name], check=True, capture_output=True)
        else:
            await asyncio.to_thread(restart_dockerd)
        d = ondemand()
        await d.load()
        try:
            assert (d.get(dep.id).state, d.get(dep.id).pending_mode) == ("stopped", "always_on"), while_down
            await asyncio.gather(*d.restart_lost())
            await d.wait_started(dep.id)
            assert d.get(dep.id).state == "ready" and d.get(dep.id).pending_mode is None, while_down
            assert d.engine(dep.id).ref != ref, while_down
            ref = d.engine(dep.id).ref
            assert containers_named(name) == [ref], while_down
        finally:
            await d.close(stop_engines=False)
    d = ondemand()
    await d.load()
    try:
        assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref == ref  # adopted: nothing owed
        assert d.restart_lost() == []
    finally:
        await d.close(stop_engines=True)
        await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", name], capture_output=True)
