"""The simulator's options (``SimOptions``), as the command line (``engine.parse_args``) or a
test in the same process (``engine.SimServer``) gives them, and the choices two of them take."""
from __future__ import annotations

from dataclasses import dataclass

FLAVORS = ("vllm", "llamacpp", "sglang")
FAILURES = ("exit-at-start", "never-ready", "crash-mid-stream", "exit-after", "wake-fails", "wake-hangs",
            "wake-garbage")


@dataclass
class SimOptions:
    """The command-line options, for in-process use with ``engine.SimServer``."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    flavor: str = "vllm"
    startup_delay: float = 0.0
    # While it loads, the start phases' lines (sim/phases.py): the weights' load takes this long from
    # the start, then the compile this long (None: 0.3 and 0.5 of startup_delay); together at most it.
    weights_delay: float | None = None
    compile_delay: float | None = None
    weights_path: str | None = None  # --load-weights: the weight files read while loading (sim/phases.py)
    token_delay: float = 0.0
    # Prompt words a second before the first token (chat, completions); 0: none. With it the first
    # token comes as the prefill ends, and each token takes token_delay after it.
    prefill_rate: float = 0.0
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
    journal: str | None = None  # a file to append one JSON line per event to (see engine's doc)
