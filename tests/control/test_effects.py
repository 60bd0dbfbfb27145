"""The decision core's effects for real (ondemand/control/effects.py): each effect a named task
that calls the deployer or the budget and reports back to the core through one ``on_*`` method,
whatever happens (an error, a defect of ours, a cancellation at shutdown), so that no attempt is
left in a phase whose report never comes; and the one reading a fit check reuses, make-room's
settle's, handed to the admit that follows it in the same step. First against fakes of the deployer
and the core, then against the real deployer and engine processes (helpers.controller_env)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from helpers import controller_env, fill_the_disk, one_line_errors, wait_for
from test_controller_races import held_budget

from ondemand.control.effects import DeployerEffects
from ondemand.errors import BudgetError, DeployerError, InsufficientMemory


class Core:
    """The core's side of the effects: what they ask it (the holds, wanted, the precheck), and
    every report they make, in order."""

    asleep_residue_gib = 0.0  # (bind sets the budget's)

    def __init__(self) -> None:
        self.reports: list[tuple] = []

    def held_for_others(self, dep_id: int) -> dict[int, float]:
        return {}

    def wanted(self, dep_id: int) -> bool:
        return True

    def precheck(self, for_dep: int | None):
        return lambda dep: True

    def on_admitted(self, dep_id: int, started: bool) -> None:
        self.reports.append(("admitted", dep_id, started))

    def on_refused(self, dep_id: int, exc: InsufficientMemory) -> None:
        self.reports.append(("refused", dep_id, exc.need))

    def on_budget_error(self, dep_id: int, reason: str) -> None:
        self.reports.append(("budget_error", dep_id, reason))

    def on_start_error(self, dep_id: int, reason: str) -> None:
        self.reports.append(("start_error", dep_id, reason))

    def on_stopped(self, dep_id: int, approved: bool, for_dep: int | None) -> None:
        self.reports.append(("stopped", dep_id, approved, for_dep))


class Deployer:
    """The deployer's calls an effect makes, each answering ``outcome``: returned, or raised."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.calls: list[str] = []

    async def _answer(self, call: str):
        self.calls.append(call)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    async def admit_start(self, dep_id: int, **kw):
        return await self._answer("admit_start")

    async def stop(self, dep_id: int, precheck, **kw):
        return await self._answer("stop")

    async def sleep(self, dep_id: int, level, precheck, **kw):
        return await self._answer("sleep")


class Budget:
    asleep_residue_gib = 2.0


def effects_on(outcome) -> tuple[DeployerEffects, Core, Deployer]:
    deployer, core = Deployer(outcome), Core()
    fx = DeployerEffects(deployer, Budget(), sampler=None, publish=lambda event: None)
    fx.bind(core)
    return fx, core, deployer


@pytest.mark.parametrize("outcome, report", [
    (True, ("admitted", 1, True)),
    (False, ("admitted", 1, False)),  # starting or ready already, or nobody wanted it
    (InsufficientMemory(10, 4, 24), ("refused", 1, 10)),
    (BudgetError("nvidia-smi did not answer"), ("budget_error", 1, "nvidia-smi did not answer")),
    (DeployerError("cannot start from stopping"), ("start_error", 1, "cannot start from stopping")),
    (RuntimeError("a bug"), ("start_error", 1, "internal error: RuntimeError('a bug')")),
    (asyncio.CancelledError(), ("admitted", 1, False)),  # shutdown: the attempt is idle again
], ids=["started", "not_started", "refused", "budget", "deployer", "defect", "cancelled"])
async def test_an_admit_reports_once_by_what_the_deployer_answered(outcome, report):
    fx, core, deployer = effects_on(outcome)
    fx.admit(1, text="Started for a request")
    await wait_for(lambda: len(fx.tasks) == 0, what="the admit's task to end")
    assert deployer.calls == ["admit_start"] and core.reports == [report]


@pytest.mark.parametrize("how, outcome, approved", [
    ("stop", True, True), ("stop", False, False), ("stop", DeployerError("gone"), False),
    ("stop", RuntimeError("a bug"), False),
    ("stop", asyncio.CancelledError(), False),
    ("sleep", 1, True), ("sleep", 0, True), ("sleep", None, False), ("sleep", RuntimeError("a bug"), False),
], ids=["stopped", "stop_kept", "stop_refused", "stop_defect", "stop_cancelled", "slept", "stopped_instead",
        "sleep_kept", "sleep_defect"])
