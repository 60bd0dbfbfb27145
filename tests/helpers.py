"""Test helpers: engine-simulator deployments, waiting, a running deployer."""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from ondemand.backends.process import ProcessBackend
from ondemand.budget import Budget
from ondemand.deployer import Deployer
from ondemand.store import Store

ROOT = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"


def sim_command(model: str = "m", *extra: str) -> list[str]:
    """The process backend's command for the engine simulator."""
    return ["ondemand", "sim-engine", "--port", "{port}", "--model", model, *extra]


def dep_fields(name: str, memory_gib: float = 10, mode: str = "on_demand", *sim_args: str, **kw) -> dict:
    fields = dict(name=name, served_name=name.upper(), engine="vllm", memory_gib=memory_gib, mode=mode,
                  state="stopped", command=sim_command(name.upper(), *sim_args), role="model")
    fields.update(kw)
    return fields


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def running_deployer(tmp_path, store, capacity: float = 24, **kw):
    d = Deployer(store, ProcessBackend(tmp_path), Budget("static", capacity),
                 start_timeout_s=kw.pop("start_timeout_s", 20), stop_timeout_s=kw.pop("stop_timeout_s", 5),
                 **kw)
    await d.load()
    try:
        yield d
    finally:
        await d.close(stop_engines=True)


