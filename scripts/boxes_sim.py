#!/usr/bin/env python3
"""Several boxes behind one LiteLLM: warm-first routing against LiteLLM's default shuffle.

A seeded discrete-event simulation, no engines: N boxes, M models registered on every box
(on demand), a Poisson traffic trace with Zipf popularity. Each box is an ondemand: a model
starts on the first request (start_s), a box holds at most ``slots`` engines, a start that
does not fit stops the least recently used idle engine (make-room) or waits for one to go
idle, an engine serves ``conc`` requests at once and queues the rest, the reaper stops an
engine idle for ``idle_s``. When ``max_waiting`` requests wait at a ready engine it answers
429, and LiteLLM cools that entry down for ``cooldown_s`` (its saturation signal; the request
fails: num_retries is 0).

Routing, as LiteLLM's router does it per request:
- shuffle: any entry of the model not in cooldown, uniformly (simple-shuffle, no order);
- warm: the same, but only the lowest order: entries whose engine is ready (order 1) while
  any is usable, else the cold ones (order 2).

Queue wait = from arrival to the start of service (a start, make-room, a full engine).

    python3 scripts/boxes_sim.py                      # the figures of docs/several-boxes.md
    python3 scripts/boxes_sim.py --boxes 4 --models 20 --rate 1.0 --hours 8 --seed 7
    python3 scripts/boxes_sim.py --json               # machine-readable
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import random
import sys
from typing import Any


@dataclasses.dataclass
class Params:
    boxes: int = 3
    models: int = 8
    slots: int = 3  # engines a box holds at once (its GPU memory)
    rate: float = 0.3  # requests per second, all models together
    zipf: float = 1.1  # popularity: model k gets a share proportional to 1 / k**zipf
    hours: float = 4.0
    service_s: float = 6.0  # mean generation time (exponential)
    conc: int = 8  # requests an engine serves at once
    start_min_s: float = 45.0  # cold start, drawn per model between min and max
    start_max_s: float = 90.0
    idle_s: float = 600.0  # ondemand_idle_timeout_s
    reap_s: float = 15.0  # reap_interval_s
    max_waiting: int = 32  # waiting at a ready engine before it answers 429
    cooldown_s: float = 5.0  # LiteLLM's cooldown_time (default 5 s)
    seed: int = 1


class Engine:
    __slots__ = ("state", "active", "waiting", "last_used")

    def __init__(self) -> None:
        self.state = "stopped"  # stopped | starting | ready
        self.active = 0
        self.waiting: collections.deque[float] = collections.deque()  # arrival times
        self.last_used = 0.0


class Sim:
    def __init__(self, p: Params, policy: str):
        self.p, self.policy = p, policy
        self.rng = random.Random(f"{p.seed}-routing")  # the trace is the same for every policy
        self.boxes = [[Engine() for _ in range(p.models)] for _ in range(p.boxes)]
        self.mem_wait: list[collections.deque[int]] = [collections.deque() for _ in range(p.boxes)]
        self.cooldown: dict[tuple[int, int], float] = {}
        trace_rng = random.Random(f"{p.seed}-trace")
        self.start_s = [trace_rng.uniform(p.start_min_s, p.start_max_s) for _ in range(p.models)]
        self.events: list[tuple[float, int, str, tuple[int, ...]]] = []
        self.seq = 0
        self.waits: list[float] = []
        self.cold_starts = 0
        self.rejected = 0
        self.evictions = 0
        self._trace(trace_rng)

    # -- events -------------------------------------------------------------------

    def _at(self, t: float, kind: str, *args: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def _trace(self, rng: random.Random) -> None:
        weights = [1 / (k + 1) ** self.p.zipf for k in range(self.p.models)]
        total = sum(weights)
        t, end = 0.0, self.p.hours * 3600
        while True:
            t += rng.expovariate(self.p.rate)
            if t > end:
                break
            model = rng.choices(range(self.p.models), weights=[w / total for w in weights])[0]
            self._at(t, "arrive", model)
        for k in range(int(end // self.p.reap_s) + 1):
            self._at(k * self.p.reap_s, "reap")

    def run(self) -> dict[str, Any]:
        while self.events:
            t, _, kind, args = heapq.heappop(self.events)
            getattr(self, "_on_" + kind)(t, *args)
        return self.report()

    # -- LiteLLM's router ---------------------------------------------------------

    def route(self, t: float, model: int) -> int:
        usable = [b for b in range(self.p.boxes) if self.cooldown.get((b, model), 0) <= t]
        if not usable:
            usable = list(range(self.p.boxes))  # every entry cooling down: LiteLLM tries them all
        if self.policy == "warm":
            ready = [b for b in usable if self.boxes[b][model].state == "ready"]
            usable = ready or usable
        return self.rng.choice(usable)

    # -- one ondemand per box -----------------------------------------------------

    def _on_arrive(self, t: float, model: int) -> None:
        box = self.route(t, model)
        eng = self.boxes[box][model]
        eng.last_used = t
        if eng.state == "ready" and eng.active < self.p.conc:
            self._serve(t, box, model, t)
            return
        if eng.state == "ready" and len(eng.waiting) >= self.p.max_waiting:
            self.rejected += 1  # 429: LiteLLM cools this entry down, the request fails
            self.cooldown[(box, model)] = t + self.p.cooldown_s
            return
        eng.waiting.append(t)
        if eng.state == "stopped" and model not in self.mem_wait[box]:
            self._admit(t, box, model)

    def _admit(self, t: float, box: int, model: int) -> None:
        engines = self.boxes[box]
        held = sum(1 for e in engines if e.state != "stopped")
        if held >= self.p.slots:
            idle = [m for m, e in enumerate(engines) if e.state == "ready" and e.active == 0 and not e.waiting]
            if not idle:
                self.mem_wait[box].append(model)  # waits until an engine goes idle
                return
            victim = min(idle, key=lambda m: engines[m].last_used)
            engines[victim].state = "stopped"
            self.evictions += 1
        engines[model].state = "starting"
        self.cold_starts += 1
        self._at(t + self.start_s[model], "ready", box, model)

    def _on_ready(self, t: float, box: int, model: int) -> None:
        eng = self.boxes[box][model]
        eng.state = "ready"
        eng.last_used = t
        self._drain(t, box, model)

    def _serve(self, t: float, box: int, model: int, arrival: float) -> None:
        eng = self.boxes[box][model]
        eng.active += 1
        self.waits.append(t - arrival)
        self._at(t + self.rng.expovariate(1 / self.p.service_s), "done", box, model)

    def _drain(self, t: float, box: int, model: int) -> None:
        eng = self.boxes[box][model]
        while eng.waiting and eng.active < self.p.conc:
            self._serve(t, box, model, eng.waiting.popleft())

    def _on_done(self, t: float, box: int, model: int) -> None:
        eng = self.boxes[box][model]
        eng.active -= 1
        eng.last_used = t
        self._drain(t, box, model)
        if eng.active == 0 and not eng.waiting and self.mem_wait[box]:
            self._admit(t, box, self.mem_wait[box].popleft())  # make-room: this one is idle now

    def _on_reap(self, t: float) -> None:
        for engines in self.boxes:
            for eng in engines:
                if (eng.state == "ready" and eng.active == 0 and not eng.waiting
                        and t - eng.last_used >= self.p.idle_s):
                    eng.state = "stopped"

    # -- figures ------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        waits = sorted(self.waits)

        def pct(q: float) -> float:
            return round(waits[min(len(waits) - 1, int(q * len(waits)))], 1) if waits else 0.0
        return {"policy": self.policy, "requests": len(waits) + self.rejected, "served": len(waits),
                "cold_starts": self.cold_starts, "evictions": self.evictions, "rejected_429": self.rejected,
                "waited_for_a_start": sum(1 for w in waits if w >= self.p.start_min_s),
                "p50_wait_s": pct(0.50), "p90_wait_s": pct(0.90), "p99_wait_s": pct(0.99),
                "mean_wait_s": round(sum(waits) / len(waits), 2) if waits else 0.0}


def simulate(p: Params) -> list[dict[str, Any]]:
    return [Sim(p, policy).run() for policy in ("shuffle", "warm")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(Params):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default, help=f"(default {field.default})")
    parser.add_argument("--json", action="store_true", help="one JSON object: the parameters and both results")
    args = vars(parser.parse_args(argv))
    as_json = args.pop("json")
    p = Params(**args)
    results = simulate(p)
    if as_json:
        print(json.dumps({"params": dataclasses.asdict(p), "results": results}))
        return 0
    print(f"{p.boxes} boxes x {p.slots} engines, {p.models} models (zipf {p.zipf}), {p.rate} req/s for "
          f"{p.hours:g} h, starts {p.start_min_s:g}-{p.start_max_s:g} s, idle {p.idle_s:g} s, seed {p.seed}")
    cols = ["policy", "requests", "cold_starts", "evictions", "waited_for_a_start", "rejected_429",
            "p50_wait_s", "p90_wait_s", "p99_wait_s", "mean_wait_s"]
    print("  ".join(f"{c:>18}" for c in cols))
    for r in results:
        print("  ".join(f"{r[c]!s:>18}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
