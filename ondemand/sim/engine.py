"""A simulated LLM engine: an aiohttp server that answers like vLLM's OpenAI server.

It is not a real engine and says so (``owned_by`` is ``ondemand-simulator``, and
the startup line on stderr). It lets the gateway, its tests, its benchmark and
the demo (``make run``) run without a GPU::

    python -m ondemand.sim.engine --port 8001 --model demo [--flavor llamacpp]

Text is deterministic: ``tok0 tok1 ...``, one token per streamed chunk. The
answer is ``--tokens`` long (default 16); ``max_tokens`` (or
``max_completion_tokens`` / ``max_output_tokens``) cuts it short with finish
reason ``length``, and ``"ignore_eos": true`` makes it exactly ``max_tokens``
long, as vLLM does. Prompt "tokens" are whitespace-separated words.

Like vLLM, a body that is not ``application/json`` or not JSON is a 400, and an
unknown ``model`` a 404 (``{"error": {"message", "type", "param", "code"}}``).
``--flavor llamacpp`` answers ``/health`` with ``{"status": "ok"}``, exposes
llama.cpp's metric names and, like llama.cpp, serves whatever model is asked.
``--flavor sglang`` answers ``/health`` with an empty 200, ``/v1/models`` as vLLM, exposes
SGLang's metric names (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``) and serves
whatever model is asked.

While loading (``--startup-delay S``, or forever with ``--fail never-ready``) the
socket listens at once and every engine route, ``/health`` and ``/v1/models``
included, answers 503 ``Loading model`` (llama.cpp's behaviour; vLLM would not
answer at all, which a gateway cannot tell from a hang). ``/_sim/*`` always
answers.

Sleep, as vLLM's sleep mode (``--flavor vllm``, and ``llamacpp`` as before): ``POST
/sleep?level=1|2`` (default 1; another level is a 400) puts both parts, ``weights`` and
``kv_cache``, to sleep (a stream it runs is cut short, as vLLM aborts its requests) and answers
200 after ``--sleep-delay S``; sleeping again changes
nothing unless deeper. ``POST /wake_up`` wakes both, ``?tags=weights`` or ``?tags=kv_cache``
(the query may repeat) those only (another tag is a 400); the call that wakes the weights
takes ``--wake-delay S``. ``GET /is_sleeping`` says true until both are awake. While either
sleeps, generation routes answer 503 (vLLM would hang); ``/health``, ``/v1/models`` and
``/metrics`` answer as usual. Level 1 keeps the weights in host memory: with ``--host-mib H``
the process really holds H MiB more (RSS) until the weights wake. Level 2 drops them: once
they are awake, generation answers garbage (200, ``garbage0 garbage1 ...``; embeddings and
scores change too) until ``POST /collective_rpc`` ``{"method": "reload_weights"}`` (200
``{"results": [null]}``; another method, or the weights still asleep, is a 400). ``POST
/reset_prefix_cache`` answers 200.

Sleep, as SGLang's memory saver (``--flavor sglang``; vLLM's routes above are 404 there, and
these are 404 in the other flavors): ``POST /release_memory_occupation`` (a JSON object,
``{}`` will do) sleeps at level 1 when the process was started with
``--enable-weights-cpu-backup``, else at level 2; ``POST /resume_memory_occupation`` (``{}``)
wakes both parts (``--wake-delay``); both answer 200 ``null``. ``POST
/update_weights_from_disk`` ``{"model_path": "..."}`` reloads the weights (ends the garbage):
200 ``{"success": true, "message", "num_paused_requests": 0}`` (400 with ``"success":
false`` while the weights sleep). SGLang's errors are ``{"error": {"message"}}`` (a 400).

Failures: ``exit-at-start`` exits with code 3 before listening;
``crash-mid-stream`` and ``exit-after S`` end the process with ``os._exit(1)``;
``wake-fails``: a wake answers 500 (SGLang: 400) and wakes nothing; ``wake-hangs``: a
wake never answers (nothing wakes; for timeouts); ``wake-garbage``: a wake succeeds, but
from then on generation answers garbage for good, even after a reload (silent garbage
after sleep cycles, as torch_memory_saver #71).

Every request but ``/_sim/*`` is recorded (the last ``--record-limit``), with its decoded
``path`` and its ``raw_path`` as received: ``GET /_sim/requests`` lists them,
``DELETE /_sim/requests`` clears them. ``GET /_sim/launch`` says how the process was started
(its argv and environment). ``GET /_sim/state`` says how it sleeps: ``{"sleeping":
{"weights": bool, "kv_cache": bool}, "level": 0|1|2, "garbage": bool, "wakes": n, "sleeps":
n}`` (level 0: awake; garbage: the weights in GPU memory are not the model's; wakes and
sleeps count the calls that changed something).

It takes the flags ondemand's engine recipes write (vLLM's ``MODEL --served-model-name S
--tensor-parallel-size N --gpu-memory-utilization U --enable-sleep-mode``, SGLang's and
llama.cpp's equivalents) and refuses an unknown flag with exit 2, as the engines do. The
served name is ``--served-model-name`` (or ``--alias``), else the model.

A record that outlives the process, for soak tests that kill and restart engines:
``--journal FILE`` appends one JSON line per event (each line one ``write`` to a file
opened ``O_APPEND``, so many simulators can share the file): ``boot`` (the process
began: ``pid``, ``model``), ``req`` (a request arrived: its ``path`` and the names of
its headers, never their values), ``end`` (that request's handler returned: ``n``,
the request's number within this process), and ``sigterm`` with ``inflight``, the
generation requests still being answered when SIGTERM (or SIGINT) came: an engine
stopped while busy says so here; ``sleep`` (with its ``level``) and ``wake`` (with the
``tags`` it woke) when a sleep or wake changed something. Every line has ``ev``, ``pid`` and
``t`` (Unix time).

GPU memory, for the fake nvidia-smi of the tests (tests/fakes/nvidia-smi): with
``--gpu-mib N`` and ``$FAKE_NVIDIA_SMI_APPS`` set, the simulator "uses" N MiB on
each GPU of ``$CUDA_VISIBLE_DEVICES`` (integer indices; GPU 0 when unset, none when
empty) by writing ``$FAKE_NVIDIA_SMI_APPS/<pid>`` (lines ``<gpu index> <MiB>``)
before its startup line, and removes the file when it exits (a SIGKILL leaves it,
but the fake ignores a dead pid's file). With ``--sleep-gpu-mib M`` the file says M MiB
instead while asleep (from the sleep until both parts are awake; default 0), as an engine's
residue (CUDA context, graphs) once its weights and KV cache are released. The file is
rewritten atomically (a temporary file, then a rename).
"""
from __future__ import annotations

