"""Relocation end to end (``scheduler = "cost"``): the whole ondemand (process backend), the fake
nvidia-smi with two GPUs and engine simulators that hold memory on their GPUs. A sleeper whose
GPU a busy model took cannot wake there; under ``cost`` it is stopped and started cold on the other
GPU, and its request is served; under ``seed`` the request waits in the memory queue until its
deadline (BEHAVIOUR.md, "The cost scheduler")."""
from __future__ import annotations

import pytest
from helpers import wait_for
from test_gpu_placement import FAKE, ask, box, claimed, gpus
from test_tiered_warmth import admin, audit_rows, sleeper

SERVER = {"budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE, "budget.capacity_gib": "",
          "metrics_interval_s": 0.1, "reap_interval_s": 3600}


async def stranded(fake_nvidia_smi, server, http) -> tuple[int, int]:
    """s (40 GiB) sleeps on GPU 0, keeping 2 GiB; busy (60 GiB, pinned to GPU 0) is ready there
    beside it: s's wake needs 38 GiB more on GPU 0, where 18 are free."""
    box(fake_nvidia_smi, gpus=2, total_gib=80)
    s = await sleeper(server, "s", 40, idle_timeout_s=600)
    assert await ask(server, http, s) == (200, "")
    assert gpus(server, s) == (0,)
    await admin(server, http, s, "sleep", {"level": 1})
    await wait_for(lambda: server.state(s) == "asleep", what="s asleep")
    busy = await server.add("busy", 60, "--gpu-mib", str(60 * 1024), gpu_count=1, gpu_ids=[0])
    assert await ask(server, http, busy) == (200, "")
    assert claimed(fake_nvidia_smi.apps) == {0: 62}
    return s, busy


@pytest.mark.server(scheduler="cost", ondemand_queue_timeout_s=60, **SERVER)  # room for a loaded machine's start
async def test_under_cost_a_sleeper_whose_gpu_was_taken_starts_cold_on_another(fake_nvidia_smi, server, http):
    s, busy = await stranded(fake_nvidia_smi, server, http)
    ticket = await server.admission.acquire(busy)  # a request in flight: make-room may not take busy
    try:
        assert await ask(server, http, s) == (200, "")
    finally:
        ticket.release()
    assert gpus(server, s) == (1,) and server.state(busy) == "ready"
    assert claimed(fake_nvidia_smi.apps) == {0: 60, 1: 40}  # its residue on GPU 0 went with the stop
    [row] = [r for r in await audit_rows(server, s, "ondemand_sleep") if "other GPUs" in r["text"]]
    assert row["text"].startswith("Stopped (asleep) to start on other GPUs: its own are taken"), row


@pytest.mark.server(scheduler="seed", ondemand_queue_timeout_s=2, **SERVER)  # its deadline is the point
async def test_under_seed_the_same_request_waits_for_memory_until_its_deadline(fake_nvidia_smi, server, http):
    s, busy = await stranded(fake_nvidia_smi, server, http)
    ticket = await server.admission.acquire(busy)
    try:
        assert await ask(server, http, s) == (503, "ondemand_queue_timeout")
    finally:
        ticket.release()
    assert server.state(s) == "asleep" and gpus(server, s) == (0,)
