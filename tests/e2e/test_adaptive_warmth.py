"""Adaptive warmth end to end: the whole ondemand (process backend, static budget), an engine
simulator that sleeps, the gateway's requests, the reaper and the pre-warm's wake, over real
sockets and the real state file. A rhythm kept in the state file is taken back at a restart; the
plan puts the engine to sleep soon after a burst and wakes it before the next, which finds it
awake. The test's gaps are seconds: its min_idle_timeout_s of 1 s makes the shortest rest worth
making half a second (it scales with that minimum), so the plan decides as it would on real
traffic with minutes."""
from __future__ import annotations

import asyncio
import random
import re
import time

import aiohttp
from helpers import TwoPools, run_app, wait_for

from ondemand.control import rhythm

CHAT = {"model": "R", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
INSIDE_S = 1.2  # between a burst's two requests
BETWEEN_S = 8.0  # from a burst's last request to the next burst


def learned_before(n: int, seed: int = 1) -> list[float]:
    """Gaps of bursts of two requests, INSIDE_S apart, every BETWEEN_S."""
    rng = random.Random(seed)
    gaps: list[float] = []
    for _ in range(n):
        gaps += [INSIDE_S + rng.uniform(-0.05, 0.05), BETWEEN_S + rng.uniform(-0.1, 0.1)]
    return gaps


async def ask(srv, http) -> None:
    async with http.post(srv.gw(srv.dep, "chat/completions"), json=CHAT, headers=srv.auth()) as r:
        assert r.status == 200, await r.text()


async def burst(srv, http) -> float:
    """Two requests INSIDE_S apart; the moment the last one ended (its idle period began)."""
    await ask(srv, http)
    await asyncio.sleep(INSIDE_S)  # the traffic's own rhythm, not a wait for a condition
    await ask(srv, http)
    return time.monotonic()


async def test_a_learned_rhythm_sleeps_the_engine_between_bursts_and_wakes_it_before_the_next(tmp_path):
    kept = learned_before(12)
    async with run_app(tmp_path, reap_interval_s=3600) as srv, aiohttp.ClientSession() as gw, \
            aiohttp.ClientSession() as admin:
        http = TwoPools(gw, admin)
        # A cold start of 2 s: ten times that is more than a gap between bursts, so the plan rests the
        # engine asleep (a wake of a few hundredths pays), never stopped (whatever this machine's load).
        srv.dep = dep = await srv.add("r", 4, "--startup-delay", "2", idle_action="sleep", keep_warm="adaptive",
                                      idle_timeout_s=60)
        await ask(srv, http)
        # A wake timed: what a rest asleep costs (the tiers' costs are measured ones).
        async with http.post(f"{srv.url}/api/deployments/{dep}/sleep", json={"level": 1},
                             headers=srv.admin_headers()) as r:
            assert r.status == 200, await r.text()
        await ask(srv, http)
        for gap in kept:  # what earlier traffic taught it, as the controller's effects keep it
            await srv.deployer.store.write_idle_gap(dep, at=time.time(), gap_s=gap, keep=rhythm.KEEP)
    async with run_app(tmp_path, reap_interval_s=0.1) as srv, aiohttp.ClientSession() as gw, \
            aiohttp.ClientSession() as admin:
        http = TwoPools(gw, admin)
        srv.dep = dep
        assert srv.controller.rhythm(dep).gaps == kept  # a restart keeps what was learned
        released = await burst(srv, http)
        await wait_for(lambda: srv.state(dep) == "asleep", timeout=BETWEEN_S / 2, what="asleep after the burst")
        assert time.monotonic() - released < BETWEEN_S / 2
        view = srv.controller.adaptive(dep)
        assert view is not None and view["rest"] in ("asleep_1", "asleep_2"), view
        assert 1 <= view["awake_for_s"] < view["prewarm_in_s"] < BETWEEN_S, view  # 1: min_idle_timeout_s
        await asyncio.sleep(released + BETWEEN_S - time.monotonic())  # the next burst, on time
        # Woken before it (the wake began at prewarm_in_s: ready by now, or on a loaded machine still on its way).
        assert srv.state(dep) in ("starting", "ready"), srv.state(dep)
        await burst(srv, http)
        assert srv.controller.prewarms(dep) == {"hit": 1, "miss": 0}
        await wait_for(lambda: srv.state(dep) == "asleep", timeout=BETWEEN_S / 2, what="asleep after the next burst")
        rows = [r for r in await srv.deployer.store.audit(dep) if r["action"] == "ondemand_prewarm"]
        assert len(rows) == 1 and rows[0]["text"].startswith("Woken ahead of its next request"), rows
        assert len(srv.controller.rhythm(dep)) == len(kept) + 3  # the live gaps learned too
        async with http.get(f"{srv.url}/metrics", headers=srv.admin_headers()) as r:
            text = await r.text()
        assert re.search(r'^ondemand_prewarms_total\{deployment="r",result="hit"\} 1\.0$', text, re.M), text
