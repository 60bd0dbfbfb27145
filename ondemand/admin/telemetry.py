"""The gateway's own metrics, for ``GET {base_path}/metrics`` (Prometheus text format).

Every app has a ``CollectorRegistry`` of its own, never prometheus_client's global
one (the tests run several apps in one process). Four sources feed it:

- the gateway's finished requests (``exchange``): counters and histograms, one
  cached child per label set, so a request costs a dict look-up and a few adds;
- the deployer's ``StartEnded`` events (``on_start_ended``): cold starts that
  ended ready or failed, and how long one that ended ready took; and its
  ``DeploymentChanged`` events (``on_deployment``): stops by their ``StopCause``;
- the start watch's ``StartTimed`` (``on_start_timed``): each phase of a cold start, and the
  error of the ETA given at its beginning;
- the deployer's ``Slept`` and ``Woken`` events (``on_slept``, ``on_woken``):
  sleeps by level and reason, wakes by result and how long a wake took. A sleep
  is no stop: the change to ``asleep`` carries no cause, so ``ondemand_stops_total``
  does not move; a stop of an asleep engine is a stop (its change to
  ``stopping`` carries the cause);
- at scrape time only, a collector that reads the live state (in flight,
  queued, each deployment's state, GPU memory, the host memory asleep engines
  hold) and the controller's counters (429s, pre-warms' results, make-room's
  victims by rule): nothing is kept up to date on the forwarding path for them.

``gpu_memory()`` gives ``(gpu index, capacity GiB, free GiB)`` per GPU and must
not block; when it raises, the GPU samples are left out of that scrape.
Imports the events, the exchange and the model only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..events import DeploymentChanged, Slept, StartEnded, StartTimed, Woken
from ..gateway.exchange import Exchange
from ..model import Deployment, KeepWarm, State

log = logging.getLogger("ondemand.admin.telemetry")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format, which every Prometheus reads
GIB = 1024 ** 3
# Starts take seconds (a small llama.cpp model) to half an hour (a large vLLM model).
START_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
# A forwarded request takes a millisecond; one that waits for a start or for memory, minutes.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0, 900.0)

# A wake takes 50 ms (level 1, a small model) to a couple of minutes (level 2: the weights are
# read again from disk); one that hangs ends at deployer.wake_timeout_s (300 s: +Inf).
WAKE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

# A start's phase: a second (a container's creation) to tens of minutes (a large model's compile).
PHASE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# The start ETA's error, |estimate - actual| / actual: issue 33 asks a median at most 0.2, p90 at most 0.4.
ETA_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 1.0, 2.0)

GpuMemory = Callable[[], list[tuple[int, float, float]]]


class _Live:
    """The gauges that mirror live state, computed when scraped."""

    def __init__(self, deployments: Callable[[], list[Deployment]], inflight: Callable[[int], int],
                 queued: Callable[[int], int], gpu_memory: GpuMemory, busy: Callable[[int], int],
                 prewarms: Callable[[int], Mapping[str, int]], make_rooms: Callable[[], Mapping[str, int]]):
        self._deployments = deployments
        self._inflight = inflight
        self._queued = queued
        self._gpu_memory = gpu_memory
        self._busy = busy
        self._prewarms = prewarms
        self._make_rooms = make_rooms

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily("ondemand_inflight", "Requests being answered by the engine, per deployment",
                                     labels=["deployment"])
        queued = GaugeMetricFamily("ondemand_queued", "Requests waiting for a start or for memory, per deployment "
                                   "(and its priority)", labels=["deployment", "priority"])
        # Kept by the controller, which refuses them: read here like the gauges.
        busy = CounterMetricFamily("ondemand_busy", "Requests refused 429 ondemand_busy: the deployment served "
                                   "its max_inflight already", labels=["deployment"])
        prewarms = CounterMetricFamily("ondemand_prewarms", "Adaptive warmth's pre-warms that ended, by result: hit "
                                       "(a request came while the pre-warmed engine was awake, or waking) or miss (it "
                                       "went idle again unused)", labels=["deployment", "result"])
        make_rooms = CounterMetricFamily("ondemand_make_room", "Victims make-room put away for a queued model, by "
                                         "the rule that allowed it: idle_timeout (idle for its whole timeout) or "
                                         "cost (before it, scheduler cost)", labels=["rule"])
        # Both documented series from 0, whatever the box's scheduler (a rate needs its first sample).
        for rule, n in {"idle_timeout": 0, "cost": 0, **self._make_rooms()}.items():
            make_rooms.add_metric([rule], n)
        state = GaugeMetricFamily("ondemand_deployment_state", "1 for the deployment's current state, else 0",
                                  labels=["deployment", "state"])
        host_asleep = 0.0
        for dep in self._deployments():
            if dep.state is State.ASLEEP:
                host_asleep += dep.host_gib or 0.0
            inflight.add_metric([dep.name], self._inflight(dep.id))
            queued.add_metric([dep.name, dep.priority.value], self._queued(dep.id))
            busy.add_metric([dep.name], self._busy(dep.id))
            results = self._prewarms(dep.id)
            if dep.keep_warm is KeepWarm.ADAPTIVE or any(results.values()):
                for result in ("hit", "miss"):
                    prewarms.add_metric([dep.name, result], results.get(result, 0))
            for s in State:
                state.add_metric([dep.name, s.value], 1.0 if dep.state is s else 0.0)
        capacity = GaugeMetricFamily("ondemand_gpu_memory_capacity_bytes", "Usable GPU memory",
                                     labels=["gpu"])
        free = GaugeMetricFamily("ondemand_gpu_memory_free_bytes", "GPU memory free for a new engine",
                                 labels=["gpu"])
        try:
            gpus = self._gpu_memory()
        except Exception as exc:  # an unreadable budget leaves the GPU samples out, never the scrape
            log.debug("GPU memory unreadable for the metrics: %s", exc)
            gpus = []
        for index, cap_gib, free_gib in gpus:
            capacity.add_metric([str(index)], cap_gib * GIB)
            free.add_metric([str(index)], free_gib * GIB)
        host = GaugeMetricFamily("ondemand_host_memory_asleep_bytes", "Host memory the asleep engines hold, "
                                 "as measured after their sleep (a level-1 sleeper's weights are there)",
                                 value=host_asleep * GIB)
        return [inflight, queued, busy, prewarms, make_rooms, state, capacity, free, host]


class Telemetry:
    def __init__(self, *, deployments: Callable[[], list[Deployment]], inflight: Callable[[int], int],
                 queued: Callable[[int], int], gpu_memory: GpuMemory,
                 busy: Callable[[int], int] = lambda dep_id: 0,
                 prewarms: Callable[[int], Mapping[str, int]] = lambda dep_id: {},
                 make_rooms: Callable[[], Mapping[str, int]] = dict):
        # No *_created series: they double the counters' series for a value nobody here reads.
        # (prometheus_client reads this switch when it writes a scrape; nothing else uses it.)
        disable_created_metrics()  # type: ignore[no-untyped-call]  # (unannotated in prometheus_client)
        self.registry = r = CollectorRegistry()
        self._requests = Counter("ondemand_requests", "Gateway requests answered, by deployment and HTTP status",
                                 ["deployment", "code"], registry=r)
        self._duration = Histogram("ondemand_request_duration_seconds",
                                   "Gateway requests from arrival to the answer's last byte", ["deployment"],
                                   buckets=REQUEST_BUCKETS, registry=r)
        self._queue_wait = Histogram("ondemand_queue_wait_seconds",
                                     "From arrival to a slot, for the requests that waited for a start or memory",
                                     ["deployment"], buckets=REQUEST_BUCKETS, registry=r)
        self._starts = Counter("ondemand_starts", "Cold engine starts that ended, by result (wakes are "
                               "ondemand_wakes_total)",
                               ["deployment", "result"], registry=r)
        self._start_duration = Histogram("ondemand_start_duration_seconds", "Cold starts, from starting to ready",
                                         ["deployment"], buckets=START_BUCKETS, registry=r)
        self._phase = Histogram("ondemand_start_phase_seconds", "Cold starts that ended ready, by phase (container, "
                                "process, weights, compile, serving; from the engine's log)", ["deployment", "phase"],
                                buckets=PHASE_BUCKETS, registry=r)
        self._eta_error = Histogram("ondemand_start_eta_error_ratio", "Cold starts that ended ready: |the ETA given at "
                                    "the start's beginning - its duration| / its duration", buckets=ETA_ERROR_BUCKETS,
                                    registry=r)
        self._stops = Counter("ondemand_stops", "Engines stopped, by reason", ["deployment", "reason"], registry=r)
        self._sleeps = Counter("ondemand_sleeps", "Engines put to sleep (not stopped), by level (1: weights in host "
                               "memory, 2: weights dropped) and why: idle, make_room or admin",
                               ["deployment", "level", "reason"], registry=r)
        self._wakes = Counter("ondemand_wakes", "Wakes that ended, by result: ready, failed (an engine call failed "
                              "or timed out) or mismatch (the wake check's answer differed); a failed or mismatched "
                              "wake is followed by a cold start", ["deployment", "result"], registry=r)
        self._wake_duration = Histogram("ondemand_wake_duration_seconds", "Wakes that ended ready: from the wake's "
                                        "first engine call to the wake check's answer", ["deployment"],
                                        buckets=WAKE_BUCKETS, registry=r)
        self._auth_failures = Counter("ondemand_auth_failures", "Requests refused 401: a wrong or missing key or "
                                      "admin token", registry=r)
        self._rate_limited = Counter("ondemand_rate_limited", "Gateway requests refused 429 after failed key checks",
                                     registry=r)
        self._health = Counter("ondemand_health_checks", "Health checks answered by the gateway, never forwarded",
                               ["deployment"], registry=r)
        self._syncs = Counter("ondemand_litellm_syncs", "LiteLLM syncs, by result", ["result"], registry=r)
        r.register(_Live(deployments, inflight, queued, gpu_memory, busy, prewarms, make_rooms))
        # Label children by key: the forwarding path looks one up instead of building it.
        self._by_code: dict[tuple[str, int], Counter] = {}
        self._by_dep: dict[str, tuple[Histogram, Histogram]] = {}

    # --- the gateway (its forwarding path: keep it cheap) --------------------------

    def exchange(self, ex: Exchange) -> None:
        """A gateway request ended (answered, refused, or its client went away)."""
        key = (ex.deployment, ex.status)
        counter = self._by_code.get(key)
        if counter is None:
            counter = self._by_code[key] = self._requests.labels(ex.deployment, str(ex.status))
        counter.inc()
        hists = self._by_dep.get(ex.deployment)
        if hists is None:
            hists = self._by_dep[ex.deployment] = (self._duration.labels(ex.deployment),
                                                   self._queue_wait.labels(ex.deployment))
        hists[0].observe(ex.duration_s)
        if ex.queued_s is not None:
            hists[1].observe(ex.queued_s)
        if ex.health:
            self._health.labels(ex.deployment).inc()
        elif ex.status == 401:
            self._auth_failures.inc()
        elif ex.status == 429 and not ex.deployment:
            # Failed-key lockouts come before a deployment is named; a 429 of a deployment
            # (ondemand_busy, or the engine's own) is not one.
            self._rate_limited.inc()

    def auth_failed(self) -> None:
        """The admin API (or /metrics) refused a token."""
        self._auth_failures.inc()

    def litellm_synced(self, ok: bool) -> None:
        self._syncs.labels("ok" if ok else "error").inc()

    # --- the deployer's events ----------------------------------------------------

    def on_deployment(self, e: DeploymentChanged) -> None:
        """A change that records a stop (it carries the cause) counts it."""
        named = e.dep if e.dep is not None else e.old
        if e.cause is not None and named is not None:
            self._stops.labels(named.name, e.cause.value).inc()

    def on_start_ended(self, e: StartEnded) -> None:
        """A cold start that ended ready or failed is counted, and one that ended ready timed, from
        its beginning (a failed wake's cold start: from its own, once the wake's engine stopped).
        Wakes are counted and timed by on_woken; a start taken back after ondemand's restart is
        counted, not timed (part of it ran before this ondemand's metrics)."""
        if e.kind != "cold" or e.result not in ("ready", "failed"):
            return
        self._starts.labels(e.name, e.result).inc()
        if e.result == "ready" and not e.taken_back:
            self._start_duration.labels(e.name).observe(e.duration_s)

    def on_slept(self, e: Slept) -> None:
        """An engine was put to sleep (published after its change to asleep, which is no stop)."""
        self._sleeps.labels(e.name, str(e.level), e.reason.value).inc()

    def on_woken(self, e: Woken) -> None:
        """A wake ended. Only a ready one is timed, as only a start that ended ready is: a failed
        wake's time says how long it took to give up (up to ``deployer.wake_timeout_s``)."""
        self._wakes.labels(e.name, e.result).inc()
        if e.result == "ready":
            self._wake_duration.labels(e.name).observe(e.seconds)

    def on_start_timed(self, e: StartTimed) -> None:
        """A cold start ended ready: its phases' durations, and its ETA's error when one was given."""
        for phase, seconds in e.phases.items():
            self._phase.labels(e.name, phase).observe(seconds)
        if e.eta_error is not None:
            self._eta_error.observe(e.eta_error)

    # --- the scrape ---------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
