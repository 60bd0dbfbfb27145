"""After a reboot (issue 21): ondemand started over a state file whose always-on deployment lost
its engine (with the process backend, always: it stops its children at shutdown, and kills a
crashed one's) starts it again (``Deployer.restart_lost``), and LiteLLM keeps the name callable
all along: the gateway entry while it starts, as for a switch to always on, then the direct one.
The deployer's own cases (a crash, a refusal, the races, the Docker API double) are in
test_deployer.py, what a unit takes back (an orphan, a sleeper) in test_unit.py; real dockerd in
test_dockerd_restart.py."""
from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from helpers import run_app, wait_for
from litellm_double import litellm_double

INTERNAL = "http://ondemand:8090/dgxmm"


def bases(double, served: str) -> list[str]:
    return sorted(m["litellm_params"]["api_base"] for m in double.models if m["model_name"] == served)


async def test_litellm_keeps_the_gateway_entry_until_the_start_after_a_restart_is_ready(tmp_path):
    async with litellm_double("sk-m") as double:
        mk = tmp_path / "master.key"
        mk.write_text("sk-m\n")
        settings = {"litellm.url": double.url, "litellm.master_key_file": str(mk), "internal_url": INTERNAL}
        async with run_app(tmp_path, **settings) as srv:
            a = await srv.add("a", 4, "--startup-delay", "2", mode="always_on")
            s = await srv.add("s", 4, mode="always_on")
            o = await srv.add("o", 4)
            for i in (a, s, o):
                await srv.deployer.restart(i)
            await srv.deployer.stop(s)  # an administrator's stop
            first = srv.deployer.base_url(a) + "/v1"
            await wait_for(lambda: bases(double, "A") == [first], what="a's direct entry")
        gateway = f"{INTERNAL}/ondemand/{a}/v1"
        async with run_app(tmp_path, **settings) as srv:
            d = srv.deployer
            assert d.get(a).pending_mode == "always_on"
            seen: list[tuple[str, list[str]]] = []

            async def watch():
                while True:
                    seen.append((d.get(a).state.value, bases(double, "A")))
                    await asyncio.sleep(0.02)
            watcher = asyncio.ensure_future(watch())
            try:
                await wait_for(lambda: bases(double, "A") == [gateway], what="the gateway entry")
                assert d.get(a).state != "ready"
                # A request LiteLLM sends there meanwhile waits for the start, then is answered.
                async with aiohttp.ClientSession() as http, http.post(
                        srv.gw(a, "chat/completions"), headers=srv.auth(),
                        json={"model": "A", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 200, await r.text()
                assert d.get(a).state == "ready"
                direct = d.base_url(a) + "/v1"
                await wait_for(lambda: bases(double, "A") == [direct], what="the direct entry, the gateway one gone")
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            assert all(b for _, b in seen)  # the name never went missing
            # Until the first sync, the entry the old ondemand left; from then on no direct entry
            # to a dead engine: the gateway's until ready.
            since = next(n for n, (_, b) in enumerate(seen) if b == [gateway])
            assert not [b for state, b in seen[since:] if state != "ready" and b != [gateway]]
            assert (d.get(a).mode, d.get(a).pending_mode) == ("always_on", None)
            assert d.get(s).state == "stopped" and bases(double, "S") == []  # the stop stays a stop
            assert d.get(o).state == "stopped" and bases(double, "O") == [f"{INTERNAL}/ondemand/{o}/v1"]
