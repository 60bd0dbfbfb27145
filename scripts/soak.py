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
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soaklib  # noqa: E402
from soaklib import Ondemand, sim_command, sim_processes  # noqa: E402

NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
RANDOM = 8  # the first eight share the random traffic; india has its metronome (adaptive warmth)
METRONOME_S = 40.0  # india's idle gap between bursts of two requests (a rest must last 30 s to pay)
BEATS = 3  # the run lasts until india's third burst at least: two idle periods, each with its pre-warm
QUEUE_TIMEOUT_S = 15
DEADLINE_S = QUEUE_TIMEOUT_S + 10  # a client gives up here: past it a request hung
PHASE = 250  # requests per pair of hot deployments
FORBIDDEN = {"authorization", "cookie", "x-dgxmm-health-check", "x-forwarded-for", "forwarded", "x-real-ip"}
GIB = 1024  # MiB
GPU_MIB = 34 * GIB  # the fake box: one GPU; 3 engines of 10 GiB fit awake, with 4 asleep (1 GiB each)
SIM_ARGS = ("--startup-delay", "0.5", "--token-delay", "0.02", "--tokens", "24", "--shutdown-delay", "0.1",
            "--gpu-mib", str(10 * GIB), "--sleep-gpu-mib", str(GIB), "--host-mib", "8",
            "--sleep-delay", "0.05", "--wake-delay", "0.2")
# Per deployment, as NAMES:
PRIORITIES = ("high", "normal", "normal", "low", "normal", "low", "normal", "low", "normal")
RANK = {"low": 0, "normal": 1, "high": 2}
LIMITS = (None, None, 3, None, None, None, None, None, None)  # max_inflight
IDLE_ACTIONS = ("sleep", "sleep2", "sleep", "stop", "sleep", "sleep2", "sleep", "stop", "stop")
KEEP_WARM = ("fixed",) * RANDOM + ("adaptive",)
LEVELS = {"sleep": 1, "sleep2": 2, "stop": 0}  # the level an idle engine of that idle_action sleeps at
ENGINES = ("vllm", "vllm", "vllm", "vllm", "sglang", "vllm", "vllm", "vllm", "vllm")
ENGINE_ARGS = ((), (), ("--fail", "wake-fails"), (), ("--flavor", "sglang", "--enable-weights-cpu-backup"),
               ("--fail", "wake-fails"), ("--fail", "wake-garbage"), (), ())
# The audit texts of make-room (action ondemand_sleep): an awake engine put to sleep, or stopped
# (idle_action stop); an asleep one stopped. Then the served name of the request it was for.
MAKE_ROOM = ("Put to sleep to make room for ", "Stopped (asleep) to make room for ")
SLEEPING = "The engine is sleeping"  # the simulator's 503 to generation while asleep


@dataclass
class Plan:
    dep: int  # index into NAMES
    route: str
    stream: bool
    cookie: bool
    health: bool
    hangup: str | None  # early | headers | midstream
    delay: float
    think: float


def plan_request(seed: int, i: int) -> Plan:
    rng = random.Random(f"{seed}:req:{i}")
    hot = random.Random(f"{seed}:phase:{i // PHASE}").sample(range(RANDOM), 2)
    dep = rng.choice(hot) if rng.random() < 0.85 else rng.randrange(RANDOM)
    r = rng.random()
    route, stream = (("chat/completions", True) if r < 0.4 else ("chat/completions", False) if r < 0.75 else
                     ("completions", True) if r < 0.85 else ("completions", False) if r < 0.95 else
                     ("embeddings", False))
    h = rng.random()
    hangup = "early" if h < 0.06 else "headers" if h < 0.09 else "midstream" if h < 0.12 and stream else None
    return Plan(dep, route, stream, rng.random() < 0.1, rng.random() < 0.03, hangup,
                rng.uniform(0.01, 3.0), rng.uniform(0, 0.05))


FAULT_KINDS = ("kill_engine_streaming", "kill_engine_starting", "kill_engine_asleep", "fail_start", "rotate_key",
               "mode_switch", "admin_stop")


