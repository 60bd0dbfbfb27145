"""A simulated LLM engine: a server that answers like vLLM's OpenAI server.

It is not a real engine and says so (``owned_by`` is ``ondemand-simulator``, and
the startup line on stderr). It lets the gateway, its tests, its benchmark and
the demo (``make run``) run without a GPU::

    python -m ondemand.sim.engine --port 8001 --model demo [--flavor llamacpp]

Text is deterministic: ``tok0 tok1 ...``, one token per streamed chunk (``--token-delay`` before
each; with ``--prefill-rate R`` a chat or completion first takes its prompt's words at R a second,
then its first token comes at once and each takes the delay after it: a replay's engine). The
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

While loading (``--startup-delay S``, or forever with ``--fail never-ready``) it prints its
flavor's start phase lines (``sim/phases.py``: vLLM's "Starting to load model", "Loading weights
took", "Graph capturing finished", "Starting vLLM API server"; SGLang's and llama.cpp's own) at
``--weights-delay`` and ``--compile-delay`` (with ``--load-weights`` it really reads the
model's weight files when the load begins, and is ready that much later), and the
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

This module is the program (its command line, ``SimServer``, ``serve`` and ``main``) and names
what it is made of: ``options`` (``SimOptions``), ``server`` (its HTTP on ondemand's lean front,
with no aiohttp: a request as the routes see it, the router, the listener and its shutdown),
``routes`` (``Sim``, ``router``: what every request passes through, the control and ``/_sim/*``
routes), ``generation`` (the generation routes and their timing), ``memory`` (sleep and wake,
host memory, the fake nvidia-smi's file), ``faults`` (the ``--fail`` modes after the start),
``record`` (the request record, the journal) and ``replies`` (the answers every route shares).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

# What the simulator is made of, named here too (its public names were this module's).
from .faults import CRASH_AFTER
from .generation import GENERATION
from .memory import PARTS, claim_gpu_memory, visible_gpus
from .options import FAILURES, FLAVORS, SimOptions
from .record import Journal
from .replies import SimError
from .routes import Sim, sim_launch
from .server import Listener

__all__ = ["CRASH_AFTER", "FAILURES", "FLAVORS", "GENERATION", "PARTS", "Journal", "Sim", "SimError", "SimOptions",
           "SimServer", "claim_gpu_memory", "main", "parse_args", "serve", "sim_launch", "visible_gpus"]


class SimServer:
    """The simulator in this process (``serve``'s, and the tests'): ``start`` begins its load and
    listens (the port: ``opts.port``, or a free one for 0), ``stop`` ends it (the requests in flight
    get ``shutdown_timeout``, then are cancelled). ``sim``: its state."""

    def __init__(self, opts: SimOptions, shutdown_timeout: float = 0.5):
        self.opts = opts
        self.sim = Sim(opts)
        self.listener = Listener(self.sim.handle, shutdown_timeout)
        self.port = 0

    async def start(self) -> int:
        self.sim.start()
        self.port = await self.listener.listen(self.opts.host, self.opts.port)
        return self.port

    async def stop(self) -> None:
        await self.listener.stop()
        self.sim.cleanup()


async def serve(opts: SimOptions) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = SimServer(opts)
    sim = server.sim
    sim.journal.write("boot", model=opts.model)

    def on_signal() -> None:
        if not stop.is_set():
            sim.journal.write("sigterm", model=opts.model, inflight=sim.inflight)
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the startup line: whoever reads it may stop us at once
        loop.add_signal_handler(sig, on_signal)
    claimed = sim.mem.gpu_file = claim_gpu_memory(opts)
    try:
        port = await server.start()
        print(f"ondemand simulator (not a real engine) serving {opts.model} on {opts.host}:{port}",
              file=sys.stderr, flush=True)
        await stop.wait()
        if opts.shutdown_delay:
            await asyncio.sleep(opts.shutdown_delay)  # as an engine that takes its time to free the GPU
    finally:
        sim.mem.gpu_file = None  # a sleep or wake still being answered writes it no more
        if claimed is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(claimed)
        await server.stop()


def parse_args(argv: list[str] | None = None) -> SimOptions:
    ap = argparse.ArgumentParser(prog="python -m ondemand.sim.engine", description=__doc__.split("\n")[0])
    _engine_flags(ap)
    _simulated_flags(ap)
    a = ap.parse_args(argv)
    fail, fail_after = _fail_mode(ap, a.fail)
    _check_ranges(ap, a)
    model = a.served or a.model or a.model_path or a.model_flag or "sim-model"
    weights_path = None
    if a.load_weights:
        weights_path = a.model_path or a.model_flag or a.model
        if not weights_path or not os.path.exists(weights_path):
            ap.error(f"--load-weights: the model {weights_path!r} is not a local directory or file")
    return SimOptions(host=a.host, port=a.port, model=model, flavor=a.flavor, startup_delay=a.startup_delay,
                      token_delay=a.token_delay, prefill_rate=a.prefill_rate, tokens=a.tokens, fail=fail,
                      fail_after=fail_after,
                      max_model_len=a.max_model_len, max_running=a.max_running, embedding_dim=a.embedding_dim,
                      record_limit=a.record_limit, shutdown_delay=a.shutdown_delay, gpu_mib=a.gpu_mib,
                      sleep_gpu_mib=a.sleep_gpu_mib, host_mib=a.host_mib, sleep_delay=a.sleep_delay,
                      wake_delay=a.wake_delay, weights_cpu_backup=a.enable_weights_cpu_backup, journal=a.journal,
                      weights_delay=a.weights_delay, compile_delay=a.compile_delay, weights_path=weights_path)


def _engine_flags(ap: argparse.ArgumentParser) -> None:
    """Where it listens, and the engines' own flags as ondemand's recipes write them (recipes.py):
    an unknown flag is refused with exit 2, as vLLM, SGLang and llama.cpp do."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (the startup line names it)")
    ap.add_argument("--model", default=None, help="the model (vLLM: the model it loads; here the served name "
                                                   "unless --served-model-name says another)")
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
    ap.add_argument("--max-model-len", type=int, default=4096)


