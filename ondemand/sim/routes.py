"""The simulator's HTTP side: ``Sim`` (what every request passes through: the record, the
journal, loading and sleeping; the control routes; the ``/_sim/*`` routes) and ``build_app``,
which routes each path to it, to its ``Memory`` (sleep and wake) or to its ``Generation``."""
from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from .faults import exit_later
from .generation import GENERATION, Generation
from .memory import Memory
from .options import FAILURES, FLAVORS, SimOptions
from .phases import print_phases
from .record import Journal, Recorded, listing
from .replies import SimError, answer, error

_LOADING = orjson.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})


class Sim:
    def __init__(self, opts: SimOptions):
        if opts.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, not {opts.flavor!r}")
        if opts.fail is not None and opts.fail not in FAILURES:
            raise ValueError(f"fail must be one of {FAILURES}, not {opts.fail!r}")
        if opts.tokens < 1:
            raise ValueError("tokens must be at least 1")
        self.opts = opts
        self.vllm = opts.flavor == "vllm"
        self.sglang = opts.flavor == "sglang"
        self.model = opts.model
        self.ready = False
        self.ready_at = float("inf")
        self.began = 0.0
        self.record: collections.deque[Recorded] = collections.deque(maxlen=opts.record_limit)
        self.journal = Journal(opts.journal, opts.model)
        self.seq = 0
        self.inflight = 0  # generation requests being answered (for the journal's sigterm line)
        self.tasks: list[asyncio.Task[Any]] = []
        self.card = {"id": opts.model, "object": "model", "created": int(time.time()),
                     "owned_by": "ondemand-simulator", "root": opts.model, "parent": None,
                     "max_model_len": opts.max_model_len}
        self.models_body = orjson.dumps({"object": "list", "data": [self.card]})
        self.mem = Memory(opts, self.journal)
        self.gen = Generation(opts, self.mem)

    # -- plumbing -------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.began = time.monotonic()
        self.weights_read = asyncio.Event()
        # With --load-weights, ready once the weights are read (``_loaded`` says when).
        self.ready_at = self.began + self.opts.startup_delay if self.opts.weights_path is None else float("inf")
        if self.opts.fail == "exit-after":
            # The simulator is a program of its own and imports nothing of ondemand
            # (tests/test_layout.py); the task is kept in self.tasks and cancelled at cleanup.
            self.tasks.append(asyncio.ensure_future(  # noqa: TID251
                exit_later(self.opts.startup_delay, self.opts.fail_after)))
        loads = self.opts.startup_delay > 0 or self.opts.weights_path is not None
        if loads and self.opts.fail != "never-ready":
            # As an engine's log says it is loading, then that it is ready (a log to follow live).
            print(f"loading {self.opts.model} ({self.opts.startup_delay:g} s)", file=sys.stderr, flush=True)
            self.tasks.append(asyncio.ensure_future(self._say_ready()))  # noqa: TID251
            self.tasks.append(asyncio.ensure_future(  # noqa: TID251
                print_phases(self.opts, self.opts.port, self._loaded)))

    def _loaded(self, shift: float) -> None:
        self.ready_at = self.began + self.opts.startup_delay + shift
        self.weights_read.set()

    async def _say_ready(self) -> None:
        if self.opts.weights_path is not None:
            await self.weights_read.wait()
        await asyncio.sleep(max(0.0, self.ready_at - time.monotonic()))
        print(f"{self.opts.model} loaded: application startup complete", file=sys.stderr, flush=True)

    async def on_cleanup(self, app: web.Application) -> None:
        for t in self.tasks:
            t.cancel()

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
        if self.mem.sleeping and path in GENERATION:
            wake = "/resume_memory_occupation" if self.sglang else "/wake_up"
            return error(503, f"The engine is sleeping; POST {wake} first.", "ServiceUnavailableError")
        try:
            return await handler(request)
        except SimError as e:
            return answer(e.body, e.status) if e.body is not None else error(e.status, e.message, e.type, e.param)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # FastAPI's shape, which is what vLLM answers for unknown routes
            return answer({"detail": e.reason}, e.status)

    # -- control routes -------------------------------------------------------------

    async def health(self, request: web.Request) -> web.StreamResponse:
        return answer({"status": "ok"}) if self.opts.flavor == "llamacpp" else web.Response()

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.models_body, content_type="application/json")

    async def model_card(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name != self.model:
            raise SimError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return answer(self.card)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        name = self.model.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{name}"}}'
        if self.sglang:
            text = (
                "# HELP sglang:num_running_reqs The number of running requests.\n"
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{label} {float(self.gen.running)}\n"
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
                "# TYPE sglang:num_queue_reqs gauge\n"
                f"sglang:num_queue_reqs{label} {float(self.gen.waiting)}\n")
        elif self.vllm:
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{label} {float(self.gen.running)}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{label} {float(self.gen.waiting)}\n")
        else:
            text = (
                "# HELP llamacpp:requests_processing Number of requests processing.\n"
                "# TYPE llamacpp:requests_processing gauge\n"
                f"llamacpp:requests_processing {self.gen.running}\n"
                "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                "# TYPE llamacpp:requests_deferred gauge\n"
                f"llamacpp:requests_deferred {self.gen.waiting}\n")
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- the simulator's own routes (besides /_sim/state, the memory's) ------------------

    async def sim_requests(self, request: web.Request) -> web.StreamResponse:
        return answer(listing(self.record))

    async def sim_clear(self, request: web.Request) -> web.StreamResponse:
        self.record.clear()
        return web.Response(status=204)