def plan_faults(seed: int, requests: int) -> list[tuple[int, str]]:
    """(after how many requests, which fault): each kind at least twice, about one per 80 requests,
    and the SIGKILL of ondemand at 40 %."""
    rng = random.Random(f"{seed}:faults")
    count = max(2 * len(FAULT_KINDS), requests // 80)
    kinds = list(FAULT_KINDS) * 2 + [rng.choice(FAULT_KINDS) for _ in range(count - 2 * len(FAULT_KINDS))]
    rng.shuffle(kinds)
    at = sorted(rng.randrange(requests // 20, requests * 95 // 100) for _ in kinds)
    return sorted([*zip(at, kinds), (requests * 4 // 10, "kill_ondemand")])


def plan_probes(requests: int) -> list[int]:
    """After how many requests a wake probe goes (one per 300 requests, at least 3; one after the
    other, each as long as it takes, up to 40 s): a request for an asleep deployment whose wakes
    fail, in turn (charlie, foxtrot, golf), so that each one's failing wake is seen even in a
    short run."""
    count = max(3, requests // 300)
    return [requests * k // (count + 1) for k in range(count)]


def make_room_for(text: str) -> str:
    """The served name a make-room audit text names ("... to make room for ALPHA (sleep level 1)")."""
    prefix = next(p for p in MAKE_ROOM if text.startswith(p))
    return text[len(prefix):].split()[0].rstrip(";,")


def wake_failure(row: dict[str, Any]) -> str:
    """An ondemand_wake_failed row's kind: refused (a wake call answered an error), mismatch
    (the wake check answered otherwise), unreachable (the engine did not answer at all)."""
    detail = row.get("detail") or {}
    if detail.get("result") == "mismatch":
        return "mismatch"
    return "refused" if " answered " in str(detail.get("reason")) else "unreachable"


WAKE_RESULTS = {
    "ready": "woken, checked, then served or slept again",
    "refused": "a wake call answered an error (--fail wake-fails): started cold",
    "mismatch": "woke, its wake check differed (--fail wake-garbage): started cold",
    "killed": "its engine SIGKILLed during the wake: started cold",
    "killed before its first wake call": "its engine SIGKILLed as the wake began (no engine to wake): started cold",
    "killed after": "its engine SIGKILLed once woken",
    "stopped": "a stop during the wake",
    "cut by the restart of ondemand": "",
    "cut by deploy stop": "",
}


@dataclass
class Done:
    i: int
    dep: int
    outcome: str
    start: float
    end: float
    key: str


@dataclass
class Soak:
    seed: int
    requests: int
    clients: int
    work: Path
    od: Ondemand = field(init=False)
    journal: Path = field(init=False)
    ids: list[int] = field(default_factory=list)
    key: str = ""
    keys: list[str] = field(default_factory=list)
    next_i: int = 0
    done: list[Done] = field(default_factory=list)
    views: dict[int, dict[str, Any]] = field(default_factory=dict)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    fault_times: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    start_faults: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    always_on: dict[int, list[list[float]]] = field(default_factory=lambda: collections.defaultdict(list))
    rotations: list[float] = field(default_factory=list)
    down: list[tuple[float, float]] = field(default_factory=list)  # ondemand not there
    left_behind: set[int] = field(default_factory=set)  # engine pids the killed ondemand left
    killed_starting: set[int] = field(default_factory=set)  # engine pids SIGKILLed while starting (or waking)
    killed_asleep: dict[int, tuple[int, float]] = field(default_factory=dict)  # pid: (deployment, when)
    audit_rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # the state file's, once ondemand stopped
    probes: list[tuple[str, Done]] = field(default_factory=list)  # (start | wake, the request)
    beats: list[Done] = field(default_factory=list)  # india's metronome's requests
    queue_samples: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # the views' queue, 0.2 s
    warmth: list[tuple[str, int, str]] = field(default_factory=list)
    broken: dict[int, float] = field(default_factory=dict)
    switched: dict[int, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks: list[tuple[str, str, str]] = field(default_factory=list)
    baseline: dict[str, int] = field(default_factory=dict)
    two_at_once: list[str] = field(default_factory=list)
    old_key_answers: list[str] = field(default_factory=list)
    inflight_peak: collections.Counter[int] = field(default_factory=collections.Counter)  # per deployment
    gpu_peak: int = 0  # MiB the live engines held on the GPU at most (the fake's processes, every 0.2 s)
    overfilled: list[str] = field(default_factory=list)
    state_peak: collections.Counter[str] = field(default_factory=collections.Counter)  # most at once, by state
    up: asyncio.Event = field(default_factory=asyncio.Event)  # clear while ondemand restarts

    def __post_init__(self) -> None:
        self.journal = self.work / "journal.jsonl"
        self.gpu_apps = self.work / "gpu-apps"
        box = soaklib.fake_gpu_box(self.work, [GPU_MIB])
        # The reaper looks every 2 s: an idle model is often still there when a queued request
        # looks (just after an idle timeout runs out), so make-room, and its priority rule, runs.
        self.od = Ondemand(self.work, {
            "min_idle_timeout_s": 1, "ondemand_idle_timeout_s": 2, "ondemand_queue_timeout_s": QUEUE_TIMEOUT_S,
            "reap_interval_s": 2, "metrics_interval_s": 0.5, "shutdown_grace_s": 2, "log_level": "info"},
            {"budget": {"source": "nvidia-smi", "nvidia_smi": str(soaklib.FAKE_NVIDIA_SMI), "host_reserve_gib": 0,
                        # plenty of host memory: each engine sleeps at its own level whatever is free
                        "meminfo_path": str(soaklib.FAKE_NVIDIA_SMI.parent / "meminfo")},
             "deployer": {"backend": "process", "start_timeout_s": 10, "stop_timeout_s": 3, "wake_timeout_s": 10}},
            env=box)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, "ok" if ok else "FAILED", detail))
        if not ok:
            self.failures.append(f"{name}: {detail}")

    def command(self, dep: int, *extra: str) -> list[str]:
        return sim_command(NAMES[dep].upper(), self.journal, *SIM_ARGS, *ENGINE_ARGS[dep], *extra)

    def mark(self, **fields: Any) -> None:
        """A line of ours in the simulators' journal (an administrator's stop, for the check of stops)."""
        with open(self.journal, "a") as fh:
            fh.write(json.dumps({"ev": "soak", "pid": os.getpid(), "t": time.time(), **fields}) + "\n")

    # --- set-up -----------------------------------------------------------------------------

    async def setup(self) -> None:
        self.key = self.od.write_key()
        self.keys.append(self.key)
        await self.od.start()
        for n, name in enumerate(NAMES):
            status, view = await self.od.api("POST", "/deployments", {
                "name": name, "served_name": name.upper(), "memory_gib": 10, "mode": "on_demand",
                # india's timeout bounds how long a pre-warmed engine waits for its request: 10 s.
                "idle_timeout_s": 10 if KEEP_WARM[n] == "adaptive" else 1 + n % 3, "command": self.command(n),
                "priority": PRIORITIES[n], "max_inflight": LIMITS[n], "engine": ENGINES[n],
                "idle_action": IDLE_ACTIONS[n], "gpu_count": 1, "keep_warm": KEEP_WARM[n]})
            assert status == 201, (status, view)
            self.ids.append(view["id"])
        # india's rhythm, as learned before (bursts every METRONOME_S): a restart takes it back.
        assert await self.od.stop() == 0
        rng = random.Random(f"{self.seed}:rhythm")
        soaklib.write_learned(self.od.cfg.db_path, self.ids[NAMES.index("india")],
                              [METRONOME_S - 1 + rng.uniform(-0.5, 0.5) for _ in range(40)], start_s=1.0)
        await self.od.start()
        self.baseline = {"fds_first": soaklib.fd_count(self.od.pid), "rss_first": soaklib.rss_kib(self.od.pid)}

    # --- clients ----------------------------------------------------------------------------

    async def client(self, session: aiohttp.ClientSession) -> None:
        while self.next_i < self.requests:
            await self.up.wait()  # requests sent while ondemand is down only count refusals
            i = self.next_i
            self.next_i += 1
            plan = plan_request(self.seed, i)
            await asyncio.sleep(plan.think)
            key, start = self.key, time.time()
            try:
                outcome = await asyncio.wait_for(self.exchange(session, plan, key), DEADLINE_S)
            except asyncio.TimeoutError:
                outcome = "HUNG past its deadline"
            self.done.append(Done(i, plan.dep, outcome, start, time.time(), key))
            if not outcome.startswith(("200", "hang-up")):
                # As a person (or LiteLLM's caller) would: an error is not retried at once. Without
                # this, errors answered at once (a start backoff) would use up the requests in seconds.
                await asyncio.sleep(random.uniform(0.3, 1.0))

    def body(self, plan: Plan) -> dict[str, Any]:
        model = NAMES[plan.dep].upper()
        if plan.route == "embeddings":
            return {"model": model, "input": "soak"}
        if plan.route == "completions":
            return {"model": model, "prompt": "soak", "stream": plan.stream}
        return {"model": model, "messages": [{"role": "user", "content": "soak"}], "stream": plan.stream}

    async def exchange(self, session: aiohttp.ClientSession, plan: Plan, key: str) -> str:
        headers = {"Authorization": f"Bearer {key}"}
        if plan.cookie:
            headers["Cookie"] = f"session={key}"
        if plan.health:
            headers["x-dgxmm-health-check"] = "1"
        url = f"{self.od.url}/ondemand/{self.ids[plan.dep]}/v1/{plan.route}"
        call = self.call(session, url, headers, plan)
        if plan.hangup != "early":
            return await call
        try:
            return await asyncio.wait_for(call, plan.delay)
        except asyncio.TimeoutError:
            view = self.views.get(self.ids[plan.dep], {})
            phase = (view.get("ondemand") or {}).get("phase")
            stage = ("queued" if phase == "queued" else "starting" if view.get("state") == "starting"
                     else "waiting" if view.get("state") != "ready" else "served")
            return f"hang-up while {stage}"

    async def call(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str], plan: Plan) -> str:
        try:
            async with session.post(url, json=self.body(plan), headers=headers) as r:
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
                return await self.read_stream(r, plan)
        except aiohttp.ClientConnectorError:
            return "ondemand down (connection refused)"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return "connection lost before the answer"
        except aiohttp.ClientPayloadError:
            return "stream cut"

    async def read_stream(self, r: aiohttp.ClientResponse, plan: Plan) -> str:
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

    # --- watching ---------------------------------------------------------------------------

    async def poll(self) -> None:
        """The views every 0.2 s (for the hang-up stages and the faults' targets), what the
        engines hold on the GPU (the fake nvidia-smi's processes) as often, and every second
        whether two engines of one deployment ever run at once."""
        n = 0
        while True:
            with contextlib.suppress(Exception):
                status, views = await self.od.api("GET", "/deployments")
                if status == 200:
                    self.views = {v["id"]: v for v in views}
                    self.queue_samples.append((time.time(), frozenset(
                        v["id"] for v in views if v["ondemand"].get("queue_position"))))
                    for d, i in enumerate(self.ids):
                        if i in self.views:
                            self.inflight_peak[d] = max(self.inflight_peak[d], self.views[i]["ondemand"]["inflight"])
                    for state, count in collections.Counter(v["state"] for v in views).items():
                        self.state_peak[state] = max(self.state_peak[state], count)
            self.look_at_gpus()
            n += 1
            if n % 5 == 0:
                per_model = collections.Counter(p["model"] for p in sim_processes(self.journal).values())
                self.two_at_once += [f"{m} x{c} at {time.time():.1f}" for m, c in per_model.items() if c > 1]
            await asyncio.sleep(0.2)

    def look_at_gpus(self) -> None:
        """The GPU is never overfilled: what the live engines hold (as the fake nvidia-smi
        counts it) never exceeds its memory."""
        for gpu, held in soaklib.gpu_claims(self.gpu_apps).items():
            used = sum(held.values())
            self.gpu_peak = max(self.gpu_peak, used)
            if used > GPU_MIB:
                models = {p: info["model"] for p, info in sim_processes(self.journal).items()}
                self.overfilled.append(f"GPU {gpu}: {used} MiB at {time.time():.1f} ("
                                       + ", ".join(f"{models.get(p, p)} {m}" for p, m in sorted(held.items())) + ")")

    # --- faults -----------------------------------------------------------------------------

    async def faults_loop(self, plan: list[tuple[int, str]]) -> None:
        for at, kind in plan:
            while self.next_i < at:
                await asyncio.sleep(0.05)
            if len(self.done) >= self.requests:
                break  # the clients are done: a fault now would test nothing
            try:
                await getattr(self, kind)()
            except Exception as exc:  # a fault that could not be made is reported, not fatal
                self.faults[f"{kind}: could not ({type(exc).__name__}: {exc})"[:90]] += 1

    def pick(self, ok: Any) -> int | None:
        """A deployment (index) whose view satisfies ``ok``, at random."""
        found = [n for n, i in enumerate(self.ids[:RANDOM]) if (v := self.views.get(i)) and ok(v)]
        return random.choice(found) if found else None

    async def wait_pick(self, ok: Any, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.pick(ok)
            if n is not None:
                return n
            await asyncio.sleep(0.02)
        return None

    def engine_pid(self, n: int) -> int | None:
        pids = [p for p, info in sim_processes(self.journal).items() if info["model"] == NAMES[n].upper()]
        return pids[0] if pids else None

    async def kill_engine_streaming(self) -> None:
        n = await self.wait_pick(lambda v: v["state"] == "ready" and v["ondemand"]["inflight"] > 0, 10)
        pid = None if n is None else self.engine_pid(n)
        if n is None or pid is None:
            self.faults["engine SIGKILL mid-stream: no busy engine found"] += 1
            return
        self.fault_times[n].append(time.time())
        soaklib.kill_pid(pid)
        self.faults["engine SIGKILL mid-stream"] += 1

    async def kill_engine_starting(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            n = self.pick(lambda v: v["state"] == "starting")
            pid = None if n is None else self.engine_pid(n)
            if n is not None and pid is not None and self.views[self.ids[n]]["state"] == "starting":
                self.fault_times[n].append(time.time())
                self.start_faults[n].append(time.time())
                self.killed_starting.add(pid)
                soaklib.kill_pid(pid)
                self.faults["engine SIGKILL while starting"] += 1
                return
            await asyncio.sleep(0.01)
        self.faults["engine SIGKILL while starting: no start found"] += 1

    async def kill_engine_asleep(self) -> None:
        """SIGKILL the engine of an asleep deployment (looked at again just before): ondemand must
        see it exit (the deployment failed, BEHAVIOUR.md "Watchdog") and start it cold on the
        next request, never leave it asleep with no engine."""
        n = await self.wait_pick(lambda v: v["state"] == "asleep", 10)
        pid = None if n is None else self.engine_pid(n)
        if n is not None and pid is not None:
            status, view = await self.od.api("GET", f"/deployments/{self.ids[n]}")
            if status == 200 and view["state"] == "asleep":
                self.fault_times[n].append(time.time())
                self.killed_asleep[pid] = (n, time.time())
                soaklib.kill_pid(pid)
                self.faults["engine SIGKILL while asleep"] += 1
                return
        self.faults["engine SIGKILL while asleep: no asleep engine found"] += 1

    async def fail_start(self) -> None:
        n = await self.wait_pick(lambda v: v["state"] in ("stopped", "failed") and v["mode"] == "on_demand"
                                 and not v.get("pending_mode"), 10)
        if n is None or n in self.broken:
            self.faults["failing start: no stopped deployment"] += 1
            return
        self.start_faults[n].append(time.time())
        self.broken[n] = time.time()
        rc, _, err = await self.od.cli("deploy", "set", str(self.ids[n]), "--command",
                                       shlex.join(self.command(n, "--fail", "exit-at-start")))
        if rc != 0:
            del self.broken[n]
            self.faults[f"deploy set (failing command) refused: {err.strip()[-60:]}"] += 1
            return
        self.faults["deploy set: a command that fails at start"] += 1

    async def rotate_key(self) -> None:
        old = self.key
        rc, _, err = await self.od.cli("key", "rotate")
        if rc != 0:
            self.faults[f"key rotate failed: {err.strip()[-60:]}"] += 1
            return
        self.rotations.append(time.time())
        self.key = self.od.key()
        self.keys.append(self.key)
        self.faults["key rotate (CLI)"] += 1
        await asyncio.sleep(1.5)  # the gateway looks at the key file at most once a second
        async with aiohttp.ClientSession() as s:
            url = f"{self.od.url}/ondemand/{self.ids[0]}/v1/chat/completions"
            async with s.post(url, json={"model": "ALPHA", "messages": []},
                              headers={"Authorization": f"Bearer {old}"}) as r:
                code = (await r.json(content_type=None) or {}).get("error", {}).get("code")
        self.old_key_answers.append(f"{r.status} {code}")

    async def mode_switch(self) -> None:
        n = await self.wait_pick(lambda v: v["mode"] == "on_demand" and v["state"] == "ready", 10)
        if n is None or n in self.broken:
            self.faults["mode set always_on: no ready deployment"] += 1
            return
        self.always_on[n].append([time.time(), float("inf")])
        rc, _, err = await self.od.cli("mode", "set", str(self.ids[n]), "always_on")
        self.switched[n] = time.time()
        self.faults["mode set always_on (CLI)" if rc == 0 else f"mode set refused: {err.strip()[-50:]}"] += 1

    async def admin_stop(self) -> None:
        n = await self.wait_pick(lambda v: v["state"] == "ready" and v["ondemand"]["inflight"] > 0, 10)
        if n is None:
            self.faults["deploy stop: no busy deployment"] += 1
            return
        self.mark(admin_stop=NAMES[n].upper())
        self.fault_times[n].append(time.time())
        rc, _, err = await self.od.cli("deploy", "stop", str(self.ids[n]))
        self.fault_times[n].append(time.time())
        self.faults["deploy stop of a busy deployment (CLI)" if rc == 0 else f"deploy stop: {err[-50:]}"] += 1

    async def kill_ondemand(self) -> None:
        t0 = time.time()
        self.up.clear()
        await self.od.kill()
        self.faults["ondemand SIGKILL, then restart"] += 1
        left = sim_processes(self.journal)
        self.left_behind |= set(left)
        await asyncio.sleep(0.5)
        await self.od.start()
        self.baseline.update(fds_restart=soaklib.fd_count(self.od.pid), rss_restart=soaklib.rss_kib(self.od.pid))
        alive = [p for p in left if p in sim_processes(self.journal)]
        self.check("engines left by the killed ondemand are killed by the restarted one",
                   bool(left) and not alive, f"{len(left)} left behind (own session, pipe gone), "
                                             f"{len(alive)} alive once the new one answers")
        self.down.append((t0, time.time()))
        self.up.set()

    async def healer(self) -> None:
        """Now and then, an administrator puts things back: a failing command is set back
        (`deploy set`), a start backoff is cleared (`deploy set --idle-timeout`), a switch to
        always on is switched back (`mode set on_demand`)."""
        while True:
            await asyncio.sleep(2)
            try:
                await self.heal_once(final=False)
            except Exception as exc:  # ondemand restarting, a slow command: next time
                self.faults[f"healer: {type(exc).__name__}"] += 1

    async def heal_once(self, final: bool) -> None:
        now = time.time()
        for n, since in list(self.switched.items()):
            if final or now - since > 5:
                rc, _, _ = await self.od.cli("mode", "set", str(self.ids[n]), "on_demand")
                if rc == 0:
                    del self.switched[n]
                    for interval in self.always_on[n]:
                        interval[1] = min(interval[1], time.time())
                    self.faults["mode set on_demand (CLI)"] += 1
        for n, i in enumerate(self.ids):
            v = self.views.get(i, {})
            if v.get("state") not in ("stopped", "failed"):
                continue
            if n in self.broken and (final or now - self.broken[n] > 4):
                rc, _, _ = await self.od.cli("deploy", "set", str(i), "--command", shlex.join(self.command(n)))
                if rc == 0:
                    del self.broken[n]
                    self.faults["deploy set: the working command back"] += 1
            elif (v.get("ondemand") or {}).get("backoff_until"):
                timeout = 1 + (v.get("idle_timeout_s") or 0) % 3  # another value than now
                rc, _, err = await self.od.cli("deploy", "set", str(i), "--idle-timeout", str(timeout))
                self.faults["deploy set --idle-timeout (clears a start backoff)" if rc == 0 else
                            f"deploy set --idle-timeout refused: {err.strip()[-60:]}"] += 1

    async def probe_loop(self, plan: list[int]) -> None:
        # The deployments whose wakes fail, and one sound level-2 sleeper (bravo): each run sees
        # wakes of every kind, whatever its traffic happened to wake.
        failing = [n for n, extra in enumerate(ENGINE_ARGS) if "--fail" in extra] + [NAMES.index("bravo")]
        for k, at in enumerate(plan):
            while self.next_i < at:
                await asyncio.sleep(0.05)
            # The one least often woken by a probe yet, in turn, but not one of the hot pair (busy,
            # it would not fall asleep): up to 30 s for the pair to change when they all are.
            woken = collections.Counter(d.dep for kind, d in self.probes if kind == "wake" and d.outcome == "200")
            turn = sorted((failing[(k + j) % len(failing)] for j in range(len(failing))), key=lambda m: woken[m])
            least = [m for m in turn if woken[m] == woken[turn[0]]]
            deadline = time.monotonic() + 30
            while True:
                hot = set(random.Random(f"{self.seed}:phase:{self.next_i // PHASE}").sample(range(RANDOM), 2))
                n = next((m for m in least if m not in hot), None)
                if n is not None or time.monotonic() > deadline or len(self.done) >= self.requests:
                    break
                await asyncio.sleep(0.5)
            n = least[0] if n is None else n
            for _ in range(3):  # again when a fault cut it (the restart of ondemand): each probe is needed
                try:
                    if await self.wake_probe(n):
                        break
                except Exception as exc:
                    self.faults[f"wake probe: could not ({type(exc).__name__}: {exc})"[:90]] += 1

    async def wake_probe(self, n: int) -> bool:
        """A request for ``n`` once it is asleep: started first by a request if it is stopped,
        then left idle until the reaper puts it to sleep. Its wake fails (or, for bravo, works),
        and the request must be answered all the same (a failed wake's by the engine started
        cold). Whether it was (200)."""
        deadline, started = time.monotonic() + 40, False
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
            while time.monotonic() < deadline:
                await self.up.wait()
                v = self.views.get(self.ids[n], {})
                state = v.get("state")
                if state == "asleep" and not v.get("pending_mode"):
                    done = await self.probe(session, n)
                    self.probes.append(("wake", done))
                    self.faults[f"wake probe: a request for asleep {NAMES[n]}"] += 1
                    return done.outcome == "200"
                if state in ("stopped", "failed") and not started and v.get("mode") == "on_demand":
                    started = True
                    self.probes.append(("start", await self.probe(session, n)))
                await asyncio.sleep(0.1)
        self.faults[f"wake probe: {NAMES[n]} never asleep within 40 s"] += 1
        return False

    async def probe(self, session: aiohttp.ClientSession, n: int) -> Done:
        plan = Plan(n, "chat/completions", False, False, False, None, 0.0, 0.0)
        key, start = self.key, time.time()
        try:
            outcome = await asyncio.wait_for(self.exchange(session, plan, key), DEADLINE_S)
        except asyncio.TimeoutError:
            outcome = "HUNG past its deadline"
        return Done(-1, n, outcome, start, time.time(), key)

    # --- the run ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.setup()
        self.up.set()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a hang-up closes its own connection
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        tasks = [asyncio.ensure_future(self.poll()), asyncio.ensure_future(self.healer())]
        metronome = asyncio.ensure_future(self.metronome())
        faults = asyncio.ensure_future(self.faults_loop(plan_faults(self.seed, self.requests)))
        probes = asyncio.ensure_future(self.probe_loop(plan_probes(self.requests)))
        t0 = time.time()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self.client(session) for _ in range(self.clients)))
            while len(self.beats) < 2 * BEATS and not metronome.done():
                await asyncio.sleep(0.5)
            self.elapsed = time.time() - t0
            metronome.cancel()
            await asyncio.gather(metronome, return_exceptions=True)
            # india's plan ends at once (a switch to fixed): at rest like the others at the end.
            await self.od.api("PATCH", f"/deployments/{self.ids[NAMES.index('india')]}", {"keep_warm": "fixed"})
            await faults
            await probes
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.heal_once(final=True)
        await self.after()

    async def metronome(self) -> None:
        """india's rhythm: a burst of two requests, METRONOME_S after the last one's end (its own
        connections)."""
        n = NAMES.index("india")
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            while True:
                for _ in range(2):
                    await self.up.wait()
                    self.beats.append(await self.probe(session, n))
                # From the burst's end: the idle gap is the rhythm, however long a cold start took.
                await asyncio.sleep(METRONOME_S)

    def attributed(self, d: Done) -> bool:
        """Whether an outcome other than an answer is explained by a fault (or is always allowed)."""
        o, lo, hi = d.outcome, d.start - 2, d.end + 2
        near = any(lo <= t <= hi for t in self.fault_times[d.dep])
        down = any(a <= hi and b >= lo for a, b in self.down)
        if o.startswith(("200", "hang-up")) and "not an answer" not in o and "not JSON" not in o \
                or "ondemand_queue_timeout" in o:
            return True
        if o.startswith(("ondemand down", "connection lost")):
            return down
        if o in ("stream cut", "502 ondemand_upstream_error", "stream error ondemand_upstream_error") \
                or "ondemand_stopped" in o:
            return near or down
        if "start_failed" in o or o == "503 ondemand_not_ready":
            return any(t <= d.end for t in self.start_faults[d.dep] + self.fault_times[d.dep])
        if "not_on_demand" in o:
            return self.always_on_during(d) >= 1
        if "does_not_fit" in o:  # two switched to always on leave no room for the on-demand ones
            return self.always_on_during(d, any_dep=True) >= 2
        if o == "401 invalid_api_key":
            return any(d.start - 3 <= t <= d.end + 1 for t in self.rotations)
        if "ondemand_busy" in o:  # 429 at its max_inflight (in a stream: queued, then over the limit)
            return LIMITS[d.dep] is not None
        return False

    def always_on_during(self, d: Done, any_dep: bool = False) -> int:
        """How many deployments (``d``'s alone, or any) were switched to always on during ``d``."""
        deps = range(len(NAMES)) if any_dep else [d.dep]
        return sum(any(a - 1 <= d.end and b + 1 >= d.start for a, b in self.always_on[n]) for n in deps)

    async def after(self) -> None:
        """The invariants, once every client is done."""
        hung = [d for d in self.done if d.outcome.startswith("HUNG")]
        self.check(f"no request hung past its deadline ({DEADLINE_S} s: queue timeout + 10 s)", not hung,
                   f"{len(hung)} hung" if hung else f"slowest {max(d.end - d.start for d in self.done):.1f} s")
        odd = collections.Counter(d.outcome for d in [*self.done, *self.beats] if not self.attributed(d))
        self.check("every answer is an answer, a hang-up, a queue timeout or explained by a fault",
                   not odd, ", ".join(f"{o} x{c}" for o, c in odd.most_common(6)))
        asleep = collections.Counter(d.outcome for d in self.done if "asleep engine" in d.outcome)
        self.check(f'no client got an asleep engine\'s 503 ("{SLEEPING}")', not asleep,
                   ", ".join(f"{o} x{c}" for o, c in asleep.items()))
        garbage = collections.Counter(NAMES[d.dep] for d in self.done if "garbage" in d.outcome)
        answered = collections.Counter(NAMES[d.dep] for d in self.done if d.outcome.startswith("200"))
        failing = [n for n, extra in enumerate(ENGINE_ARGS) if "--fail" in extra]
        self.check("no client got garbage (a wake whose weights did not come back is caught by its check)",
                   not garbage, str(dict(garbage)) if garbage else "answers of the engines whose wakes fail: "
                   + ", ".join(f"{NAMES[n]} {answered[NAMES[n]]}" for n in failing))
        wakes = [d for kind, d in self.probes if kind == "wake"]
        odd_probes = collections.Counter(d.outcome for _, d in self.probes if not self.attributed(d))
        self.check("every wake probe (a request for an asleep deployment) answered",
                   bool(wakes) and not odd_probes, ", ".join(f"{o} x{c}" for o, c in odd_probes.items()) or
                   ", ".join(f"{NAMES[d.dep]} {d.outcome}" for d in wakes))
        self.check("a rotated-out key is refused (401, not counted for the rate limit)",
                   bool(self.old_key_answers) and all(a == "401 invalid_api_key" for a in self.old_key_answers),
                   ", ".join(collections.Counter(self.old_key_answers)))
        self.check("never two engines of one deployment at once (/proc, every second)", not self.two_at_once,
                   "; ".join(self.two_at_once[:3]))
        self.check(f"the GPU never overfilled ({GPU_MIB // GIB} GiB; the fake nvidia-smi's processes every 0.2 s)",
                   not self.overfilled, "; ".join(self.overfilled[:2]) or
                   f"at most {self.gpu_peak / GIB:.0f} GiB held; at most {self.state_peak['ready']} ready and "
                   f"{self.state_peak['asleep']} asleep at once")
        await self.quiet_checks()
        await self.priority_checks()
        self.prewarm_checks()
        rc = await self.od.stop()
        self.check("ondemand stops on SIGTERM with exit code 0", rc == 0, f"exit code {rc}")
        await asyncio.sleep(0.5)
        orphans = sim_processes(self.journal)
        self.check("no engine process left after ondemand stops (asleep ones too)", not orphans, str(orphans)[:200])
        for p in orphans:
            soaklib.kill_pid(p)
        verdict = soaklib.integrity(self.od.cfg.db_path)
        self.check("the state file passes PRAGMA integrity_check", verdict == "ok", verdict[:200])
        secrets = [*self.keys, self.od.token()]
        errors = [line for line in self.od.stderr_path.read_text().splitlines()
                  if " ERROR " in line or line.startswith("Traceback")]
        self.check("no ERROR line or traceback in ondemand's log", not errors, "; ".join(errors[:3])[:300])
        hits = soaklib.secrets_found(soaklib.log_files(self.work), secrets)
        self.check(f"no secret ({len(self.keys)} keys, the admin token) in any log", not hits,
                   "; ".join(hits[:4]) or f"{len(soaklib.log_files(self.work))} files read")
        self.journal_checks()

    async def quiet_checks(self) -> None:
        """With no client left: nothing in flight or queued; every deployment's state agrees
        with its engine; then (engines put to sleep or stopped) again, and the gateway's file
        descriptors and memory back near where they were."""
        deadline = time.monotonic() + 5
        while True:
            _, views = await self.od.api("GET", "/deployments")
            _, host = await self.od.api("GET", "/host")
            busy = {v["name"]: (v["ondemand"]["inflight"], v["ondemand"]["queued"]) for v in views
                    if v["ondemand"]["inflight"] or v["ondemand"]["queued"]}
            if (not busy and not host["ondemand"]["queued"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        self.check("in flight and queued are 0 everywhere (deployment views, host)",
                   not busy and not host["ondemand"]["queued"], f"{busy} host queued {host['ondemand']['queued']}")
        await self.agreement_check("as the clients end")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, views = await self.od.api("GET", "/deployments")
            if all(self.at_rest(v) for v in views):
                break
            await asyncio.sleep(0.2)
        states = {v["name"]: v["state"] + (f" {v['sleep_level']}" if v["state"] == "asleep" else "") for v in views}
        self.check("every idle engine put to sleep at its level (sleep, sleep2) or stopped by the reaper",
                   all(self.at_rest(v) for v in views), ", ".join(f"{k} {v}" for k, v in states.items()))
        await self.agreement_check("at rest")
        await asyncio.sleep(1)
        fds, rss = soaklib.fd_count(self.od.pid), soaklib.rss_kib(self.od.pid)
        # Idle keep-alive connections to the engines still running (asleep) are no leak: they
        # end with the engine, or when it closes them (the simulator, as aiohttp, after 75 s;
        # vLLM's and SGLang's uvicorn after 5 s). They are counted apart.
        # And each engine still running holds two: its output's pipe and its log file.
        ports = {info["port"] for info in sim_processes(self.journal).values()}
        kept = sum(1 for port in soaklib.tcp_peer_ports(self.od.pid) if port in ports)
        base_fds, base_rss = self.baseline["fds_restart"], self.baseline["rss_restart"]
        kinds = ", ".join(f"{k} {c}" for k, c in sorted(soaklib.fd_kinds(self.od.pid).items(), key=lambda x: -x[1]))
        self.check("open fds back near their value after the restart (+10), but what asleep engines hold",
                   fds - kept - 2 * len(ports) <= base_fds + 10,
                   f"{base_fds} after restart, {fds} at the end: {kept} idle connections to and 2 each for "
                   f"{len(ports)} asleep engines (first process: {self.baseline['fds_first']}; at the end {kinds})")
        self.check("RSS back near its value after the restart (+64 MiB)", rss <= base_rss + 65536,
                   f"{base_rss // 1024} MiB after restart, {rss // 1024} MiB at the end")
        self.rss = (base_rss, rss)

    def at_rest(self, view: dict[str, Any]) -> bool:
        """Stopped or failed; or asleep at its deployment's level (never one that stops when idle)."""
        if view["state"] in ("stopped", "failed"):
            return True
        level = LEVELS[IDLE_ACTIONS[NAMES.index(view["name"])]]
        return view["state"] == "asleep" and level > 0 and view["sleep_level"] == level

    async def agreement_check(self, when: str) -> None:
        """Every deployment's state agrees with its engine: an asleep one's engine sleeps at its
        level (``/_sim/state``; vLLM's ``/is_sleeping`` true), a ready one's is awake
        (``/is_sleeping`` false), a stopped or failed one has no engine process. A view is
        compared only when it did not change around the engine's answer (the reaper may act
        meanwhile); a disagreement that lasts 10 s fails."""
        checked: collections.Counter[str] = collections.Counter()
        wrong: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for n, dep_id in enumerate(self.ids):
                deadline, last = time.monotonic() + 10, "no stable view"
                while time.monotonic() < deadline:
                    agrees, last = await self.agrees(http, n, dep_id)
                    if agrees:
                        checked[last] += 1
                        break
                    await asyncio.sleep(0.2)  # the view moved, or they disagree: look again
                else:
                    wrong.append(f"{NAMES[n]}: {last}")
        self.check(f"every deployment's state agrees with its engine ({when})", not wrong,
                   "; ".join(wrong[:3]) or ", ".join(f"{k} x{c}" for k, c in sorted(checked.items())))

    async def agrees(self, http: aiohttp.ClientSession, n: int, dep_id: int) -> tuple[bool | None, str]:
        """(None: the view moved, look again; or whether it agrees, and what was seen)."""
        def view() -> Any:
            return self.od.api("GET", "/deployments")
        _, views = await view()
        before = next(v for v in views if v["id"] == dep_id)
        state = before["state"]
        engines = [p for p, info in sim_processes(self.journal).items() if info["model"] == NAMES[n].upper()]
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

    async def priority_checks(self) -> None:
        """From the audit rows and the request log: no make-room sleep or stop ever took a
        deployment of higher priority than the request it was made for, and each was made
        while a request for that one waited; the limited deployment never served more than its
        limit."""
        rows: list[dict[str, Any]] = []
        before = ""
        while True:
            status, page = await self.od.api("GET", f"/audit?limit=1000{before}")
            if status != 200 or not page:
                break
            rows += page
            before = f"&before={page[-1]['id']}"
        self.audit_rows = rows
        by_name = {name.upper(): n for n, name in enumerate(NAMES)}
        by_id = {i: n for n, i in enumerate(self.ids)}
        stops = [r for r in rows if r["action"] == "ondemand_sleep" and r["text"].startswith(MAKE_ROOM)]
        asked = [*self.done, *(d for _, d in self.probes), *self.beats]
        wrong, unasked = [], []
        for r in stops:
            victim, requester = by_id[r["deployment_id"]], by_name[make_room_for(r["text"])]
            if RANK[PRIORITIES[victim]] > RANK[PRIORITIES[requester]]:
                wrong.append(f"{NAMES[victim]} ({PRIORITIES[victim]}) for {NAMES[requester]} "
                             f"({PRIORITIES[requester]}) at {r['at']:.1f}")
            if not any(d.dep == requester and d.start - 1 <= r["at"] <= d.end + 2 for d in asked):
                unasked.append(f"{NAMES[victim]} for {NAMES[requester]} at {r['at']:.1f}")
        classes = collections.Counter(f"{PRIORITIES[by_id[r['deployment_id']]]} for "
                                      f"{PRIORITIES[by_name[make_room_for(r['text'])]]}" for r in stops)
        self.check("no make-room sleep or stop took a deployment of higher priority than its request (audit rows)",
                   bool(stops) and not wrong,
                   "; ".join(wrong[:3]) or f"{len(stops)} make-room sleeps and stops: "
                   + ", ".join(f"{k} x{c}" for k, c in sorted(classes.items())))
        self.check("every make-room sleep or stop was made while a request for its model waited (request log)",
                   not unasked, "; ".join(unasked[:3]) or f"{len(stops)} matched")
        busy = sum(d.outcome.endswith("ondemand_busy") for d in self.done)
        over = {NAMES[n]: self.inflight_peak[n] for n, limit in enumerate(LIMITS)
                if limit is not None and self.inflight_peak[n] > limit}
        self.check("a deployment with max_inflight never served more at once (views every 0.2 s)", not over,
                   str(over) if over else f"{busy} refused 429 ondemand_busy; peaks "
                   + ", ".join(f"{NAMES[n]} {self.inflight_peak[n]}" for n in range(len(NAMES))))

    def prewarm_checks(self) -> None:
        """Adaptive warmth (india's pre-warms, from the audit rows, the metronome's requests and
        the views' queue every 0.2 s): a pre-warm takes memory from nobody."""
        rows, beats = self.audit_rows, self.beats
        prewarms = [r for r in rows if r["action"] == "ondemand_prewarm"]
        for_india = [r for r in rows if r["action"] == "ondemand_sleep" and r["text"].startswith(MAKE_ROOM)
                     and make_room_for(r["text"]) == "INDIA"]
        unasked = [f"{r['text'][:40]} at {r['at']:.1f}" for r in for_india
                   if not any(d.start - 1 <= r["at"] <= d.end + 2 for d in beats)]
        self.check("a pre-warm never made room: no sleep or stop for india but while a request for it was out",
                   not unasked, "; ".join(unasked[:3]) or f"{len(for_india)} made for india's requests")
        queued = []
        for r in prewarms:
            around = [q for t, q in self.queue_samples if r["at"] - 1 <= t <= r["at"] + 1]
            if len(around) >= 3 and frozenset.intersection(*around):
                queued.append(f"at {r['at']:.1f} ({', '.join(sorted(map(str, frozenset.intersection(*around))))})")
        india = self.ids[NAMES.index("india")]
        victim = sum(1 for r in rows if r["action"] == "ondemand_sleep" and r["deployment_id"] == india
                     and r["text"].startswith(MAKE_ROOM))
        rests = sorted(r["at"] for r in rows if r["action"] == "ondemand_sleep" and r["deployment_id"] == india)
        # A hit: one of india's requests came before its engine was put away again.
        hits = sum(1 for r in prewarms if any(r["at"] <= d.start < min([t for t in rests if t > r["at"]] or [1e18])
                                              for d in beats))
        # What the pre-warms that found no free memory left in ondemand's log (control/effects.py).
        no_room = self.od.stderr_path.read_text().count(f"no pre-warm of deployment {india}: ")
        self.check("no pre-warm began while a request waited for memory (the queue the second around it); "
                   "pre-warms were tried", bool(prewarms or no_room) and not queued,
                   "; ".join(queued[:3]) or f"{len(prewarms)} pre-warms of india ({hits} hits), {no_room} found no "
                   f"free memory; {victim} times make-room's victim")

    def journal_checks(self) -> None:
        events = soaklib.read_journal(self.journal)
        reqs = [e for e in events if e["ev"] == "req"]
        leaked = collections.Counter(h for e in reqs for h in e["h"] if h in FORBIDDEN)
        self.check("no Authorization, Cookie, health-check or forwarding header reached an engine", not leaked,
                   f"{dict(leaked)} in {len(reqs)} engine requests" if leaked else f"{len(reqs)} engine requests")
        stops = [e for e in events if e["ev"] == "soak" and "admin_stop" in e]
        busy = [e for e in events if e["ev"] == "sigterm" and e["inflight"] > 0]
        unexcused = [e for e in busy if not any(s["admin_stop"] == e["model"] and e["t"] - 15 <= s["t"] <= e["t"]
                                                for s in stops)]
        sigterms = sum(e["ev"] == "sigterm" for e in events)
        self.check("no engine stopped with a request in flight, but by an administrator's deploy stop",
                   not unexcused, f"{sigterms} SIGTERMs; busy: {len(busy)} after deploy stop, "
                                  f"{len(unexcused)} otherwise {[(e['model'], e['inflight']) for e in unexcused][:4]}")
        self.boots = sum(e["ev"] == "boot" for e in events)
        self.engine_requests = len(reqs)
        self.events = soaklib.rows(self.od.cfg.db_path, "SELECT at, deployment_id, text FROM events ORDER BY id")
        self.warmth_checks(soaklib.WarmthJournal(events), stops)

    def warmth_checks(self, wj: soaklib.WarmthJournal, admin_stops: list[dict[str, Any]]) -> None:
        """Sleeps and wakes, from the engines' journal and the audit rows (BEHAVIOUR.md, "Tiered
        warmth"); and the counts of the summary's warmth table."""
        self.check("no engine put to sleep with a generation request in flight (journal: sleep call vs req/end)",
                   not wj.busy_sleeps, "; ".join(wj.busy_sleeps[:3]) or f"{len(wj.sleeps)} sleeps")
        self.check("no generation request reached an asleep engine (journal: between its sleep call and its wake)",
                   not wj.asleep_served, "; ".join(wj.asleep_served[:3]) or f"{len(wj.sleeps)} sleeps")
        levels = collections.Counter((model, level) for _, model, _, level in wj.sleeps)
        off = [f"{m} at level {lv} x{c}" for (m, lv), c in sorted(levels.items())
               if LEVELS[IDLE_ACTIONS[NAMES.index(m.lower())]] != lv]
        self.check("every engine slept at its deployment's level (sleep 1, sleep2 2; stop never)", not off,
                   "; ".join(off[:4]) or ", ".join(f"{m.lower()} {lv} x{c}" for (m, lv), c in sorted(levels.items())))
        # Each audited sleep (ondemand_sleep into asleep) matched with the engine's sleep line of
        # that level (within 5 s after); a sleep cut by the SIGKILL of ondemand needs none.
        by_id = {i: NAMES[n].upper() for n, i in enumerate(self.ids)}
        ordered = sorted((r["at"], by_id[r["deployment_id"]], r["detail"]["level"]) for r in self.audit_rows
                         if r["action"] == "ondemand_sleep" and (r.get("detail") or {}).get("to") == "asleep")
        lines = sorted((t, model, level) for _, model, t, level in wj.sleeps)
        unmatched = []
        for at, model, level in ordered:
            hit = next((x for x in lines if x[1] == model and x[2] == level and at - 0.5 <= x[0] <= at + 5), None)
            if hit is not None:
                lines.remove(hit)
            elif not any(a - 5 <= at <= b for a, b in self.down) and not any(
                    NAMES[n].upper() == model and at - 1 <= when <= at + 5 for n, when in self.killed_asleep.values()):
                # (an engine the soak SIGKILLed as it was marked asleep never got its sleep call)
                unmatched.append(f"{model.lower()} level {level} audited at {at:.1f}, no sleep line")
        unmatched += [f"{model.lower()} level {level} at {t:.1f}, not audited" for t, model, level in lines]
        self.check("every sleep ondemand audited reached its engine, and every engine's sleep was audited",
                   not unmatched, "; ".join(unmatched[:3]) or f"{len(ordered)} audited, {len(wj.sleeps)} slept")
        # The wakes: a wake cut by the SIGKILL of ondemand (its restart stops the engine) or by an
        # administrator's deploy stop is no failed wake; every other failing one must be audited.
        def cut(w: soaklib.Wake) -> str | None:
            if w.pid in self.left_behind and (w.result in ("killed", "killed after", "stopped") or
                                              any(w.end_t >= a - 0.5 for a, _ in self.down)):
                return "cut by the restart of ondemand"
            # The mark is written as the command line starts, a second or so before the stop.
            if any(s["admin_stop"] == w.model and w.t - 3 <= s["t"] <= w.end_t for s in admin_stops):
                return "cut by deploy stop"
            return None
        results = collections.Counter(cut(w) or w.result for w in wj.wakes)
        failing = [w for w in wj.wakes if w.failed and cut(w) is None]
        # An asleep engine SIGKILLed by the soak while its deployment was starting was being
        # woken, before the wake's first call: the wake finds no engine, and fails. One killed
        # asleep may have been too, if a request came between the last look and the kill.
        for pid, model, t in wj.vanished_asleep:
            waking = pid in self.killed_starting
            if pid in self.killed_asleep:
                n, when = self.killed_asleep[pid]
                waking = any(r["action"] == "ondemand_wake_failed" and r["deployment_id"] == self.ids[n]
                             and "no engine to wake" in str(r["detail"].get("reason"))
                             and when - 1 <= r["at"] <= when + 10 for r in self.audit_rows)
            if waking and pid not in self.left_behind:
                w = soaklib.Wake(pid, model, t, 0)
                w.close("killed", t)
                failing.append(w)
                results["killed before its first wake call"] += 1
        # An asleep engine SIGKILLed: its deployment failed (exited while asleep), never left asleep.
        seen_failed = []
        for n, when in self.killed_asleep.values():
            later = [e["text"] for e in self.events if e["deployment_id"] == self.ids[n] and e["at"] >= when]
            if later and later[0].startswith("Woken for a request"):
                later = later[1:]  # a request came as it was killed: the wake
            seen_failed.append((NAMES[n], later[0] if later else "nothing"))
        wrong = [f"{name}: {text}" for name, text in seen_failed
                 if not text.startswith(("asleep → failed: engine exited", "wake from sleep",
                                         "the engine's sleep failed"))]  # killed during its sleep call
        self.check("an asleep engine SIGKILLed: its deployment failed (or its wake, just begun, failed)",
                   not wrong, "; ".join(wrong[:3]) or
                   ", ".join(f"{name}: {text[:40]}" for name, text in seen_failed) or "none was found asleep")
        audited = [r for r in self.audit_rows if r["action"] == "ondemand_wake_failed"]
        per_model_audit = collections.Counter(by_id[r["deployment_id"]] for r in audited)
        per_model_journal = collections.Counter(w.model for w in failing)
        kinds_audit = collections.Counter(wake_failure(r) for r in audited)
        kinds_journal = collections.Counter({"refused": "refused", "mismatch": "mismatch", "killed": "unreachable"}
                                            [w.result] for w in failing)
        self.check("ondemand_wake_failed audit rows = the failing wakes the journal shows (per deployment, per kind)",
                   per_model_audit == per_model_journal and kinds_audit == kinds_journal,
                   f"audit {dict(sorted(per_model_audit.items()))} {dict(kinds_audit)}; journal "
                   f"{dict(sorted(per_model_journal.items()))} {dict(kinds_journal)}")
        expect = {NAMES[n].upper(): ("refused" if "wake-fails" in extra else "mismatch" if "wake-garbage" in extra
                                     else "ready") for n, extra in enumerate(ENGINE_ARGS)}
        odd = collections.Counter(f"{w.model} {w.result}" for w in wj.wakes if cut(w) is None
                                  and w.result in ("ready", "refused", "mismatch") and w.result != expect[w.model])
        tried = {m for m, r in expect.items() if r != "ready"}
        self.check("every wake of a wake-fails engine was refused, of the wake-garbage one caught by its check; "
                   "every other one woke",
                   # some wake failed; a short run may never wake one deployment (its asleep engine
                   # SIGKILLed, or busy whenever a probe looked), so not each kind is asked for
                   not odd and bool({expect[w.model] for w in wj.wakes if cut(w) is None} & {"refused", "mismatch"}),
                   "; ".join(f"{k} x{c}" for k, c in odd.items()) or "wakes of " + ", ".join(
                       f"{m.lower()} {sum(w.model == m for w in wj.wakes)}" for m in sorted(tried)))
        # The warmth table of the summary.
        rows = [r for r in self.audit_rows if r["action"] == "ondemand_sleep"]

        def count(pred: Any) -> int:
            return sum(1 for r in rows if pred(r["text"], r.get("detail") or {}))
        level_n = collections.Counter(level for *_, level in wj.sleeps)
        after_failed = sum(1 for w in failing if any(b[1] == w.model and b[2] >= w.t for b in wj.boots))
        self.warmth = [
            ("sleeps at level 1 (engines' journal)", level_n[1], ""),
            ("sleeps at level 2 (engines' journal)", level_n[2], ""),
            ("put to sleep idle (reaper)", count(lambda t, d: t.startswith("Put to sleep after") and "level" in d), ""),
            ("stopped idle (reaper; idle_action stop)",
             count(lambda t, d: t.startswith("Put to sleep after") and "level" not in d), ""),
            ("make-room: an awake engine put to sleep",
             count(lambda t, d: t.startswith(MAKE_ROOM[0]) and "level" in d), ""),
            ("make-room: an awake engine stopped (idle_action stop)",
             count(lambda t, d: t.startswith(MAKE_ROOM[0]) and "level" not in d), ""),
            ("make-room: an asleep engine stopped", count(lambda t, d: t.startswith(MAKE_ROOM[1])), ""),
            *[(f"wakes: {k}", results.get(k, 0), WAKE_RESULTS.get(k, ""))
              for k in sorted({"ready", "refused", "mismatch", *results})],
            ("wake failures audited (ondemand_wake_failed)", len(audited),
             ", ".join(f"{k} {c}" for k, c in sorted(kinds_audit.items()))),
            ("cold starts (engine processes started)", len(wj.boots),
             f"{after_failed} after a failed wake"),
        ]

    # --- the summary ------------------------------------------------------------------------

    def summary(self) -> str:
        by = collections.Counter(d.outcome for d in self.done)
        deps = ", ".join(f"{name} ({PRIORITIES[n]}, {IDLE_ACTIONS[n]}"
                         + (", sglang" if ENGINES[n] == "sglang" else "")
                         + (f", {' '.join(ENGINE_ARGS[n][1:])}" if "--fail" in ENGINE_ARGS[n] else "")
                         + (f", at most {LIMITS[n]} at once" if LIMITS[n] else "")
                         + (f", keep_warm adaptive, every {METRONOME_S:g} s" if KEEP_WARM[n] == "adaptive" else "")
                         + ")"
                         for n, name in enumerate(NAMES))
        out = [f"Soak: seed {self.seed}, {len(self.done)} requests from {self.clients} clients over "
               f"{len(NAMES)} deployments of 10 GiB on one {GPU_MIB // GIB} GiB GPU (3 fit awake at once): {deps}; "
               f"{self.elapsed:.0f} s; {self.boots} engine starts, {self.engine_requests} requests reached engines.",
               ""]
        out.append(soaklib.table("Requests by outcome", by.most_common(), ("outcome", "requests")))
        out += ["", soaklib.table("Faults injected", sorted(self.faults.items()), ("fault", "times"))]
        out += ["", soaklib.table("Tiered warmth", self.warmth, ("what", "times", "detail"))]
        out += ["", soaklib.table("Invariants", self.checks, ("invariant", "result", "detail"))]
        return "\n".join(out) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ondemand-soak-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        soak = Soak(args.seed, args.requests, args.clients, work)
        try:
            await soak.run()
        finally:
            if soak.od.proc is not None and soak.od.proc.returncode is None:
                await soak.od.stop()
            for p in sim_processes(soak.journal):
                soaklib.kill_pid(p)
        text = soak.summary()
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
    ap.add_argument("--record", metavar="FILE", help="write the summary there too")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs, journal, state file)")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
