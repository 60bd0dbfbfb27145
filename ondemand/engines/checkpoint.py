"""What a checkpoint on this host needs of GPU memory: its weights and its KV cache per token.

A recipe without ``memory_gib`` is booked from its checkpoint when the checkpoint can be
read here (``recipes.booking``): a local directory, or the snapshot of the repo in
``deployer.model_cache`` (Hugging Face's layout, ``hub/models--org--name/snapshots/<rev>/``).

Only headers are read: a ``*.safetensors`` file opens with its header's length (8 bytes,
little-endian) and the JSON header (at most 100 MB, the format's own bound) that gives each
tensor's ``data_offsets``; the sum of their spans is the weights' size. ``config.json`` gives
the KV cache per token: layers x KV heads x head size x 2 (keys and values) x the dtype's bytes.

``read`` returns None when there is no checkpoint to read, and raises ``Unreadable`` when there
is one that does not parse as its format says (the caller falls back and logs it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAX_HEADER = 100_000_000  # the safetensors format's own bound on a header
_CONFIG_MAX = 16 * 2**20  # a config.json beyond this is not one
INDEX = "model.safetensors.index.json"

# Bytes of one element, by the names config.json (torch_dtype/dtype) and --kv-cache-dtype use.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float64": 8, "double": 8,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int8": 1, "fp4_e2m1": 0.5,
}


class Unreadable(ValueError):
    """A checkpoint file or its config that does not parse as its format says."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights_bytes: int
    kv_bytes_per_token: float
    context: int  # max_position_embeddings


def snapshot(model: str, model_cache: Path | None) -> Path | None:
    """The directory ``model`` is read from on this host: the path itself when it is a local
    directory, else the snapshot of the repo in the cache (``refs/main``'s, else the newest)."""
    if os.path.isabs(model) or model.startswith("."):
        return Path(model) if os.path.isdir(model) else None
    if model_cache is None or model.count("/") != 1:
        return None
    name = "models--" + model.replace("/", "--")
    for repo in (model_cache / "hub" / name, model_cache / name):
        snaps = repo / "snapshots"
        if not snaps.is_dir():
            continue
        try:
            ref = (repo / "refs" / "main").read_text().strip()
        except OSError:
            ref = ""
        if ref and (snaps / ref).is_dir():
            return snaps / ref
        dirs = [d for d in snaps.iterdir() if d.is_dir()]
        if dirs:
            return max(dirs, key=lambda d: d.stat().st_mtime)
    return None


def header_bytes(path: Path) -> int:
    """The bytes of the tensors one safetensors file holds, from its header only."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise Unreadable(f"{path}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if not 2 <= n <= MAX_HEADER:
                raise Unreadable(f"{path}: a header of {n} bytes (at most {MAX_HEADER})")
            raw = f.read(n)
    except OSError as exc:
        raise Unreadable(f"{path}: {exc}") from exc
    if len(raw) != n:
        raise Unreadable(f"{path}: the header is cut short")
    header = _json_object(raw, path, "the header is")
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise Unreadable(f"{path}: tensor {name!r} has no data_offsets [begin, end]")
        total += offsets[1] - offsets[0]
    return total


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index's ``weight_map`` names (each once),
    else every ``*.safetensors`` in the directory."""
    index = directory / INDEX
    if index.is_file():
        data = _json_file(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise Unreadable(f"{index}: no weight_map of tensor names to files")
        names = sorted(set(weight_map.values()))
        if any(os.path.isabs(n) or ".." in Path(n).parts for n in names):
            raise Unreadable(f"{index}: a weight_map file outside the checkpoint")
        return [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


def _json_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(_CONFIG_MAX + 1)
    except OSError as exc:
        raise Unreadable(f"{path}: {exc}") from exc
    if len(raw) > _CONFIG_MAX:
        raise Unreadable(f"{path}: larger than {_CONFIG_MAX} bytes")
    return _json_object(raw, path, "")


def _json_object(raw: bytes, path: Path, what: str) -> dict[str, Any]:
    """``raw`` as a JSON object, else Unreadable naming ``path`` (``what``: "the header is")."""
    lead = f"{path}: {what + ' ' if what else ''}"
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise Unreadable(f"{lead}not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise Unreadable(f"{lead}not an object")
    return data


def _positive_int(cfg: Mapping[str, Any], key: str, path: Path) -> int:
    value = cfg.get(key)
    if type(value) is not int or value <= 0:
        raise Unreadable(f"{path}: {key} is not a positive whole number")
    return value


def dtype_bytes(name: object) -> float | None:
    """Bytes of one element of the dtype ``name`` (``torch.bfloat16`` or ``bfloat16``); None: unknown."""
    if not isinstance(name, str):
        return None
    return DTYPE_BYTES.get(name.lower().removeprefix("torch."))


def kv_per_token(config: Mapping[str, Any], path: Path, kv_dtype: str | None = None) -> tuple[float, int]:
    """(the KV cache's bytes per token, the context length) from a config.json's values.
    ``kv_dtype``: the engine's ``--kv-cache-dtype`` (None or ``auto``: the model's dtype)."""
    top = config
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        config = text  # a multimodal model: its language model's values
    layers = _positive_int(config, "num_hidden_layers", path)
    heads = _positive_int(config, "num_attention_heads", path)
    kv_heads = _positive_int(config, "num_key_value_heads", path) if config.get("num_key_value_heads") is not None \
        else heads
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim", path)
    else:
        hidden = _positive_int(config, "hidden_size", path)
        head_dim = hidden // heads
        if head_dim <= 0:
            raise Unreadable(f"{path}: hidden_size {hidden} is smaller than num_attention_heads {heads}")
    context = _positive_int(config, "max_position_embeddings", path)
    if kv_dtype is not None and kv_dtype.lower() != "auto":
        size = dtype_bytes(kv_dtype)
        if size is None:
            raise Unreadable(f"--kv-cache-dtype {kv_dtype}: not a dtype known here")
    else:
        name = next((c.get(k) for c in (config, top) for k in ("torch_dtype", "dtype") if c.get(k) is not None),
                    None)
        size = dtype_bytes(name)
        if size is None:
            raise Unreadable(f"{path}: torch_dtype {name!r} is not a dtype known here")
    return layers * kv_heads * head_dim * 2 * size, context


def read(model: str, model_cache: Path | None, kv_dtype: str | None = None) -> Checkpoint | None:
    """The checkpoint of ``model`` on this host; None when there is none to read (not local,
    not in the cache, or no safetensors files). Raises Unreadable."""
    directory = snapshot(model, model_cache)
    if directory is None or not (directory / "config.json").is_file():
        return None
    files = weight_files(directory)
    if not files:
        return None
    weights = sum(header_bytes(f) for f in files)
    per_token, context = kv_per_token(_json_file(directory / "config.json"), directory / "config.json", kv_dtype)
    return Checkpoint(directory, weights, per_token, context)
