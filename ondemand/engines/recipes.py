"""Engine recipes: the command line, environment and mounts an engine runs with.

An admin names the model, the engine, the GPUs and the memory; a recipe writes
the rest (KServe's ServingRuntimes do this for Kubernetes). A deployment with
``engine`` = ``vllm``, ``sglang`` or ``llamacpp`` **and a ``model``** gets:

- the model, the served name, the address (``0.0.0.0`` and its ``port`` in a
  container; ``127.0.0.1`` and ``{port}`` for a child process, which the process
  backend fills in);
- tensor parallelism from ``gpu_count``;
- the memory share from ``memory_gib``: vLLM's ``--gpu-memory-utilization``
  (default 0.9 of each GPU it sees) would otherwise take memory the budget booked
  for another engine on the same GPU, and that engine's start fails. Without
  ``memory_gib`` (vLLM, SGLang) the booking is derived (``booking``): the checkpoint's
  weights and KV cache when it can be read on this host (``checkpoint.py``; the
  context capped at ``deployer.max_model_len`` is passed as ``--max-model-len`` /
  ``--context-length``), else the engine's default share, 0.90, passed explicitly;
- the sleep flags, when the deployment may sleep;
- then its own ``args``, last, so an admin may override any derived flag (the last
  flag wins in all three engines).

A deployment without a ``model`` runs its ``image`` + ``args`` or its
``command`` exactly as given, as before recipes; ``custom`` has no recipe.

The box adds what every engine needs (``Box``): the model cache mounted at the
image's Hugging Face cache (a child process gets ``HF_HOME``), so weights are
downloaded once, not at every cold start; the token file as ``HF_TOKEN``, read at
the start and never kept (not in a view, a log, the state file); the deployment's
own ``env`` and ``volumes``.

Pure functions and values: no I/O but reading the token file in ``launch(...,
secrets=True)``. ``check`` validates an admin's fields and raises ``FieldError``
naming the field.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from ..config import Config
from ..model import Booking, Deployment
from . import checkpoint, compile_cache, tiers, warmth

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang", "llamacpp", "custom")
RECIPES = ("vllm", "sglang", "llamacpp")
MAX_SHARE = 0.95
ENGINE_DEFAULT_SHARE = 0.90  # vLLM's and SGLang's own default share of each GPU, booked without memory_gib
GIB = 2**30
# The engines' context-length and KV-cache dtype flags.
_CONTEXT_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length"}
_KV_DTYPE_FLAG = "--kv-cache-dtype"
# Where the images keep Hugging Face's cache (they run as root).
HF_CACHE = "/root/.cache/huggingface"
# Where a recipe's compile cache goes (``deployer.compile_cache``, one directory per configuration):
# vLLM's cache root in its images (VLLM_CACHE_ROOT for a child process: torch.compile's and Triton's
# artifacts). SGLang's cache root (SGLANG_CACHE_DIR: its torch.compile cache, DeepGEMM's JIT kernels,
# and in recent releases Triton's, Inductor's and the CUDA driver's), with the per-component
# variables its docs name for older releases ("Enabling cache for torch.compile": the Inductor
# cache; SGLANG_DG_CACHE_DIR). llama.cpp's images build its CUDA kernels as PTX only for A100 and
# H100 (ggml-cuda's default architectures: 80-virtual, 90-virtual), which the CUDA driver compiles
# at the first run into its JIT cache (CUDA_CACHE_PATH): lost with each container, kept here.
VLLM_CACHE = "/root/.cache/vllm"
SGLANG_CACHE = LLAMACPP_CACHE = "/root/.cache/ondemand-compile"
CUDA_CACHE_MAX = str(4 * 2**30)  # the most the CUDA driver's JIT cache takes (its default keeps less)
MASK = "***"
# Names an admin's env may not set: the GPUs are the budget's choice, the token is the box's.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HF_TOKEN"})
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
# An argument that names a secret: its value is masked in views (``--api-key X``, ``--hf-token=X``).
_SECRET_FLAG = re.compile(r"--?[A-Za-z0-9_-]*(key|token|secret|password)\Z", re.IGNORECASE)
# The Docker API socket: a container that mounts it owns the host.
_DOCKER_SOCKETS = ("docker.sock",)

# How each image is entered (docker backend). vLLM's images changed their entrypoint across
# releases (``python3 -m vllm.entrypoints.openai.api_server``, then ``vllm serve``); every one has
# the ``vllm`` command, so the recipe sets it rather than guess. SGLang's images have none.
# llama.cpp's server images enter ``llama-server`` already (None: the image's own).
ENTRYPOINTS: dict[str, tuple[str, ...] | None] = {
    "vllm": ("vllm", "serve"),
    "sglang": ("python3", "-m", "sglang.launch_server"),
    "llamacpp": None,
}


class FieldError(ValueError):
    """A field an admin gave is not allowed: ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def is_secret(name: str) -> bool:
    return name.endswith(("_TOKEN", "_KEY"))


