"""The simulator's routes: ``Sim`` (what every request passes through: the record, the journal,
loading and sleeping; the control routes; the ``/_sim/*`` routes) and ``router``, which routes
each path to it, to its ``Memory`` (sleep and wake) or to its ``Generation`` (served by
``server.Listener``)."""
from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from typing import Any

import orjson

from .faults import exit_later
from .generation import GENERATION, Generation
from .memory import Memory
from .options import FAILURES, FLAVORS, SimOptions
from .phases import print_phases
from .record import Journal, Recorded, listing
from .replies import JSON, TEXT, Reply, SimError, answer, empty, error
from .server import NoRoute, Request, Router

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
        self.router = router(self)

    # -- plumbing -------------------------------------------------------------------

    def start(self) -> None:
        """The start (before the socket listens): the loading's clock, its lines, ``--fail exit-after``."""
        self.began = time.monotonic()
        self.weights_read = asyncio.Event()
        # With --load-weights, ready once the weights are read (``_loaded`` says when).
        self.ready_at = self.began + self.opts.startup_delay if self.opts.weights_path is None else float("inf")
        if self.opts.fail == "exit-after":
            # The simulator is a program of its own and imports nothing of ondemand but the lean
            # front (tests/test_layout.py); the task is kept in self.tasks and cancelled at cleanup.
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

    def cleanup(self) -> None:
        """The end (after the socket closed and the requests ended): its own tasks are cancelled."""
        for t in self.tasks:
            t.cancel()

    async def handle(self, request: Request) -> Reply:
        """Every request: ``/_sim/*`` straight to its route; any other recorded with its body (and
        journaled), then answered as the engine would (``_answer``)."""
        path = request.path
        if path.startswith("/_sim/"):
            try:
                return await self.router.resolve(request)(request)
            except NoRoute as e:
                return e.reply()
        generation = path in GENERATION
        self.inflight += generation
        try:
            body = await request.read()
            raw_headers = request.raw_headers
            self.record.append((time.time(), request.method, path, request.query_string, raw_headers, body,
                                request.raw_path))
            if self.journal.fd < 0:
                return await self._answer(request, path)
            self.seq += 1
            n = self.seq
            self.journal.write("req", n=n, path=path, h=sorted({k.decode("latin-1").lower() for k, _ in raw_headers}))
            try:
                return await self._answer(request, path)
            finally:
                self.journal.write("end", n=n)
        finally:
            self.inflight -= generation

    async def _answer(self, request: Request, path: str) -> Reply:
        """503 while loading (any path), generation 503 while asleep, else the route's answer: a
        ``SimError`` as its error, no route as FastAPI says it (what vLLM answers)."""
        if not self.ready:
            if self.opts.fail == "never-ready" or time.monotonic() < self.ready_at:
                return Reply(503, _LOADING, JSON)
            self.ready = True
        if self.mem.sleeping and path in GENERATION:
            wake = "/resume_memory_occupation" if self.sglang else "/wake_up"
            return error(503, f"The engine is sleeping; POST {wake} first.", "ServiceUnavailableError")
        try:
            return await self.router.resolve(request)(request)
        except SimError as e:
            return answer(e.body, e.status) if e.body is not None else error(e.status, e.message, e.type, e.param)
        except NoRoute as e:
            return answer({"detail": e.reason}, e.status)

    # -- control routes -------------------------------------------------------------

    async def health(self, request: Request) -> Reply:
        return answer({"status": "ok"}) if self.opts.flavor == "llamacpp" else empty()

    async def models(self, request: Request) -> Reply:
        return Reply(200, self.models_body, JSON)

    async def model_card(self, request: Request) -> Reply:
        name = request.match
        if name != self.model:
            raise SimError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return answer(self.card)

    async def metrics(self, request: Request) -> Reply:
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
        return Reply(200, text.encode(), TEXT)

    # -- the simulator's own routes (besides /_sim/state, the memory's) ------------------

    async def sim_requests(self, request: Request) -> Reply:
        return answer(listing(self.record))

    async def sim_clear(self, request: Request) -> Reply:
        self.record.clear()
        return empty(204)


async def sim_launch(request: Request) -> Reply:
    """How this process was started: its argv and environment (tests check what a recipe and
    the box gave the engine: flags, HF_HOME, HF_TOKEN, the deployment's env)."""
    import json  # here: this route is rare, and json (unlike orjson) writes any str the environment holds
    return Reply(200, json.dumps({"argv": sys.argv, "env": dict(os.environ)}).encode(),
                 {"Content-Type": "application/json; charset=utf-8"})


def router(sim: Sim) -> Router:
    """Each path to its route: ``sim``'s, its memory's or its generation's, by flavor."""
    r, mem, gen = Router(), sim.mem, sim.gen
    for path, route in (("/health", sim.health), ("/v1/models", sim.models), ("/v1/models/{model}", sim.model_card),
                        ("/metrics", sim.metrics), ("/_sim/requests", sim.sim_requests),
                        ("/_sim/state", mem.sim_state), ("/_sim/launch", sim_launch)):
        r.add("GET", path, route)
    r.add("DELETE", "/_sim/requests", sim.sim_clear)
    if sim.sglang:
        posts = [("/release_memory_occupation", mem.release_memory_occupation),
                 ("/resume_memory_occupation", mem.resume_memory_occupation),
                 ("/update_weights_from_disk", mem.update_weights_from_disk)]
    else:
        r.add("GET", "/is_sleeping", mem.is_sleeping)
        posts = [("/sleep", mem.sleep), ("/wake_up", mem.wake_up), ("/collective_rpc", mem.collective_rpc),
                 ("/reset_prefix_cache", mem.reset_prefix_cache)]
    posts += [("/v1/chat/completions", gen.chat), ("/v1/chat/completions/batch", gen.chat_batch),
              ("/v1/completions", gen.completions), ("/v1/responses", gen.responses), ("/v1/messages", gen.messages),
              ("/v1/embeddings", gen.embeddings), ("/v1/rerank", gen.rerank), ("/rerank", gen.rerank),
              ("/v2/rerank", gen.rerank), ("/v1/score", gen.score), ("/score", gen.score),
              ("/v1/audio/transcriptions", gen.transcriptions)]
    for path, route in posts:
        r.add("POST", path, route)
    return r
