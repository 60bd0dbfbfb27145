"""Shared fixtures: real state files and the one fake of nvidia-smi (tests/fakes)."""
from __future__ import annotations

import pytest

try:
    import aiohttp  # noqa: F401  (the project's dependencies live in its venv)
except ModuleNotFoundError:
    pytest.exit("the tests need the project's virtual environment: run `make test` "
                "(or `make install`, then `.venv/bin/python -m pytest`)", returncode=4)

from helpers import FAKES  # noqa: E402
from ondemand.store import Store


@pytest.fixture
async def store(tmp_path):
    s = await Store.open(tmp_path / "ondemand.db")
    yield s
    await s.close()


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """Write GPU lines ("total, used" in MiB) and get the fake's path."""
    f = tmp_path / "gpus.csv"
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FILE", str(f))

    def set_gpus(*lines: str) -> str:
        tmp = f.with_suffix(".tmp")  # atomic: a read in between never sees an empty file
        tmp.write_text("".join(line + "\n" for line in lines))
        tmp.replace(f)
        return str(FAKES / "nvidia-smi")
    return set_gpus


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
