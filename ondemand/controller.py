"""The controller: slots, the wait queue, make-room decisions, start failures,
mode switches and the live counters of on-demand deployments.

It owns in memory (nothing is persisted; design document, "Nothing is
persisted"): per-deployment in-flight counts, idle timers, the waiters and
the queue. It drives the deployer, which owns the states.

How a request gets a slot (``acquire``): ready → a slot at once, counted
only when the waiter takes it (no await between the state read and the
count). Otherwise the request becomes a waiter of its deployment and loops:
it kicks the deployment's *attempt* if none runs, then sleeps until a change
(state change, removal, queue change), its own verdict, or at most 15 s.
An attempt is a task of its own, one per deployment, shared by all its
waiters, so a burst of first requests starts the model once, and a waiter
that hangs up never cancels a deployer call half-way. Its decisions (start,
make room, queue) run under ``_lock``, the one controller lock, so two
attempts never pick the same victims or count the same free memory twice.

Invariants:
- a slot is handed out only for state ``ready``, synchronously;
- a stop is approved only by ``is_idle`` run inside ``deployer.stop``'s
  precheck, which marks ``stopping`` before any await; so a slot and a stop
  never interleave (design document, "Never stopping a busy model");
- every waiter leaves in its ``finally``, so counts never drift, and the
  queue entry of a deployment nobody waits for is removed at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any, Callable

from .budget import Budget
from .deployer import Deployer, StartFailed, StartInterrupted
from .errors import DeployerError, InsufficientMemory, OndemandError
from .eviction import Candidate, pick_victims
from .metrics import MetricsSampler
from .queue import WaitQueue
from .tasks import TaskGroup

log = logging.getLogger("ondemand.controller")

ACTOR = "ondemand"
STARTABLE = frozenset({"stopped", "failed", "asleep"})
SLEEPING = frozenset({"stopped", "asleep", "stopping", "planned"})
BACKOFF_FIRST_S = 60.0
BACKOFF_MAX_S = 900.0


def _err_stopped(name: str) -> OndemandError:
    return OndemandError(503, "ondemand_stopped",
                         f"{name} was stopped while it was starting for this request; send it again to start it")


class Slot:
    """A granted slot; ``release()`` is idempotent, so a double release cannot drift the count."""
    __slots__ = ("_controller", "dep_id", "_released")

    def __init__(self, controller: "Controller", dep_id: int):
        self._controller = controller
        self.dep_id = dep_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._controller._release(self.dep_id)

    async def __aenter__(self) -> "Slot":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


class _Waiter:
    __slots__ = ("dep_id", "arrival", "deadline", "on_queued", "notified", "verdict")

    def __init__(self, dep_id: int, arrival: float, deadline: float, on_queued, verdict: asyncio.Future):
        self.dep_id = dep_id
        self.arrival = arrival
        self.deadline = deadline
        self.on_queued = on_queued
        self.notified = False
        self.verdict = verdict  # resolved with an OndemandError for this waiter


@dataclasses.dataclass
class _DepWait:
    waiters: list[_Waiter] = dataclasses.field(default_factory=list)
    attempt: asyncio.Task | None = None
    starting_for_request: bool = False


@dataclasses.dataclass
class _Backoff:
    until: float
    delay: float
    reason: str


class Controller:
    def __init__(self, deployer: Deployer, budget: Budget, metrics: MetricsSampler, *,
                 queue_timeout_s: float = 900, max_queued: int = 256, idle_timeout_s: int = 600,
                 min_idle_timeout_s: int = 60, make_room_wait_s: float = 20.0, recent_stop_s: float = 20.0,
                 max_tick_s: float = 15.0, publish_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 on_counters: Callable[[int], None] | None = None):
        self.deployer = deployer
        self.budget = budget
        self.metrics = metrics
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.idle_timeout_s = idle_timeout_s
        self.min_idle_timeout_s = min_idle_timeout_s
        self.make_room_wait_s = make_room_wait_s
        self.recent_stop_s = recent_stop_s
        self.max_tick_s = max_tick_s
        self.publish_interval_s = publish_interval_s
        self.clock = clock
        self.wall = wall
        self.on_counters = on_counters
        self.queue = WaitQueue()
        self.tasks = TaskGroup("controller")
        self._lock = asyncio.Lock()
        self._inflight: dict[int, int] = {}
        self._last_activity: dict[int, float] = {}
        self._last_request_at: dict[int, float] = {}
        self._waits: dict[int, _DepWait] = {}
        self._waiting = 0
        self._backoff: dict[int, _Backoff] = {}
        self._last_ondemand_stop = -math.inf
        self._seen: dict[int, tuple] = {}
        self._published_at: dict[int, float] = {}
        self._publish_timers: dict[int, asyncio.TimerHandle] = {}
        self._tick: asyncio.Future | None = None
        now = clock()
        for dep in deployer.all():  # first seen after a restart: a full idle timeout
            self._last_activity[dep["id"]] = now
            self._seen[dep["id"]] = self._fingerprint(dep)
        deployer.listeners.append(self._on_deployment)

    # --- reads ----------------------------------------------------------------

    def inflight(self, dep_id: int) -> int:
        return self._inflight.get(dep_id, 0)

    def waiting(self, dep_id: int | None = None) -> int:
        if dep_id is None:
            return self._waiting
        dw = self._waits.get(dep_id)
        return len(dw.waiters) if dw else 0

    def idle_timeout(self, dep: dict[str, Any]) -> int:
        return dep.get("idle_timeout_s") or self.idle_timeout_s

    def is_idle(self, dep: dict[str, Any], now: float | None = None) -> bool:
        """May this deployment be stopped as idle (reaper, make-room)? No await: a precheck."""
        dep_id = dep["id"]
        now = self.clock() if now is None else now
        return ((dep.get("mode") or "always_on") == "on_demand"
                and dep["role"] == "model"
                and dep["state"] in ("ready", "asleep")
                and not dep.get("pending_mode")
                and self._inflight.get(dep_id, 0) == 0
                and not self.waiting(dep_id)
                and now - self._last_activity.get(dep_id, now) >= self.idle_timeout(dep)
                and self.metrics.idle(dep_id))

    def status(self, dep_id: int) -> dict[str, Any]:
        dep = self.deployer.get(dep_id)
        dw = self._waits.get(dep_id)
        inflight = self._inflight.get(dep_id, 0)
        starting = dep is not None and dep["state"] == "starting"
        if dep_id in self.queue and not starting:
            phase = "queued"
        elif starting and dw is not None and dw.starting_for_request:
            phase = "starting_for_request"
        elif inflight:
            phase = "serving"
        elif dep is None or dep["state"] == "failed":
            phase = "failed"
        elif dep["state"] in SLEEPING:
            phase = "sleeping"
        else:
            phase = "idle"
        return {"inflight": inflight, "queued": len(dw.waiters) if dw else 0,
                "last_request_at": self._last_request_at.get(dep_id), "phase": phase}

    # --- notifications ----------------------------------------------------------

    def _wake_all(self) -> None:
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)
        self._tick = None

    def _tick_future(self) -> asyncio.Future:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        return self._tick

    @staticmethod
    def _fingerprint(dep: dict[str, Any]) -> tuple:
        from .deployer import CONFIG_FIELDS
        return tuple(repr(dep.get(k)) for k in sorted(CONFIG_FIELDS)) + (dep.get("mode"),)

    def _on_deployment(self, dep_id: int, dep: dict[str, Any] | None, old: str | None) -> None:
        """Deployer listener: every transition, change and removal."""
        now = self.clock()
        if dep is None:
            dw = self._waits.get(dep_id)
            if dw is not None:
                name = f"deployment {dep_id}"
                err = _err_stopped(name) if dw.starting_for_request else \
                    OndemandError(404, "not_found", f"deployment {dep_id} was removed")
                self._give_verdict(dep_id, err)
            self.queue.remove(dep_id)
            for table in (self._inflight, self._last_activity, self._last_request_at, self._backoff, self._seen):
                table.pop(dep_id, None)
            self._wake_all()
            return
        fp = self._fingerprint(dep)
        seen = self._seen.get(dep_id)
        if seen is None:
            self._last_activity[dep_id] = now  # a new deployment
        elif seen != fp:
            self._backoff.pop(dep_id, None)  # a changed model or configuration
            if seen[-1] != "on_demand" and dep.get("mode") == "on_demand":
                self._last_activity[dep_id] = now  # switched to on demand
        self._seen[dep_id] = fp
        if dep["state"] == "ready" and old != "ready":
            self._last_activity[dep_id] = now
            self._backoff.pop(dep_id, None)
        self._wake_all()

    def _counters_changed(self, dep_id: int) -> None:
        """At most one publish a second per deployment: the first at once, later ones folded."""
        if self.on_counters is None or dep_id in self._publish_timers:
            return
        now = self.clock()
        due = self._published_at.get(dep_id, -math.inf) + self.publish_interval_s
        if now >= due:
            self._publish(dep_id)
        else:
            self._publish_timers[dep_id] = asyncio.get_running_loop().call_later(due - now, self._publish, dep_id)

    def _publish(self, dep_id: int) -> None:
        self._publish_timers.pop(dep_id, None)
        self._published_at[dep_id] = self.clock()
        if self.deployer.get(dep_id) is not None and self.on_counters is not None:
            self.on_counters(dep_id)

    # --- slots ------------------------------------------------------------------

    def _grant(self, dep_id: int) -> Slot:
        self._inflight[dep_id] = self._inflight.get(dep_id, 0) + 1
        self._last_activity[dep_id] = self.clock()
        self._last_request_at[dep_id] = self.wall()
        self._counters_changed(dep_id)
        return Slot(self, dep_id)

    def _release(self, dep_id: int) -> None:
        n = self._inflight.get(dep_id, 0) - 1
        if n > 0:
            self._inflight[dep_id] = n
        else:
            self._inflight.pop(dep_id, None)
        if dep_id in self._last_activity:
            self._last_activity[dep_id] = self.clock()
        self._counters_changed(dep_id)

    async def acquire(self, dep_id: int, *, on_queued: Callable[[], None] | None = None,
                      arrival: float | None = None) -> Slot:
        """A slot of ``dep_id``, starting it, making room or queueing as needed.

        ``arrival``: when the request arrived (the deadline counts from it).
        ``on_queued`` is called once, the first time the request waits for memory.
        Raises OndemandError with the design document's codes.
        """
        dep = self.deployer.get(dep_id)
        if dep is None:
            raise OndemandError(404, "not_found", f"deployment {dep_id} does not exist")
        if dep["state"] == "ready":
            return self._grant(dep_id)
        self._check_backoff(dep)
        if self._waiting >= self.max_queued:
            raise OndemandError(503, "ondemand_queue_full",
                                f"{self._waiting} requests are waiting already (ondemand_max_queued)",
                                headers={"Retry-After": "60"})
        arrival = self.clock() if arrival is None else arrival
        waiter = _Waiter(dep_id, arrival, arrival + self.queue_timeout_s, on_queued,
                         asyncio.get_running_loop().create_future())
        dw = self._waits.get(dep_id)
        if dw is None:
            dw = self._waits[dep_id] = _DepWait()
        dw.waiters.append(waiter)
        self._waiting += 1
        self._counters_changed(dep_id)
        try:
            if dep_id in self.queue:
                self._notify_queued(waiter)
            while True:
                if waiter.verdict.done():
                    raise waiter.verdict.result()
                dep = self.deployer.get(dep_id)
                if dep is None:
                    raise OndemandError(404, "not_found", f"deployment {dep_id} was removed")
                if dep["state"] == "ready":
                    return self._grant(dep_id)
                self._kick(dep_id, dw, dep)
                if waiter.verdict.done():
                    continue
                now = self.clock()
                if now >= waiter.deadline:
                    await self._timed_out(dep, waiter)
                timeout = min(self.max_tick_s, waiter.deadline - now, self._next_idle_expiry(now))
                await asyncio.wait((self._tick_future(), waiter.verdict), timeout=max(timeout, 0.01),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            dw.waiters.remove(waiter)
            self._waiting -= 1
            if not dw.waiters:
                if self._waits.get(dep_id) is dw and (dw.attempt is None or dw.attempt.done()):
                    del self._waits[dep_id]
                if self.queue.remove(dep_id):  # nobody waits: it gives up its place
                    self._wake_all()
            self._counters_changed(dep_id)

    async def _timed_out(self, dep: dict[str, Any], waiter: _Waiter) -> None:
        waited = self.clock() - waiter.arrival
        text = f"a request for {dep['name']} gave up after waiting {waited:.0f} s (ondemand_queue_timeout_s)"
        try:
            await self.deployer.store.write_audit(action="ondemand_queue_timeout", actor=ACTOR,
                                                  deployment_id=dep["id"], text=text,
                                                  detail={"waited_s": round(waited, 1), "state": dep["state"]})
        except Exception:
            log.exception("cannot audit a queue timeout")
        raise OndemandError(503, "ondemand_queue_timeout",
                            f"{dep['served_name']} was not ready within {self.queue_timeout_s:g} s; try again later",
                            headers={"Retry-After": "60"})

    def _next_idle_expiry(self, now: float) -> float:
        """Seconds until some idle timeout runs out, when anything is queued (a victim may appear)."""
        if not len(self.queue):
            return math.inf
        soonest = math.inf
        for dep in self.deployer.all():
            if ((dep.get("mode") or "always_on") == "on_demand" and dep["state"] in ("ready", "asleep")
                    and not self._inflight.get(dep["id"])):
                left = self._last_activity.get(dep["id"], now) + self.idle_timeout(dep) - now
                if left > 0:
                    soonest = min(soonest, left + 0.05)
        return soonest

    def _notify_queued(self, waiter: _Waiter) -> None:
        if not waiter.notified:
            waiter.notified = True
            if waiter.on_queued is not None:
                try:
                    waiter.on_queued()
                except Exception:
                    log.exception("on_queued callback failed")

    def _give_verdict(self, dep_id: int, err: OndemandError) -> None:
        dw = self._waits.get(dep_id)
        for waiter in (dw.waiters if dw else ()):
            if not waiter.verdict.done():
                waiter.verdict.set_result(err)

    # --- start failures -------------------------------------------------------

    def _check_backoff(self, dep: dict[str, Any]) -> None:
        b = self._backoff.get(dep["id"])
        if b is not None and self.clock() < b.until:
            raise self._start_failed(dep, b)

    def _start_failed(self, dep: dict[str, Any], b: _Backoff) -> OndemandError:
        left = max(1, int(b.until - self.clock()))
        return OndemandError(503, "start_failed",
                             f"{dep['served_name']} failed to start: {b.reason}; new starts are refused "
                             f"for {left} s", headers={"Retry-After": str(left)})

    def _record_failure(self, dep_id: int, reason: str) -> _Backoff:
        prev = self._backoff.get(dep_id)
        delay = BACKOFF_FIRST_S if prev is None else min(prev.delay * 2, BACKOFF_MAX_S)
        b = self._backoff[dep_id] = _Backoff(self.clock() + delay, delay, reason)
        return b

    # --- attempts -------------------------------------------------------------

    def _kick(self, dep_id: int, dw: _DepWait, dep: dict[str, Any]) -> None:
        """Start the deployment's attempt unless one runs or the state says wait."""
        if dw.attempt is not None and not dw.attempt.done():
            return
        if dep["state"] not in STARTABLE or dep.get("pending_mode"):
            return  # starting by hand, stopping, planned, or set_mode is starting it: wait
        if (dep.get("mode") or "always_on") != "on_demand":
            if dep["state"] in ("stopped", "failed"):
                self._give_verdict(dep_id, OndemandError(
                    503, "not_on_demand", f"{dep['served_name']} was switched to always on and is {dep['state']}"))
            return
        b = self._backoff.get(dep_id)
        if b is not None and self.clock() < b.until:
            self._give_verdict(dep_id, self._start_failed(dep, b))
            return
        dw.attempt = self.tasks.spawn(self._attempt(dep_id, dw), f"attempt {dep['name']}")

    async def _attempt(self, dep_id: int, dw: _DepWait) -> None:
        stopped_victim = False
        async with self._lock:
            while True:
                dep = self.deployer.get(dep_id)
                if not dw.waiters or dep is None:
                    return  # an attempt starts nothing when no one waits any more
                if dep["state"] not in STARTABLE or dep.get("pending_mode") \
                        or (dep.get("mode") or "always_on") != "on_demand":
                    return
                is_head = self.queue.is_head_or_empty(dep_id)
                need = float(dep.get("memory_gib") or 0)
                if not is_head:
                    reserved = self.queue.reserved_for_others(dep_id)
                    if reserved > 0:
                        snap = await self.budget.snapshot(self.deployer.all(), exclude=dep_id)
                        if need > snap.free - reserved + 1e-9:
                            self._enqueue(dep_id, dw)
                            return
                waking = dep["state"] == "asleep"
                # Set before the move to starting, whose view is published from inside admit_start.
                dw.starting_for_request = True
                try:
                    admitted = await self.deployer.admit_start(
                        dep_id, actor=ACTOR, audit="ondemand_start",
                        text=("Woken" if waking else "Started") + " for a request")
                    break
                except InsufficientMemory as exc:
                    dw.starting_for_request = False
                    recent_stop = self.clock() - self._last_ondemand_stop < self.recent_stop_s
                    if exc.need > exc.capacity + 1e-9 and not stopped_victim and not recent_stop:
                        self._give_verdict(dep_id, OndemandError(
                            503, "does_not_fit",
                            f"{dep['served_name']} needs {exc.need:g} GiB, more than the {exc.capacity:g} GiB "
                            "that on-demand models can ever use here"))
                        return
                    self._enqueue(dep_id, dw)
                    if not is_head:
                        return  # only the head makes room
                    victims = self._pick_victims(dep_id, exc.need - exc.free)
                    if not victims:
                        return  # queued until something changes
                    freed = await self._stop_victims(victims, dep)
                    if not freed:
                        return  # they became busy: wait for the next change
                    stopped_victim = True
                    self.queue.reserve(dep_id, freed)
                    await self._wait_for_free(dep, need)
                except DeployerError as exc:
                    dw.starting_for_request = False
                    dep = self.deployer.get(dep_id)
                    if dep is not None and dep["state"] in STARTABLE:
                        b = self._record_failure(dep_id, str(exc))
                        self._give_verdict(dep_id, self._start_failed(dep, b))
                    return
        if not admitted:
            dw.starting_for_request = False
            return
        if self.queue.remove(dep_id):
            self._wake_all()
        try:
            await self.deployer.wait_started(dep_id)
        except StartFailed as exc:
            dep = self.deployer.get(dep_id)
            b = self._record_failure(dep_id, str(exc))
            if dep is not None:
                self._give_verdict(dep_id, self._start_failed(dep, b))
        except StartInterrupted:
            self._give_verdict(dep_id, _err_stopped(dep["served_name"]))
        finally:
            dw.starting_for_request = False
            if not dw.waiters and self._waits.get(dep_id) is dw:
                del self._waits[dep_id]

    def _enqueue(self, dep_id: int, dw: _DepWait) -> None:
        first = min((w.arrival for w in dw.waiters), default=self.clock())
        if self.queue.add(dep_id, first):
            log.info("deployment %d queued for memory", dep_id)
            self._wake_all()
        for waiter in dw.waiters:
            self._notify_queued(waiter)
        self._counters_changed(dep_id)

    def _pick_victims(self, requester: int, shortfall: float) -> list[Candidate]:
        now = self.clock()
        candidates = [Candidate(d["id"], float(d.get("memory_gib") or 0), self._last_activity.get(d["id"], now))
                      for d in self.deployer.all() if d["id"] != requester and self.is_idle(d, now)]
        return pick_victims(candidates, shortfall)

    async def _stop_victims(self, victims: list[Candidate], requester: dict[str, Any]) -> float:
        freed = 0.0
        names = []
        for v in victims:
            stopped = await self.deployer.stop(
                v.id, lambda d: self.is_idle(d), actor=ACTOR, audit="ondemand_sleep",
                text=f"Put to sleep to make room for {requester['served_name']}")
            if stopped:
                self._last_ondemand_stop = self.clock()
                freed += v.memory_gib
                names.append(str(v.id))
        if names:
            log.info("stopped %s to make room for %s (%.1f GiB)", ", ".join(names), requester["name"], freed)
        return freed

    async def _wait_for_free(self, dep: dict[str, Any], need: float) -> None:
        """Freed memory may read as used for a while (nvidia-smi): wait up to ~20 s."""
        deadline = self.clock() + self.make_room_wait_s
        while self.clock() < deadline:
            snap = await self.budget.snapshot(self.deployer.all(), exclude=dep["id"])
            if snap.free + 1e-9 >= need:
                return
            await asyncio.sleep(0.25)

    # --- the reaper's step ------------------------------------------------------

    async def reap_once(self) -> list[int]:
        """Stop every on-demand deployment that is idle by the rules; returns their ids."""
        stopped = []
        now = self.clock()
        for dep in self.deployer.all():
            if not self.is_idle(dep, now):
                continue
            minutes = round(self.idle_timeout(dep) / 60, 2)  # "0.33", "10", "1.5"
            ok = await self.deployer.stop(dep["id"], lambda d: self.is_idle(d), actor=ACTOR, audit="ondemand_sleep",
                                          text=f"Put to sleep after {minutes:g} min idle")
            if ok:
                self._last_ondemand_stop = self.clock()
                stopped.append(dep["id"])
        return stopped

    # --- mode switch --------------------------------------------------------------

    async def set_mode(self, dep_id: int, mode: str, *, idle_timeout_s: int | None = None,
                       set_idle_timeout: bool = False, user: str | None = None) -> dict[str, Any]:
        """Switch a deployment's mode (design document, "Switch to always on")."""
        if mode not in ("on_demand", "always_on"):
            raise OndemandError(400, "invalid_mode", "mode must be on_demand or always_on")
        if set_idle_timeout and idle_timeout_s is not None and \
                not self.min_idle_timeout_s <= idle_timeout_s <= 86400:
            raise OndemandError(400, "invalid_idle_timeout",
                                f"idle_timeout_s must be {self.min_idle_timeout_s} to 86400 seconds, or null")
        async with self._lock:  # a start decision, like an attempt's
            dep = self.deployer.get(dep_id)
            if dep is None:
                raise OndemandError(404, "not_found", f"deployment {dep_id} does not exist")
            if dep["role"] != "model" and mode == "on_demand":
                raise OndemandError(400, "invalid_mode", f"a {dep['role']} deployment is always always_on")
            old = {"mode": dep.get("mode") or "always_on", "idle_timeout_s": dep.get("idle_timeout_s"),
                   "pending_mode": dep.get("pending_mode")}
            fields: dict[str, Any] = {}
            if set_idle_timeout:
                fields["idle_timeout_s"] = idle_timeout_s
            start = False
            if mode == "on_demand":
                fields.update(mode="on_demand", pending_mode=None)
            elif old["mode"] == "always_on":
                fields["pending_mode"] = None
            elif dep["state"] in ("stopped", "failed", "asleep"):
                fields["pending_mode"] = "always_on"
                start = True
            elif dep["state"] == "starting":
                fields["pending_mode"] = "always_on"  # applied when the start ends
            else:
                fields.update(mode="always_on", pending_mode=None)
            self._backoff.pop(dep_id, None)  # set_mode resets the start backoff
            new = {**old, **{k: v for k, v in fields.items() if k in old}}
            text = f"mode {old['mode']} → {mode}" + (" (pending the start)" if start else "")
            dep = await self.deployer.update(dep_id, actor="admin", user=user, audit="ondemand_mode", text=text,
                                             detail={"old": old, "new": new}, **fields)
            if mode == "on_demand":
                self._last_activity[dep_id] = self.clock()
            if start:
                try:
                    await self.deployer.admit_start(dep_id, actor="admin", user=user,
                                                    text="starting for the switch to always on")
                except (InsufficientMemory, DeployerError) as exc:
                    # A refused start clears the pending mode and leaves the deployment as it was.
                    await self.deployer.update(dep_id, actor="admin", user=user, pending_mode=None,
                                               text=f"switch to always on refused: {exc}")
                    if isinstance(exc, InsufficientMemory):
                        raise OndemandError(409, "insufficient_memory", f"cannot start it now: {exc}") from exc
                    raise OndemandError(409, "start_refused", f"cannot start it now: {exc}") from exc
        self._wake_all()
        return dep

    async def close(self) -> None:
        for handle in self._publish_timers.values():
            handle.cancel()
        self._publish_timers.clear()
        await self.tasks.close()