def _simulated_flags(ap: argparse.ArgumentParser) -> None:
    """The simulator's own: which engine it plays, how long each thing takes, its memory, its failures."""
    ap.add_argument("--flavor", choices=FLAVORS, default="vllm")
    ap.add_argument("--startup-delay", type=float, default=0.0, metavar="S", help="answer 503 for S seconds")
    ap.add_argument("--weights-delay", type=float, default=None, metavar="S",
                    help="the weights' load lines S seconds after the start (default 0.3 of --startup-delay)")
    ap.add_argument("--compile-delay", type=float, default=None, metavar="S",
                    help="then the compile's, S seconds later (default 0.5 of --startup-delay)")
    ap.add_argument("--load-weights", action="store_true",
                    help="read the model's weight files (a local directory's *.safetensors, or the file) while "
                         "loading, as an engine does: the load lasts at least the read")
    ap.add_argument("--token-delay", type=float, default=0.0, metavar="S", help="seconds per generated token")
    ap.add_argument("--prefill-rate", type=float, default=0.0, metavar="R",
                    help="prompt words a second before the first token (chat, completions); then the first "
                         "token comes as the prefill ends, each token taking --token-delay after it")
    ap.add_argument("--tokens", type=int, default=16, metavar="N", help="length of an answer")
    ap.add_argument("--fail", nargs="+", metavar="MODE [S]",
                    help="exit-at-start | never-ready | crash-mid-stream | exit-after S | wake-fails | "
                         "wake-hangs | wake-garbage")
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


def _fail_mode(ap: argparse.ArgumentParser, given: list[str] | None) -> tuple[str | None, float]:
    """--fail MODE [S]: the mode, and the seconds of exit-after (the only one that takes them)."""
    if not given:
        return None, 0.0
    fail = given[0]
    if fail not in FAILURES:
        ap.error(f"--fail: {fail!r} is not one of {', '.join(FAILURES)}")
    if (fail == "exit-after") != (len(given) == 2) or len(given) > 2:
        ap.error("--fail: only exit-after takes a value, and it needs one: --fail exit-after S")
    if fail != "exit-after":
        return fail, 0.0
    try:
        return fail, float(given[1])
    except ValueError:
        ap.error(f"--fail exit-after: {given[1]!r} is not a number of seconds")


def _check_ranges(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The numbers that must be in range; ap.error (exit 2) names the first that is not."""
    if a.tokens < 1:
        ap.error("--tokens must be at least 1")
    for flag in ("gpu_mib", "sleep_gpu_mib", "host_mib", "sleep_delay", "wake_delay", "prefill_rate"):
        if getattr(a, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must not be negative")
    for flag in ("weights_delay", "compile_delay"):
        if (getattr(a, flag) or 0.0) < 0:
            ap.error(f"--{flag.replace('_', '-')} must not be negative")
    if (a.weights_delay or 0.0) + (a.compile_delay or 0.0) > a.startup_delay:
        ap.error("--weights-delay and --compile-delay are parts of --startup-delay: together at most it")
    if not 0 < a.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")


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
