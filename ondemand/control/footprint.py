"""Measured footprints: how much GPU memory each engine really uses.

Once an engine is ready, and then every ``metrics_interval_s``, nvidia-smi's
``--query-compute-apps`` lists every process that holds GPU memory. An
engine's share is what the processes of its tree hold: the child process and
its workers (process backend) or the container's processes as the host
numbers them (docker backend, Docker's ``top``). The deployer keeps the
result in ``measured_gib``, and fit checks count the larger of declared and
measured. Only the ``nvidia-smi`` budget measures; with the others there is
nothing to ask.

When ondemand itself runs in a container without the host's pid namespace,
nvidia-smi there lists no processes (or pids it cannot match), so nothing is
measured and declared sizes stand: run it with ``--pid=host`` to measure.
"""
from __future__ import annotations

import asyncio
import logging

from ..engines.deployer import Deployer
from ..engines.memory import apps_gib
from ..model import State
from .budget import Budget, BudgetError

log = logging.getLogger("ondemand.control.footprint")



class FootprintSampler:
    def __init__(self, deployer: Deployer, budget: Budget, *, interval_s: float = 10.0):
        self.deployer = deployer
        self.budget = budget
        self.interval_s = interval_s
        self._poke = asyncio.Event()

    def engine_ready(self) -> None:
        """An engine just became ready: measure now, not at the next period."""
        self._poke.set()

    async def sample(self) -> dict[int, float]:
        """Measure every ready engine once and record what was found."""
        ready = [dep_id for dep_id, _url in self.deployer.engines_in((State.READY,))]
        if not ready or self.budget.source != "nvidia-smi":
            return {}
        try:
            apps = await self.budget.compute_apps()
        except BudgetError as exc:
            log.debug("cannot measure footprints: %s", exc)
            return {}
        found = {}
        for dep_id in ready:
            engine = self.deployer.engine(dep_id)
            if engine is None:
                continue
            gib = apps_gib(apps, await self.deployer.backend.pids(engine))
            if gib is not None:
                found[dep_id] = gib
                await self.deployer.record_footprint(dep_id, gib)
        return found

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # A timer that sets the event, not wait_for: wait_for wraps the wait in a new
            # task each round (Python < 3.12), a stray task for anyone counting them.
            timer = loop.call_later(self.interval_s, self._poke.set)
            try:
                await self._poke.wait()
            finally:
                timer.cancel()
            self._poke.clear()
            try:
                await self.sample()
            except Exception:  # a measurement is a courtesy: never end the loop over one
                log.exception("measuring engine footprints failed")
