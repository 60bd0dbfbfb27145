"""The controller's async edge: a request's admission, and an administrator's mode switch.

Everything decided here is decided by the core (``controller.py``) in plain ``def`` calls:
``admit`` is the core's step (a ticket or a refusal, at once) with the engine's address read in
it; the only awaits are a waiter's sleep until the core wakes it (``wait``), and the deployer's
writes of a mode switch.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..engines.deployer import Deployer
from ..errors import BudgetError, DeployerError, InsufficientMemory, OndemandError
from ..model import Deployment
from .controller import Controller
from .ticket import Ticket, Waits, Want
from .verdicts import Refusal

log = logging.getLogger("ondemand.control.admission")

__all__ = ["Admission", "Refusal", "Ticket", "Waits", "Want"]  # what a request meets here


class Admission:
    def __init__(self, controller: Controller, deployer: Deployer):
        self.controller = controller
        self.deployer = deployer

    def admit(self, dep_id: int, want: Want) -> Ticket:
        """A request's verdict in one step (the core's ``admit``: a refusal raised, or a ticket),
        and the engine's address of a ticket that goes on to it, read in that same step (no
        await between): a deployment removed or started on another address before this step
        gives its new state, never a stale target."""
        ticket = self.controller.admit(dep_id, want)
        if ticket.waits is None and (want is Want.TRAFFIC or want is Want.MODEL):
            ticket.base = self.deployer.base_url(dep_id)
        return ticket

    def screen(self, dep_id: int, want: Want) -> Deployment:
        """The refusals that need no wait (``verdicts.screen``), for a request whose body is still
        on its way: they come before it is read. Returns the deployment as read now."""
        return self.controller.screen(dep_id, want)

    async def acquire(self, dep_id: int, *, arrival: float | None = None,
                      on_queued: Callable[[], None] | None = None) -> Ticket:
        """A traffic request's ticket of ``dep_id``: at once when it is ready, else once the core
        says so (``wait``). Raises the core's refusals. The gateway asks ``admit`` and ``wait``
        itself (its body may come between them); this is the races' tests' one call."""
        ticket = self.admit(dep_id, Want.TRAFFIC)
        if ticket.waits is None:
            return ticket
        return await self.wait(dep_id, arrival=arrival, on_queued=on_queued)

    async def wait(self, dep_id: int, *, arrival: float | None = None,
                   on_queued: Callable[[], None] | None = None) -> Ticket:
        """The ticket of a traffic request that has to wait: with its slot, the deployment and
        its engine's base URL as read in the step that grants it.

        ``arrival``: when the request arrived (its deadline counts from it).
        ``on_queued`` is called once, the first time the request waits for memory.
        Raises OndemandError with the codes of the README's error table. A hang-up
        (cancellation) leaves the queue at once and never takes a slot.
        """
        core = self.controller
        ticket = self.admit(dep_id, Want.TRAFFIC)  # a turn of the loop may have passed: ready now?
        if ticket.waits is None:
            return ticket
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        waiter = core.join(dep_id, arrival=core.clock() if arrival is None else arrival, notify=wake.set,
                           on_queued=on_queued)
        try:
            while True:
                # take() counts the slot in the same step as it reads ready: the count and the
                # grant are one, and a waiter cancelled before this line has taken nothing.
                granted = core.take(waiter)
                if granted is not None:
                    granted.base = self.deployer.base_url(dep_id)  # its engine's, as of the grant
                    return granted
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
