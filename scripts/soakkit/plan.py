"""The soak's plan: its deployments (what each is and does), which request goes where and how,
which fault after which request, and the words of the audit rows and of the engines it reads.
All from ``--seed`` alone: the same seed replays the same plan."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

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