import argparse
import array
import asyncio
import base64
import collections
import contextlib
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

FLAVORS = ("vllm", "llamacpp", "sglang")
# One recorded request: (time, method, path, query, raw headers, body, raw path as received).
_Recorded = tuple[float, str, str, str, tuple[tuple[bytes, bytes], ...], bytes, str]
FAILURES = ("exit-at-start", "never-ready", "crash-mid-stream", "exit-after", "wake-fails", "wake-hangs",
            "wake-garbage")
PARTS = ("weights", "kv_cache")  # what sleeps, as vLLM's wake_up tags name them
GENERATION = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/v1/audio/transcriptions", "/v1/chat/completions/batch"))
CRASH_AFTER = 3  # content chunks sent before --fail crash-mid-stream kills the process

_SSE = {"Content-Type": "text/event-stream; charset=utf-8"}
_DONE = b"data: [DONE]\n\n"
_LOADING = orjson.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})

_TOK: list[str] = []  # token i as text, shared by every request
_TOKJ: list[bytes] = []  # the same, JSON-encoded once
_GTOK: list[str] = []  # token i of garbage (the weights are not the model's), and JSON-encoded
_GTOKJ: list[bytes] = []


def _tokens(n: int) -> None:
    for i in range(len(_TOK), n):
        s, g = (f" tok{i}", f" garbage{i}") if i else ("tok0", "garbage0")
        _TOK.append(s)
        _TOKJ.append(orjson.dumps(s))
        _GTOK.append(g)
        _GTOKJ.append(orjson.dumps(g))


def _hold(mib: int) -> bytearray | None:
    """``mib`` MiB of host memory, every page touched so that the RSS really grows."""
    if mib <= 0:
        return None
    b = bytearray(mib << 20)
    b[::4096] = b"\x01" * (len(b) // 4096)
    return b


@dataclass
class SimOptions:
    """The command-line options, for in-process use with ``build_app``."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    flavor: str = "vllm"
    startup_delay: float = 0.0
    token_delay: float = 0.0
    tokens: int = 16
    fail: str | None = None  # one of FAILURES
    fail_after: float = 0.0  # seconds, for fail="exit-after"
    max_model_len: int = 4096
    max_running: int = 0  # 0: unlimited; above it requests wait (vllm:num_requests_waiting)
    embedding_dim: int = 8
    record_limit: int = 1000
    shutdown_delay: float = 0.0  # seconds between SIGTERM and the exit (a large engine freeing memory)
    gpu_mib: int = 0  # MiB per visible GPU reported to the fake nvidia-smi (0: none)
    sleep_gpu_mib: int = 0  # the same while asleep
    host_mib: int = 0  # host memory really held while asleep at level 1 (the weights' copy)
    sleep_delay: float = 0.0  # seconds a sleep takes
    wake_delay: float = 0.0  # seconds the wake of the weights takes
    weights_cpu_backup: bool = False  # SGLang's --enable-weights-cpu-backup: it sleeps at level 1, else 2
    journal: str | None = None  # a file to append one JSON line per event to (see the module's doc)


class Journal:
    """``--journal FILE``: events as JSON lines, each appended with one write."""

    def __init__(self, path: str | None, model: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else -1
        self.model = model
        self.pid = os.getpid()

    def write(self, ev: str, **fields: Any) -> None:
        if self.fd >= 0:
            os.write(self.fd, orjson.dumps({"ev": ev, "pid": self.pid, "t": time.time(), **fields}) + b"\n")


class SimError(Exception):
    """An error answer: vLLM's shape, or ``body`` as it is (SGLang's shapes)."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None,
                 body: Any = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.body = status, message, type, param, body


