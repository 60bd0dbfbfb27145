"""The soak's invariants once every client is done: each answer explained, nothing hung, no
garbage or asleep engine's 503 reached a client, nothing left in flight, every engine at rest and
agreeing with its deployment's state, fds and memory back, a clean stop, an intact state file,
no secret in a log. The audit's checks (audit.py) and the journal's (warmth.py) are called here."""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp
import soaklib
from soaklib import sim_processes

from . import audit, warmth
from .plan import DEADLINE_S, ENGINE_ARGS, ENGINES, GIB, GPU_MIB, IDLE_ACTIONS, LEVELS, LIMITS, NAMES, SLEEPING, Done
from .state import Soak


def attributed(soak: Soak, d: Done) -> bool:
    """Whether an outcome other than an answer is explained by a fault (or is always allowed)."""
    o, lo, hi = d.outcome, d.start - 2, d.end + 2
    near = any(lo <= t <= hi for t in soak.fault_times[d.dep])
    down = any(a <= hi and b >= lo for a, b in soak.down)
    if o.startswith(("200", "hang-up")) and "not an answer" not in o and "not JSON" not in o \
            or "ondemand_queue_timeout" in o:
        return True
    if o.startswith(("ondemand down", "connection lost")):
        return down
    if o in ("stream cut", "502 ondemand_upstream_error", "stream error ondemand_upstream_error") \
            or "ondemand_stopped" in o:
        return near or down
    if "start_failed" in o or o == "503 ondemand_not_ready":
        return any(t <= d.end for t in soak.start_faults[d.dep] + soak.fault_times[d.dep])
    if "not_on_demand" in o:
        return always_on_during(soak, d) >= 1
    if "does_not_fit" in o:  # two switched to always on leave no room for the on-demand ones
        return always_on_during(soak, d, any_dep=True) >= 2
    if o == "401 invalid_api_key":
        return any(d.start - 3 <= t <= d.end + 1 for t in soak.rotations)
    if "ondemand_busy" in o:  # 429 at its max_inflight (in a stream: queued, then over the limit)
        return LIMITS[d.dep] is not None
    return False


def always_on_during(soak: Soak, d: Done, any_dep: bool = False) -> int:
    """How many deployments (``d``'s alone, or any) were switched to always on during ``d``."""
    deps = range(len(NAMES)) if any_dep else [d.dep]
    return sum(any(a - 1 <= d.end and b + 1 >= d.start for a, b in soak.always_on[n]) for n in deps)


