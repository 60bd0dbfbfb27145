"""ondemand/admin/gpu_memory.py: the GPU memory the metrics show, read from the real budget over
the fake nvidia-smi (tests/fakes) inside the whole ondemand on loopback: read in the background
(a caller never waits), forgotten when a read fails, one read at a time, and a scrape that reads
the cached snapshot."""
import asyncio

import pytest
from helpers import wait_for
from test_telemetry import scrape

from ondemand.admin.gpu_memory import GpuMemory


@pytest.mark.server(**{"budget.source": "nvidia-smi"})
async def test_gpu_memory_is_read_in_the_background_and_a_failure_forgets_it(server, fake_nvidia_smi, monkeypatch):
    server.deployer.budget.nvidia_smi = fake_nvidia_smi("24576, 1024")
    gpu = GpuMemory(server.deployer, server.deployer.budget, max_age_s=0)
    try:
        assert gpu() == []  # nothing read yet, and the caller does not wait for it
        assert await wait_for(gpu) == [(0, 24.0, 23.0)]
        monkeypatch.setenv("FAKE_NVIDIA_SMI_FAIL", "1")
        await wait_for(lambda: gpu() == [])
    finally:
        await gpu.close()



async def test_a_scrape_reads_a_cached_gpu_snapshot(server, http, monkeypatch):
    budget = server.deployer.budget
    reads = []
    real = budget.snapshot

    async def counted(*a, **kw):
        reads.append(1)
        return await real(*a, **kw)
    monkeypatch.setattr(budget, "snapshot", counted)
    for _ in range(5):
        await scrape(server, http)
    assert len(reads) <= 1  # the start-up's reading is under 5 s old: at most one more


async def test_one_read_at_a_time_and_none_while_the_last_is_fresh(server, monkeypatch):
    budget = server.deployer.budget
    reads, release = [], asyncio.Event()
    real = budget.snapshot

    async def slow(*a, **kw):
        reads.append(1)
        await release.wait()
        return await real(*a, **kw)
    monkeypatch.setattr(budget, "snapshot", slow)
    gpu = GpuMemory(server.deployer, budget, max_age_s=60)
    try:
        for _ in range(5):  # stale (never read), but the read asked for first is still under way
            assert gpu() == []
            await asyncio.sleep(0)
        assert len(reads) == 1
        release.set()
        assert await wait_for(gpu) == [(0, 24.0, 24.0)]
        for _ in range(5):  # fresh: no new read
            gpu()
            await asyncio.sleep(0)
        assert len(reads) == 1
    finally:
        await gpu.close()
