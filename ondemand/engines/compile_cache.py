"""The compile cache: one directory per engine configuration under ``deployer.compile_cache``.

vLLM keeps its torch.compile and CUDA-graph artifacts under its cache root (``VLLM_CACHE_ROOT``,
``/root/.cache/vllm`` in its images); an empty one costs a cold start the whole compilation
(vLLM #19824, #20264). ``key`` names a configuration: the first 12 hex digits of the SHA-256
of the engine, its image (or command), the model, the arguments without host, port and served
name (they change nothing that is compiled, and the process backend's port changes at every
start), and the deployment's own environment. Two deployments share a directory only when all
of that is the same: they would compile the same thing.

``prepare`` makes the directory and says whether it was warm (something in it from an earlier
start), and stamps its use; ``prune`` removes the directories not used for ``retention_days``.
The standard library only; ``prepare`` and ``prune`` touch the disk (call them off the loop).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger("ondemand.engines.compile_cache")

KEY_DIGITS = 12
USED = ".ondemand-used"  # its mtime: the last start that used the directory
# The flags (with their value) that are not part of a configuration.
_LEFT_OUT = frozenset({"--host", "--port", "--served-model-name", "--alias"})


def config_args(args: Sequence[str]) -> list[str]:
    """``args`` without host, port and served name (``--flag X`` and ``--flag=X``)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in _LEFT_OUT:
            skip = True
            continue
        if arg.partition("=")[0] in _LEFT_OUT and "=" in arg:
            continue
        out.append(arg)
    return out


def key(engine: str, runs: Sequence[str], model: str, args: Sequence[str],
        env: Iterable[tuple[str, str]] = ()) -> str:
    """The configuration's key: ``runs`` is the image (docker) or the command (process)."""
    spec = {"engine": engine, "runs": list(runs), "model": model, "args": config_args(args),
            "env": sorted([k, v] for k, v in env)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:KEY_DIGITS]


def directory(root: Path, cache_key: str) -> Path:
    return root / cache_key


def prepare(root: Path, cache_key: str, now: float | None = None) -> bool:
    """Make the key's directory (and the root) if need be, stamp its use; whether it was warm:
    it held something besides the stamp before this start. Raises OSError."""
    path = directory(root, cache_key)
    path.mkdir(parents=True, exist_ok=True)
    with os.scandir(path) as entries:
        warm = any(e.name != USED for e in entries)
    stamp = path / USED
    stamp.touch()
    if now is not None:
        os.utime(stamp, (now, now))
    return warm


def prune(root: Path, retention_days: float, now: float | None = None) -> list[str]:
    """Remove the keys' directories not used for ``retention_days`` (by their stamp, else the
    directory's own mtime); the keys removed. Only directories named as keys are touched."""
    if not root.is_dir():
        return []
    before = (time.time() if now is None else now) - retention_days * 86400.0
    removed = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink() or not _is_key(entry.name):
            continue
        try:
            stamp = entry / USED
            used = stamp.stat().st_mtime if stamp.exists() else entry.stat().st_mtime
        except OSError:
            continue
        if used < before:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.info("compile cache: removed %d configuration(s) unused for %g days: %s", len(removed),
                 retention_days, ", ".join(removed))
    return removed


def _is_key(name: str) -> bool:
    return len(name) == KEY_DIGITS and all(c in "0123456789abcdef" for c in name)
