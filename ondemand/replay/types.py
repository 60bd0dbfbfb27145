"""The replay's values, shared by its rooms: a request of the trace, what a deployment's engine
costs, the box, a policy, and what one policy's replay gave.

The trace's rooms (``trace``, ``deployments``) make ``Request``, ``Replayed`` and ``Box``; the
run (``run``) turns them and a ``Policy`` into a ``PolicyResult``; the report (``report``) writes
the results as a table, JSON and a page."""
from __future__ import annotations

import dataclasses

from ..config import BudgetConfig, Config
from ..engines.tiers import ASLEEP_1, ASLEEP_2, STOPPED, Tier
from ..model import Deployment
from .sketch import Sketch

POLICY_KINDS = ("current", "always-on", "ttl", "sleep-ttl", "lru", "sleep-lru", "fixed", "adaptive", "seed", "cost",
                "clairvoyant")
# The ones that take seconds: "ttl=300".
TIMED_KINDS = frozenset({"ttl", "sleep-ttl", "lru", "sleep-lru", "fixed"})
# The ones that may take seconds or not: "clairvoyant" rests at once, "clairvoyant=60" its own rests
# no sooner than 60 s idle (the floor every product policy keeps: min_idle_timeout_s).
FLOORED_KINDS = frozenset({"clairvoyant"})
# Peers whose make-room takes any model with nothing in flight (Ollama's rule), not only one idle
# for its whole timeout.
LRU_KINDS = frozenset({"lru", "sleep-lru"})
WAITED = ("ready", "wake", "cold", "queue")  # the longest thing a request waited for


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request of the trace. ``model`` is the deployment's name once the trace is read
    (a row without one is assigned by weight, seeded); ``line`` is its line in the file."""
    at_s: float  # seconds since the trace's first request
    model: str
    input_tokens: int
    output_tokens: int
    stream: bool = True
    line: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Costs:
    """What a deployment's engine costs (the tiers' defaults for one without a record). Coming
    back from a rest tier costs the field its ``cost_key`` names (``back_s``)."""
    cold_start_s: float = STOPPED.default_s
    wake_s: float = ASLEEP_1.default_s  # from level 1
    wake2_s: float = ASLEEP_2.default_s  # from level 2
    sleep_s: float = 2.0
    prefill_tokens_per_s: float = 5000.0  # the engine's, shared by the requests prefilling at once
    decode_tokens_per_s: float = 50.0  # one request's
    max_concurrency: int = 256  # requests the engine runs at once (vLLM's max_num_seqs); more wait inside it
    kv_tokens: int = 4 * 32768  # the KV cache: contexts (input + output) admitted at once
    decode_batch_tokens_per_s: float | None = None  # the engine's decode in all; None: no bound
    max_model_len: int = 32768  # a longer request (input + output) is rejected at its arrival

    def back_s(self, tier: Tier) -> float:
        """What coming back from ``tier`` costs this engine: a wake from its level, a cold start."""
        cost: float = getattr(self, tier.cost_key)
        return cost


def fits_engine(req: Request, costs: Costs) -> bool:
    """Does ``req`` fit its engine's ``max_model_len`` (input + output tokens)? A longer one is
    rejected at its arrival, as vLLM rejects it, and starts nothing (the edge, and the
    clairvoyant reference's arrivals, both ask this)."""
    return req.input_tokens + req.output_tokens <= costs.max_model_len


@dataclasses.dataclass(frozen=True, slots=True)
class Replayed:
    """A deployment in the replay: its fields (ids 1..n, on demand and stopped unless it says
    ``mode = "always_on"``), its engine's costs, its share of the rows without a model, and the
    idle gaps adaptive warmth had learned of it (the state file's, oldest first; none from a file)."""
    deployment: Deployment
    costs: Costs = Costs()
    weight: float = 1.0
    gaps: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """The box the replay runs on: each GPU's GiB (one pool when ``per_gpu`` is False: unified
    memory, or a static ``capacity_gib``), the host's memory, and the configuration's keys the
    decisions read (their defaults are config.py's)."""
    gpus: tuple[float, ...]
    host_gib: float
    per_gpu: bool = True
    reserve_gib: float = BudgetConfig.reserve_gib
    queue_timeout_s: float = Config.ondemand_queue_timeout_s
    max_queued: int = Config.ondemand_max_queued
    reap_interval_s: float = Config.reap_interval_s
    idle_timeout_s: int = Config.ondemand_idle_timeout_s  # for deployments that set none
    min_idle_timeout_s: int = Config.min_idle_timeout_s
    sleep_timeout_s: int | None = Config.sleep_timeout_s
    host_reserve_gib: float = BudgetConfig.host_reserve_gib
    asleep_residue_gib: float = BudgetConfig.asleep_residue_gib
    scheduler: str = Config.scheduler  # the decision core's (control/scheduler.py)


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """A policy as typed (``name``, e.g. "ttl=300"): its kind and, for a timed one, seconds."""
    name: str
    kind: str
    seconds: int | None = None

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``current``, ``always-on``, ``adaptive``, ``seed``, ``cost``, ``clairvoyant``, ``ttl=S``,
        ``sleep-ttl=S``, ``lru=S``, ``sleep-lru=S``, ``fixed=S``, ``clairvoyant=S`` (S whole seconds ≥ 1);
        ValueError naming the policy otherwise."""
        kind, sep, value = text.strip().partition("=")
        if kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy {text!r}: one of current, always-on, ttl=S, sleep-ttl=S, lru=S, "
                             "sleep-lru=S, fixed=S, adaptive, seed, cost, clairvoyant, clairvoyant=S")
        if (kind in TIMED_KINDS) != bool(sep) and kind not in FLOORED_KINDS:
            raise ValueError(f"policy {text!r}: {kind} takes seconds ({kind}=S)" if kind in TIMED_KINDS
                             else f"policy {text!r}: {kind} takes no value")
        if not sep:
            return cls(text.strip(), kind)
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"policy {text!r}: S must be whole seconds, 1 or more")
        return cls(text.strip(), kind, int(value))


@dataclasses.dataclass(slots=True)
class Tally:
    """What a policy gave, for the box or one deployment (the JSON's fields, before the
    percentiles: ``ttft`` sketches each served request's TTFT, ``wait`` each wait)."""
    requests: int = 0
    served: int = 0
    failed: int = 0
    slo_met: int = 0  # a count here, exact; the JSON's is the fraction of requests
    # Sketches, not the values: their memory does not grow with the trace (a week of a busy box is
    # hundreds of thousands of requests per policy), and a percentile is within 0.5 % (sketch.py).
    ttft: Sketch = dataclasses.field(default_factory=Sketch)
    # What the gateway and the scheduling cost a request (arrival to the moment a ready engine took
    # it; a timed-out one counts at its deadline), of the served and the timed-out requests.
    wait: Sketch = dataclasses.field(default_factory=Sketch)
    # Each value itself, in the order the requests ended, only when the replay is asked to keep
    # them (``replay(keep=True)``: the tests, a small trace looked at closely); None otherwise.
    ttfts: list[float] | None = None
    waits: list[float] | None = None
    wait_slo_met: int = 0  # served requests whose wait met the SLO (a count; the JSON's is a fraction)
    timed_out: int = 0  # the queue's deadline passed
    refused: int = 0  # answered at once with an error (does_not_fit, the queue full, 429, a backoff)
    rejected: int = 0  # longer than its engine's max_model_len: refused at arrival, apart from failed
    waited: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(WAITED, 0))
    cold_starts: int = 0
    wakes: int = 0
    sleeps: int = 0
    stops: int = 0
    prewarms: int = 0  # adaptive warmth's pre-warms that started
    prewarm_hits: int = 0  # ...and found a request before their engine went away again
    gpu_seconds: float = 0.0  # summed over GPUs: the time some engine held memory there
    gpu_gib_seconds: float = 0.0  # the GiB held times the time

    @classmethod
    def keeping(cls, keep: bool) -> Tally:
        """A tally that keeps each value too when ``keep`` (``ttfts``, ``waits``)."""
        return cls(ttfts=[], waits=[]) if keep else cls()

    def add_ttft(self, ttft: float) -> None:
        self.ttft.add(ttft)
        if self.ttfts is not None:
            self.ttfts.append(ttft)

    def add_wait(self, wait: float) -> None:
        self.wait.add(wait)
        if self.waits is not None:
            self.waits.append(wait)

    def reset(self) -> None:
        """Everything back to nothing counted (a measured window begins); one that keeps its
        values goes on keeping them."""
        fresh = Tally.keeping(self.ttfts is not None)
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(fresh, field.name))


@dataclasses.dataclass(slots=True)
class PolicyResult:
    """One policy's replay: the box's tally, each deployment's (by name), the end of the last
    request, and the timelines the page draws: ``memory`` is (t, gpu, deployment, GiB held from
    then on; 0 when it let go) at each change, ``queue`` is (t, requests queued for memory)."""
    policy: Policy
    total: Tally
    per_deployment: dict[str, Tally]
    end_s: float = 0.0
    memory: list[tuple[float, int, str, float]] = dataclasses.field(default_factory=list)
    queue: list[tuple[float, int]] = dataclasses.field(default_factory=list)
