"""The simulated failures (``--fail``) that happen after the start: the process's end, the
crash in a stream, and the wakes that fail or hang (exit-at-start and never-ready are the
start's: ``engine.main`` and ``routes.Sim``)."""
from __future__ import annotations

import asyncio
import os
import sys

CRASH_AFTER = 3  # content chunks sent before --fail crash-mid-stream kills the process


def die(why: str, code: int = 1) -> None:
    print(f"ondemand simulator: simulated failure: {why}", file=sys.stderr, flush=True)
    os._exit(code)


async def exit_later(delay: float, fail_after: float) -> None:
    """--fail exit-after S: end the process S seconds after ready (``delay``, the startup delay)."""
    await asyncio.sleep(delay + fail_after)
    die(f"exit {fail_after:g}s after ready (--fail exit-after)")


async def wake_fault(fail: str | None) -> str | None:
    """--fail wake-hangs: never return; wake-fails: the error's message."""
    if fail == "wake-hangs":
        await asyncio.Event().wait()
    if fail == "wake-fails":  # as an engine that cannot re-allocate its weights
        return "simulated failure: wake failed (--fail wake-fails)"
    return None
