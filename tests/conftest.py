"""Shared fixtures: real state files (``store``), the whole server on loopback (``server``,
configured with ``@pytest.mark.server(...)``), an HTTP client (``http``), a real Docker
engine for the ``docker`` tests (``docker_env``), and the one fake of nvidia-smi (tests/fakes).

tests/ mirrors the package: the tests of ``ondemand/control/`` in tests/control/, and so on
(the package's top-level modules here, at the root); the suites that run the whole ondemand
apart: e2e/ (end to end on loopback), hostile/ (malformed and flooding clients), heavy/ (real
Docker, LiteLLM, llama.cpp, vLLM, Prometheus, a browser), bench/ (the benches' and the soak's
short versions), packaging/. Test modules import each other and their folders' helpers by name
(test_cli's helpers; control/core_doubles.py, the decision core's fake clock and recording effects),
as in one flat folder: every folder of tests/ is on ``sys.path`` (below), so a file run alone finds
them too.

Here, at the root: helpers.py (``run_app``, the one way to start the server, which
``server`` wraps; ``wait_for``, the way to wait for something to happen instead of a
fixed sleep; engine-simulator deployment rows), docker_double.py (a Docker Engine API
on a Unix socket), docker_real.py (the real one's network and image), litellm_double.py,
and test_backend_contract.py (what every engine backend must do)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

for _folder in sorted({p.parent for p in Path(__file__).parent.glob("*/**/test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

try:
    import aiohttp  # noqa: F401  (the project's dependencies live in its venv)
except ModuleNotFoundError:
    pytest.exit("the tests need the project's virtual environment: run `make test` "
                "(or `make install`, then `.venv/bin/python -m pytest`)", returncode=4)

from helpers import FAKES, FIRST, run_app  # noqa: E402
from hypothesis import settings  # noqa: E402

from ondemand.state.store import Store  # noqa: E402

# The property tests draw the same examples on every run of `make test` (a newcomer's first run
# must pass, and a failure must come back when run again); `make fuzz` draws new ones
# (ONDEMAND_HYPOTHESIS=explore), which is how a case the fixed draw misses is found.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("ONDEMAND_HYPOTHESIS", "fixed"))

def pytest_collection_modifyitems(session, config, items):
    rank = {Path(__file__).parent / name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(FIRST)))  # stable: the rest keep their order


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "server(**overrides): config overrides (and write_key=False) for the `server` "
                   "fixture, e.g. @pytest.mark.server(ondemand_queue_timeout_s=1)")


@pytest.fixture
async def server(request, tmp_path):
    """The whole ondemand on loopback (``helpers.run_app``: process backend, static budget,
    a key and an admin token), as a ``helpers.Server``: ``url``, ``key``, ``token``, ``cfg``
    (``cfg.admin_socket``), ``app``, ``deployer``, ``controller``. A test's or module's
    ``@pytest.mark.server(...)`` overrides the configuration."""
    overrides: dict = {}
    for marker in reversed(list(request.node.iter_markers("server"))):  # the closest wins
        overrides.update(marker.kwargs)
    async with run_app(tmp_path, **overrides) as srv:
        yield srv


@pytest.fixture
async def http():
    """A client session for the test's requests (gateway and admin on their own connections)."""
    from helpers import two_pools
    async with two_pools() as s:
        yield s


@pytest.fixture
async def store(tmp_path):
    s = await Store.open(tmp_path / "ondemand.db")
    yield s
    await s.close()


@pytest.fixture(scope="session")
def docker_env():
    """A real Docker engine's network for this run and the simulator image's config
    (tests/docker_real.py); skips, saying why, where there is none."""
    import docker_real
    with docker_real.environment() as env:
        yield env


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """Write GPU lines ("total, used" in MiB, GPU i on line i+1) and get the fake's path.

    The processes' directory the fake reads (``$FAKE_NVIDIA_SMI_APPS``, inherited by
    every child, so a simulator started with ``--gpu-mib N`` shows up) is
    ``fake_nvidia_smi.apps``, also the ``fake_gpu_apps`` fixture: a file there named
    by a live pid, with lines ``<gpu index> <MiB>``, adds to those GPUs' used memory
    and to ``--query-compute-apps``."""
    f = tmp_path / "gpus.csv"
    apps = tmp_path / "gpu-apps"
    apps.mkdir()
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FILE", str(f))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_APPS", str(apps))

    def set_gpus(*lines: str) -> str:
        tmp = f.with_suffix(".tmp")  # atomic: a read in between never sees an empty file
        tmp.write_text("".join(line + "\n" for line in lines))
        tmp.replace(f)
        return str(FAKES / "nvidia-smi")
    set_gpus.apps = apps
    set_gpus.path = str(FAKES / "nvidia-smi")
    return set_gpus


@pytest.fixture
def fake_gpu_apps(fake_nvidia_smi):
    """The fake nvidia-smi's processes directory (see ``fake_nvidia_smi``)."""
    return fake_nvidia_smi.apps


def pytest_asyncio_loop_factories(config, item):
    """The event loops a test runs on: asyncio's, and uvloop too (the loop ondemand
    serves on) for a module with ``LOOPS = ("asyncio", "uvloop")`` or a test marked
    ``uvloop``: the forwarding paths, whose transports behave differently on the two."""
    import asyncio

    loops = {"asyncio": asyncio.new_event_loop}
    if "uvloop" in getattr(item.module, "LOOPS", ()) or item.get_closest_marker("uvloop"):
        import uvloop
        loops["uvloop"] = uvloop.new_event_loop
    return loops
