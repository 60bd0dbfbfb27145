"""The engine side of tiered warmth: the calls that put an engine to sleep and wake it, and the
wake check.

The tier of each sleep level (``tiers.py``) says which calls go in and out of it, in which order;
this module makes them, through the engine client (``client.py``). The deployer decides when and
at which level (``rules.py``), marks the state and writes what came of it.

- A sleep is the calls into its level's tier (``Tier.enter``: one, vLLM ``/sleep?level=N``, SGLang
  ``/release_memory_occupation``); one that fails is reported, and the deployer stops the engine
  (its state is not known).
- A wake is the calls out of its level's tier, in the engines' order (``Tier.leave``), then the wake
  check: the greedy one-token completion recorded after the engine's cold start must come back
  the same (torch_memory_saver #71: a wake can answer garbage). An engine with no check recorded
  (not a completion model) must answer ``/health``. A failure is :class:`WakeFailed`, with
  ``failed`` or ``mismatch``.
"""
from __future__ import annotations

import asyncio
import json
import logging

from ..model import Deployment
from . import tiers, warmth
from .backends import Engine
from .client import CallFailed, EngineClient

log = logging.getLogger("ondemand.engines.sleeper")


class WakeFailed(Exception):
    """An engine call of the sleep API failed (a sleep's, read as its reason), or a wake did not
    bring the engine back: a call failed or timed out (``failed``), or the wake check's answer
    differed (``mismatch``)."""

    def __init__(self, result: str, reason: str):
        super().__init__(reason)
        self.result = result


class Sleeper:
    """Makes the sleep API's calls and the wake check on the engine client."""

    def __init__(self, client: EngineClient, wake_timeout_s: float = 300.0):
        self.client = client
        self.wake_timeout_s = wake_timeout_s  # a whole wake's calls; and the wake check's completion

    async def call(self, engine: Engine, step: tiers.Step) -> None:
        """One POST of the sleep API; raises WakeFailed unless it answers 200. No timeout of its
        own: a level-1 sleep copies the weights to host memory (a wake is bounded as a whole)."""
        path, query, body = step
        try:
            await self.client.post(engine, path, query=query, body=body)
        except CallFailed as exc:
            raise WakeFailed("failed", f"POST {path} {exc}" if exc.status else f"POST {path} failed: {exc}") from exc

    async def sleep(self, engine: Engine, dep: Deployment, level: int) -> str | None:
        """The engine's sleep calls (into ``level``'s tier); why one failed, or None."""
        try:
            for step in tiers.asleep(level).enter(dep):
                await self.call(engine, step)
        except WakeFailed as exc:
            return str(exc)
        return None

    async def wake(self, engine: Engine, dep: Deployment, level: int) -> None:
        """The engine calls that wake it from ``level`` (out of its tier), in order, then the wake
        check; raises WakeFailed. The caller bounds it (``wake_timeout_s``)."""
        for step in tiers.asleep(level).leave(dep):
            await self.call(engine, step)
        if dep.wake_check is None:
            if not await self.client.answers(engine, "/health"):
                raise WakeFailed("failed", "the engine does not answer /health after its wake")
            return
        try:
            got = await self.completion(engine, dep)
        except (CallFailed, ValueError) as exc:
            raise WakeFailed("failed", f"the wake check's completion failed: {exc}") from exc
        if got != dep.wake_check:
            raise WakeFailed("mismatch", f"the wake check answered {got!r}, not {dep.wake_check!r} as after its "
                                         "start: its weights did not come back whole")

    async def completion(self, engine: Engine, dep: Deployment) -> str | None:
        """The greedy one-token completion's text (None: not a completion); raises CallFailed
        for no answer or one that is not 200, ValueError for one that is not JSON."""
        data = await self.client.post(engine, "/v1/completions", body=warmth.check_body(dep),
                                      timeout=self.wake_timeout_s)
        return warmth.check_text(json.loads(data))

    async def record_check(self, engine: Engine, dep: Deployment) -> str | None:
        """The wake check's answer after a cold start, or None (not a completion model: an
        embedding model's wakes are checked by /health only)."""
        try:
            return await self.completion(engine, dep)
        except (CallFailed, ValueError, asyncio.TimeoutError) as exc:
            log.info("%s: no wake check recorded (/v1/completions: %s); its wakes are checked by /health",
                     dep.name, exc)
            return None
