"""The soak's clients: the random traffic of ``--clients`` clients, the wake probes (a request for
a deployment once it is asleep, its wake failing or not) and india's metronome (adaptive warmth);
each answer read as a client sees it and written down as one outcome."""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from typing import Any

import aiohttp

from .plan import DEADLINE_S, ENGINE_ARGS, METRONOME_S, NAMES, PHASE, RANDOM, SLEEPING, Done, Plan, plan_request
from .state import Soak


async def client(soak: Soak, session: aiohttp.ClientSession) -> None:
    while soak.next_i < soak.requests:
        await soak.up.wait()  # requests sent while ondemand is down only count refusals
        i = soak.next_i
        soak.next_i += 1
        plan = plan_request(soak.seed, i)
        await asyncio.sleep(plan.think)
        key, start = soak.key, time.time()
        try:
            outcome = await asyncio.wait_for(exchange(soak, session, plan, key), DEADLINE_S)
        except asyncio.TimeoutError:
            outcome = "HUNG past its deadline"
        soak.done.append(Done(i, plan.dep, outcome, start, time.time(), key))
        if not outcome.startswith(("200", "hang-up")):
            # As a person (or LiteLLM's caller) would: an error is not retried at once. Without
            # this, errors answered at once (a start backoff) would use up the requests in seconds.
            await asyncio.sleep(random.uniform(0.3, 1.0))


def body(plan: Plan) -> dict[str, Any]:
    model = NAMES[plan.dep].upper()
    if plan.route == "embeddings":
        return {"model": model, "input": "soak"}
    if plan.route == "completions":
        return {"model": model, "prompt": "soak", "stream": plan.stream}
    return {"model": model, "messages": [{"role": "user", "content": "soak"}], "stream": plan.stream}


async def exchange(soak: Soak, session: aiohttp.ClientSession, plan: Plan, key: str) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    if plan.cookie:
        headers["Cookie"] = f"session={key}"
    if plan.health:
        headers["x-dgxmm-health-check"] = "1"
    url = f"{soak.od.url}/ondemand/{soak.ids[plan.dep]}/v1/{plan.route}"
    answer = call(soak, session, url, headers, plan)
    if plan.hangup != "early":
        return await answer
    try:
        return await asyncio.wait_for(answer, plan.delay)
    except asyncio.TimeoutError:
        view = soak.views.get(soak.ids[plan.dep], {})
        phase = (view.get("ondemand") or {}).get("phase")
        stage = ("queued" if phase == "queued" else "starting" if view.get("state") == "starting"
                 else "waiting" if view.get("state") != "ready" else "served")
        return f"hang-up while {stage}"


async def call(soak: Soak, session: aiohttp.ClientSession, url: str, headers: dict[str, str], plan: Plan) -> str:
    try:
        async with session.post(url, json=body(plan), headers=headers) as r:
            if plan.hangup == "headers":
                r.close()
                return "hang-up as the answer began"
            if r.status != 200:
                data = await r.json(content_type=None)
                error = data.get("error") or {}
                if SLEEPING in str(error.get("message")):
                    return f"{r.status} from an asleep engine"
                return f"{r.status} {error.get('code')}"
            if plan.health:
                await r.read()
                return "200 health check (answered by the gateway)"
            if not plan.stream:
                raw = await r.read()
                try:
                    data = json.loads(raw)
                except ValueError:
                    return "200 but not JSON"
                if b"garbage" in raw:
                    return "200 but garbage (the weights were not the model's)"
                return "200" if data.get("data") or data.get("choices") else "200 but not an answer"
            return await read_stream(r, plan)
    except aiohttp.ClientConnectorError:
        return "ondemand down (connection refused)"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return "connection lost before the answer"
    except aiohttp.ClientPayloadError:
        return "stream cut"


