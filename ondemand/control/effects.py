"""The controller's effects, for real: each action runs as a named task that
calls the deployer or the budget, and reports its result back to the
decision core through one of its ``on_*`` methods.

The core never awaits; the slow work is here, and none of it holds a lock:
a make-room that waits 20 s for a victim to stop or for freed memory to show
is a task like any other, while ``mode set``, ``status``, other stops and
requests for ready models go on. Every report is made in a ``finally`` or an
``except`` that covers the whole call, so an attempt can never be left in a
phase whose report never comes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..engines import warmth
from ..engines.deployer import Deployer
from ..engines.metrics import MetricsSampler
from ..errors import BudgetError, DeployerError, InsufficientMemory, log_unwritten
from ..events import CountersChanged, StopCause
from ..model import Deployment
from ..tasks import TaskGroup
from . import rhythm
from .budget import Budget, Reading
from .controller import ACTOR, Controller
from .keepwarm import rest_levels, tier_costs
from .protocol import Timer
from .starts import StartHistory

log = logging.getLogger("ondemand.control.effects")


class DeployerEffects:
    def __init__(self, deployer: Deployer, budget: Budget, sampler: MetricsSampler, *,
                 publish: Callable[[object], None], settle_poll_s: float = 0.05,
                 starts: StartHistory | None = None):
        self.deployer = deployer
        self.budget = budget
        self.sampler = sampler
        self.starts = starts  # the measured wakes and cold starts: the rest tiers' costs
        self.publish = publish
        self.settle_poll_s = settle_poll_s
        # Make-room's last reading, the one that showed its memory free, handed to the admit the
        # controller asks for in the same step (on_settled): the only reading a fit check reuses.
        # Any other would be older than the request or the attempt, and miss what a process took
        # since (issue 40: a 40 GiB model placed on a GPU a foreign process had just filled).
        self._settled: tuple[int, Reading] | None = None
        self.tasks = TaskGroup("controller")
        self._controller: Controller | None = None

    def bind(self, controller: Controller) -> None:
        """The core the reports go to (made after this object: it reads through it)."""
        self._controller = controller
        controller.asleep_residue_gib = self.budget.asleep_residue_gib  # what make-room counts

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("effects are not bound to a controller")
        return self._controller

    # --- reads ------------------------------------------------------------------

    def deployment(self, dep_id: int) -> Deployment | None:
        return self.deployer.get(dep_id)

    def deployments(self) -> list[Deployment]:
        return self.deployer.all()

    def engine_idle(self, dep_id: int) -> bool:
        return self.sampler.idle(dep_id)

    def sleeping(self, dep_id: int) -> bool:
        unit = self.deployer.unit(dep_id)
        return unit is not None and unit.sleeping

    def idle_level(self, dep: Deployment) -> int:
        return warmth.idle_level(dep, self.budget.per_gpu)

    def tiers(self, dep: Deployment) -> Mapping[str, float]:
        """Its sleep levels as the deployer would take them now (``keepwarm.rest_levels``), and
        stopped; the costs from the start history."""
        levels = rest_levels(dep, self.budget.per_gpu, self.budget.host_available_gib(), self.budget.host_reserve_gib)
        starts = self.starts
        if starts is None:
            return tier_costs(levels, lambda level: None, None)
        return tier_costs(levels, lambda level: starts.wake_eta_s(dep.id, level), starts.eta_s(dep.id))

    def sleep_s(self, dep: Deployment) -> float:
        level = self.idle_level(dep)
        took = self.starts.sleep_eta_s(dep.id, level) if self.starts is not None and level else None
        return took or 0.0

    # --- actions ------------------------------------------------------------------

    def admit(self, dep_id: int, *, text: str) -> None:
        settled, self._settled = self._settled, None
        reading = settled[1] if settled is not None and settled[0] == dep_id else None
        self.tasks.spawn(self._admit(dep_id, text, reading), f"admit {dep_id}")

    async def _admit(self, dep_id: int, text: str, reading: Reading | None) -> None:
        ctl = self.controller
        try:
            started = await self.deployer.admit_start(
                dep_id, actor=ACTOR, audit="ondemand_start", text=text,
                held_for_others=lambda: ctl.held_for_others(dep_id), wanted=lambda: ctl.wanted(dep_id),
                reading=reading)
        except InsufficientMemory as exc:
            ctl.on_refused(dep_id, exc)
        except BudgetError as exc:
            log.warning("cannot read the memory budget for deployment %d: %s", dep_id, exc)
            ctl.on_budget_error(dep_id, str(exc))
        except DeployerError as exc:
            ctl.on_start_error(dep_id, str(exc))
        except asyncio.CancelledError:  # shutdown: never leave the attempt in its phase
            ctl.on_admitted(dep_id, False)
            raise
        except Exception as exc:  # a defect of ours: the waiters hear it as a failed start
            log.exception("admitting deployment %d failed", dep_id)
            ctl.on_start_error(dep_id, f"internal error: {exc!r}")
        else:
            ctl.on_admitted(dep_id, started)

    def prewarm(self, dep_id: int, *, text: str) -> None:
        dep = self.deployer.get(dep_id)
        if dep is not None:  # its weights read ahead (issue 33), whether or not the start follows
            self.deployer.start_hooks.expected(dep)
        self.tasks.spawn(self._prewarm(dep_id, text), f"prewarm {dep_id}")

    async def _prewarm(self, dep_id: int, text: str) -> None:
        """The deployer's start (or wake) with its fit check and no make-room: memory free now
        or nothing; the queue's holds out of reach; ``prewarm_wanted`` asked as it marks."""
        ctl = self.controller
        started = False
        try:
            started = await self.deployer.admit_start(
                dep_id, actor=ACTOR, audit="ondemand_prewarm", text=text,
                held_for_others=lambda: ctl.held_for_others(dep_id), wanted=lambda: ctl.prewarm_wanted(dep_id))
        except InsufficientMemory as exc:
            log.info("no pre-warm of deployment %d: %s", dep_id, exc)
        except (BudgetError, DeployerError) as exc:
            log.warning("no pre-warm of deployment %d: %s", dep_id, exc)
        except Exception:  # a defect of ours: no pre-warm, and the next request starts it as ever
            log.exception("pre-warming deployment %d failed", dep_id)
        finally:  # cancelled too (shutdown): reported, so the period never waits on it
            ctl.on_prewarmed(dep_id, started)

    def stop(self, dep_id: int, *, text: str, for_dep: int | None) -> None:
        self.tasks.spawn(self._put_away(dep_id, text, for_dep, sleep=False), f"stop {dep_id}")

    def sleep(self, dep_id: int, *, text: str, for_dep: int | None, level: int | None = None) -> None:
        self.tasks.spawn(self._put_away(dep_id, text, for_dep, sleep=True, level=level), f"sleep {dep_id}")

    async def _put_away(self, dep_id: int, text: str, for_dep: int | None, *, sleep: bool,
                        level: int | None = None) -> None:
        """Stop it, or put it to sleep (asleep, or stopped instead: the host reserve, a failed
        sleep call), if its precheck still approves it (the reaper's ``is_idle``, or make-room's rule
        for ``for_dep``); reports ``on_stopped`` whatever happens."""
        ctl = self.controller
        done = False
        cause = StopCause.IDLE if for_dep is None else StopCause.MAKE_ROOM
        precheck = ctl.precheck(for_dep)
        try:
            if sleep:
                slept = await self.deployer.sleep(dep_id, level, precheck, actor=ACTOR, audit="ondemand_sleep",
                                                  text=text, cause=cause, or_stop=True)
                done = slept is not None
            else:
                done = await self.deployer.stop(dep_id, precheck, actor=ACTOR, audit="ondemand_sleep", text=text,
                                                cause=cause)
        except Exception:
            log.exception("%s deployment %d failed", "putting to sleep" if sleep else "stopping", dep_id)
        finally:
            ctl.on_stopped(dep_id, done, for_dep)

    def settle(self, dep_id: int, within_s: float) -> None:
        self.tasks.spawn(self._settle(dep_id, within_s), f"settle {dep_id}")

    async def _settle(self, dep_id: int, within_s: float) -> None:
        """Freed memory may read as used for a while (nvidia-smi): look until the
        deployment fits on some allowed GPU set, the fit check's own rule; 50 ms after
        each reading (which itself takes nvidia-smi's time), so freed memory is seen soon
        after it shows."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        settled: tuple[int, Reading] | None = None
        try:
            while loop.time() < deadline:
                # The head of higher priority that took this one's place holds what it freed.
                target = self.controller.settle_target(dep_id)
                dep = self.deployer.get(target)
                if dep is None:
                    return
                try:
                    reading = await self.budget.read(self.deployer.all())
                    self.budget.check_fit(dep, self.deployer.as_read(), reading,
                                          self.controller.held_for_others(target))
                    settled = (target, reading)
                    return
                except BudgetError:
                    return  # the next admit reads it again and says why
                except InsufficientMemory:
                    pass
                await asyncio.sleep(self.settle_poll_s)
        finally:
            # Offered to the admit on_settled asks for in this step; never kept past it.
            self._settled = settled
            try:
                self.controller.on_settled(dep_id)
            finally:
                self._settled = None

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        self.tasks.spawn(self._audit(action, dep_id, text, detail), f"audit {action}")

    async def _audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        try:
            await self.deployer.store.write_audit(action=action, actor=ACTOR, deployment_id=dep_id,
                                                  text=text, detail=detail)
        except Exception as exc:
            log_unwritten(log, exc, "cannot write the audit row %s", action)

    def idle_gap(self, dep_id: int, gap_s: float) -> None:
        self.tasks.spawn(self._idle_gap(dep_id, gap_s), f"idle gap {dep_id}")

    async def _idle_gap(self, dep_id: int, gap_s: float) -> None:
        try:
            await self.deployer.store.write_idle_gap(dep_id, at=time.time(), gap_s=gap_s, keep=rhythm.KEEP)
        except Exception as exc:  # a gap not kept is a little less learned, never a failed request
            log_unwritten(log, exc, "cannot keep an idle gap of deployment %d", dep_id)

    def counters_changed(self, dep_id: int) -> None:
        self.publish(CountersChanged(dep_id))

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)

    async def close(self) -> None:
        await self.tasks.close()
