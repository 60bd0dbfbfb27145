"""The soak: a real `ondemand serve` process (process backend, static budget, the engine
simulator) under many clients and real faults, then the invariants that must hold.

    python scripts/soak.py --seed 1 --requests 10000 [--clients 50] [--record bench/soak.md]

Load: ``--requests`` requests from ``--clients`` clients over 4 deployments of which 2 fit
at once; streaming and not; two deployments are "hot" at a time and the pair changes every
250 requests, so models are put to sleep, started and made room for all the time. The
deployments have priorities (alpha high, bravo and charlie normal, delta low) and charlie
a ``max_inflight`` of 3, so requests queue by priority, make-room picks by class, and
charlie's bursts are refused 429 ``ondemand_busy``.

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

It prints one summary: requests by outcome, faults injected, invariants checked; the exit
code is 1 when an invariant broke. ``--record FILE`` writes the summary there too.
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

NAMES = ("alpha", "bravo", "charlie", "delta")
QUEUE_TIMEOUT_S = 15
DEADLINE_S = QUEUE_TIMEOUT_S + 10  # a client gives up here: past it a request hung
PHASE = 250  # requests per pair of hot deployments
FORBIDDEN = {"authorization", "cookie", "x-dgxmm-health-check", "x-forwarded-for", "forwarded", "x-real-ip"}
SIM_ARGS = ("--startup-delay", "0.5", "--token-delay", "0.02", "--tokens", "24", "--shutdown-delay", "0.1")
PRIORITIES = ("high", "normal", "normal", "low")  # per deployment, as NAMES
RANK = {"low": 0, "normal": 1, "high": 2}
LIMITS = (None, None, 3, None)  # max_inflight per deployment
MAKE_ROOM = "Put to sleep to make room for "  # the audit text of a make-room stop


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
    hot = random.Random(f"{seed}:phase:{i // PHASE}").sample(range(4), 2)
    dep = rng.choice(hot) if rng.random() < 0.85 else rng.randrange(4)
    r = rng.random()
    route, stream = (("chat/completions", True) if r < 0.4 else ("chat/completions", False) if r < 0.75 else
                     ("completions", True) if r < 0.85 else ("completions", False) if r < 0.95 else
                     ("embeddings", False))
    h = rng.random()
    hangup = "early" if h < 0.06 else "headers" if h < 0.09 else "midstream" if h < 0.12 and stream else None
    return Plan(dep, route, stream, rng.random() < 0.1, rng.random() < 0.03, hangup,
                rng.uniform(0.01, 3.0), rng.uniform(0, 0.05))


FAULT_KINDS = ("kill_engine_streaming", "kill_engine_starting", "fail_start", "rotate_key", "mode_switch",
               "admin_stop")


def plan_faults(seed: int, requests: int) -> list[tuple[int, str]]:
    """(after how many requests, which fault): each kind at least twice, about one per 80 requests,
    and the SIGKILL of ondemand at 40 %."""
    rng = random.Random(f"{seed}:faults")
    count = max(2 * len(FAULT_KINDS), requests // 80)
    kinds = list(FAULT_KINDS) * 2 + [rng.choice(FAULT_KINDS) for _ in range(count - 2 * len(FAULT_KINDS))]
    rng.shuffle(kinds)
    at = sorted(rng.randrange(requests // 20, requests * 95 // 100) for _ in kinds)
    return sorted([*zip(at, kinds), (requests * 4 // 10, "kill_ondemand")])


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
    broken: dict[int, float] = field(default_factory=dict)
    switched: dict[int, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks: list[tuple[str, str, str]] = field(default_factory=list)
    baseline: dict[str, int] = field(default_factory=dict)
    two_at_once: list[str] = field(default_factory=list)
    old_key_answers: list[str] = field(default_factory=list)
    inflight_peak: collections.Counter[int] = field(default_factory=collections.Counter)  # per deployment
    up: asyncio.Event = field(default_factory=asyncio.Event)  # clear while ondemand restarts

    def __post_init__(self) -> None:
        self.journal = self.work / "journal.jsonl"
        # The reaper looks every 2 s: an idle model is often still there when a queued request
        # looks (just after an idle timeout runs out), so make-room, and its priority rule, runs.
        self.od = Ondemand(self.work, {
            "min_idle_timeout_s": 1, "ondemand_idle_timeout_s": 2, "ondemand_queue_timeout_s": QUEUE_TIMEOUT_S,
            "reap_interval_s": 2, "metrics_interval_s": 0.5, "shutdown_grace_s": 2, "log_level": "info"},
            {"budget": {"source": "static", "capacity_gib": 20},
             "deployer": {"backend": "process", "start_timeout_s": 10, "stop_timeout_s": 3}})

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, "ok" if ok else "FAILED", detail))
        if not ok:
            self.failures.append(f"{name}: {detail}")

    def command(self, dep: int, *extra: str) -> list[str]:
        return sim_command(NAMES[dep].upper(), self.journal, *SIM_ARGS, *extra)

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
                "idle_timeout_s": 1 + n % 3, "command": self.command(n), "priority": PRIORITIES[n],
                "max_inflight": LIMITS[n]})
            assert status == 201, (status, view)
            self.ids.append(view["id"])
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
                    return f"{r.status} {(data.get('error') or {}).get('code')}"
                if plan.health:
                    await r.read()
                    return "200 health check (answered by the gateway)"
                if not plan.stream:
                    data = await r.json()
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
                return f"stream error {json.loads(data)['error'].get('code')}"
            chunks += 1
            if plan.hangup == "midstream" and chunks >= 2:
                r.close()
                return "hang-up mid-stream"
        return "stream cut"

    # --- watching ---------------------------------------------------------------------------

    async def poll(self) -> None:
        """The views every 0.2 s (for the hang-up stages and the faults' targets), and every
        second whether two engines of one deployment ever run at once."""
        n = 0
        while True:
            with contextlib.suppress(Exception):
                status, views = await self.od.api("GET", "/deployments")
                if status == 200:
                    self.views = {v["id"]: v for v in views}
                    for n, i in enumerate(self.ids):
                        if i in self.views:
                            self.inflight_peak[n] = max(self.inflight_peak[n], self.views[i]["ondemand"]["inflight"])
            n += 1
            if n % 5 == 0:
                per_model = collections.Counter(p["model"] for p in sim_processes(self.journal).values())
                self.two_at_once += [f"{m} x{c} at {time.time():.1f}" for m, c in per_model.items() if c > 1]
            await asyncio.sleep(0.2)

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
        found = [n for n, i in enumerate(self.ids) if (v := self.views.get(i)) and ok(v)]
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
                soaklib.kill_pid(pid)
                self.faults["engine SIGKILL while starting"] += 1
                return
            await asyncio.sleep(0.01)
        self.faults["engine SIGKILL while starting: no start found"] += 1

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

    # --- the run ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.setup()
        self.up.set()
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a hang-up closes its own connection
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        tasks = [asyncio.ensure_future(self.poll()), asyncio.ensure_future(self.healer())]
        faults = asyncio.ensure_future(self.faults_loop(plan_faults(self.seed, self.requests)))
        t0 = time.time()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self.client(session) for _ in range(self.clients)))
            self.elapsed = time.time() - t0
            await faults
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.heal_once(final=True)
        await self.after()

    def attributed(self, d: Done) -> bool:
        """Whether an outcome other than an answer is explained by a fault (or is always allowed)."""
        o, lo, hi = d.outcome, d.start - 2, d.end + 2
        near = any(lo <= t <= hi for t in self.fault_times[d.dep])
        down = any(a <= hi and b >= lo for a, b in self.down)
        if o.startswith(("200", "hang-up")) and "not an answer" not in o or "ondemand_queue_timeout" in o:
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
        odd = collections.Counter(d.outcome for d in self.done if not self.attributed(d))
        self.check("every answer is an answer, a hang-up, a queue timeout or explained by a fault",
                   not odd, ", ".join(f"{o} x{c}" for o, c in odd.most_common(6)))
        self.check("a rotated-out key is refused (401, not counted for the rate limit)",
                   bool(self.old_key_answers) and all(a == "401 invalid_api_key" for a in self.old_key_answers),
                   ", ".join(collections.Counter(self.old_key_answers)))
        self.check("never two engines of one deployment at once (/proc, every second)", not self.two_at_once,
                   "; ".join(self.two_at_once[:3]))
        await self.quiet_checks()
        await self.priority_checks()
        rc = await self.od.stop()
        self.check("ondemand stops on SIGTERM with exit code 0", rc == 0, f"exit code {rc}")
        await asyncio.sleep(0.5)
        orphans = sim_processes(self.journal)
        self.check("no engine process left after ondemand stops", not orphans, str(orphans)[:200])
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
        """With no client left: nothing in flight or queued, then (engines put to sleep) the
        gateway's file descriptors and memory back near where they were."""
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
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, views = await self.od.api("GET", "/deployments")
            if all(v["state"] in ("stopped", "failed") for v in views):
                break
            await asyncio.sleep(0.2)
        states = collections.Counter(v["state"] for v in views)
        self.check("every engine put to sleep by the reaper once idle", set(states) <= {"stopped", "failed"},
                   str(dict(states)))
        await asyncio.sleep(1)
        fds, rss = soaklib.fd_count(self.od.pid), soaklib.rss_kib(self.od.pid)
        base_fds, base_rss = self.baseline["fds_restart"], self.baseline["rss_restart"]
        self.check("open fds back near their value after the restart (+10)", fds <= base_fds + 10,
                   f"{base_fds} after restart, {fds} at the end (first process: {self.baseline['fds_first']})")
        self.check("RSS back near its value after the restart (+64 MiB)", rss <= base_rss + 65536,
                   f"{base_rss // 1024} MiB after restart, {rss // 1024} MiB at the end")
        self.rss = (base_rss, rss)

    async def priority_checks(self) -> None:
        """From the audit rows and the request log: no make-room stop ever took a deployment
        of higher priority than the request it was made for, and each was made while a
        request for that one waited; the limited deployment never served more than its limit."""
        rows: list[dict[str, Any]] = []
        before = ""
        while True:
            status, page = await self.od.api("GET", f"/audit?limit=1000{before}")
            if status != 200 or not page:
                break
            rows += page
            before = f"&before={page[-1]['id']}"
        by_name = {name.upper(): n for n, name in enumerate(NAMES)}
        by_id = {i: n for n, i in enumerate(self.ids)}
        stops = [r for r in rows if r["action"] == "ondemand_sleep" and r["text"].startswith(MAKE_ROOM)]
        wrong, unasked = [], []
        for r in stops:
            victim, requester = by_id[r["deployment_id"]], by_name[r["text"][len(MAKE_ROOM):]]
            if RANK[PRIORITIES[victim]] > RANK[PRIORITIES[requester]]:
                wrong.append(f"{NAMES[victim]} ({PRIORITIES[victim]}) for {NAMES[requester]} "
                             f"({PRIORITIES[requester]}) at {r['at']:.1f}")
            if not any(d.dep == requester and d.start - 1 <= r["at"] <= d.end + 2 for d in self.done):
                unasked.append(f"{NAMES[victim]} for {NAMES[requester]} at {r['at']:.1f}")
        classes = collections.Counter(f"{PRIORITIES[by_id[r['deployment_id']]]} for "
                                      f"{PRIORITIES[by_name[r['text'][len(MAKE_ROOM):]]]}" for r in stops)
        self.check("no make-room stop took a deployment of higher priority than its request (audit rows)",
                   bool(stops) and not wrong,
                   "; ".join(wrong[:3]) or f"{len(stops)} make-room stops: "
                   + ", ".join(f"{k} x{c}" for k, c in sorted(classes.items())))
        self.check("every make-room stop was made while a request for its model waited (request log)",
                   not unasked, "; ".join(unasked[:3]) or f"{len(stops)} matched")
        busy = sum(d.outcome.endswith("ondemand_busy") for d in self.done)
        over = {NAMES[n]: self.inflight_peak[n] for n, limit in enumerate(LIMITS)
                if limit is not None and self.inflight_peak[n] > limit}
        self.check("a deployment with max_inflight never served more at once (views every 0.2 s)", not over,
                   str(over) if over else f"{busy} refused 429 ondemand_busy; peaks "
                   + ", ".join(f"{NAMES[n]} {self.inflight_peak[n]}" for n in range(len(NAMES))))

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

    # --- the summary ------------------------------------------------------------------------

    def summary(self) -> str:
        by = collections.Counter(d.outcome for d in self.done)
        out = [f"Soak: seed {self.seed}, {len(self.done)} requests from {self.clients} clients over "
               f"{len(NAMES)} deployments (2 fit at once; priorities {', '.join(PRIORITIES)}; charlie at most "
               f"{LIMITS[2]} at once), {self.elapsed:.0f} s; {self.boots} engine starts, "
               f"{self.engine_requests} requests reached engines.", ""]
        out.append(soaklib.table("Requests by outcome", by.most_common(), ("outcome", "requests")))
        out += ["", soaklib.table("Faults injected", sorted(self.faults.items()), ("fault", "times"))]
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
                "# The soak's last full run\n\n`make soak` (scripts/soak.py); how it works: its docstring.\n\n"
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