@dataclasses.dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool = False

    def __str__(self) -> str:
        return f"{self.host}:{self.container}" + (":ro" if self.read_only else "")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How an engine runs: the backend's whole input besides the deployment's identity.

    ``entrypoint`` + ``args`` is the command line: for the docker backend the container's
    Entrypoint (None: the image's own) and Cmd; for the process backend ``entrypoint`` is
    None and ``args`` is the whole argv, ``{port}`` standing for the port it picks."""
    image: str | None
    entrypoint: tuple[str, ...] | None
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    compile_key: str | None = None  # its directory under deployer.compile_cache (compile_cache.key)

    @property
    def argv(self) -> list[str]:
        """The command line as it will run, with the value of every secret flag masked."""
        out: list[str] = []
        mask_next = False
        for arg in (*(self.entrypoint or ()), *self.args):
            flag, eq, _ = arg.partition("=")
            if mask_next:
                out.append(MASK)
            elif eq and flag.startswith("-") and _SECRET_FLAG.match(flag):
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
            mask_next = not eq and bool(_SECRET_FLAG.match(arg))
        return out

    def shown_env(self) -> dict[str, str]:
        """The environment as views show it: secrets' values masked."""
        return {k: MASK if is_secret(k) else v for k, v in self.env}


@dataclasses.dataclass(frozen=True)
class Box:
    """What the box gives every engine (``deployer.*``)."""
    backend: str = "process"
    images: Mapping[str, str] = dataclasses.field(default_factory=dict)
    commands: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    model_cache: Path | None = None
    compile_cache: Path | None = None
    hf_token_file: Path | None = None
    volume_roots: tuple[Path, ...] = ()
    sleep_flags: bool = True
    kv_sequences: int = 4
    max_model_len: int = 32768

    @classmethod
    def from_config(cls, cfg: Config) -> Box:
        d = cfg.deployer
        return cls(backend=d.backend, images=dict(d.images), commands={k: tuple(v) for k, v in d.commands.items()},
                   model_cache=d.model_cache, compile_cache=d.compile_cache, hf_token_file=d.hf_token_file,
                   volume_roots=tuple(d.volume_roots), sleep_flags=d.sleep_flags,
                   kv_sequences=d.kv_sequences, max_model_len=d.max_model_len)

    @property
    def in_container(self) -> bool:
        return self.backend == "docker"


def share(memory_gib: float, gpu_count: int, gpu_size_gib: float) -> float:
    """The engine's memory share of each GPU it sees: ``memory_gib / gpu_count`` of one
    GPU's total, rounded down to 0.01 (so the engine takes at most what the budget booked;
    0.01 at least).
    Raises FieldError on ``memory_gib`` above ``MAX_SHARE``."""
    per_gpu = memory_gib / max(gpu_count, 1)
    # Rounded down, with a hair of slack for binary fractions (0.3 * 100 = 30.000000000000004).
    # At least 0.01: the engines refuse 0 (a model of a few hundred MiB on a large GPU).
    value = max(0.01, math.floor(per_gpu / gpu_size_gib * 100 + 1e-9) / 100)
    if value > MAX_SHARE:
        raise FieldError("memory_gib", f"{memory_gib:g} GiB on {max(gpu_count, 1)} GPU(s) of {gpu_size_gib:g} GiB "
                                       f"is a share of {per_gpu / gpu_size_gib:.2f} of each; at most {MAX_SHARE} "
                                       "(the engine needs the rest): raise gpu_count or lower memory_gib")
    return value


def may_sleep(dep: Deployment, per_gpu: bool) -> bool:
    """Whether the deployment's engine is started able to sleep: a vLLM or SGLang recipe whose
    ``idle_action`` sleeps (``auto``: on discrete GPUs only; on unified memory, DGX Spark, a
    wake is not reliable: vLLM #50011)."""
    return dep.model is not None and warmth.idle_level(dep, per_gpu) > 0


def _gpus(dep: Deployment, box_gpus: int) -> int:
    """How many GPUs the engine sees (``gpu_count`` NULL: every GPU of the box)."""
    return box_gpus if dep.gpu_count is None else dep.gpu_count


def _derived(dep: Deployment, box: Box, gpu_size_gib: float | None, box_gpus: int,
             per_gpu: bool) -> tuple[list[str], dict[str, str]]:
    """The recipe's own arguments (after the entrypoint or command) and environment."""
    model = dep.model or ""
    host, port = ("0.0.0.0", str(dep.port)) if box.in_container else ("127.0.0.1", "{port}")
    gpus = _gpus(dep, box_gpus)
    pooled = gpus if per_gpu else 1  # one pool (unified memory): the share is of the pool
    env: dict[str, str] = {}
    sleep = may_sleep(dep, per_gpu)
    capped = dep.booking.max_model_len if dep.memory_gib <= 0 and dep.booking is not None else None
    if dep.engine == "vllm":
        args = [model, "--served-model-name", dep.served_name, "--host", host, "--port", port]
        if gpus > 1:
            args += ["--tensor-parallel-size", str(gpus)]
        if gpus > 0 and dep.booked_gib > 0 and gpu_size_gib:
            args += ["--gpu-memory-utilization", f"{share(dep.booked_gib, pooled, gpu_size_gib):.2f}"]
        if capped is not None:
            args += [_CONTEXT_FLAG["vllm"], str(capped)]
        if sleep:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # the /sleep and /wake_up routes
            if box.sleep_flags:
                args.append("--enable-sleep-mode")
    elif dep.engine == "sglang":
        args = ["--model-path", model, "--served-model-name", dep.served_name, "--host", host, "--port", port]
        if gpus > 1:
            args += ["--tp", str(gpus)]
        if gpus > 0 and dep.booked_gib > 0 and gpu_size_gib:
            args += ["--mem-fraction-static", f"{share(dep.booked_gib, pooled, gpu_size_gib):.2f}"]
        if capped is not None:
            args += [_CONTEXT_FLAG["sglang"], str(capped)]
        args.append("--enable-metrics")  # /metrics: without it the sampler never sees the engine idle
        if sleep and box.sleep_flags:
            args.append("--enable-memory-saver")
            if tiers.asleep(warmth.idle_level(dep, per_gpu)).host:
                args.append("--enable-weights-cpu-backup")  # level 1: the weights kept in host memory
    else:  # llamacpp
        args = ["-m" if model.endswith(".gguf") else "-hf", model, "--alias", dep.served_name,
                "--host", host, "--port", port]
        if gpus > 0:
            args += ["-ngl", "999"]
        args.append("--metrics")  # /metrics: without it the sampler never sees the engine idle
    return args, env


def launch(dep: Deployment, box: Box, *, gpu_size_gib: float | None = None, box_gpus: int = 1,
           per_gpu: bool = True, secrets: bool = False) -> Launch:
    """How ``dep``'s engine runs on this box. ``gpu_size_gib``: one GPU's total memory (the
    pool's, on one pool), for the memory share (None: not known, the share is left out);
    ``box_gpus``: the box's GPUs (for ``gpu_count`` NULL); ``secrets``: read the token file
    (for a start; a view leaves the value out). Raises FieldError (a share over the limit)
    and OSError (an unreadable token file, only with ``secrets``)."""
    env: dict[str, str] = {}
    mounts: list[Mount] = []
    if dep.model is not None and dep.engine in RECIPES:
        derived, env = _derived(dep, box, gpu_size_gib, box_gpus, per_gpu)
        if box.in_container:
            image = dep.image or box.images.get(dep.engine)
            entrypoint = ENTRYPOINTS[dep.engine]
            args = (*derived, *dep.args)
        else:
            image, entrypoint = None, None
            args = (*box.commands.get(dep.engine, ()), *derived, *dep.args)
    elif box.in_container:
        image, entrypoint, args = dep.image, None, dep.args
    else:
        image, entrypoint, args = None, None, dep.command
    recipe = dep.model is not None and dep.engine in RECIPES
    # The box's cache and token go to recipes only: a row without a model runs as it was given.
    if box.model_cache is not None and recipe:
        if box.in_container:
            mounts.append(Mount(str(box.model_cache), HF_CACHE))
            env["HF_HOME"] = HF_CACHE
        else:
            env["HF_HOME"] = str(box.model_cache)
        if dep.engine == "llamacpp":  # llama.cpp's -hf downloads go here
            env["LLAMA_CACHE"] = (HF_CACHE if box.in_container else str(box.model_cache)) + "/llama.cpp"
    cache_key = _compile_cache(dep, box, image, args, env, mounts, _gpus(dep, box_gpus)) if recipe else None
    if box.hf_token_file is not None and recipe:
        env["HF_TOKEN"] = read_token(box.hf_token_file) if secrets else MASK
    env.update(dep.env)
    if box.in_container:
        mounts.extend(parse_volume(v) for v in dep.volumes)
    return Launch(image, entrypoint, tuple(args), tuple(env.items()), tuple(mounts), cache_key)


def _compile_cache(dep: Deployment, box: Box, image: str | None, args: Sequence[str], env: dict[str, str],
                   mounts: list[Mount], gpus: int) -> str | None:
    """The compile cache's key for a recipe (None: no ``deployer.compile_cache``, or a llama.cpp
    without a GPU: nothing it runs is compiled at start), its directory given to the engine:
    mounted in a container, by path to a process."""
    if box.compile_cache is None or dep.model is None or (dep.engine == "llamacpp" and gpus <= 0):
        return None
    runs = [image or ""] if box.in_container else list(box.commands.get(dep.engine, ()))
    own = args if box.in_container else args[len(box.commands.get(dep.engine, ())):]
    cache_key = compile_cache.key(dep.engine, runs, dep.model, own, dep.env)
    host = str(compile_cache.directory(box.compile_cache, cache_key))
    inside = {"vllm": VLLM_CACHE, "sglang": SGLANG_CACHE}.get(dep.engine, LLAMACPP_CACHE)
    root = inside if box.in_container else host
    if box.in_container:
        mounts.append(Mount(host, root))
    env.update(cache_env(dep.engine, root))
    return cache_key


def cache_env(engine: str, root: str) -> dict[str, str]:
    """The variables that put ``engine``'s compile caches under ``root``."""
    if engine == "vllm":
        return {"VLLM_CACHE_ROOT": root}
    if engine == "sglang":
        return {"SGLANG_CACHE_DIR": root, "SGLANG_DG_CACHE_DIR": root + "/deep_gemm",
                "TORCHINDUCTOR_CACHE_DIR": root + "/inductor", "TRITON_CACHE_DIR": root + "/triton"}
    return {"CUDA_CACHE_PATH": root + "/nv", "CUDA_CACHE_MAXSIZE": CUDA_CACHE_MAX}


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last ``flag X`` or ``flag=X`` in ``args`` gives (the last flag wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def booking(dep: Deployment, box: Box, gpu_sizes: Sequence[float] | None, per_gpu: bool = True) -> Booking | None:
    """What a recipe without ``memory_gib`` is booked (None: ``memory_gib`` given, not a vLLM or
    SGLang recipe, no GPU, or the GPUs' sizes not known yet). Reads the checkpoint's headers
    (``checkpoint.read``): its weights plus the KV cache of ``box.kv_sequences`` sequences of its
    context (at most ``box.max_model_len``, then passed to the engine), plus 10 % and 1 GiB per
    GPU; a checkpoint not on this host, or one that does not parse (logged), books the engine's
    default share (``ENGINE_DEFAULT_SHARE`` of each of its GPUs, the smallest it may get)."""
    if dep.memory_gib > 0 or dep.model is None or dep.engine not in _CONTEXT_FLAG:
        return None
    sizes = list(gpu_sizes or ())
    if per_gpu and dep.gpu_ids:
        sizes = [sizes[i] for i in dep.gpu_ids if i < len(sizes)]
    gpus = (len(gpu_sizes or ()) if dep.gpu_count is None else dep.gpu_count) if per_gpu else 1
    if gpus <= 0 or dep.gpu_count == 0:
        return None
    try:
        found = checkpoint.read(dep.model, box.model_cache, flag_value(dep.args, _KV_DTYPE_FLAG))
    except (checkpoint.Unreadable, OSError) as exc:
        log.warning("%s: cannot size the checkpoint of %s (%s): booked the engine's default share %.2f",
                    dep.name, dep.model, exc, ENGINE_DEFAULT_SHARE)
        found = None
    if found is not None:
        given = flag_value(dep.args, _CONTEXT_FLAG[dep.engine])
        context = min(found.context, box.max_model_len)
        capped = context if context < found.context else None
        # ASCII digits of a sane length: "²" passes isdigit() and 5,000 digits int(), both then raise.
        if given is not None and given.isascii() and given.isdigit() and len(given) <= 9 and int(given) > 0:
            context, capped = int(given), None  # the admin's own flag: it is what the engine runs with
        kv = box.kv_sequences * context * found.kv_bytes_per_token
        gib = (found.weights_bytes + kv) * 1.1 / GIB + gpus
        return Booking(math.ceil(gib * 1000) / 1000, "checkpoint", capped)
    if not sizes:
        return None
    return Booking(ENGINE_DEFAULT_SHARE * min(sizes) * gpus, "engine_default")


def read_token(path: Path) -> str:
    """The token in the file, stripped (raises OSError, or ValueError when it is empty)."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty")
    return token


# --- checks of an admin's fields ----------------------------------------------------------

def check_model(engine: str, model: object) -> str | None:
    if model is None:
        return None
    if engine == "custom":
        raise FieldError("model", "custom engines have no recipe: give image and args (docker) or command (process)")
    if not isinstance(model, str) or not model or len(model) > 1024 or model.startswith("-") \
            or any(c.isspace() or ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in model):
        raise FieldError("model", "a Hugging Face repo id (Qwen/Qwen3-8B) or a path (/models/...), "
                                  "without spaces or control characters, not starting with '-'")
    return model


def check_env(env: object) -> dict[str, str]:
    """A deployment's own environment. Null is refused as ``args``' null is (an edit of
    ``{"env": null}`` stored ``{}``): ``{}`` is none."""
    if not isinstance(env, Mapping):
        raise FieldError("env", "an object of NAME: value")
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise FieldError("env", f"{name!r}: names are upper-case letters, digits and '_', not starting with "
                                    "a digit")
        if name in RESERVED_ENV:
            raise FieldError("env", f"{name} is set by ondemand (the GPUs are the budget's choice; the token "
                                    "comes from deployer.hf_token_file)")
        if not isinstance(value, str) or "\0" in value or len(value) > 32768:
            raise FieldError("env", f"{name}: the value is a string")
        out[name] = value
    return out


def parse_volume(spec: str) -> Mount:
    """``/host:/container[:ro|:rw]`` (already checked)."""
    parts = spec.split(":")
    read_only = len(parts) == 3 and parts[2] == "ro"
    return Mount(parts[0], parts[1], read_only)


def _under(path: str, roots: Sequence[Path]) -> bool:
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip("/") + "/"):
            return True
    return False


def check_volumes(volumes: object, box: Box) -> list[str]:
    """A deployment's volumes. Null is refused, as ``check_env``'s: ``[]`` is none."""
    if not isinstance(volumes, list) or not all(isinstance(v, str) for v in volumes):
        raise FieldError("volumes", "a list of \"/host/path:/container/path[:ro]\"")
    if volumes and not box.in_container:
        raise FieldError("volumes", "only for the docker backend (a child process sees the host's files)")
    out = []
    for spec in volumes:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise FieldError("volumes", f"{spec!r}: \"/host/path:/container/path[:ro]\"")
        host, container = parts[0], parts[1]
        if not host.startswith("/") or not container.startswith("/") or "\0" in spec:
            raise FieldError("volumes", f"{spec!r}: both paths are absolute")
        real = os.path.realpath(host)
        if real == "/" or PurePosixPath(container) == PurePosixPath("/"):
            raise FieldError("volumes", f"{spec!r}: never the root directory")
        if any(os.path.basename(p) in _DOCKER_SOCKETS for p in (host, real)):
            raise FieldError("volumes", f"{spec!r}: never the Docker socket (it would own the host)")
        if not _under(host, box.volume_roots):
            roots = ", ".join(str(r) for r in box.volume_roots) or "none: set deployer.volume_roots"
            raise FieldError("volumes", f"{spec!r}: the host path must be under deployer.volume_roots ({roots})")
        out.append(spec)
    return out


def check_engine(engine: object) -> str:
    if engine not in ENGINES:
        raise FieldError("engine", ", ".join(ENGINES[:-1]) + " or " + ENGINES[-1])
    assert isinstance(engine, str)
    return engine


def check_fits_box(memory_gib: float, gpu_count: int | None, gpu_sizes: Sequence[float], per_gpu: bool,
                   has_model: bool) -> None:
    """A recipe's GPU count and memory share against the box's GPUs (``gpu_sizes``: each GPU's
    total, or the one pool's). Raises FieldError naming ``gpu_count`` or ``memory_gib``."""
    if not gpu_sizes:
        return
    n = len(gpu_sizes) if per_gpu else 1
    if per_gpu and gpu_count is not None and gpu_count > n:
        raise FieldError("gpu_count", f"{gpu_count} GPUs, but this box has {n}")
    count = n if gpu_count is None else gpu_count
    if has_model and count > 0 and memory_gib > 0:
        share(memory_gib, count if per_gpu else 1, min(gpu_sizes))