async def read_stream(r: aiohttp.ClientResponse, plan: Plan) -> str:
    queued, chunks = False, 0
    async for line in r.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return "200 stream (queued notice first)" if queued else "200 stream"
        if b'"ondemand-queued"' in data:
            queued = True
            continue
        if data.startswith(b'{"error"'):
            error = json.loads(data)["error"]
            if SLEEPING in str(error.get("message")):
                return "stream error from an asleep engine"
            return f"stream error {error.get('code')}"
        if b"garbage" in data:
            r.close()
            return "200 stream but garbage (the weights were not the model's)"
        chunks += 1
        if plan.hangup == "midstream" and chunks >= 2:
            r.close()
            return "hang-up mid-stream"
    return "stream cut"


async def probe_loop(soak: Soak, plan: list[int]) -> None:
    # The deployments whose wakes fail, and one sound level-2 sleeper (bravo): each run sees
    # wakes of every kind, whatever its traffic happened to wake.
    failing = [n for n, extra in enumerate(ENGINE_ARGS) if "--fail" in extra] + [NAMES.index("bravo")]
    for k, at in enumerate(plan):
        while soak.next_i < at:
            await asyncio.sleep(0.05)
        # The one least often woken by a probe yet, in turn, but not one of the hot pair (busy,
        # it would not fall asleep): up to 30 s for the pair to change when they all are.
        woken = collections.Counter(d.dep for kind, d in soak.probes if kind == "wake" and d.outcome == "200")
        turn = sorted((failing[(k + j) % len(failing)] for j in range(len(failing))), key=lambda m: woken[m])
        least = [m for m in turn if woken[m] == woken[turn[0]]]
        deadline = time.monotonic() + 30
        while True:
            hot = set(random.Random(f"{soak.seed}:phase:{soak.next_i // PHASE}").sample(range(RANDOM), 2))
            n = next((m for m in least if m not in hot), None)
            if n is not None or time.monotonic() > deadline or len(soak.done) >= soak.requests:
                break
            await asyncio.sleep(0.5)
        n = least[0] if n is None else n
        for _ in range(3):  # again when a fault cut it (the restart of ondemand): each probe is needed
            try:
                if await wake_probe(soak, n):
                    break
            except Exception as exc:
                soak.faults[f"wake probe: could not ({type(exc).__name__}: {exc})"[:90]] += 1


async def wake_probe(soak: Soak, n: int) -> bool:
    """A request for ``n`` once it is asleep: started first by a request if it is stopped,
    then left idle until the reaper puts it to sleep. Its wake fails (or, for bravo, works),
    and the request must be answered all the same (a failed wake's by the engine started
    cold). Whether it was (200)."""
    deadline, started = time.monotonic() + 40, False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
        while time.monotonic() < deadline:
            await soak.up.wait()
            v = soak.views.get(soak.ids[n], {})
            state = v.get("state")
            if state == "asleep" and not v.get("pending_mode"):
                done = await probe(soak, session, n)
                soak.probes.append(("wake", done))
                soak.faults[f"wake probe: a request for asleep {NAMES[n]}"] += 1
                return done.outcome == "200"
            if state in ("stopped", "failed") and not started and v.get("mode") == "on_demand":
                started = True
                soak.probes.append(("start", await probe(soak, session, n)))
            await asyncio.sleep(0.1)
    soak.faults[f"wake probe: {NAMES[n]} never asleep within 40 s"] += 1
    return False


async def probe(soak: Soak, session: aiohttp.ClientSession, n: int) -> Done:
    plan = Plan(n, "chat/completions", False, False, False, None, 0.0, 0.0)
    key, start = soak.key, time.time()
    try:
        outcome = await asyncio.wait_for(exchange(soak, session, plan, key), DEADLINE_S)
    except asyncio.TimeoutError:
        outcome = "HUNG past its deadline"
    return Done(-1, n, outcome, start, time.time(), key)


async def metronome(soak: Soak) -> None:
    """india's rhythm: a burst of two requests, METRONOME_S after the last one's end (its own
    connections)."""
    n = NAMES.index("india")
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        while True:
            for _ in range(2):
                await soak.up.wait()
                soak.beats.append(await probe(soak, session, n))
            # From the burst's end: the idle gap is the rhythm, however long a cold start took.
            await asyncio.sleep(METRONOME_S)