async def after(soak: Soak) -> None:
    """The invariants, once every client is done."""
    hung = [d for d in soak.done if d.outcome.startswith("HUNG")]
    soak.check(f"no request hung past its deadline ({DEADLINE_S} s: queue timeout + 10 s)", not hung,
               f"{len(hung)} hung" if hung else f"slowest {max(d.end - d.start for d in soak.done):.1f} s")
    odd = collections.Counter(d.outcome for d in [*soak.done, *soak.beats] if not attributed(soak, d))
    soak.check("every answer is an answer, a hang-up, a queue timeout or explained by a fault",
               not odd, ", ".join(f"{o} x{c}" for o, c in odd.most_common(6)))
    asleep = collections.Counter(d.outcome for d in soak.done if "asleep engine" in d.outcome)
    soak.check(f'no client got an asleep engine\'s 503 ("{SLEEPING}")', not asleep,
               ", ".join(f"{o} x{c}" for o, c in asleep.items()))
    garbage = collections.Counter(NAMES[d.dep] for d in soak.done if "garbage" in d.outcome)
    answered = collections.Counter(NAMES[d.dep] for d in soak.done if d.outcome.startswith("200"))
    failing = [n for n, extra in enumerate(ENGINE_ARGS) if "--fail" in extra]
    soak.check("no client got garbage (a wake whose weights did not come back is caught by its check)",
               not garbage, str(dict(garbage)) if garbage else "answers of the engines whose wakes fail: "
               + ", ".join(f"{NAMES[n]} {answered[NAMES[n]]}" for n in failing))
    wakes = [d for kind, d in soak.probes if kind == "wake"]
    odd_probes = collections.Counter(d.outcome for _, d in soak.probes if not attributed(soak, d))
    soak.check("every wake probe (a request for an asleep deployment) answered",
               bool(wakes) and not odd_probes, ", ".join(f"{o} x{c}" for o, c in odd_probes.items()) or
               ", ".join(f"{NAMES[d.dep]} {d.outcome}" for d in wakes))
    soak.check("a rotated-out key is refused (401, not counted for the rate limit)",
               bool(soak.old_key_answers) and all(a == "401 invalid_api_key" for a in soak.old_key_answers),
               ", ".join(collections.Counter(soak.old_key_answers)))
    soak.check("never two engines of one deployment at once (/proc, every second)", not soak.two_at_once,
               "; ".join(soak.two_at_once[:3]))
    soak.check(f"the GPU never overfilled ({GPU_MIB // GIB} GiB; the fake nvidia-smi's processes every 0.2 s)",
               not soak.overfilled, "; ".join(soak.overfilled[:2]) or
               f"at most {soak.gpu_peak / GIB:.0f} GiB held; at most {soak.state_peak['ready']} ready and "
               f"{soak.state_peak['asleep']} asleep at once")
    await quiet_checks(soak)
    await audit.priority_checks(soak)
    audit.prewarm_checks(soak)
    rc = await soak.od.stop()
    soak.check("ondemand stops on SIGTERM with exit code 0", rc == 0, f"exit code {rc}")
    await asyncio.sleep(0.5)
    orphans = sim_processes(soak.journal)
    soak.check("no engine process left after ondemand stops (asleep ones too)", not orphans, str(orphans)[:200])
    for p in orphans:
        soaklib.kill_pid(p)
    verdict = soaklib.integrity(soak.od.cfg.db_path)
    soak.check("the state file passes PRAGMA integrity_check", verdict == "ok", verdict[:200])
    secrets = [*soak.keys, soak.od.token()]
    errors = [line for line in soak.od.stderr_path.read_text().splitlines()
              if " ERROR " in line or line.startswith("Traceback")]
    soak.check("no ERROR line or traceback in ondemand's log", not errors, "; ".join(errors[:3])[:300])
    hits = soaklib.secrets_found(soaklib.log_files(soak.work), secrets)
    soak.check(f"no secret ({len(soak.keys)} keys, the admin token) in any log", not hits,
               "; ".join(hits[:4]) or f"{len(soaklib.log_files(soak.work))} files read")
    warmth.journal_checks(soak)


async def quiet_checks(soak: Soak) -> None:
    """With no client left: nothing in flight or queued; every deployment's state agrees
    with its engine; then (engines put to sleep or stopped) again, and the gateway's file
    descriptors and memory back near where they were."""
    deadline = time.monotonic() + 5
    while True:
        _, views = await soak.od.api("GET", "/deployments")
        _, host = await soak.od.api("GET", "/host")
        busy = {v["name"]: (v["ondemand"]["inflight"], v["ondemand"]["queued"]) for v in views
                if v["ondemand"]["inflight"] or v["ondemand"]["queued"]}
        if (not busy and not host["ondemand"]["queued"]) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    soak.check("in flight and queued are 0 everywhere (deployment views, host)",
               not busy and not host["ondemand"]["queued"], f"{busy} host queued {host['ondemand']['queued']}")
    await agreement_check(soak, "as the clients end")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, views = await soak.od.api("GET", "/deployments")
        if all(at_rest(v) for v in views):
            break
        await asyncio.sleep(0.2)
    states = {v["name"]: v["state"] + (f" {v['sleep_level']}" if v["state"] == "asleep" else "") for v in views}
    soak.check("every idle engine put to sleep at its level (sleep, sleep2) or stopped by the reaper",
               all(at_rest(v) for v in views), ", ".join(f"{k} {v}" for k, v in states.items()))
    await agreement_check(soak, "at rest")
    await asyncio.sleep(1)
    fds, rss = soaklib.fd_count(soak.od.pid), soaklib.rss_kib(soak.od.pid)
    # Idle keep-alive connections to the engines still running (asleep) are no leak: they
    # end with the engine, or when it closes them (the simulator, as aiohttp, after 75 s;
    # vLLM's and SGLang's uvicorn after 5 s). They are counted apart.
    # And each engine still running holds two: its output's pipe and its log file.
    ports = {info["port"] for info in sim_processes(soak.journal).values()}
    kept = sum(1 for port in soaklib.tcp_peer_ports(soak.od.pid) if port in ports)
    base_fds, base_rss = soak.baseline["fds_restart"], soak.baseline["rss_restart"]
    kinds = ", ".join(f"{k} {c}" for k, c in sorted(soaklib.fd_kinds(soak.od.pid).items(), key=lambda x: -x[1]))
    soak.check("open fds back near their value after the restart (+10), but what asleep engines hold",
               fds - kept - 2 * len(ports) <= base_fds + 10,
               f"{base_fds} after restart, {fds} at the end: {kept} idle connections to and 2 each for "
               f"{len(ports)} asleep engines (first process: {soak.baseline['fds_first']}; at the end {kinds})")
    soak.check("RSS back near its value after the restart (+64 MiB)", rss <= base_rss + 65536,
               f"{base_rss // 1024} MiB after restart, {rss // 1024} MiB at the end")
    soak.rss = (base_rss, rss)


