"""The compile cache and the weights read ahead through a running ondemand: a vLLM recipe on the
process backend (the engine simulator as its command) with ``deployer.compile_cache`` set and a
local checkpoint. The view's ``compile_cache`` ({key, warm}) and ``read_ahead``, the directory
the engine is given, a key unused for ``retention_days`` removed at a start, the read-ahead
skipped when memory is short and never delaying a start (engines/startwatch.py's hooks)."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import aiohttp
from helpers import run_app, wait_for

from ondemand.admin.components import WATCH
from ondemand.engines import compile_cache

SIM = ["ondemand", "sim-engine", "--startup-delay", "0.3"]


def checkpoint(tmp_path, size: int = 3 * 2**20):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * size)
    return d


def settings(tmp_path, **kw) -> dict:
    return {"deployer.commands.vllm": SIM, "deployer.compile_cache": str(tmp_path / "cc"), **kw}


async def view(server, http, dep_id: int) -> dict:
    async with http.get(f"{server.url}/api/deployments/{dep_id}", headers=server.admin_headers()) as r:
        assert r.status == 200
        return await r.json()


async def create(server, model: str, **kw) -> int:
    dep = await server.deployer.create(dict(name="tiny", served_name="tiny", engine="vllm", model=model,
                                            memory_gib=2, mode="on_demand", state="stopped", **kw))
    return dep.id


async def start(server, dep_id: int) -> None:
    await server.deployer.admit_start(dep_id)
    await server.deployer.wait_started(dep_id)


async def launched_env(http, server, dep_id: int) -> dict[str, str]:
    async with http.get(server.deployer.base_url(dep_id) + "/_sim/launch") as r:
        return (await r.json())["env"]


async def test_one_directory_per_configuration_warm_on_the_next_start_and_old_keys_pruned(tmp_path):
    model = checkpoint(tmp_path)
    stale = "0123456789ab"  # a configuration last used 40 days ago: retention_days is 30
    compile_cache.prepare(tmp_path / "cc", stale, now=time.time() - 40 * 86400)
    async with run_app(tmp_path, **settings(tmp_path)) as server, aiohttp.ClientSession() as http:
        dep_id = await create(server, str(model))
        key = (await view(server, http, dep_id))["compile_cache"]["key"]
        assert len(key) == 12 and (await view(server, http, dep_id))["compile_cache"]["warm"] is None  # not known yet

        await start(server, dep_id)
        shown = await view(server, http, dep_id)
        assert shown["compile_cache"] == {"key": key, "warm": False}  # made at this start: cold
        assert (await launched_env(http, server, dep_id))["VLLM_CACHE_ROOT"] == str(tmp_path / "cc" / key)

        async def pruned() -> bool:
            return not (tmp_path / "cc" / stale).exists()
        await wait_for(pruned, timeout=10, interval=0.05, what="the unused key removed")
        assert (tmp_path / "cc" / key).is_dir()

        # What vLLM leaves there (torch.compile's artifacts) makes the next start of the same
        # configuration a warm one.
        (tmp_path / "cc" / key / "torch_compile_cache").mkdir()
        await server.deployer.stop(dep_id)
        await start(server, dep_id)
        assert (await view(server, http, dep_id))["compile_cache"] == {"key": key, "warm": True}
        await server.deployer.stop(dep_id)

        # Another argument: another configuration, another directory, not known to be warm.
        await server.deployer.edit(dep_id, {"args": ["--max-model-len", "2048"]})
        other = (await view(server, http, dep_id))["compile_cache"]
        assert other["key"] != key and other["warm"] is None
        await start(server, dep_id)
        assert (await view(server, http, dep_id))["compile_cache"] == {"key": other["key"], "warm": False}
        assert (await launched_env(http, server, dep_id))["VLLM_CACHE_ROOT"] == str(tmp_path / "cc" / other["key"])
        assert sorted(p.name for p in (tmp_path / "cc").iterdir()) == sorted([key, other["key"]])
        await server.deployer.stop(dep_id)


async def test_a_slow_read_ahead_never_delays_the_start(tmp_path):
    """The checkpoint's read is held (a cold disk, as slow as the test says): the start goes on
    beside it, is ready while the read is still under way, and the read ends later."""
    model = checkpoint(tmp_path)
    release = threading.Event()
    async with run_app(tmp_path, **settings(tmp_path)) as server, aiohttp.ClientSession() as http:
        ahead = server.app[WATCH].readahead
        real = ahead.reader

        def held(files, stop):
            while not (release.is_set() or stop.is_set()):
                release.wait(0.05)
            return real(files, stop)
        ahead.reader = held
        dep_id = await create(server, str(model))
        await asyncio.wait_for(start(server, dep_id), 20)  # a start that waited for the read would not end
        assert server.state(dep_id) == "ready"
        reading = (await view(server, http, dep_id))["read_ahead"]
        assert reading["state"] == "reading" and reading["gib"] == round(3 * 2**20 / 2**30, 3)
        release.set()

        async def done():
            shown = (await view(server, http, dep_id))["read_ahead"]
            return shown if shown["state"] == "done" else None
        shown = await wait_for(done, timeout=10, interval=0.05, what="the read-ahead to end")
        assert shown["seconds"] is not None and shown["why"] is None
        await server.deployer.stop(dep_id)


async def test_the_read_ahead_is_skipped_when_memory_is_short(tmp_path):
    model = checkpoint(tmp_path)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:        1048576 kB\nMemAvailable:   17825792 kB\n")
    reads = []
    async with run_app(tmp_path, **settings(tmp_path, **{"budget.meminfo_path": str(meminfo)})) as server, \
            aiohttp.ClientSession() as http:
        ahead = server.app[WATCH].readahead
        ahead.reader = lambda files, stop: reads.append(files) or 0
        dep_id = await create(server, str(model))
        await start(server, dep_id)
        # 17 GiB available less the 16 GiB host reserve: 1 GiB to spare, and the weights are 3 MiB:
        # read. Then the host has less to spare than the weights.
        assert (await view(server, http, dep_id))["read_ahead"]["state"] in ("reading", "done")
        await server.deployer.stop(dep_id)
        meminfo.write_text("MemTotal:       33554432 kB\nMemFree:        1048576 kB\nMemAvailable:   16779264 kB\n")
        os.truncate(model / "model.safetensors", 2 * 2**20 + 1)  # 2 MiB and a byte of weights, 2 MiB to spare
        await start(server, dep_id)
        shown = (await view(server, http, dep_id))["read_ahead"]
        assert shown["state"] == "skipped" and "memory is short" in shown["why"], shown
        assert len(reads) == 1  # only the first start's
        await server.deployer.stop(dep_id)


async def test_an_adaptive_prewarms_moment_reads_the_weights_ahead_even_when_nothing_starts(tmp_path):
    """The expected next start (an adaptive pre-warm) reads the weights ahead as a start does, even
    when the pre-warm finds no memory free and starts nothing: the request expected then will."""
    from ondemand.admin.components import EFFECTS
    model = checkpoint(tmp_path)
    async with run_app(tmp_path, **settings(tmp_path)) as server, aiohttp.ClientSession() as http:
        big = await server.add("big", 24)  # the whole static budget, busy elsewhere
        await start(server, big)
        dep_id = await create(server, str(model))
        server.app[EFFECTS].prewarm(dep_id, text="Woken ahead of its next request")

        async def read() -> dict | None:
            shown = (await view(server, http, dep_id))["read_ahead"]
            return shown if shown is not None and shown["state"] == "done" else None
        shown = await wait_for(read, timeout=10, interval=0.05, what="the weights read ahead")
        assert shown["gib"] == round(3 * 2**20 / 2**30, 3)
        assert server.state(dep_id) == "stopped"  # no memory free: nothing started
        await server.deployer.stop(big)
