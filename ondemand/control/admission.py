"""The controller's async edge: a request waiting for its slot, and an
administrator's mode switch. Everything decided here is decided by the core
(``controller.py``) in plain ``def`` calls; the only awaits are a waiter's
sleep until the core wakes it, and the deployer's writes of a mode switch.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..engines.deployer import Deployer
from ..errors import BudgetError, DeployerError, InsufficientMemory, OndemandError
from ..model import Deployment
from .controller import Controller, Slot

log = logging.getLogger("ondemand.control.admission")

__all__ = ["Admission", "Slot"]


class Admission:
    def __init__(self, controller: Controller, deployer: Deployer):
        self.controller = controller
        self.deployer = deployer

    def take_now(self, dep_id: int) -> Slot | None:
        """A slot at once when ``dep_id`` is ready, else None (nothing joined, nothing waits);
        raises ``ondemand_busy`` past its ``max_inflight``. The streaming path asks this first,
        so that a ready model's stream makes no task of its own for the notice."""
        return self.controller.try_take(dep_id)

    async def acquire(self, dep_id: int, *, arrival: float | None = None,
                      on_queued: Callable[[], None] | None = None) -> Slot:
        """A slot of ``dep_id``: at once when it is ready, else once the core says so.

        ``arrival``: when the request arrived (its deadline counts from it).
        ``on_queued`` is called once, the first time the request waits for memory.
        Raises OndemandError with the codes of the README's error table. A hang-up
        (cancellation) leaves the queue at once and never takes a slot.
        """
        core = self.controller
        slot = core.try_take(dep_id)
        if slot is not None:
            return slot
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        waiter = core.join(dep_id, arrival=core.clock() if arrival is None else arrival, notify=wake.set,
                           on_queued=on_queued)
        try:
            while True:
                # take() counts the slot in the same step as it reads ready: the count and the
                # grant are one, and a waiter cancelled before this line has taken nothing.
                slot = core.take(waiter)
                if slot is not None:
                    return slot
                wake.clear()
                # A timer that sets the event (take() then raises the timeout), not wait_for,
                # which would wrap the wait in a task of its own (Python < 3.12).
                timer = loop.call_later(core.next_wake(waiter) + 0.001, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
        finally:
            core.leave(waiter)

    async def set_mode(self, dep_id: int, mode: str, *, idle_timeout_s: int | None = None,
                       set_idle_timeout: bool = False, user: str | None = None) -> Deployment:
        """Switch a deployment's mode (README, "Switch to always on"). A refused start
        clears the pending mode and leaves the deployment as it was."""
        plan = self.controller.plan_mode(dep_id, mode, idle_timeout_s=idle_timeout_s,
                                         set_idle_timeout=set_idle_timeout)
        dep = await self.deployer.update(dep_id, actor="admin", user=user, audit="ondemand_mode", text=plan.text,
                                         detail=plan.detail, **plan.fields)
        self.controller.mode_switched(dep_id)
        if not plan.start:
            return dep
        try:
            await self.deployer.admit_start(dep_id, actor="admin", user=user,
                                            text="starting for the switch to always on",
                                            held_for_others=lambda: self.controller.held_for_others(dep_id))
        except (InsufficientMemory, BudgetError, DeployerError) as exc:
            await self.deployer.update(dep_id, actor="admin", user=user, pending_mode=None,
                                       text=f"switch to always on refused: {exc}")
            self.controller.mode_switched(dep_id)
            code = "insufficient_memory" if isinstance(exc, InsufficientMemory) else "start_refused"
            raise OndemandError(409, code, f"cannot start it now: {exc}") from exc
        return self.deployer.get(dep_id) or dep
