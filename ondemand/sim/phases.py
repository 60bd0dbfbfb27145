"""The start phases' lines the simulator prints while it loads, as each engine logs them (vLLM's,
SGLang's, llama.cpp's), at the moments ``--weights-delay`` and ``--compile-delay`` say: weights
load from the start, compilation follows, the API server starts after both, and the startup is
complete at ``--startup-delay``. ondemand reads a start's phases from these lines
(ondemand/engines/phases.py), so ``make run`` and the tests show them as a real engine's.

With ``--load-weights`` the weights' load is real: the model's weight files (a directory's
``*.safetensors``, or the file itself) are read from disk once the load begins, as an engine's
loader reads them, and the load lasts at least that long; the lines after it, and the moment
the engine is ready, move by what the read took beyond ``--weights-delay``."""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from .options import SimOptions

# Each flavor's lines: (when, a share of the weights and compile delays passed, the line).
# "W" is the weights' delay, "C" the compile's; {model}, {w}, {c}, {host}, {port} are filled in.
LINES: dict[str, tuple[tuple[float, float, str], ...]] = {
    "vllm": (
        (0.0, 0.0, "INFO [gpu_model_runner.py] Starting to load model {model}..."),
        (1.0, 0.0, "INFO [default_loader.py] Loading weights took {w:.2f} seconds"),
        (1.0, 0.0, "INFO [gpu_model_runner.py] Model loading took 0.01 GiB and {w:.2f} seconds"),
        (1.0, 0.6, "INFO [monitor.py] torch.compile takes {c:.2f} s in total"),
        (1.0, 1.0, "INFO [gpu_model_runner.py] Graph capturing finished in {c:.1f} secs, took 0.01 GiB"),
        (1.0, 1.0, "INFO [api_server.py] Starting vLLM API server 0 on http://{host}:{port}"),
    ),
    "sglang": (
        (0.0, 0.0, "[TP0] Load weight begin. avail mem=1.00 GB"),
        (1.0, 0.0, "[TP0] Load weight end. type=Simulated, dtype=torch.bfloat16, mem usage=0.01 GB"),
        (1.0, 0.0, "[TP0] Capture cuda graph begin. This can take up to several minutes."),
        (1.0, 1.0, "[TP0] Capture cuda graph end. Time elapsed: {c:.2f} s."),
        (1.0, 1.0, "INFO:     Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)"),
    ),
    "llamacpp": (
        (0.0, 0.0, "llama_model_loader: loaded meta data with 30 key-value pairs from {model}"),
        (0.5, 0.0, "load_tensors: offloaded 33/33 layers to GPU"),
        (1.0, 0.0, "common_init_from_params: warming up the model with an empty run"),
        (1.0, 1.0, "main: server is listening on http://{host}:{port} - starting the main loop"),
    ),
}


def delays(opts: SimOptions) -> tuple[float, float]:
    """The weights' and the compile's delays: as given, else 0.3 and 0.5 of the startup delay."""
    weights = opts.weights_delay if opts.weights_delay is not None else 0.3 * opts.startup_delay
    compile_s = opts.compile_delay if opts.compile_delay is not None else 0.5 * opts.startup_delay
    return weights, compile_s


CHUNK = 8 * 2**20


def read_weights(path: str) -> int:
    """Read the weight files at ``path`` (a directory's safetensors, or one file); the bytes read."""
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    done = 0
    buf = bytearray(CHUNK)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                done += n
    return done


async def print_phases(opts: SimOptions, port: int, loaded: Callable[[float], None] = lambda shift: None) -> None:
    """Print the flavor's phase lines on stderr at their moments (a task of the simulator's);
    with ``opts.weights_path``, read the weights when their load begins and tell ``loaded`` by
    how much the read moved what follows."""
    weights, compile_s = delays(opts)
    loop = asyncio.get_running_loop()
    began = loop.time()
    shift = 0.0
    pending = opts.weights_path
    for w_share, c_share, line in LINES[opts.flavor]:
        if pending is not None and w_share > 0:  # the load began with the lines before this one
            await asyncio.to_thread(read_weights, pending)
            shift, pending = max(0.0, loop.time() - began - weights), None
            loaded(shift)
        at = w_share * weights + c_share * compile_s + (shift if w_share > 0 else 0.0)
        wait = began + at - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        print(line.format(model=opts.model, w=weights + shift, c=compile_s, host=opts.host, port=port),
              file=sys.stderr, flush=True)
