"""The `litellm` library as a real client of the ondemand gateway.

Run with the LiteLLM venv's python (``scripts/heavy/litellm-venv.sh``), never
with the project's: it imports ``litellm`` and nothing of ``ondemand``.

Input: one JSON job, from the file named by argv[1] or from stdin::

    {"api_base": "http://127.0.0.1:PORT/dgxmm/ondemand/7/v1",
     "api_key": "<the on-demand key>",
     "model": "openai/X",
     "entry": {...},               # the registration (ondemand_entry), for "health"
     "calls": [{"kind": "completion"} | {"kind": "stream"} | {"kind": "health"}, ...]}

A call may carry "messages" and "max_tokens"; a health call its own "entry". Output: JSON lines on stdout,
flushed one by one so the caller can react while a call runs:

    {"call": i, "event": "chunk", "id": ..., "content": ..., "finish_reason": ...}   (stream)
    {"call": i, "event": "result", ...}      (completion: id, model, content; stream: the
                                              joined content and the chunk count; health:
                                              LiteLLM's verdict)
    {"call": i, "event": "error", "type": ..., "status_code": ..., "message": ...}
    {"event": "done"}

The health call is made the way the proxy makes it (litellm/proxy/health_check.py,
``_run_model_health_check``): the mode resolved from model_info / the cost map,
``update_litellm_params_for_health_check`` (which merges
``model_info.health_check_params`` into a copy of litellm_params, adds the
random short messages and ``max_tokens``), then ``litellm.ahealth_check(params,
mode=..., prompt=DEFAULT_HEALTH_CHECK_PROMPT, input=["test from litellm"])``
under the proxy's timeout. A result without "error" is what the proxy reports
as a healthy endpoint.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list from the internet

# Our JSON lines get a private copy of stdout; whatever litellm prints goes to stderr.
_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import litellm  # noqa: E402

DEFAULT_MESSAGES = [{"role": "user", "content": "hello there"}]


def emit(obj: dict) -> None:
    _OUT.write(json.dumps(obj, default=repr) + "\n")
    _OUT.flush()


def error_event(i: int, exc: BaseException) -> dict:
    return {"call": i, "event": "error", "type": type(exc).__name__,
            "status_code": getattr(exc, "status_code", None), "message": str(exc)[:2000]}


async def completion(i: int, job: dict, call: dict) -> None:
    t0 = time.monotonic()
    resp = await litellm.acompletion(model=job["model"], api_base=job["api_base"], api_key=job["api_key"],
                                     messages=call.get("messages") or DEFAULT_MESSAGES,
                                     max_tokens=call.get("max_tokens"), num_retries=call.get("num_retries", 0))
    choice = resp.choices[0]
    emit({"call": i, "event": "result", "id": resp.id, "model": resp.model,
          "content": choice.message.content, "finish_reason": choice.finish_reason,
          "seconds": round(time.monotonic() - t0, 3)})


async def stream(i: int, job: dict, call: dict) -> None:
    t0 = time.monotonic()
    resp = await litellm.acompletion(model=job["model"], api_base=job["api_base"], api_key=job["api_key"],
                                     messages=call.get("messages") or DEFAULT_MESSAGES,
                                     max_tokens=call.get("max_tokens"), stream=True,
                                     num_retries=call.get("num_retries", 0))
    parts: list[str] = []
    n = 0
    finish = None
    async for chunk in resp:
        n += 1
        choice = chunk.choices[0] if chunk.choices else None
        content = choice.delta.content if choice is not None else None
        if choice is not None and choice.finish_reason:
            finish = choice.finish_reason
        if content:
            parts.append(content)
        emit({"call": i, "event": "chunk", "id": chunk.id, "content": content,
              "finish_reason": choice.finish_reason if choice is not None else None,
              "t": round(time.monotonic() - t0, 3)})
    emit({"call": i, "event": "result", "content": "".join(parts), "chunks": n, "finish_reason": finish,
          "seconds": round(time.monotonic() - t0, 3)})


def _proxy_health_helpers():
    """The proxy's own helpers, under their current or older names."""
    from litellm.proxy import health_check as hc

    update = getattr(hc, "update_litellm_params_for_health_check", None) or hc._update_litellm_params_for_health_check
    resolve = getattr(hc, "resolve_health_check_mode", None)
    return hc, update, resolve


async def health(i: int, job: dict, call: dict) -> None:
    from litellm.constants import DEFAULT_HEALTH_CHECK_PROMPT, HEALTH_CHECK_TIMEOUT_SECONDS

    hc, update, resolve = _proxy_health_helpers()
    entry = copy.deepcopy(call.get("entry") or job["entry"])  # the proxy probes a deep copy too
    model_info = entry.get("model_info") or {}
    litellm_params = entry["litellm_params"]
    # older releases have no resolver: model_info.mode only
    mode = resolve(model_info, litellm_params) if resolve is not None else model_info.get("mode")
    params = update(model_info, litellm_params)
    probe = {k: v for k, v in params.items() if k not in ("api_key",)}  # what went out, minus the secret
    timeout = model_info.get("health_check_timeout") or HEALTH_CHECK_TIMEOUT_SECONDS
    t0 = time.monotonic()
    result = await hc.run_with_timeout(
        litellm.ahealth_check(params, mode=mode, prompt=DEFAULT_HEALTH_CHECK_PROMPT, input=["test from litellm"]),
        timeout)
    healthy = isinstance(result, dict) and "error" not in result
    exc = result.get("exception") if isinstance(result, dict) else None
    emit({"call": i, "event": "result", "healthy": healthy, "mode": mode,
          "status_code": getattr(exc, "status_code", None),
          "probe_extra_headers": probe.get("extra_headers"), "probe_max_tokens": probe.get("max_tokens"),
          "error": (result or {}).get("error") if isinstance(result, dict) else repr(result),
          "seconds": round(time.monotonic() - t0, 3)})


CALLS = {"completion": completion, "stream": stream, "health": health}


async def main() -> int:
    raw = open(sys.argv[1]).read() if len(sys.argv) > 1 and sys.argv[1] != "-" else sys.stdin.read()
    job = json.loads(raw)
    for i, call in enumerate(job.get("calls") or []):
        kind = call.get("kind")
        if kind not in CALLS:
            emit({"call": i, "event": "error", "type": "UnknownCall", "status_code": None,
                  "message": f"unknown call kind {kind!r}"})
            continue
        try:
            await CALLS[kind](i, job, call)
        except Exception as exc:  # reported, then the next call
            emit(error_event(i, exc))
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