async def test_a_put_away_reports_once_whatever_happens(how, outcome, approved):
    """A stop or a sleep (make-room's for deployment 7 here) reports ``on_stopped`` once, approved
    only when the deployer put it away: a stop says True; a sleep its level, 0 when it stopped it
    instead, None when its precheck kept it. An error, a defect or a cancellation (shutdown) is a
    put-away not done."""
    fx, core, deployer = effects_on(outcome)
    put_away = fx.stop if how == "stop" else fx.sleep
    put_away(3, text="Put to sleep to make room for D7", for_dep=7)
    await wait_for(lambda: len(fx.tasks) == 0, what="the put-away's task to end")
    assert deployer.calls == [how] and core.reports == [("stopped", 3, approved, 7)]


async def test_an_idle_gap_or_audit_row_the_disk_refused_is_one_line_and_a_defect_keeps_its_traceback(
        store, monkeypatch, caplog):
    """interfaces.md: a full disk is a one-line error. The idle gaps and the core's audit rows,
    written by tasks as the start history is, logged the StateFileError's whole traceback."""
    fx, _core, deployer = effects_on(True)
    deployer.store = store
    fill_the_disk(store, monkeypatch)
    fx.idle_gap(1, 42.0)
    fx.audit("ondemand_queue_timeout", 1, "D1 was not ready within 900 s", {})
    await wait_for(lambda: len(fx.tasks) == 0, what="the writes to end")
    lines = sorted(one_line_errors(caplog, "ondemand.control.effects"))
    assert len(lines) == 2, lines
    assert lines[0].startswith("ERROR ondemand.control.effects: cannot keep an idle gap of deployment 1: the state "
                               "file ") and "database or disk is full" in lines[0]
    assert lines[1].startswith("ERROR ondemand.control.effects: cannot write the audit row ondemand_queue_timeout: "
                               "the state file ") and "database or disk is full" in lines[1]
    caplog.clear()

    async def defect(*args, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(store, "write_idle_gap", defect)
    monkeypatch.setattr(store, "write_audit", defect)
    fx.idle_gap(1, 42.0)
    fx.audit("ondemand_queue_timeout", 1, "again", {})
    await wait_for(lambda: len(fx.tasks) == 0, what="the writes to end")
    records = [r for r in caplog.records if r.name == "ondemand.control.effects"]
    assert len(records) == 2 and all(r.exc_info is not None for r in records)


# --- against the real deployer and engine processes -----------------------------------------------

async def test_only_make_rooms_own_reading_serves_the_admit_after_it(tmp_path, store):
    """Issue 40: a fit check reads the GPUs anew, but for the admit that follows make-room's
    settle, which takes the settle's reading (the one that showed the freed memory) in the same
    step; nothing else is reused, so a reading from before the request never places a start."""
    async with controller_env(tmp_path, store, capacity=24) as env:
        d = env.deployer
        a, x = await env.add("a", 16), await env.add("x", 12)
        await env.start(a)
        env.skip(1.1)  # a idle for its full timeout
        await env.fresh_metrics()
        reads, given = [], []
        real_read, real_admit = d.budget.read, d.admit_start

        async def read(deps):
            reads.append(await real_read(deps))
            return reads[-1]

        async def admit_start(dep_id, **kw):
            given.append((dep_id, kw.get("reading"), len(reads)))
            return await real_admit(dep_id, **kw)
        d.budget.read, d.admit_start = read, admit_start
        await d.budget.read(d.all())  # a reading taken just before the request: never reused
        async with await env.acquire(x):
            assert env.state(x) == "ready" and env.state(a) == "stopped"
        # The first admit read anew (refused: a holds the memory); the settle read until a's
        # memory showed free, and the second admit was handed that very reading.
        assert [(dep, r) for dep, r, _ in given] == [(x, None), (x, reads[-1])]
        assert len(reads) >= 3 and given[1][2] == len(reads)
        assert env.effects._settled is None  # never kept past the step that offered it


async def test_an_effect_cancelled_at_shutdown_leaves_no_attempt_stuck(tmp_path, store):
    """Cancelling the effects (shutdown) while an admit reads the budget reports back: the
    attempt is idle again, nothing was marked starting, and the waiter can still leave."""
    from ondemand.control.controller import Phase
    release = asyncio.Event()
    async with controller_env(tmp_path, store, budget=held_budget(release)) as env:
        a = await env.add("a")
        w = asyncio.ensure_future(env.acquire(a))
        await wait_for(lambda: env.controller.attempt_phase(a) is Phase.ADMITTING)
        await env.effects.close()
        assert env.controller.attempt_phase(a) is Phase.IDLE and env.state(a) == "stopped"
        w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await w
        assert env.controller.waiting() == 0 and env.controller.attempt_phase(a) is None
