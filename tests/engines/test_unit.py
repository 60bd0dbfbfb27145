"""One deployment's lifecycle object (ondemand/engines/unit.py, ``Unit``), driven through the
deployer that owns it: a start's wait for readiness (its polls, its one change future, its
timeout, an engine that exits first or cannot run), the watchdog's two halves (an engine that
exits while serving, one that stops answering), and what the next ondemand takes back after a
crash (an orphan, a sleeper, a wake cut short). Real engine simulators on the process backend
and the real state file; the Docker API double where an engine must outlive ondemand. The
deployer's own operations (the fit check, the gates, stop, sleep, remove, the starts owed after
a restart) are test_deployer.py's; a start as one object and its events, test_start.py's."""
import asyncio
import contextlib
import json
import os

import pytest
from helpers import dep_fields, running_deployer, wait_for

from ondemand.engines.deployer import StartFailed


async def as_if_ondemand_died(d) -> None:
    """What a crash leaves: ondemand's tasks end with it, its engines run on and its rows say
    what they said (the next ondemand finds them: the process backend kills them). Closed as
    the app closes a deployer whose engines outlive it (the docker backend's), it then holds
    none, so that running_deployer's own close stops nothing."""
    await d.close(stop_engines=False)
    for unit in d.units():
        unit.engine = None


# --- a start: readiness ----------------------------------------------------------------


async def test_a_start_is_polled_quickly_and_holds_one_change_future(tmp_path, store):
    """Readiness is asked for every 20 ms at first, then every 50 ms; a long start keeps one
    future for the deployment's next change, not one per poll."""
    from ondemand.engines.unit import ready_poll_s
    assert ready_poll_s(0.0) == 0.02 and ready_poll_s(1.9) == 0.02 and ready_poll_s(2.0) == 0.05
    assert ready_poll_s(3600) == 0.05
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a", 4, "on_demand", "--startup-delay", "2.5"))
        await d.admit_start(dep.id)
        most = 0
        while d.get(dep.id).state == "starting":
            most = max(most, d.unit(dep.id).listeners)
            await asyncio.sleep(0.05)
        assert d.get(dep.id).state == "ready" and most <= 2


async def test_start_timeout_fails_with_reason(tmp_path, store):
    # An engine that prints at once and never listens: the simulator's own banner comes after its
    # imports, which can take longer than the 1 s timeout on a loaded machine.
    async with running_deployer(tmp_path, store, start_timeout_s=1.0) as d:
        dep = await d.create(dep_fields("a", 10, "on_demand",
                                        command=["sh", "-c", "echo 'simulator: never ready'; exec sleep 60"]))
        with pytest.raises(StartFailed, match="within 1 s"):
            await d.restart(dep.id)
        now = d.get(dep.id)
        assert now.state == "failed" and "within 1 s" in now.state_reason
        assert "simulator" in now.log_tail
        assert (await store.deployment(dep.id))["state"] == "failed"


