"""The reaper: every ``reap_interval_s``, idle on-demand models are put to sleep.

The rule of "idle" and the stop itself belong to the controller
(``Controller.reap``, with ``is_idle`` as the precheck of the deployer's
stop); this is only the clock.
"""
from __future__ import annotations

import asyncio
import logging

from .controller import Controller

log = logging.getLogger("ondemand.control.reaper")


class Reaper:
    def __init__(self, controller: Controller, interval_s: float = 15.0):
        self.controller = controller
        self.interval_s = interval_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.controller.reap()
            except Exception:
                log.exception("reaper step failed")
