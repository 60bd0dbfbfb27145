"""The engine client: ondemand's own calls to its engines.

Readiness (``/health``, ``/v1/models``), the watchdog's probe, the sleep API's calls, the wake
check's completion and the metrics sampler's ``/metrics`` all go through ``http/pool.py``'s
``Upstreams``, the app's one set of engine pools that the gateway forwards on
(``Upstreams.call``, on connections of their own beside the traffic's, so a probe never waits
behind busy streams): one HTTP client to the engines, a timeout per call, and one error,
:class:`CallFailed`, for an engine that cannot be reached, breaks off, times out or answers
another status than asked.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from ..http.pool import PayloadError, UpstreamError, Upstreams
from .backends import Engine

JSON_LINES = b"Content-Type: application/json\r\n"


class CallFailed(Exception):
    """The engine could not be reached, broke off, did not answer in time, or answered another
    status than 200 (``status``: 0 when there was no answer)."""

    def __init__(self, reason: str, status: int = 0):
        super().__init__(reason)
        self.status = status


class EngineClient:
    """Calls to the engines by their deployment's id and address (``Engine.base_url``)."""

    def __init__(self, upstreams: Upstreams, probe_timeout_s: float = 5.0):
        self.upstreams = upstreams
        self.probe_timeout_s = probe_timeout_s  # readiness and the watchdog's probe

    async def call(self, dep_id: int, base_url: str, method: str, path: str, *,
                   query: Mapping[str, str] | None = None, body: Any = None,
                   timeout: float | None) -> tuple[int, bytes]:
        """(status, body) of one call; ``body``: sent as JSON (None: no body; an empty one for a
        POST). Raises CallFailed when there is no whole answer."""
        target = path + ("?" + urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        try:
            return await self.upstreams.call(dep_id, base_url, method, target, body=data,
                                             lines=JSON_LINES if body is not None else b"", timeout=timeout)
        except (UpstreamError, PayloadError, OSError) as exc:
            raise CallFailed(str(exc) or repr(exc)) from exc
        except asyncio.TimeoutError:
            raise CallFailed(f"no answer within {timeout:g} s") from None

    async def answers(self, engine: Engine, path: str = "/health") -> bool:
        """Whether ``GET path`` answers 200 within the probe's timeout."""
        try:
            status, _ = await self.call(engine.deployment_id, engine.base_url, "GET", path,
                                        timeout=self.probe_timeout_s)
        except CallFailed:
            return False
        return status == 200

    async def served_names(self, engine: Engine, checks_name: bool) -> list[str] | None:
        """The model ids the engine's /v1/models lists; None while it does not answer yet.
        ``checks_name``: an answer without names is not an answer yet (vLLM and SGLang list
        theirs; a llama.cpp row run as given may list none)."""
        try:
            status, data = await self.call(engine.deployment_id, engine.base_url, "GET", "/v1/models",
                                           timeout=self.probe_timeout_s)
        except CallFailed:
            return None
        if status != 200:
            return None if checks_name else []
        try:
            body = json.loads(data)
        except ValueError:  # not JSON: no name can be read from it
            return None if checks_name else []
        data_ = body.get("data") if isinstance(body, dict) else None
        return [str(m.get("id")) for m in data_ if isinstance(m, dict)] if isinstance(data_, list) else []

    async def post(self, engine: Engine, path: str, *, query: Mapping[str, str] | None = None, body: Any = None,
                   timeout: float | None = None) -> bytes:
        """The body of a ``POST`` that must answer 200; raises CallFailed otherwise."""
        status, data = await self.call(engine.deployment_id, engine.base_url, "POST", path, query=query,
                                       body=body, timeout=timeout)
        if status != 200:
            raise CallFailed(f"answered {status}: {data[:200].decode('utf-8', 'replace')}", status)
        return data

    async def metrics(self, dep_id: int, base_url: str, timeout: float) -> str:
        """The text of the engine's ``/metrics`` ("" for an answer other than 200)."""
        status, data = await self.call(dep_id, base_url, "GET", "/metrics", timeout=timeout)
        return data.decode("utf-8", "replace") if status == 200 else ""
