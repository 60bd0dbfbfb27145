"""A real Docker engine for the tests marked ``docker`` (``make test-docker``): the run's
network and the engine simulator's image (the ``docker_env`` fixture in conftest.py), and
deployment rows for that image.

Engines are the engine simulator in the locally built image ``ondemand-sim-engine:latest``
(``make engine-image``), on a user-defined network made for this run. Everything the tests
create (containers ``ondemand-t<run>-*``, the network) is removed at the end, also on failure.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from ondemand.model import Deployment

IMAGE = "ondemand-sim-engine:latest"
RUN = uuid.uuid4().hex[:8]


def docker(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


@contextlib.contextmanager
def environment() -> Iterator[dict]:
    """The run's network and the simulator image; skips when there is no Docker engine."""
    if shutil.which("docker") is None:
        pytest.skip("docker unavailable: no docker CLI on PATH")
    info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    if info.returncode != 0:
        pytest.skip(f"docker unavailable: `docker info` failed: {(info.stderr or info.stdout).strip()[:300]}")
    image = docker("image", "inspect", IMAGE, check=False)
    if image.returncode != 0:
        pytest.skip(f"image {IMAGE} is missing: build it with `make engine-image` (scripts/heavy/engine-image.sh)")
    config = json.loads(image.stdout)[0]["Config"]
    network = f"ondemand-test-{RUN}"
    docker("network", "create", network)
    try:
        yield {"network": network, "entrypoint": config.get("Entrypoint") or []}
    finally:
        ids = docker("ps", "-aq", "--filter", f"name=ondemand-t{RUN}-", check=False).stdout.split()
        if ids:
            docker("rm", "-f", *ids, check=False)
        docker("network", "rm", network, check=False)


_seq = itertools.count(1)


def deployment(docker_env: dict, *sim_opts: str, **fields) -> Deployment:
    """A deployment row for the simulator image; ``sim_opts`` are the simulator's options."""
    n = next(_seq)
    name = f"t{RUN}-{n}"
    sim = ["--host", "0.0.0.0", "--port", "8000", "--model", f"m{n}", *sim_opts]
    if not any("ondemand.sim.engine" in part for part in docker_env["entrypoint"]):
        sim = ["python3", "-m", "ondemand.sim.engine", *sim]
    row = {"id": 1000 + n, "name": name, "served_name": f"m{n}", "engine": "vllm", "image": IMAGE,
           "args": sim, "command": [], "port": 8000, "memory_gib": 1, "role": "model",
           "state": "starting", "mode": "on_demand"}
    row.update(fields)
    return Deployment.from_row(row)


def inspect(ref: str) -> dict | None:
    out = docker("container", "inspect", ref, check=False)
    return json.loads(out.stdout)[0] if out.returncode == 0 else None


def containers_named(name: str) -> list[str]:
    out = docker("ps", "-aq", "--no-trunc", "--filter", f"name=^/{name}$")
    return out.stdout.split()
