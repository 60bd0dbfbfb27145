"""engines/startwatch.py: a cold start's phases followed in its engine's log, their ETA counted
down in the view, the metrics, the queued notice; and, end to end, the engine simulator's vLLM
lines read by a running ondemand."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

from ondemand.engines.backends import Engine
from ondemand.engines.recipes import Launch
from ondemand.engines.start import Start
from ondemand.engines.startwatch import StartWatch
from ondemand.events import StartPhase, StartTimed
from ondemand.gateway import notice
from ondemand.model import Deployment, State


class Estimates:
    def __init__(self, single: float | None = None):
        self.single = single

    def eta_s(self, dep_id: int) -> float | None:
        return self.single

    def wake_eta_s(self, dep_id: int, level: int | None = None) -> float | None:
        return self.single


class Log:
    """The engine's log as a backend's follow gives it: chunks the test pushes, in any pieces."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closed = False

    async def follow(self, dep: Deployment):
        try:
            while (chunk := await self.queue.get()) is not None:
                yield chunk
        finally:
            self.closed = True


def dep(state: State, **kw) -> Deployment:
    return Deployment(id=1, name="d", served_name="D", engine="vllm", state=state, **kw)


# The deployment's unit, as the watch finds it by id: its start under way, its caches.
UNIT = SimpleNamespace(dep=dep(State.STOPPED), start=None, launched=None, read_ahead=None)


def watch_of(log: Log, clock: list[float], single: float | None = None) -> tuple[StartWatch, list]:
    published: list = []
    UNIT.start = None
    w = StartWatch(log.follow, publish=published.append, estimates=Estimates(single), units=lambda i: UNIT,
                   clock=lambda: clock[0])
    return w, published


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def start(w: StartWatch, clock: list[float], at: float) -> None:
    """A cold start begins (its StartBegan, as the deployer publishes it) and creates its engine."""
    clock[0] = at
    UNIT.start = Start(dep(State.STARTING), "cold", began=at)
    w.on_start_began(UNIT.start.began_event())
    w.before(UNIT.start, dep(State.STARTING), Launch(None, None, ()))
    w.after(UNIT.start, dep(State.STARTING), Engine(1, "d", "http://x"))
    await settle()


def end(w: StartWatch, clock: list[float], result: str = "ready") -> None:
    """The start ends (the registry's mark leaves ``starting``; its StartEnded)."""
    start, UNIT.start = UNIT.start, None
    w.on_start_ended(start.end(result, now=clock[0]))


async def test_phases_from_a_log_in_pieces_and_the_eta_of_the_next_start():
    log, clock = Log(), [0.0]
    w, published = watch_of(log, clock)
    try:
        await start(w, clock, 100.0)
        assert w.phase(1) == "process" and w.eta_s(1) is None  # no history, no single ETA: nothing known
        for at, chunk in ((101.0, b"noise\nStarting to lo"), (101.0, b"ad model x\n"), (105.0, b"Loading weights "),
                          (105.0, b"took 4 s\nother\n"), (125.0, b"Starting vLLM API server on http://h:1\n")):
            clock[0] = at
            await log.queue.put(chunk)
            await settle()
        assert [e.phase for e in published if isinstance(e, StartPhase)] == [
            "container", "process", "weights", "compile", "serving"]
        clock[0] = 128.0
        end(w, clock)
        timed = [e for e in published if isinstance(e, StartTimed)]
        assert timed == [StartTimed(1, "d", {"container": 0.0, "process": 1.0, "weights": 4.0, "compile": 20.0,
                                             "serving": 3.0}, None)]
        await settle()
        assert log.closed and w.phase(1) is None  # the follow ended with the start
        assert w.eta_s(1) == 28.0  # not starting: the whole start's, from its phases
        # The next start: its ETA counts down by phase, re-anchored when a phase begins.
        log.queue = asyncio.Queue()
        log.closed = False
        await start(w, clock, 200.0)
        assert w.eta_s(1) == 28.0 and w.notice_phase(1) == "starting its engine"
        clock[0] = 210.0
        assert w.eta_s(1) == 27.0  # still in process (median 1 s, 10 s in): 0 left of it, then 4 + 20 + 3
        await log.queue.put(b"Loading weights took 1 s\n")  # weights skipped: straight to compile
        await settle()
        assert w.phase(1) == "compile" and w.eta_s(1) == 23.0
        bars = w.fields(1, None)["start_phases"]
        assert [(b["phase"], b["done"]) for b in bars] == [("container", True), ("process", True),
                                                            ("weights", True), ("compile", False),
                                                            ("serving", False)]
        clock[0] = 233.0
        end(w, clock)
        error = [e for e in published if isinstance(e, StartTimed)][-1].eta_error
        assert error == abs(28.0 - 33.0) / 33.0
    finally:
        await w.close()