async def test_exit_at_start_fails_with_log_tail(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a", 10, "on_demand", "--fail", "exit-at-start"))
        with pytest.raises(StartFailed, match="exited with code"):
            await d.restart(dep.id)
        assert d.get(dep.id).log_tail


async def test_command_not_found_fails(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a", command=["/nonexistent/engine", "{port}"]))
        with pytest.raises(StartFailed, match="cannot run"):
            await d.restart(dep.id)


# --- the watchdog ----------------------------------------------------------------------


async def test_watchdog_engine_exit_while_ready_is_failed(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        os.killpg(d.engine(dep.id).ref.pid, 9)
        await wait_for(lambda: d.get(dep.id).state == "failed", what="failed")
        assert "exited" in d.get(dep.id).state_reason
        events = await store.events(dep.id)
        assert events[0]["actor"] == "watchdog"


async def test_watchdog_kills_an_engine_that_stops_answering_and_its_streams_end(tmp_path, store, caplog):
    """A hung engine (SIGSTOP mid-stream) is failed after the checks, then killed at once,
    not after a SIGTERM it cannot hear and the whole stop timeout; the stream in flight
    ends within a few seconds of that; the next start does not call it a leftover."""
    import time

    import aiohttp
    async with running_deployer(tmp_path, store, watch_interval_s=0.1, watch_failures=2, probe_timeout_s=0.3,
                                stop_timeout_s=30) as d:
        dep = await d.create(dep_fields("a", 4, "on_demand", "--token-delay", "0.05", "--tokens", "400"))
        await d.restart(dep.id)
        engine = d.engine(dep.id)
        async with aiohttp.ClientSession() as http:
            body = {"model": "A", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(engine.base_url + "/v1/chat/completions", json=body) as r:
                await r.content.readline()  # streaming
                os.killpg(engine.ref.pid, 19)  # SIGSTOP: alive but silent
                await wait_for(lambda: d.get(dep.id).state == "failed", timeout=10, what="failed")
                failed_at = time.monotonic()
                with pytest.raises((aiohttp.ClientError, asyncio.TimeoutError)):
                    async with asyncio.timeout(10):
                        while await r.content.readline():
                            pass
                        raise aiohttp.ClientPayloadError("ended")  # a cut stream ends like this too
                assert time.monotonic() - failed_at < 5  # not the 30 s stop timeout
        await wait_for(lambda: engine.ref.returncode is not None, timeout=5, what="the engine dead")
        assert "stopped answering" in d.get(dep.id).state_reason and "killed" in d.get(dep.id).state_reason
        caplog.clear()
        await d.restart(dep.id)  # the next start: no leftover of an earlier ondemand
        assert not [r for r in caplog.records if "left behind" in r.getMessage()]
        assert d.get(dep.id).state == "ready"


# --- taken back by the next ondemand -----------------------------------------------------


async def test_restart_of_ondemand_kills_orphans_and_marks_stopped(tmp_path, store):
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(dep_fields("a"))
        await d.restart(dep.id)
        orphan = d.engine(dep.id).ref
        await as_if_ondemand_died(d)
    os.kill(orphan.pid, 0)  # still running
    async with running_deployer(tmp_path, store) as d2:
        assert d2.get(dep.id).state == "stopped"
        # The dead ondemand was this very process: it reaps its orphan, as init would. Awaiting
        # the child (not polling /proc) also lets the loop finish its transport before it ends.
        assert await asyncio.wait_for(orphan.wait(), 10) is not None


async def test_a_sleeper_outlives_a_crash_of_ondemand_and_is_woken_not_orphaned(tmp_path, store):
    """Docker backend over the Docker API double: ondemand ends while its engine sleeps; the next
    one finds the container asleep, takes it back asleep (not stopped, not orphaned), and a wake
    brings the same container back. One that ended mid-wake (the row says starting, with the
    sleep's level) wakes it again at start-up, since an asleep vLLM answers /health all the same."""
    from docker_double import DockerDouble

    from ondemand.control.budget import Budget
    from ondemand.engines.backends.docker import DockerBackend
    from ondemand.engines.deployer import Deployer

    image, network = "ondemand-sim-engine:latest", "ondemand-test"
    double = DockerDouble()
    double.add_network(network, [("172.30.0.0/16", "172.30.0.1")])
    double.add_image(image, [])
    # Host memory to spare for a level-1 sleep whatever this machine's (a small test box under a
    # loaded suite has less than the 16 GiB reserve left, and the host reserve would make it a 2).
    plenty = tmp_path / "meminfo"
    plenty.write_text("MemTotal: 67108864 kB\nMemFree: 1000 kB\nMemAvailable: 62914560 kB\n")

    @contextlib.asynccontextmanager
    async def ondemand():
        backend = DockerBackend(docker_url=double.url, network=network, gpus=False, in_container=False)
        d = Deployer(store, backend, Budget("static", 24, meminfo_path=str(plenty)), start_timeout_s=20,
                     stop_timeout_s=5)
        await d.load()
        try:
            yield d
        finally:
            await d.close(stop_engines=False)  # as a crash leaves docker engines: running

    async def sleeping(d, dep_id) -> bool:
        status, body = await d.client.call(dep_id, d.base_url(dep_id), "GET", "/is_sleeping", timeout=5)
        assert status == 200
        return json.loads(body)["is_sleeping"]

    sim = ["python3", "-m", "ondemand", "sim-engine", "--host", "127.0.0.1", "--port", "8000", "--model", "A"]
    async with double:
        async with ondemand() as d:
            dep = await d.create({**dep_fields("a", 4), "command": [], "image": image, "args": sim,
                                  "idle_action": "sleep2"})
            await d.restart(dep.id)
            first = d.engine(dep.id).ref
            assert await d.sleep(dep.id) == 2 and await sleeping(d, dep.id)
        async with ondemand() as d:
            now = d.get(dep.id)
            assert (now.state, now.sleep_level) == ("asleep", 2) and d.engine(dep.id).ref == first
            assert await sleeping(d, dep.id)
            await d.restart(dep.id)  # the wake: same container, weights reloaded, checked
            assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref == first
            assert not await sleeping(d, dep.id)
            assert await d.sleep(dep.id, 1) == 1
            await store.update_deployment(dep.id, state="starting")  # as if it ended in the wake's first step
        async with ondemand() as d:
            await d.wait_started(dep.id)
            assert d.get(dep.id).state == "ready" and d.engine(dep.id).ref == first
            assert not await sleeping(d, dep.id)
            assert not [r for r in await store.audit(dep.id) if r["action"] == "ondemand_wake_failed"]
            await d.stop(dep.id)
