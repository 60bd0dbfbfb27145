"""The engine side of tiered warmth (ondemand/engines/sleeper.py) against the engine simulator
in this process, through the engine client and its pools: a sleep and a wake make their tier's
calls, the wake check compares the one-token answer recorded after the start, and each failure
comes back as ``WakeFailed`` with its result. The deployer's decisions around them, end to end:
test_tiered_warmth.py."""
from __future__ import annotations

import contextlib

import aiohttp
import pytest

from ondemand.engines.backends import Engine
from ondemand.engines.client import EngineClient
from ondemand.engines.sleeper import Sleeper, WakeFailed
from ondemand.http.pool import Upstreams
from ondemand.model import Deployment, State
from ondemand.sim.engine import SimServer
from ondemand.sim.options import SimOptions


@contextlib.asynccontextmanager
async def engine(**kw):
    """(the sleeper, a running simulator as an Engine, the simulator's own session)."""
    server = SimServer(SimOptions(port=0, model="M", **kw), shutdown_timeout=0.1)
    url = f"http://127.0.0.1:{await server.start()}"
    upstreams = Upstreams()
    try:
        async with aiohttp.ClientSession(url) as sim:
            yield Sleeper(EngineClient(upstreams, probe_timeout_s=2), wake_timeout_s=2), Engine(1, "m", url), sim
    finally:
        await upstreams.close()
        await server.stop()


DEP = Deployment(id=1, name="m", served_name="M", engine="vllm", memory_gib=10, state=State.READY)


async def calls(sim) -> list[str]:
    """The sleep API's calls the simulator received, in order (path?query)."""
    async with sim.get("/_sim/requests") as r:
        return [q["path"] + ("?" + q["query"] if q.get("query") else "") for q in await r.json()
                if q["path"] not in ("/metrics", "/health", "/v1/models", "/v1/completions")]


async def test_a_sleep_and_a_wake_with_the_wake_check_recorded_after_the_start():
    async with engine() as (sleeper, eng, sim):
        check = await sleeper.record_check(eng, DEP)
        assert check  # the greedy one-token answer
        dep = DEP.replace(wake_check=check)
        assert await sleeper.sleep(eng, dep, 1) is None
        await sleeper.wake(eng, dep, 1)
        assert await calls(sim) == ["/sleep?level=1", "/wake_up"]


async def test_a_level_2_wake_reloads_the_weights_in_vllms_order():
    async with engine() as (sleeper, eng, sim):
        dep = DEP.replace(wake_check=await sleeper.record_check(eng, DEP))
        assert await sleeper.sleep(eng, dep, 2) is None
        await sleeper.wake(eng, dep, 2)
        assert await calls(sim) == ["/sleep?level=2", "/wake_up?tags=weights", "/collective_rpc",
                                    "/wake_up?tags=kv_cache", "/reset_prefix_cache"]


async def test_a_wake_that_answers_garbage_is_a_mismatch():
    async with engine(fail="wake-garbage") as (sleeper, eng, sim):
        dep = DEP.replace(wake_check=await sleeper.record_check(eng, DEP))
        assert await sleeper.sleep(eng, dep, 1) is None
        with pytest.raises(WakeFailed) as err:
            await sleeper.wake(eng, dep, 1)
        assert err.value.result == "mismatch" and repr(dep.wake_check) in str(err.value)


async def test_a_wake_call_that_fails_is_failed_with_the_engines_answer():
    async with engine(fail="wake-fails") as (sleeper, eng, sim):
        dep = DEP.replace(wake_check=await sleeper.record_check(eng, DEP))
        assert await sleeper.sleep(eng, dep, 1) is None
        with pytest.raises(WakeFailed) as err:
            await sleeper.wake(eng, dep, 1)
        assert err.value.result == "failed" and str(err.value).startswith("POST /wake_up answered 500")


async def test_without_a_wake_check_a_wake_is_checked_by_health():
    async with engine() as (sleeper, eng, sim):
        assert DEP.wake_check is None  # not a completion model: no check recorded
        assert await sleeper.sleep(eng, DEP, 1) is None
        await sleeper.wake(eng, DEP, 1)
        async with sim.get("/_sim/requests") as r:
            assert [q["path"] for q in await r.json()][-2:] == ["/wake_up", "/health"]


async def test_an_engine_that_does_not_answer_gives_the_sleeps_reason_and_a_failed_wake():
    async with engine() as (sleeper, _, _):
        gone = Engine(1, "m", "http://127.0.0.1:9")  # nothing listens there
        reason = await sleeper.sleep(gone, DEP, 1)
        assert reason is not None and reason.startswith("POST /sleep failed")
        with pytest.raises(WakeFailed) as err:
            await sleeper.wake(gone, DEP, 1)
        assert err.value.result == "failed" and str(err.value).startswith("POST /wake_up failed")