async def test_an_engine_that_logs_no_phase_keeps_the_single_eta_counted_down():
    log, clock = Log(), [0.0]
    w, published = watch_of(log, clock, single=30.0)
    try:
        await start(w, clock, 0.0)
        await log.queue.put(b"INFO some engine that says nothing of its phases\n")
        await settle()
        clock[0] = 12.0
        assert w.phase(1) == "process" and w.eta_s(1) == 18.0
        assert w.fields(1, None)["start_eta_s"] == 18.0 and w.notice_eta_s(1) == 18.0
        end(w, clock)
        assert w.history.medians(1) == {}  # no logged phase: the next start keeps the single ETA
        error = [e for e in published if isinstance(e, StartTimed)][-1].eta_error
        assert error == abs(30.0 - 12.0) / 12.0
    finally:
        await w.close()


async def test_a_wake_has_no_phases_and_a_failed_start_records_none():
    log, clock = Log(), [0.0]
    w, published = watch_of(log, clock)
    try:
        UNIT.start = Start(dep(State.STARTING, sleep_level=1), "wake", began=0.0)
        w.on_start_began(UNIT.start.began_event())
        assert w.phase(1) is None
        end(w, clock)
        await start(w, clock, 0.0)
        end(w, clock, "failed")
        await settle()
        assert w.phase(1) is None and log.closed
        assert not [e for e in published if isinstance(e, StartTimed)] and w.history.medians(1) == {}
    finally:
        await w.close()


def test_the_queued_notice_names_the_phase():
    text = notice.notice_text("M", 12.4, (1, 2), "loading weights")
    assert "(place 1 of 2, loading weights, about 12 s)" in text
    assert "(about 3 s)" in notice.notice_text("M", 3.0)


async def test_the_simulators_vllm_lines_read_by_a_running_ondemand(server, http):
    """End to end: the simulator prints vLLM's phase lines as it loads; the view shows each phase
    while it starts, the metrics count them, and the next start's ETA is by phase."""
    dep_id = await server.add("p", 10, "--startup-delay", "1.2", "--weights-delay", "0.3", "--compile-delay", "0.5")
    seen: list[str] = []
    server.app[_bus_key()].subscribe(StartPhase, lambda e: seen.append(e.phase))
    await server.deployer.admit_start(dep_id)

    async def in_compile():
        async with http.get(f"{server.url}/api/deployments/{dep_id}", headers=server.admin_headers()) as r:
            view = await r.json()
        return view if view["start_phase"] == "compile" else None
    view = await wait_for(in_compile, timeout=10, interval=0.05, what="the compile phase in the view")
    assert [b["phase"] for b in view["start_phases"]] == ["container", "process", "weights", "compile"]
    await server.deployer.wait_started(dep_id)
    assert seen == ["container", "process", "weights", "compile", "serving"]
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers()) as r:
        text = await r.text()
    counts = {s.labels["phase"]: s.value for f in text_string_to_metric_families(text)
              if f.name == "ondemand_start_phase_seconds" for s in f.samples if s.name.endswith("_count")}
    assert counts == {"container": 1.0, "process": 1.0, "weights": 1.0, "compile": 1.0, "serving": 1.0}
    weights = server.app[_watch_key()].history.medians(dep_id)["weights"]
    assert 0.2 <= weights < 3.0  # the simulator's 0.3 s, as seen through the log
    assert _eta_errors(text) == (0.0, 0.0)  # the first start had no ETA to err
    await server.deployer.stop(dep_id)
    # The next start is given an ETA (its phases' medians) as it begins: its error is counted.
    timed: list[StartTimed] = []
    server.app[_bus_key()].subscribe(StartTimed, timed.append)
    await server.deployer.admit_start(dep_id)
    await server.deployer.wait_started(dep_id)
    async with http.get(f"{server.url}/metrics", headers=server.admin_headers()) as r:
        text = await r.text()
    (error,) = [e.eta_error for e in timed]
    assert error is not None and _eta_errors(text) == (1.0, error)
    await server.deployer.stop(dep_id)


def _eta_errors(text: str) -> tuple[float, float]:
    """ondemand_start_eta_error_ratio's count and sum."""
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               if f.name == "ondemand_start_eta_error_ratio" for s in f.samples}
    return samples.get("ondemand_start_eta_error_ratio_count", 0.0), samples.get("ondemand_start_eta_error_ratio_sum", 0.0)


def _bus_key():
    from ondemand.admin.components import BUS
    return BUS


def _watch_key():
    from ondemand.admin.components import WATCH
    return WATCH
