"""The soak's faults, for real (engines SIGKILLed streaming, starting and asleep, failing starts,
key rotations, mode switches, an administrator's stop, a SIGKILL of ondemand and its restart),
and the administrator who puts things back (the healer)."""
from __future__ import annotations

import asyncio
import random
import shlex
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import soaklib
from soaklib import sim_processes

from .plan import NAMES, RANDOM
from .state import Soak


async def faults_loop(soak: Soak, plan: list[tuple[int, str]]) -> None:
    for at, kind in plan:
        while soak.next_i < at:
            await asyncio.sleep(0.05)
        if len(soak.done) >= soak.requests:
            break  # the clients are done: a fault now would test nothing
        try:
            await FAULTS[kind](soak)
        except Exception as exc:  # a fault that could not be made is reported, not fatal
            soak.faults[f"{kind}: could not ({type(exc).__name__}: {exc})"[:90]] += 1


def pick(soak: Soak, ok: Any) -> int | None:
    """A deployment (index) whose view satisfies ``ok``, at random."""
    found = [n for n, i in enumerate(soak.ids[:RANDOM]) if (v := soak.views.get(i)) and ok(v)]
    return random.choice(found) if found else None


async def wait_pick(soak: Soak, ok: Any, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = pick(soak, ok)
        if n is not None:
            return n
        await asyncio.sleep(0.02)
    return None


def engine_pid(soak: Soak, n: int) -> int | None:
    pids = [p for p, info in sim_processes(soak.journal).items() if info["model"] == NAMES[n].upper()]
    return pids[0] if pids else None


async def kill_engine_streaming(soak: Soak) -> None:
    n = await wait_pick(soak, lambda v: v["state"] == "ready" and v["ondemand"]["inflight"] > 0, 10)
    pid = None if n is None else engine_pid(soak, n)
    if n is None or pid is None:
        soak.faults["engine SIGKILL mid-stream: no busy engine found"] += 1
        return
    soak.fault_times[n].append(time.time())
    soaklib.kill_pid(pid)
    soak.faults["engine SIGKILL mid-stream"] += 1


async def kill_engine_starting(soak: Soak) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        n = pick(soak, lambda v: v["state"] == "starting")
        pid = None if n is None else engine_pid(soak, n)
        if n is not None and pid is not None and soak.views[soak.ids[n]]["state"] == "starting":
            soak.fault_times[n].append(time.time())
            soak.start_faults[n].append(time.time())
            soak.killed_starting.add(pid)
            soaklib.kill_pid(pid)
            soak.faults["engine SIGKILL while starting"] += 1
            return
        await asyncio.sleep(0.01)
    soak.faults["engine SIGKILL while starting: no start found"] += 1


async def kill_engine_asleep(soak: Soak) -> None:
    """SIGKILL the engine of an asleep deployment (looked at again just before): ondemand must
    see it exit (the deployment failed, BEHAVIOUR.md "Watchdog") and start it cold on the
    next request, never leave it asleep with no engine."""
    n = await wait_pick(soak, lambda v: v["state"] == "asleep", 10)
    pid = None if n is None else engine_pid(soak, n)
    if n is not None and pid is not None:
        status, view = await soak.od.api("GET", f"/deployments/{soak.ids[n]}")
        if status == 200 and view["state"] == "asleep":
            soak.fault_times[n].append(time.time())
            soak.killed_asleep[pid] = (n, time.time())
            soaklib.kill_pid(pid)
            soak.faults["engine SIGKILL while asleep"] += 1
            return
    soak.faults["engine SIGKILL while asleep: no asleep engine found"] += 1


async def fail_start(soak: Soak) -> None:
    n = await wait_pick(soak, lambda v: v["state"] in ("stopped", "failed") and v["mode"] == "on_demand"
                             and not v.get("pending_mode"), 10)
    if n is None or n in soak.broken:
        soak.faults["failing start: no stopped deployment"] += 1
        return
    soak.start_faults[n].append(time.time())
    soak.broken[n] = time.time()
    rc, _, err = await soak.od.cli("deploy", "set", str(soak.ids[n]), "--command",
                                   shlex.join(soak.command(n, "--fail", "exit-at-start")))
    if rc != 0:
        del soak.broken[n]
        soak.faults[f"deploy set (failing command) refused: {err.strip()[-60:]}"] += 1
        return
    soak.faults["deploy set: a command that fails at start"] += 1


async def rotate_key(soak: Soak) -> None:
    old = soak.key
    rc, _, err = await soak.od.cli("key", "rotate")
    if rc != 0:
        soak.faults[f"key rotate failed: {err.strip()[-60:]}"] += 1
        return
    soak.rotations.append(time.time())
    soak.key = soak.od.key()
    soak.keys.append(soak.key)
    soak.faults["key rotate (CLI)"] += 1
    await asyncio.sleep(1.5)  # the gateway looks at the key file at most once a second
    async with aiohttp.ClientSession() as s:
        url = f"{soak.od.url}/ondemand/{soak.ids[0]}/v1/chat/completions"
        async with s.post(url, json={"model": "ALPHA", "messages": []},
                          headers={"Authorization": f"Bearer {old}"}) as r:
            code = (await r.json(content_type=None) or {}).get("error", {}).get("code")
    soak.old_key_answers.append(f"{r.status} {code}")


async def mode_switch(soak: Soak) -> None:
    n = await wait_pick(soak, lambda v: v["mode"] == "on_demand" and v["state"] == "ready", 10)
    if n is None or n in soak.broken:
        soak.faults["mode set always_on: no ready deployment"] += 1
        return
    soak.always_on[n].append([time.time(), float("inf")])
    rc, _, err = await soak.od.cli("mode", "set", str(soak.ids[n]), "always_on")
    soak.switched[n] = time.time()
    soak.faults["mode set always_on (CLI)" if rc == 0 else f"mode set refused: {err.strip()[-50:]}"] += 1


async def admin_stop(soak: Soak) -> None:
    n = await wait_pick(soak, lambda v: v["state"] == "ready" and v["ondemand"]["inflight"] > 0, 10)
    if n is None:
        soak.faults["deploy stop: no busy deployment"] += 1
        return
    soak.mark(admin_stop=NAMES[n].upper())
    soak.fault_times[n].append(time.time())
    rc, _, err = await soak.od.cli("deploy", "stop", str(soak.ids[n]))
    soak.fault_times[n].append(time.time())
    soak.faults["deploy stop of a busy deployment (CLI)" if rc == 0 else f"deploy stop: {err[-50:]}"] += 1


async def kill_ondemand(soak: Soak) -> None:
    t0 = time.time()
    soak.up.clear()
    await soak.od.kill()
    soak.faults["ondemand SIGKILL, then restart"] += 1
    left = sim_processes(soak.journal)
    soak.left_behind |= set(left)
    await asyncio.sleep(0.5)
    await soak.od.start()
    soak.baseline.update(fds_restart=soaklib.fd_count(soak.od.pid), rss_restart=soaklib.rss_kib(soak.od.pid))
    alive = [p for p in left if p in sim_processes(soak.journal)]
    soak.check("engines left by the killed ondemand are killed by the restarted one",
               bool(left) and not alive, f"{len(left)} left behind (own session, pipe gone), "
                                         f"{len(alive)} alive once the new one answers")
    soak.down.append((t0, time.time()))
    soak.up.set()


async def healer(soak: Soak) -> None:
    """Now and then, an administrator puts things back: a failing command is set back
    (`deploy set`), a start backoff is cleared (`deploy set --idle-timeout`), a switch to
    always on is switched back (`mode set on_demand`)."""
    while True:
        await asyncio.sleep(2)
        try:
            await heal_once(soak, final=False)
        except Exception as exc:  # ondemand restarting, a slow command: next time
            soak.faults[f"healer: {type(exc).__name__}"] += 1


async def heal_once(soak: Soak, final: bool) -> None:
    now = time.time()
    for n, since in list(soak.switched.items()):
        if final or now - since > 5:
            rc, _, _ = await soak.od.cli("mode", "set", str(soak.ids[n]), "on_demand")
            if rc == 0:
                del soak.switched[n]
                for interval in soak.always_on[n]:
                    interval[1] = min(interval[1], time.time())
                soak.faults["mode set on_demand (CLI)"] += 1
    for n, i in enumerate(soak.ids):
        v = soak.views.get(i, {})
        if v.get("state") not in ("stopped", "failed"):
            continue
        if n in soak.broken and (final or now - soak.broken[n] > 4):
            rc, _, _ = await soak.od.cli("deploy", "set", str(i), "--command", shlex.join(soak.command(n)))
            if rc == 0:
                del soak.broken[n]
                soak.faults["deploy set: the working command back"] += 1
        elif (v.get("ondemand") or {}).get("backoff_until"):
            timeout = 1 + (v.get("idle_timeout_s") or 0) % 3  # another value than now
            rc, _, err = await soak.od.cli("deploy", "set", str(i), "--idle-timeout", str(timeout))
            soak.faults["deploy set --idle-timeout (clears a start backoff)" if rc == 0 else
                        f"deploy set --idle-timeout refused: {err.strip()[-60:]}"] += 1


# What plan_faults names, by name.
FAULTS: dict[str, Callable[[Soak], Awaitable[None]]] = {
    "kill_engine_streaming": kill_engine_streaming, "kill_engine_starting": kill_engine_starting,
    "kill_engine_asleep": kill_engine_asleep, "fail_start": fail_start, "rotate_key": rotate_key,
    "mode_switch": mode_switch, "admin_stop": admin_stop, "kill_ondemand": kill_ondemand}
