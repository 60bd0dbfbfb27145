"""The queued notice: telling a person why their answer is late, without
breaking any client that parses the answer.

Who gets what (BEHAVIOUR.md, "The queued notice"):
- only a request that enters the memory queue because the idle models make-room
  may take do not free enough (or that waits behind the queue's head) is told:
  one whose make-room found its victims, or that waits for a start or a wake,
  gets nothing, and its answer is exactly the engine's (the controller decides);
- a streaming chat/completions or completions request that is told gets one
  ``ondemand-queued`` chunk at once, then the engine's bytes;
- Responses and Anthropic messages streams never get one (their typed events
  must begin with response.created / message_start);
- a non-streaming chat, completions or Responses answer of a request that
  queued gets the notice prepended to its text;
- a request that asks for structured output gets none at all.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import orjson

STREAM_NOTICE = "stream"  # send the chunk while queued
PREPEND = "prepend"  # prepend to a non-streaming answer
NONE = None

_STRUCTURED = ("response_format", "tools", "tool_choice", "functions", "function_call", "structured_outputs")


class Wait(NamedTuple):
    """What the notice tells of the wait, as it stood when the request queued."""
    eta_s: float | None = None  # how long its start (or, asleep, its wake) takes, from its history, when known
    place: tuple[int, int] | None = None  # (the entry's place in the queue, from 1; the queue's length)
    phase: str | None = None  # what its start is doing, in words ("loading weights"), while it starts


UNKNOWN = Wait()  # nothing known of the wait


def notice_text(served_name: str, eta_s: float | None = None, place: tuple[int, int] | None = None,
                phase: str | None = None) -> str:
    """The notice: "[ondemand] NAME is waiting for GPU memory (place P of Q, PHASE, about S s);
    your answer follows." P of Q: the entry's place in the memory queue and the queue's length;
    PHASE: what its start is doing ("loading weights"), while it starts; S: the expected start
    (what is left of it while it starts; a wake's estimate when it is asleep). Each part only
    when known."""
    parts = []
    if place is not None:
        parts.append(f"place {place[0]} of {place[1]}")
    if phase is not None:
        parts.append(phase)
    if eta_s is not None:
        parts.append(f"about {max(1, round(eta_s))} s")
    where = f" ({', '.join(parts)})" if parts else ""
    return f"[ondemand] {served_name} is waiting for GPU memory{where}; your answer follows.\n\n"


def is_structured(body: dict[str, Any]) -> bool:
    for key in _STRUCTURED:
        if body.get(key) is not None:
            return True
    for key, value in body.items():
        if key.startswith("guided_") and value is not None:
            return True
    text = body.get("text")
    if isinstance(text, dict):
        fmt = text.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
            return True
    return False


def mode(route: str, body: dict[str, Any] | None) -> str | None:
    """How a request to ``route`` (e.g. "chat/completions") may get a notice."""
    if body is None or route not in ("chat/completions", "completions", "responses") or is_structured(body):
        return NONE
    if body.get("stream"):
        return STREAM_NOTICE if route != "responses" else NONE
    return PREPEND


def queued_chunk(route: str, served_name: str, wait: Wait = UNKNOWN) -> bytes:
    now = int(time.time())
    text = notice_text(served_name, *wait)
    if route == "completions":
        chunk = {"id": "ondemand-queued", "object": "text_completion", "created": now, "model": served_name,
                 "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    else:
        chunk = {"id": "ondemand-queued", "object": "chat.completion.chunk", "created": now,
                 "model": served_name,
                 # No "role": the engine's first chunk carries it, and clients that
                 # accumulate deltas (the OpenAI SDK's stream helper) would join two.
                 "choices": [{"index": 0, "delta": {"content": text},
                              "logprobs": None, "finish_reason": None}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def error_events(error: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"


def prepend(route: str, body: bytes, served_name: str, wait: Wait = UNKNOWN) -> bytes:
    """The engine's JSON answer with the notice in front of its text; unchanged
    when the answer has no place for it (tool calls with null content ...)."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    text = notice_text(served_name, *wait)
    changed = False
    try:
        if route == "chat/completions":
            msg = answer["choices"][0]["message"]
            if isinstance(msg.get("content"), str):
                msg["content"] = text + msg["content"]
                changed = True
        elif route == "completions":
            choice = answer["choices"][0]
            if isinstance(choice.get("text"), str):
                choice["text"] = text + choice["text"]
                changed = True
        elif route == "responses":
            for item in answer.get("output") or ():
                if item.get("type") == "message":
                    for part in item.get("content") or ():
                        if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                            part["text"] = text + part["text"]
                            changed = True
                            break
                    break
    except (KeyError, IndexError, TypeError, AttributeError):
        return body
    return orjson.dumps(answer) if changed else body