def _error(status: int, message: str, type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _event(d: dict[str, Any]) -> bytes:
    kind: str = d["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(d) + b"\n\n"


def _words(x: Any) -> int:
    if isinstance(x, str):
        return len(x.split())
    if isinstance(x, list):
        return sum(_words(e) for e in x)
    if isinstance(x, dict):
        return _words(x.get("content", x.get("text")))
    return 1 if isinstance(x, int) and not isinstance(x, bool) else 0


def _uid() -> str:
    return uuid.uuid4().hex


def _die(why: str, code: int = 1) -> None:
    print(f"ondemand simulator: simulated failure: {why}", file=sys.stderr, flush=True)
    os._exit(code)


class Sim:
    def __init__(self, opts: SimOptions):
        if opts.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, not {opts.flavor!r}")
        if opts.fail is not None and opts.fail not in FAILURES:
            raise ValueError(f"fail must be one of {FAILURES}, not {opts.fail!r}")
        if opts.tokens < 1:
            raise ValueError("tokens must be at least 1")
        self.opts = opts
        self.vllm = opts.flavor == "vllm"  # it refuses another model's name (llama.cpp and SGLang serve any)
        self.sglang = opts.flavor == "sglang"
        self.json_only = opts.flavor != "llamacpp"  # a body that is not application/json is a 400
        self.model = opts.model
        self.model_j = orjson.dumps(opts.model)
        self.crash = opts.fail == "crash-mid-stream"
        self.ready = False
        self.ready_at = float("inf")
        self.asleep = dict.fromkeys(PARTS, False)
        self.sleep_level = 0  # 0 while both parts are awake
        self.dropped = False  # a level 2 sleep dropped the weights; a reload ends it
        self.poisoned = False  # --fail wake-garbage, after a wake: garbage for good
        self.host_mem: bytearray | None = None  # the weights' host copy (--host-mib) while asleep at level 1
        self.sleeps = self.wakes = 0
        self.memory = asyncio.Lock()  # one sleep, wake or reload at a time
        self.gpu_file: str | None = None  # this process's file for the fake nvidia-smi (serve sets it)
        self.running = 0
        self.waiting = 0
        self.sem = asyncio.Semaphore(opts.max_running) if opts.max_running > 0 else None
        self.record: collections.deque[_Recorded] = collections.deque(maxlen=opts.record_limit)
        self.journal = Journal(opts.journal, opts.model)
        self.seq = 0
        self.inflight = 0  # generation requests being answered (for the journal's sigterm line)
        self.tasks: list[asyncio.Task[Any]] = []
        self.card = {"id": opts.model, "object": "model", "created": int(time.time()),
                     "owned_by": "ondemand-simulator", "root": opts.model, "parent": None,
                     "max_model_len": opts.max_model_len}
        self.models_body = orjson.dumps({"object": "list", "data": [self.card]})
        _tokens(opts.tokens)

    @property
    def sleeping(self) -> bool:
        return any(self.asleep.values())

    @property
    def garbage(self) -> bool:
        """Whether the weights in GPU memory are not the model's (generation answers garbage)."""
        return self.dropped or self.poisoned

    # -- plumbing -------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.ready_at = time.monotonic() + self.opts.startup_delay
        if self.opts.fail == "exit-after":
            # The simulator is a program of its own and imports nothing of ondemand
            # (tests/test_layout.py); the task is kept in self.tasks and cancelled at cleanup.
            self.tasks.append(asyncio.ensure_future(self._exit_later()))  # noqa: TID251
        if self.opts.startup_delay > 0 and self.opts.fail != "never-ready":
            # As an engine's log says it is loading, then that it is ready (a log to follow live).
            print(f"loading {self.opts.model} ({self.opts.startup_delay:g} s)", file=sys.stderr, flush=True)
            self.tasks.append(asyncio.ensure_future(self._say_ready()))  # noqa: TID251

    async def _say_ready(self) -> None:
        await asyncio.sleep(self.opts.startup_delay)
        print(f"{self.opts.model} loaded: application startup complete", file=sys.stderr, flush=True)

    async def on_cleanup(self, app: web.Application) -> None:
        for t in self.tasks:
            t.cancel()

    async def _exit_later(self) -> None:
        await asyncio.sleep(self.opts.startup_delay + self.opts.fail_after)
        _die(f"exit {self.opts.fail_after:g}s after ready (--fail exit-after)")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith("/_sim/"):
            return await handler(request)
        generation = path in GENERATION
        self.inflight += generation
        try:
            body = await request.read() if request.body_exists else b""
            self.record.append((time.time(), request.method, path, request.query_string, request.raw_headers, body,
                                request.raw_path))
            if self.journal.fd < 0:
                return await self._handle(request, handler, path)
            self.seq += 1
            n = self.seq
            self.journal.write("req", n=n, path=path,
                               h=sorted({k.decode("latin-1").lower() for k, _ in request.raw_headers}))
            try:
                return await self._handle(request, handler, path)
            finally:
                self.journal.write("end", n=n)
        finally:
            self.inflight -= generation

    async def _handle(self, request: web.Request, handler: Handler, path: str) -> web.StreamResponse:
        if not self.ready:
            if self.opts.fail == "never-ready" or time.monotonic() < self.ready_at:
                return web.Response(status=503, body=_LOADING, content_type="application/json")
            self.ready = True
        if self.sleeping and path in GENERATION:
            wake = "/resume_memory_occupation" if self.sglang else "/wake_up"
            return _error(503, f"The engine is sleeping; POST {wake} first.", "ServiceUnavailableError")
        try:
            return await handler(request)
        except SimError as e:
            return _json(e.body, e.status) if e.body is not None else _error(e.status, e.message, e.type, e.param)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # FastAPI's shape, which is what vLLM answers for unknown routes
            return _json({"detail": e.reason}, e.status)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if self.json_only and request.content_type != "application/json":
            raise SimError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise SimError(400, f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise SimError(400, "Input should be a valid dictionary or object")
        model = body.get("model")
        if model and model != self.model and self.vllm:  # llama.cpp serves whatever is asked
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return body

    def _length(self, body: dict[str, Any], *keys: str) -> tuple[int, bool]:
        """Tokens to generate, and whether the request's limit cut them short."""
        for k in keys:
            lim = body.get(k)
            if lim is not None:
                if not isinstance(lim, int) or isinstance(lim, bool) or lim < 1:
                    raise SimError(400, f"{k} must be at least 1, got {lim}.", param=k)
                if lim > self.opts.max_model_len:
                    raise SimError(400, f"'{k}' is too large: {lim}. This model's maximum context length is "
                                        f"{self.opts.max_model_len} tokens.", param=k)
                n = lim if body.get("ignore_eos") else min(lim, self.opts.tokens)
                _tokens(n)
                return n, n == lim
        return self.opts.tokens, False

    async def _enter(self) -> None:
        if self.sem is not None:
            self.waiting += 1
            try:
                await self.sem.acquire()
            finally:
                self.waiting -= 1
        self.running += 1

    def _leave(self) -> None:
        self.running -= 1
        if self.sem is not None:
            self.sem.release()

    async def _generate(self, n: int, make: Callable[[], object]) -> web.StreamResponse:
        await self._enter()
        try:
            if self.opts.token_delay:
                await asyncio.sleep(self.opts.token_delay * n)
            out = make()
            return out if isinstance(out, web.StreamResponse) else _json(out)
        finally:
            self._leave()

    async def _stream(self, request: web.Request, n: int, before: list[bytes], frame: Callable[[int], bytes],
                      after: Callable[[], Iterable[bytes]]) -> web.StreamResponse:
        await self._enter()
        resp = web.StreamResponse(headers=_SSE)
        try:
            await resp.prepare(request)
            write = resp.write
            for b in before:
                await write(b)
            delay = self.opts.token_delay
            crash_at = min(CRASH_AFTER, n - 1) if self.crash else -1
            for i in range(n):
                if delay:
                    await asyncio.sleep(delay)
                if self.sleeping:  # as vLLM's sleep: what the engine runs is aborted, the stream cut short
                    await resp.write_eof()
                    return resp
                if i == crash_at:
                    _die("crash mid-stream (--fail crash-mid-stream)")
                await write(frame(i))
            for b in after():
                await write(b)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away; so does the generation
        finally:
            self._leave()
        return resp

    # -- control routes -------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _json({"status": "ok"}) if self.opts.flavor == "llamacpp" else web.Response()

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.models_body, content_type="application/json")

    async def model_card(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name != self.model:
            raise SimError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return _json(self.card)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        name = self.model.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{name}"}}'
        if self.sglang:
            text = (
                "# HELP sglang:num_running_reqs The number of running requests.\n"
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{label} {float(self.running)}\n"
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
                "# TYPE sglang:num_queue_reqs gauge\n"
                f"sglang:num_queue_reqs{label} {float(self.waiting)}\n")
        elif self.vllm:
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{label} {float(self.running)}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{label} {float(self.waiting)}\n")
        else:
            text = (
                "# HELP llamacpp:requests_processing Number of requests processing.\n"
                "# TYPE llamacpp:requests_processing gauge\n"
                f"llamacpp:requests_processing {self.running}\n"
                "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                "# TYPE llamacpp:requests_deferred gauge\n"
                f"llamacpp:requests_deferred {self.waiting}\n")
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- sleep and wake (the state; vLLM's and SGLang's routes below) ------------------

    def _residue(self) -> None:
        """Rewrite this process's file for the fake nvidia-smi: --sleep-gpu-mib while asleep."""
        if self.gpu_file is not None:
            claim_gpu_memory(self.opts, self.opts.sleep_gpu_mib if self.sleeping else self.opts.gpu_mib)

    async def _sleep(self, level: int) -> None:
        async with self.memory:
            if self.sleeping and level <= self.sleep_level:
                return  # asleep already, as deep or deeper
            if self.opts.sleep_delay:
                await asyncio.sleep(self.opts.sleep_delay)
            self.asleep = dict.fromkeys(PARTS, True)
            self.sleep_level = level
            if level == 2:  # the weights are dropped, the host keeps no copy
                self.dropped, self.host_mem = True, None
            elif self.host_mem is None:
                self.host_mem = _hold(self.opts.host_mib)
            self.sleeps += 1
            self._residue()
            self.journal.write("sleep", level=level)

    async def _wake_fault(self) -> str | None:
        """--fail wake-hangs: never return; wake-fails: the error's message."""
        if self.opts.fail == "wake-hangs":
            await asyncio.Event().wait()
        if self.opts.fail == "wake-fails":  # as an engine that cannot re-allocate its weights
            return "simulated failure: wake failed (--fail wake-fails)"
        return None

    async def _wake(self, tags: Iterable[str]) -> None:
        async with self.memory:
            woken = [p for p in PARTS if p in tags and self.asleep[p]]
            if not woken:
                return
            if "weights" in woken and self.opts.wake_delay:
                await asyncio.sleep(self.opts.wake_delay)
            for p in woken:
                self.asleep[p] = False
            if "weights" in woken:
                self.host_mem = None  # back on the GPU: the host copy is freed
            if not self.sleeping:
                self.sleep_level = 0
            if self.opts.fail == "wake-garbage":
                self.poisoned = True
            self.wakes += 1
            self._residue()
            self.journal.write("wake", tags=woken)

    async def _reload(self) -> str | None:
        """Load the weights again (ends a level 2 sleep's garbage), or why not."""
        async with self.memory:
            if self.asleep["weights"]:
                return "the weights are asleep: wake them first"
            self.dropped = False
            return None

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise SimError(400, f"level must be 1 or 2, got {level!r}", param="level")
        await self._sleep(int(level))
        return web.Response()

    async def wake_up(self, request: web.Request) -> web.StreamResponse:
        tags = request.query.getall("tags", [])
        unknown = [t for t in tags if t not in PARTS]
        if unknown:
            raise SimError(400, f"unknown tags {unknown}: the tags are {', '.join(PARTS)}", param="tags")
        fault = await self._wake_fault()
        if fault is not None:
            raise SimError(500, fault, "InternalServerError")
        await self._wake(tags or PARTS)
        return web.Response()

    async def is_sleeping(self, request: web.Request) -> web.StreamResponse:
        return _json({"is_sleeping": self.sleeping})

    async def collective_rpc(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            raise SimError(400, f"JSON decode error: {e}") from None
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            raise SimError(400, "Missing 'method' in request body", param="method")
        if method != "reload_weights":
            raise SimError(400, f"the simulator knows the method reload_weights only, not {method!r}",
                           param="method")
        why = await self._reload()
        if why is not None:
            raise SimError(400, why)
        return _json({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        return web.Response()

    async def _sglang_body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            body = e
        if not isinstance(body, dict):  # FastAPI's validation error, as SGLang answers it
            message = "JSON decode error" if isinstance(body, Exception) else "Input should be an object"
            raise SimError(400, message, body={"object": "error", "message": message, "type": "Bad Request",
                                               "param": None, "code": 400})
        return body

    async def release_memory_occupation(self, request: web.Request) -> web.StreamResponse:
        await self._sglang_body(request)
        await self._sleep(1 if self.opts.weights_cpu_backup else 2)
        return _json(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.StreamResponse:
        await self._sglang_body(request)
        fault = await self._wake_fault()
        if fault is not None:
            raise SimError(400, fault, body={"error": {"message": fault}})
        await self._wake(PARTS)
        return _json(None)

    async def update_weights_from_disk(self, request: web.Request) -> web.StreamResponse:
        body = await self._sglang_body(request)
        if not isinstance(body.get("model_path"), str):
            message = "model_path: Field required"
            raise SimError(400, message, body={"object": "error", "message": message, "type": "Bad Request",
                                               "param": None, "code": 400})
        why = await self._reload()
        if why is not None:
            raise SimError(400, why, body={"success": False, "message": why, "num_paused_requests": 0})
        return _json({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    async def sim_state(self, request: web.Request) -> web.StreamResponse:
        return _json({"sleeping": self.asleep, "level": self.sleep_level, "garbage": self.garbage,
                      "wakes": self.wakes, "sleeps": self.sleeps})

    async def sim_requests(self, request: web.Request) -> web.StreamResponse:
        return _json([{"time": t, "method": m, "path": p, "raw_path": rp, "query": q,
                       "headers": [[k.decode("utf-8", "replace"), v.decode("utf-8", "replace")] for k, v in h],
                       "body": b.decode("utf-8", "replace"), "body_b64": base64.b64encode(b).decode()}
                      for t, m, p, q, h, b, rp in self.record])

    async def sim_clear(self, request: web.Request) -> web.StreamResponse:
        self.record.clear()
        return web.Response(status=204)

    # -- generation -----------------------------------------------------------------

    def _usage(self, p: int, n: int) -> dict[str, Any]:
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n, "prompt_tokens_details": None}

    def _text(self) -> tuple[list[str], list[bytes]]:
        """The tokens generation answers with (and JSON-encoded): garbage when the weights are."""
        return (_GTOK, _GTOKJ) if self.garbage else (_TOK, _TOKJ)

    def _include_usage(self, body: dict[str, Any]) -> bool:
        so = body.get("stream_options")
        return isinstance(so, dict) and bool(so.get("include_usage", True))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise SimError(400, "messages: Field required", param="messages")
        n, cut = self._length(body, "max_completion_tokens", "max_tokens")
        p, rid, created = _words(msgs), "chatcmpl-" + _uid(), int(time.time())
        finish, (tok, tj) = "length" if cut else "stop", self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": rid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [self._chat_choice(0, tok[:n], finish)], "usage": self._usage(p, n)})
        head = (b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
                b'"choices":[{"index":0,"delta":{') % (rid.encode(), created, self.model_j)
        mid = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        end = b'},"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
        last, usage = n - 1, self._include_usage(body)

        def after() -> Iterator[bytes]:
            if usage:
                yield b"data: " + orjson.dumps({
                    "id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model, "choices": [], "usage": self._usage(p, n)}) + b"\n\n"
            yield _DONE
        return await self._stream(request, n, [head + b'"role":"assistant","content":""' + mid],
                                  lambda i: head + b'"content":' + tj[i] + (end if i == last else mid), after)

    def _chat_choice(self, index: int, tokens: list[str], finish: str) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": "".join(tokens), "refusal": None,
                                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": finish, "stop_reason": None}

    async def chat_batch(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        convs = body.get("messages")
        if not isinstance(convs, list) or not convs:
            raise SimError(400, "messages: Field required", param="messages")
        if not isinstance(convs[0], list):
            convs = [convs]
        if body.get("stream"):
            raise SimError(400, "Streaming is not supported for batch chat completions.", param="stream")
        n, cut = self._length(body, "max_completion_tokens", "max_tokens")
        p, finish = _words(convs), "length" if cut else "stop"
        rid, created, tok = "chatcmpl-" + _uid(), int(time.time()), self._text()[0][:n]
        return await self._generate(n, lambda: {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model,
            "choices": [self._chat_choice(i, tok, finish) for i in range(len(convs))],
            "usage": self._usage(p, n * len(convs))})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise SimError(400, "prompt: Field required", param="prompt")
        n, cut = self._length(body, "max_tokens")
        p, rid, created = _words(prompt), "cmpl-" + _uid(), int(time.time())
        finish, (tok, tj) = "length" if cut else "stop", self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": rid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "text": "".join(tok[:n]), "logprobs": None, "finish_reason": finish,
                             "stop_reason": None, "prompt_logprobs": None}],
                "usage": self._usage(p, n)})
        head = b'data: {"id":"%s","object":"text_completion","created":%d,"model":%s,"choices":[{"index":0,"text":' % (
            rid.encode(), created, self.model_j)
        mid = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        end = b',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
        last, usage = n - 1, self._include_usage(body)

        def after() -> Iterator[bytes]:
            if usage:
                yield b"data: " + orjson.dumps({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": self.model, "choices": [], "usage": self._usage(p, n)}) + b"\n\n"
            yield _DONE
        return await self._stream(request, n, [], lambda i: head + tj[i] + (end if i == last else mid), after)

    def _response(self, rid: str, created: int, body: dict[str, Any], status: str, output: list[Any],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "metadata": body.get("metadata"), "model": self.model, "output": output,
                "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
                "temperature": body.get("temperature", 1.0), "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
                "usage": usage}

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if body.get("input") is None:
            raise SimError(400, "input: Field required", param="input")
        n, cut = self._length(body, "max_output_tokens")
        p = _words(body["input"]) + _words(body.get("instructions") or "")
        uid, created = _uid(), int(time.time())
        rid, mid, status = "resp_" + uid, "msg_" + uid, "incomplete" if cut else "completed"
        tok, tj = self._text()

        def final(seq: int | None = None) -> Any:  # the response (seq None), else its closing events
            text = "".join(tok[:n])
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = {"id": mid, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
            usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + n}
            done = self._response(rid, created, body, status, [item], usage)
            if seq is None:
                return done
            at = {"item_id": mid, "output_index": 0, "content_index": 0}
            return [_event({"type": "response.output_text.done", "sequence_number": seq, **at,
                            "text": text, "logprobs": []}),
                    _event({"type": "response.content_part.done", "sequence_number": seq + 1, **at, "part": part}),
                    _event({"type": "response.output_item.done", "sequence_number": seq + 2, "output_index": 0,
                            "item": item}),
                    _event({"type": "response.completed", "sequence_number": seq + 3, "response": done})]
        if not body.get("stream"):
            return await self._generate(n, final)
        started = self._response(rid, created, body, "in_progress", [], None)
        before = [
            _event({"type": "response.created", "sequence_number": 0, "response": started}),
            _event({"type": "response.in_progress", "sequence_number": 1, "response": started}),
            _event({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                    "item": {"id": mid, "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}}),
            _event({"type": "response.content_part.added", "sequence_number": 3, "item_id": mid, "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})]
        head = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":'
        mid_b = b',"item_id":"%s","output_index":0,"content_index":0,"delta":' % mid.encode()
        return await self._stream(request, n, before,
                                  lambda i: head + b"%d" % (4 + i) + mid_b + tj[i] + b',"logprobs":[]}\n\n',
                                  lambda: final(4 + n))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if not isinstance(body.get("messages"), list):
            raise SimError(400, "messages: Field required", param="messages")
        if body.get("max_tokens") is None:
            raise SimError(400, "max_tokens: Field required", param="max_tokens")
        n, cut = self._length(body, "max_tokens")
        p = _words(body["messages"]) + _words(body.get("system") or "")
        mid, stop = "msg_" + _uid(), "max_tokens" if cut else "end_turn"
        tok, tj = self._text()
        if not body.get("stream"):
            return await self._generate(n, lambda: {
                "id": mid, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": "".join(tok[:n])}], "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": p, "output_tokens": n}})
        before = [
            _event({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "content": [], "model": self.model,
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": 0}}}),
            _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})]
        head = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                b'"delta":{"type":"text_delta","text":')
        # vLLM ends its Anthropic stream with a bare "data: [DONE]" too; clients ignore it.
        return await self._stream(request, n, before, lambda i: head + tj[i] + b"}}\n\n", lambda: [
            _event({"type": "content_block_stop", "index": 0}),
            _event({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"input_tokens": p, "output_tokens": n}}),
            _event({"type": "message_stop"}), _DONE])

    def _vector(self, key: str, dim: int) -> list[float]:
        r = random.Random(("garbage\x00" if self.garbage else "") + key)
        v = [r.uniform(-1.0, 1.0) for _ in range(dim)]
        norm = sum(x * x for x in v) ** 0.5 or 1.0
        return [x / norm for x in v]

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        inp = body.get("input")
        if isinstance(inp, str) or (isinstance(inp, list) and inp and all(isinstance(x, int) for x in inp)):
            inp = [inp]
        if not isinstance(inp, list) or not inp:
            raise SimError(400, "input: Field required", param="input")
        dim = body.get("dimensions") or self.opts.embedding_dim
        if not isinstance(dim, int) or dim < 1:
            raise SimError(400, f"dimensions must be a positive integer, got {dim!r}", param="dimensions")
        b64 = body.get("encoding_format") == "base64"
        data = []
        for i, x in enumerate(inp):
            v = self._vector(x if isinstance(x, str) else orjson.dumps(x).decode(), dim)
            data.append({"index": i, "object": "embedding",
                         "embedding": base64.b64encode(array.array("f", v).tobytes()).decode() if b64 else v})
        p = _words(inp)
        return await self._generate(1, lambda: {
            "id": "embd-" + _uid(), "object": "list", "created": int(time.time()), "model": self.model,
            "data": data, "usage": {"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0,
                                    "prompt_tokens_details": None}})

    def _score(self, a: str, b: str) -> float:
        return random.Random(f"{'garbage' if self.garbage else ''}\x00{a}\x00{b}").random()

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list):
            raise SimError(400, "query and documents are required", param="documents")
        texts = [d.get("text", "") if isinstance(d, dict) else str(d) for d in docs]
        scored: list[dict[str, Any]] = [{"index": i, "document": {"text": t}, "relevance_score": self._score(query, t)}
                                        for i, t in enumerate(texts)]
        results = sorted(scored, key=lambda r: -r["relevance_score"])
        top = body.get("top_n") or len(results)
        if not isinstance(top, int) or top < 0:
            raise SimError(400, f"top_n must be a non-negative integer, got {top!r}", param="top_n")
        tokens = _words(query) * len(texts) + _words(texts)
        return await self._generate(1, lambda: {"id": "rerank-" + _uid(), "model": self.model,
                                                "usage": {"total_tokens": tokens}, "results": results[:top]})

    async def score(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        a, b = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        if a is None or b is None:
            raise SimError(400, "text_1 and text_2 are required", param="text_2")
        a, b = a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]
        if len(a) == 1:
            a = a * len(b)
        if len(a) != len(b):
            raise SimError(400, "text_1 and text_2 must have the same length, or text_1 a single text")
        p = _words(a) + _words(b)
        return await self._generate(1, lambda: {
            "id": "score-" + _uid(), "object": "list", "created": int(time.time()), "model": self.model,
            "data": [{"index": i, "object": "score", "score": self._score(x, y)}
                     for i, (x, y) in enumerate(zip(a, b, strict=False))],
            "usage": {"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0, "prompt_tokens_details": None}})

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "multipart/form-data":
            raise SimError(400, "Expected multipart/form-data with a file field", param="file")
        from email.parser import BytesParser  # here: it costs startup time, and this route is rare
        raw = await request.read()
        msg = BytesParser().parsebytes(
            b"Content-Type: " + request.headers["Content-Type"].encode() + b"\r\n\r\n" + raw)
        fields = {part.get_param("name", header="content-disposition"): part for part in msg.get_payload() or []
                  if not isinstance(part, str)}
        if "file" not in fields:
            raise SimError(400, "file: Field required", param="file")
        # decode=True gives a leaf part's bytes (typeshed allows a Message too).
        model = cast(bytes, fields["model"].get_payload(decode=True)).decode() if "model" in fields else None
        if model and model != self.model and self.vllm:
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        size = len(fields["file"].get_payload(decode=True) or b"")
        text = f"simulated transcription of {size} bytes"
        fmt = (cast(bytes, fields["response_format"].get_payload(decode=True)).decode()
               if "response_format" in fields else "json")
        return await self._generate(1, lambda: web.Response(text=text) if fmt == "text" else {"text": text})


SIM_KEY = web.AppKey("sim", Sim)


def build_app(opts: SimOptions) -> web.Application:
    """The simulator as an aiohttp application; its ``Sim`` state is ``app[SIM_KEY]``."""
    sim = Sim(opts)
    app = web.Application(middlewares=[sim.middleware], client_max_size=256 * 1024 * 1024)
    app[SIM_KEY] = sim
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    r = app.router
    r.add_get("/health", sim.health)
    r.add_get("/v1/models", sim.models)
    r.add_get("/v1/models/{model}", sim.model_card)
    r.add_get("/metrics", sim.metrics)
    if sim.sglang:
        r.add_post("/release_memory_occupation", sim.release_memory_occupation)
        r.add_post("/resume_memory_occupation", sim.resume_memory_occupation)
        r.add_post("/update_weights_from_disk", sim.update_weights_from_disk)
    else:
        r.add_post("/sleep", sim.sleep)
        r.add_post("/wake_up", sim.wake_up)
        r.add_get("/is_sleeping", sim.is_sleeping)
        r.add_post("/collective_rpc", sim.collective_rpc)
        r.add_post("/reset_prefix_cache", sim.reset_prefix_cache)
    r.add_get("/_sim/requests", sim.sim_requests)
    r.add_get("/_sim/state", sim.sim_state)
    r.add_get("/_sim/launch", sim_launch)
    r.add_delete("/_sim/requests", sim.sim_clear)
    r.add_post("/v1/chat/completions", sim.chat)
    r.add_post("/v1/chat/completions/batch", sim.chat_batch)
    r.add_post("/v1/completions", sim.completions)
    r.add_post("/v1/responses", sim.responses)
    r.add_post("/v1/messages", sim.messages)
    r.add_post("/v1/embeddings", sim.embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r.add_post(path, sim.rerank)
    for path in ("/v1/score", "/score"):
        r.add_post(path, sim.score)
    r.add_post("/v1/audio/transcriptions", sim.transcriptions)
    return app


def visible_gpus(env: str | None) -> list[int]:
    """The GPU indices in ``$CUDA_VISIBLE_DEVICES``: GPU 0 when unset, none when empty;
    like CUDA, the list ends at the first entry that is not an index."""
    if env is None:
        return [0]
    gpus: list[int] = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit():
            break
        gpus.append(int(item))
    return gpus


def claim_gpu_memory(opts: SimOptions, mib: int | None = None) -> str | None:
    """Write this process's file for the fake nvidia-smi (see the module's doc), saying
    ``mib`` MiB per GPU (default ``opts.gpu_mib``), and return its path, or None when
    there is nothing to claim."""
    apps = os.environ.get("FAKE_NVIDIA_SMI_APPS")
    gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not opts.gpu_mib or not apps or not gpus:
        return None
    os.makedirs(apps, exist_ok=True)
    path = os.path.join(apps, str(os.getpid()))
    tmp = os.path.join(apps, f".{os.getpid()}.tmp")  # atomic: the fake never reads half a file
    with open(tmp, "w") as f:
        f.writelines(f"{gpu} {opts.gpu_mib if mib is None else mib}\n" for gpu in gpus)
    os.replace(tmp, path)
    return path


async def serve(opts: SimOptions) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    app = build_app(opts)
    sim = app[SIM_KEY]
    sim.journal.write("boot", model=opts.model)

    def on_signal() -> None:
        if not stop.is_set():
            sim.journal.write("sigterm", model=opts.model, inflight=sim.inflight)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the startup line: whoever reads it may stop us at once
        loop.add_signal_handler(sig, on_signal)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    claimed = sim.gpu_file = claim_gpu_memory(opts)
    try:
        await web.TCPSite(runner, opts.host, opts.port, backlog=1024).start()
        port = runner.addresses[0][1]
        print(f"ondemand simulator (not a real engine) serving {opts.model} on {opts.host}:{port}",
              file=sys.stderr, flush=True)
        await stop.wait()
        if opts.shutdown_delay:
            await asyncio.sleep(opts.shutdown_delay)  # as an engine that takes its time to free the GPU
    finally:
        sim.gpu_file = None  # a sleep or wake still being answered writes it no more
        if claimed is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(claimed)
        await runner.cleanup()


async def sim_launch(request: web.Request) -> web.StreamResponse:
    """How this process was started: its argv and environment (tests check what a recipe and
    the box gave the engine: flags, HF_HOME, HF_TOKEN, the deployment's env)."""
    return web.json_response({"argv": sys.argv, "env": dict(os.environ)})


# Long: one declaration per flag the simulator takes, and their checks, read top to bottom.
def parse_args(argv: list[str] | None = None) -> SimOptions:
    ap = argparse.ArgumentParser(prog="python -m ondemand.sim.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (the startup line names it)")
    ap.add_argument("--model", default=None, help="the model (vLLM: the model it loads; here the served name "
                                                   "unless --served-model-name says another)")
    # The engines' own flags, as ondemand's recipes write them (recipes.py); an unknown flag is
    # refused with exit 2, as vLLM, SGLang and llama.cpp do.
    ap.add_argument("model_path", nargs="?", help="vLLM's positional model (vllm serve MODEL)")
    ap.add_argument("--served-model-name", "--alias", dest="served", help="the served name (vLLM, SGLang; "
                                                                         "llama.cpp's --alias)")
    ap.add_argument("--model-path", "-m", "-hf", dest="model_flag", help="SGLang's --model-path, llama.cpp's -m/-hf")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    for flag in ("--enable-sleep-mode", "--enable-memory-saver", "--metrics", "--enable-metrics"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true",
                    help="SGLang's: release_memory_occupation keeps the weights in host memory (a level 1 "
                         "sleep; without it, level 2)")
    ap.add_argument("--flavor", choices=FLAVORS, default="vllm")
    ap.add_argument("--startup-delay", type=float, default=0.0, metavar="S", help="answer 503 for S seconds")
    ap.add_argument("--token-delay", type=float, default=0.0, metavar="S", help="seconds per generated token")
    ap.add_argument("--tokens", type=int, default=16, metavar="N", help="length of an answer")
    ap.add_argument("--fail", nargs="+", metavar="MODE [S]",
                    help="exit-at-start | never-ready | crash-mid-stream | exit-after S | wake-fails | "
                         "wake-hangs | wake-garbage")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-running", type=int, default=0, metavar="N", help="concurrent generations (0: no limit)")
    ap.add_argument("--embedding-dim", type=int, default=8)
    ap.add_argument("--record-limit", type=int, default=1000, metavar="N")
    ap.add_argument("--shutdown-delay", type=float, default=0.0, metavar="S", help="exit S seconds after SIGTERM")
    ap.add_argument("--gpu-mib", type=int, default=0, metavar="N",
                    help="use N MiB on each GPU of $CUDA_VISIBLE_DEVICES, as the fake nvidia-smi "
                         "in $FAKE_NVIDIA_SMI_APPS sees it")
    ap.add_argument("--sleep-gpu-mib", type=int, default=0, metavar="M",
                    help="with --gpu-mib: M MiB on each GPU instead while asleep (default 0)")
    ap.add_argument("--host-mib", type=int, default=0, metavar="H",
                    help="really hold H MiB more of host memory while asleep at level 1 (the weights' copy)")
    ap.add_argument("--sleep-delay", type=float, default=0.0, metavar="S", help="a sleep takes S seconds")
    ap.add_argument("--wake-delay", type=float, default=0.0, metavar="S",
                    help="the wake of the weights takes S seconds")
    ap.add_argument("--journal", metavar="FILE",
                    help="append one JSON line per event (boot, req, end, sigterm with the requests in flight, "
                         "sleep, wake)")
    a = ap.parse_args(argv)
    fail, fail_after = None, 0.0
    if a.fail:
        fail = a.fail[0]
        if fail not in FAILURES:
            ap.error(f"--fail: {fail!r} is not one of {', '.join(FAILURES)}")
        if (fail == "exit-after") != (len(a.fail) == 2) or len(a.fail) > 2:
            ap.error("--fail: only exit-after takes a value, and it needs one: --fail exit-after S")
        if fail == "exit-after":
            try:
                fail_after = float(a.fail[1])
            except ValueError:
                ap.error(f"--fail exit-after: {a.fail[1]!r} is not a number of seconds")
    if a.tokens < 1:
        ap.error("--tokens must be at least 1")
    for flag in ("gpu_mib", "sleep_gpu_mib", "host_mib", "sleep_delay", "wake_delay"):
        if getattr(a, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must not be negative")
    if not 0 < a.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    model = a.served or a.model or a.model_path or a.model_flag or "sim-model"
    return SimOptions(host=a.host, port=a.port, model=model, flavor=a.flavor, startup_delay=a.startup_delay,
                      token_delay=a.token_delay, tokens=a.tokens, fail=fail, fail_after=fail_after,
                      max_model_len=a.max_model_len, max_running=a.max_running, embedding_dim=a.embedding_dim,
                      record_limit=a.record_limit, shutdown_delay=a.shutdown_delay, gpu_mib=a.gpu_mib,
                      sleep_gpu_mib=a.sleep_gpu_mib, host_mib=a.host_mib, sleep_delay=a.sleep_delay,
                      wake_delay=a.wake_delay, weights_cpu_backup=a.enable_weights_cpu_backup, journal=a.journal)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.fail == "exit-at-start":
        print("ondemand simulator: simulated failure: exit at start (--fail exit-at-start)",
              file=sys.stderr, flush=True)
        return 3
    try:
        import uvloop
        run: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(opts))
    except OSError as e:
        print(f"ondemand simulator: cannot listen on {opts.host}:{opts.port}: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