async def sim_launch(request: web.Request) -> web.StreamResponse:
    """How this process was started: its argv and environment (tests check what a recipe and
    the box gave the engine: flags, HF_HOME, HF_TOKEN, the deployment's env)."""
    return web.json_response({"argv": sys.argv, "env": dict(os.environ)})


SIM_KEY = web.AppKey("sim", Sim)


def build_app(opts: SimOptions) -> web.Application:
    """The simulator as an aiohttp application; its ``Sim`` state is ``app[SIM_KEY]``."""
    sim = Sim(opts)
    app = web.Application(middlewares=[sim.middleware], client_max_size=256 * 1024 * 1024)
    app[SIM_KEY] = sim
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    r, mem, gen = app.router, sim.mem, sim.gen
    r.add_get("/health", sim.health)
    r.add_get("/v1/models", sim.models)
    r.add_get("/v1/models/{model}", sim.model_card)
    r.add_get("/metrics", sim.metrics)
    if sim.sglang:
        r.add_post("/release_memory_occupation", mem.release_memory_occupation)
        r.add_post("/resume_memory_occupation", mem.resume_memory_occupation)
        r.add_post("/update_weights_from_disk", mem.update_weights_from_disk)
    else:
        r.add_post("/sleep", mem.sleep)
        r.add_post("/wake_up", mem.wake_up)
        r.add_get("/is_sleeping", mem.is_sleeping)
        r.add_post("/collective_rpc", mem.collective_rpc)
        r.add_post("/reset_prefix_cache", mem.reset_prefix_cache)
    r.add_get("/_sim/requests", sim.sim_requests)
    r.add_get("/_sim/state", mem.sim_state)
    r.add_get("/_sim/launch", sim_launch)
    r.add_delete("/_sim/requests", sim.sim_clear)
    r.add_post("/v1/chat/completions", gen.chat)
    r.add_post("/v1/chat/completions/batch", gen.chat_batch)
    r.add_post("/v1/completions", gen.completions)
    r.add_post("/v1/responses", gen.responses)
    r.add_post("/v1/messages", gen.messages)
    r.add_post("/v1/embeddings", gen.embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r.add_post(path, gen.rerank)
    for path in ("/v1/score", "/score"):
        r.add_post(path, gen.score)
    r.add_post("/v1/audio/transcriptions", gen.transcriptions)
    return app
