"""The soak: a real `ondemand serve` process (process backend, the nvidia-smi budget on a fake
GPU box, the engine simulator) under many clients and real faults, then the invariants that
must hold.

    python scripts/soak.py --seed 1 --requests 10000 [--clients 50] [--record bench/soak.md]

Load: ``--requests`` requests from ``--clients`` clients over 8 deployments (10 GiB each) on a
fake GPU box (tests/fakes/nvidia-smi: one GPU of 34 GiB) where 3 fit awake at once; streaming
and not; two deployments are "hot" at a time and the pair changes every 250 requests, so models
are put to sleep, woken, started and made room for all the time. The deployments have priorities
(alpha high, delta, foxtrot and hotel low, the others normal) and charlie a ``max_inflight`` of
3, so requests queue by priority, make-room picks by class, and charlie's bursts are refused 429
``ondemand_busy``.

Tiered warmth: most deployments sleep when idle (``idle_action`` ``sleep``; bravo and foxtrot
``sleep2``; delta and hotel ``stop``); echo is an SGLang engine, the others vLLM. An asleep
engine keeps 1 GiB on its GPU (``--sleep-gpu-mib``) and, at level 1, 8 MiB more of host memory
(``--host-mib``; ``budget.host_reserve_gib`` is 0 so that the box's memory never changes a
level), so make-room puts awake engines to sleep and stops asleep ones. Some engines fail their
wakes: charlie and foxtrot (``--fail wake-fails``: the wake call answers 500) and golf
(``--fail wake-garbage``: it wakes, then answers garbage, which the wake check must catch);
each such wake ends in a cold start, audited ``ondemand_wake_failed``. Wake probes (a request
for one of them once it is asleep, one per 300 requests, at least 3) make sure each one's
failing wake is seen even in a short run.

Adaptive warmth: india (``keep_warm`` adaptive, idle action stop) has no share of the random
traffic and no fault picks it; a metronome sends it a burst of two requests ``METRONOME_S``
seconds after the last one ended (the run lasts until its ``BEATS``-th burst), and its state file
starts with 40 such gaps learned and a cold start timed (written before a restart at set-up), so
from its first burst on it is stopped a second or two after each burst and started again (a
pre-warm) before the next, with memory free at that moment only, on a box the others keep nearly
full. What is
checked: no make-room ever ran for a pre-warm (a sleep or stop for india while no request for it
was out), no pre-warm began while a request waited for memory (the views' queue, every 0.2 s),
and pre-warms were tried (started, or found no free memory: ondemand's log says so). At the end
india is set back to fixed (its plan ends at once).

What is checked about sleep and wake: from the engines' journal (``--journal``: ``req``/``end``
of every request, ``sleep``, ``wake``, ``sigterm``), no engine was put to sleep with a
generation request in flight, none reached an asleep engine, each slept at its deployment's
level, every audited sleep reached its engine, and the ``ondemand_wake_failed`` rows are the
failing wakes the journal shows (per deployment and kind); from the clients, none got an asleep
engine's 503 or garbage; from the views, every deployment's state agrees with its engine's own
(``/_sim/state``, ``/is_sleeping``); from the fake's processes, the GPU never overfilled.

Faults, for real: client hang-ups at every stage (waiting in the queue, while the model
starts, right as the answer begins, mid-stream); engines SIGKILLed mid-stream and while
starting; starts that fail (`deploy set --command` with `--fail exit-at-start`, set back
later); key rotations (`ondemand key rotate`; clients switch to the new key, and the old
one is tried once to see it refused); `mode set` always_on and back, `deploy stop` and
`deploy set` through the command line; one SIGKILL of ondemand itself and a restart on the
same state directory.

The plan (which request goes where, how, and which hang-up; which fault after which
request) comes from ``--seed`` alone: the same seed replays the same plan. Timing, and so
the outcome of each request, is the machine's.

It prints one summary: requests by outcome, faults injected, tiered warmth (sleeps by level
and cause, wakes by result, cold starts), invariants checked; the exit code is 1 when an
invariant broke. ``--record FILE`` writes the summary there too.

Its parts are in scripts/soakkit/ (the plan, the clients, the faults, the checks); what it shares
with the crash test, in scripts/soaklib.py.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soaklib  # noqa: E402
from soakkit import checks, faults, traffic, watch  # noqa: E402
from soakkit.plan import (  # noqa: E402
    BEATS,
    ENGINE_ARGS,
    ENGINES,
    GIB,
    GPU_MIB,
    IDLE_ACTIONS,
    KEEP_WARM,
    LIMITS,
    METRONOME_S,
    NAMES,
    PRIORITIES,
    plan_faults,
    plan_probes,
)
from soakkit.state import Soak  # noqa: E402
from soaklib import sim_processes  # noqa: E402


async def setup(soak: Soak) -> None:
    soak.key = soak.od.write_key()
    soak.keys.append(soak.key)
    await soak.od.start()
    for n, name in enumerate(NAMES):
        status, view = await soak.od.api("POST", "/deployments", {
            "name": name, "served_name": name.upper(), "memory_gib": 10, "mode": "on_demand",
            # india's timeout bounds how long a pre-warmed engine waits for its request: 10 s.
            "idle_timeout_s": 10 if KEEP_WARM[n] == "adaptive" else 1 + n % 3, "command": soak.command(n),
            "priority": PRIORITIES[n], "max_inflight": LIMITS[n], "engine": ENGINES[n],
            "idle_action": IDLE_ACTIONS[n], "gpu_count": 1, "keep_warm": KEEP_WARM[n]})
        assert status == 201, (status, view)
        soak.ids.append(view["id"])
    # india's rhythm, as learned before (bursts every METRONOME_S): a restart takes it back.
    assert await soak.od.stop() == 0
    rng = random.Random(f"{soak.seed}:rhythm")
    soaklib.write_learned(soak.od.cfg.db_path, soak.ids[NAMES.index("india")],
                          [METRONOME_S - 1 + rng.uniform(-0.5, 0.5) for _ in range(40)], start_s=1.0)
    await soak.od.start()
    soak.baseline = {"fds_first": soaklib.fd_count(soak.od.pid), "rss_first": soaklib.rss_kib(soak.od.pid)}


async def run(soak: Soak) -> None:
    await setup(soak)
    soak.up.set()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a hang-up closes its own connection
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    tasks = [asyncio.ensure_future(watch.poll(soak)), asyncio.ensure_future(faults.healer(soak))]
    metronome = asyncio.ensure_future(traffic.metronome(soak))
    injecting = asyncio.ensure_future(faults.faults_loop(soak, plan_faults(soak.seed, soak.requests)))
    probes = asyncio.ensure_future(traffic.probe_loop(soak, plan_probes(soak.requests)))
    t0 = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(traffic.client(soak, session) for _ in range(soak.clients)))
        while len(soak.beats) < 2 * BEATS and not metronome.done():
            await asyncio.sleep(0.5)
        soak.elapsed = time.time() - t0
        metronome.cancel()
        await asyncio.gather(metronome, return_exceptions=True)
        # india's plan ends at once (a switch to fixed): at rest like the others at the end.
        await soak.od.api("PATCH", f"/deployments/{soak.ids[NAMES.index('india')]}", {"keep_warm": "fixed"})
        await injecting
        await probes
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await faults.heal_once(soak, final=True)
    await checks.after(soak)


def summary(soak: Soak) -> str:
    by = collections.Counter(d.outcome for d in soak.done)
    deps = ", ".join(f"{name} ({PRIORITIES[n]}, {IDLE_ACTIONS[n]}"
                     + (", sglang" if ENGINES[n] == "sglang" else "")
                     + (f", {' '.join(ENGINE_ARGS[n][1:])}" if "--fail" in ENGINE_ARGS[n] else "")
                     + (f", at most {LIMITS[n]} at once" if LIMITS[n] else "")
                     + (f", keep_warm adaptive, every {METRONOME_S:g} s" if KEEP_WARM[n] == "adaptive" else "")
                     + ")"
                     for n, name in enumerate(NAMES))
    out = [f"Soak: seed {soak.seed}, scheduler {soak.scheduler}, {len(soak.done)} requests from {soak.clients} "
           f"clients over {len(NAMES)} deployments of 10 GiB on one {GPU_MIB // GIB} GiB GPU (3 fit awake at once): "
           f"{deps}; "
           f"{soak.elapsed:.0f} s; {soak.boots} engine starts, {soak.engine_requests} requests reached engines.",
           ""]
    out.append(soaklib.table("Requests by outcome", by.most_common(), ("outcome", "requests")))
    out += ["", soaklib.table("Faults injected", sorted(soak.faults.items()), ("fault", "times"))]
    out += ["", soaklib.table("Tiered warmth", soak.warmth, ("what", "times", "detail"))]
    out += ["", soaklib.table("Invariants", soak.checks, ("invariant", "result", "detail"))]
    return "\n".join(out) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ondemand-soak-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        soak = Soak(args.seed, args.requests, args.clients, work, scheduler=args.scheduler)
        try:
            await run(soak)
        finally:
            if soak.od.proc is not None and soak.od.proc.returncode is None:
                await soak.od.stop()
            for p in sim_processes(soak.journal):
                soaklib.kill_pid(p)
        text = summary(soak)
        print(text)
        if args.record:
            Path(args.record).write_text(
                "# The soak's last recorded run\n\n`make soak` (scripts/soak.py, 10,000 requests) records here; "
                "how it works: its docstring.\n\n"
                + text.replace("Soak: ", "", 1))
        if soak.failures:
            print("FAILED:\n  " + "\n  ".join(soak.failures), file=sys.stderr)
            if not args.keep:
                print(f"(run again with --keep DIR to keep the logs; ondemand's stderr: "
                      f"{soak.od.stderr_path})", file=sys.stderr)
            return 1
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--scheduler", choices=("seed", "cost"), default="seed",
                    help="the box's scheduler (the invariants hold under each)")
    ap.add_argument("--record", metavar="FILE", help="write the summary there too")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs, journal, state file)")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
