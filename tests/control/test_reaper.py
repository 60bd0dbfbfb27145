"""The reaper (ondemand/control/reaper.py): only the clock of the controller's step (``reap``),
every ``reap_interval_s``; a step that fails is logged and the next one comes as ever. What a step
does (the idle rule, which tier): test_controller.py; with real engines: test_controller_races.py."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import types

from ondemand.control import reaper as reaper_mod
from ondemand.control.reaper import Reaper


class Core:
    """The controller's step: the first ``failing`` steps raise (a defect of ours)."""

    def __init__(self, failing: int) -> None:
        self.failing = failing
        self.steps = 0
        self.three = asyncio.Event()

    def reap(self) -> list[int]:
        self.steps += 1
        if self.steps == 3:
            self.three.set()
        if self.steps <= self.failing:
            raise RuntimeError("a step failed")
        return []


async def test_the_reaper_steps_every_interval_and_outlives_a_step_that_fails(monkeypatch, caplog):
    slept: list[float] = []

    async def sleep(delay: float) -> None:  # the interval, noted and not waited out
        slept.append(delay)
        await asyncio.sleep(0)
    monkeypatch.setattr(reaper_mod, "asyncio", types.SimpleNamespace(sleep=sleep))
    core = Core(failing=2)
    task = asyncio.ensure_future(Reaper(core, interval_s=42.0).run())
    three = asyncio.ensure_future(core.three.wait())
    try:
        done, _ = await asyncio.wait({task, three}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert three in done, task.exception() if task in done else "no third step"  # the loop went on
    finally:
        for t in (task, three):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    assert core.steps >= 3 and slept[:3] == [42.0] * 3  # each step after one interval
    failed = [r for r in caplog.records if r.name == "ondemand.control.reaper" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in failed] == ["reaper step failed"] * 2