def at_rest(view: dict[str, Any]) -> bool:
    """Stopped or failed; or asleep at its deployment's level (never one that stops when idle)."""
    if view["state"] in ("stopped", "failed"):
        return True
    level = LEVELS[IDLE_ACTIONS[NAMES.index(view["name"])]]
    return view["state"] == "asleep" and level > 0 and view["sleep_level"] == level


async def agreement_check(soak: Soak, when: str) -> None:
    """Every deployment's state agrees with its engine: an asleep one's engine sleeps at its
    level (``/_sim/state``; vLLM's ``/is_sleeping`` true), a ready one's is awake
    (``/is_sleeping`` false), a stopped or failed one has no engine process. A view is
    compared only when it did not change around the engine's answer (the reaper may act
    meanwhile); a disagreement that lasts 10 s fails."""
    checked: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for n, dep_id in enumerate(soak.ids):
            deadline, last = time.monotonic() + 10, "no stable view"
            while time.monotonic() < deadline:
                ok, last = await agrees(soak, http, n, dep_id)
                if ok:
                    checked[last] += 1
                    break
                await asyncio.sleep(0.2)  # the view moved, or they disagree: look again
            else:
                wrong.append(f"{NAMES[n]}: {last}")
    soak.check(f"every deployment's state agrees with its engine ({when})", not wrong,
               "; ".join(wrong[:3]) or ", ".join(f"{k} x{c}" for k, c in sorted(checked.items())))


async def agrees(soak: Soak, http: aiohttp.ClientSession, n: int, dep_id: int) -> tuple[bool | None, str]:
    """(None: the view moved, look again; or whether it agrees, and what was seen)."""
    def view() -> Any:
        return soak.od.api("GET", "/deployments")
    _, views = await view()
    before = next(v for v in views if v["id"] == dep_id)
    state = before["state"]
    engines = [p for p, info in sim_processes(soak.journal).items() if info["model"] == NAMES[n].upper()]
    seen: str
    if state in ("stopped", "failed"):
        ok, seen = not engines, f"{state}, no engine" if not engines else f"{state} but engine pids {engines}"
    elif state in ("ready", "asleep") and before.get("base_url"):
        try:
            async with http.get(before["base_url"] + "/_sim/state") as r:
                sim = await r.json()
            sleeping = any(sim["sleeping"].values())
            vllm = ENGINES[n] == "vllm"
            if vllm:
                async with http.get(before["base_url"] + "/is_sleeping") as r:
                    said = (await r.json())["is_sleeping"]
            else:
                said = sleeping
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
            return None, f"{state}, engine not answering ({type(exc).__name__})"
        if state == "ready":
            ok = not sleeping and not said
            seen = "ready, awake" if ok else f"ready but the engine sleeps (level {sim['level']})"
        else:
            ok = sleeping and said and sim["level"] == before["sleep_level"]
            seen = (f"asleep {sim['level']}, engine asleep" if ok else
                    f"asleep {before['sleep_level']} but the engine says sleeping {said}, level {sim['level']}")
    else:
        return None, f"{state}: moving"
    _, views = await view()
    after = next(v for v in views if v["id"] == dep_id)
    if (after["state"], after["updated_at"]) != (state, before["updated_at"]):
        return None, seen
    return ok, seen
