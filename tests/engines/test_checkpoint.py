"""Bookings that match the engine (issue 29): a recipe without ``memory_gib`` is booked its
checkpoint's weights and KV cache when the checkpoint can be read here (ondemand/engines/checkpoint.py,
``recipes.booking``), else the engine's default share of each GPU, passed explicitly."""
from __future__ import annotations

import json
import logging
import struct
import threading
from pathlib import Path

import pytest
from helpers import running_deployer

from ondemand.control.budget import Budget
from ondemand.engines import checkpoint
from ondemand.engines.recipes import Box, booking, launch
from ondemand.model import Deployment

GIB = 2**30
# A Llama-like config: 32 layers, 8 KV heads of 128 (4096 / 32), bfloat16, 131072 tokens.
CONFIG = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
          "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
KV_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head size x (K and V) x bf16 bytes = 128 KiB


def safetensors(path: Path, tensors: dict[str, int], size: int | None = None) -> None:
    """A safetensors file whose header lists ``tensors`` (name: bytes), then sparse data."""
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [n // 2], "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + (at if size is None else size))


def model_dir(root: Path, config: dict | None = None, shards: int = 0, weights: int = 16 * GIB) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    if not shards:
        safetensors(root / "model.safetensors", {"a": weights // 2, "b": weights - weights // 2})
        return root
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors(root / name, {f"l{i}.x": weights // shards // 2, f"l{i}.y": weights // shards // 2})
        weight_map.update({f"l{i}.x": name, f"l{i}.y": name})
    (root / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def dep(**kw) -> Deployment:
    fields = dict(id=1, name="m", served_name="m", engine="vllm", model="Qwen/Qwen3-8B", memory_gib=0,
                  gpu_count=1, port=8000)
    fields.update(kw)
    return Deployment.from_row(fields)


def booked(d: Deployment, box: Box | None = None, sizes=(80.0,)) -> Deployment:
    return d.replace(booking=booking(d, box or Box(), sizes))


def expected_gib(weights: int, context: int, per_token: float = KV_PER_TOKEN, sequences: int = 4,
                 gpus: int = 1) -> float:
    return (weights + sequences * context * per_token) * 1.1 / GIB + gpus


def test_the_kv_arithmetic_by_hand():
    per_token, context = checkpoint.kv_per_token(CONFIG, Path("config.json"))
    assert (per_token, context) == (131072, 131072)
    # head_dim given wins over hidden_size / heads; no num_key_value_heads: every head is a KV head
    per_token, _ = checkpoint.kv_per_token({**CONFIG, "head_dim": 256, "num_key_value_heads": None},
                                           Path("config.json"))
    assert per_token == 32 * 32 * 256 * 2 * 2
    # the KV cache's own dtype (--kv-cache-dtype fp8): one byte a value
    assert checkpoint.kv_per_token(CONFIG, Path("c"), "fp8")[0] == 32 * 8 * 128 * 2 * 1
    assert checkpoint.kv_per_token(CONFIG, Path("c"), "auto")[0] == KV_PER_TOKEN


def test_a_local_checkpoint_is_booked_its_weights_and_kv_cache_capped_context_passed(tmp_path):
    path = model_dir(tmp_path / "llama")
    d = booked(dep(model=str(path)))
    assert d.memory_source == "checkpoint" and d.booking.max_model_len == 32768
    want = expected_gib(16 * GIB, 32768)  # 16 GiB of weights + 4 x 32768 x 128 KiB = 16 GiB of KV
    assert want == pytest.approx(16 * 2 * 1.1 + 1)
    assert d.footprint_gib == pytest.approx(want, abs=0.001) and d.footprint_gib >= want
    argv = launch(d, Box(backend="process"), gpu_size_gib=80.0).argv
    assert argv[argv.index("--max-model-len") + 1] == "32768"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == f"{int(want / 80 * 100) / 100:.2f}"
    sg = booked(dep(model=str(path), engine="sglang"))
    argv = launch(sg, Box(backend="process"), gpu_size_gib=80.0).argv
    assert argv[argv.index("--context-length") + 1] == "32768"


def test_a_short_context_is_not_capped_and_the_settings_apply(tmp_path):
    path = model_dir(tmp_path / "small", {**CONFIG, "max_position_embeddings": 8192})
    d = booked(dep(model=str(path), gpu_count=2), Box(kv_sequences=2), sizes=(80.0, 80.0))
    assert d.booking.max_model_len is None
    assert d.footprint_gib == pytest.approx(expected_gib(16 * GIB, 8192, sequences=2, gpus=2), abs=0.001)
    assert "--max-model-len" not in launch(d, Box(), gpu_size_gib=80.0, box_gpus=2).argv
    d = booked(dep(model=str(path)), Box(max_model_len=4096))
    assert d.booking.max_model_len == 4096
    assert d.footprint_gib == pytest.approx(expected_gib(16 * GIB, 4096), abs=0.001)


def test_kv_cache_dtype_and_max_model_len_in_the_args_are_honoured(tmp_path):
    path = model_dir(tmp_path / "llama")
    d = booked(dep(model=str(path), args=["--kv-cache-dtype", "fp8", "--max-model-len=16384"]))
    assert d.booking.max_model_len is None  # the admin's own flag stands
    assert d.footprint_gib == pytest.approx(expected_gib(16 * GIB, 16384, KV_PER_TOKEN / 2), abs=0.001)
    assert launch(d, Box(), gpu_size_gib=80.0).argv.count("--max-model-len=16384") == 1


def test_a_sharded_checkpoint_in_the_cache_counts_each_file_once(tmp_path):
    cache = tmp_path / "hf"
    repo = cache / "hub" / "models--org--big"
    model_dir(repo / "snapshots" / "abc123", shards=3, weights=30 * GIB)
    model_dir(repo / "snapshots" / "old", weights=1 * GIB)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    found = checkpoint.read("org/big", cache)
    assert found is not None and found.path.name == "abc123" and found.weights_bytes == 30 * GIB
    d = booked(dep(model="org/big"), Box(model_cache=cache))
    assert d.memory_source == "checkpoint"
    assert d.footprint_gib == pytest.approx(expected_gib(30 * GIB, 32768), abs=0.001)


def test_a_broken_header_falls_back_to_the_engine_default_with_a_warning(tmp_path, caplog):
    path = model_dir(tmp_path / "broken")
    with open(path / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 200_000_000))  # beyond the format's 100 MB bound
    with caplog.at_level(logging.WARNING, logger="ondemand.engines.recipes"):
        d = booked(dep(model=str(path)))
    assert d.memory_source == "engine_default" and d.footprint_gib == pytest.approx(72.0)
    assert "cannot size the checkpoint" in caplog.text
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(checkpoint.Unreadable):
        checkpoint.read(str(path), None)
    (path / "model.safetensors").unlink()
    safetensors(path / "model.safetensors", {"a": 10})
    (path / "config.json").write_text("{\"num_hidden_layers\": 2}")  # no heads
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ondemand.engines.recipes"):
        assert booked(dep(model=str(path))).memory_source == "engine_default"
    assert "num_attention_heads" in caplog.text


def test_not_on_this_host_books_the_engine_default_passed_explicitly():
    d = booked(dep(), sizes=(80.0, 40.0))  # the smallest GPU it may get: 0.9 x 40
    assert d.memory_source == "engine_default" and d.footprint_gib == pytest.approx(36.0)
    argv = launch(d, Box(), gpu_size_gib=40.0, box_gpus=2).argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.90"
    pinned = booked(dep(gpu_ids=[0]), sizes=(80.0, 40.0))
    assert pinned.footprint_gib == pytest.approx(72.0)
    two = booked(dep(gpu_count=None), sizes=(80.0, 80.0))
    assert two.footprint_gib == pytest.approx(144.0)


def test_declared_llamacpp_cpu_and_unknown_sizes_get_no_derived_booking():
    assert booking(dep(memory_gib=20), Box(), (80.0,)) is None
    assert dep(memory_gib=20).memory_source == "declared"
    assert booking(dep(engine="llamacpp"), Box(), (80.0,)) is None
    assert booking(dep(gpu_count=0), Box(), (80.0,)) is None
    assert booking(dep(), Box(), None) is None
    assert booking(dep(model=None, command=["x"]), Box(), (80.0,)) is None


def test_measured_beyond_the_booking_is_measured():
    d = booked(dep())
    assert d.replace(measured_gib=70.0).memory_source == "engine_default"
    m = d.replace(measured_gib=75.0)
    assert m.memory_source == "measured" and m.footprint_gib == 75.0 and not m.over_declared


async def test_the_deployer_reads_checkpoints_in_a_thread_not_on_the_event_loop(tmp_path, store, monkeypatch):
    # Its start-up, a creation, an edit, a dry run and a start's missing booking: each reads the
    # headers and the config in a thread (a checkpoint on slow storage would hold up every request),
    # and the step without an await then books what was read.
    loop_thread, threads = threading.get_ident(), []
    real_read = checkpoint.read

    def read(*args, **kw):
        threads.append(threading.get_ident())
        return real_read(*args, **kw)
    monkeypatch.setattr(checkpoint, "read", read)
    path = str(model_dir(tmp_path / "llama"))
    fields = dict(name="m", served_name="m", engine="vllm", model=path, memory_gib=0, gpu_count=1,
                  mode="on_demand", state="stopped", role="model")
    async with running_deployer(tmp_path, store) as d:
        dep = await d.create(fields)
        assert dep.memory_source == "checkpoint" and dep.booking.max_model_len == 32768
        assert dep.footprint_gib == pytest.approx(expected_gib(16 * GIB, 32768), abs=0.001)
        edited = await d.edit(dep.id, {"args": ("--max-model-len", "8192")})
        assert edited.booking.max_model_len is None
        assert edited.footprint_gib == pytest.approx(expected_gib(16 * GIB, 8192), abs=0.001)
        dry = await d.book(Deployment.from_row({**fields, "name": "n", "id": 0}))
        assert dry.memory_source == "checkpoint" and d.unit(0) is None  # a dry run keeps nothing
        assert d.unit(dep.id).booked is not None  # the deployment's read is kept, for its next step
        n = len(threads)
        assert d.with_booking(edited) == edited and len(threads) == n  # the step without an await reads nothing
    await store.insert_deployment({**fields, "name": "away", "model": "org/not-here"})
    budget = Budget("static", 24)
    monkeypatch.setattr(budget, "sizes", lambda: None)  # the GPUs not read yet at its start-up
    async with running_deployer(tmp_path, store, budget=budget) as d:  # ondemand's next start
        assert d.get(dep.id).footprint_gib == pytest.approx(edited.footprint_gib)
        away = next(x for x in d.all() if x.name == "away")
        assert away.booking is None and len(threads) == n + 2
        monkeypatch.setattr(budget, "sizes", lambda: (24.0,))
        assert not await d.admit_start(away.id, wanted=lambda: False)  # booked, then nothing starts
        assert d.get(away.id).memory_source == "engine_default" and d.get(away.id).footprint_gib == pytest.approx(21.6)
        assert len(threads) == n + 3
        await d.admit_start(away.id, wanted=lambda: False)
        assert len(threads) == n + 3  # booked now: nothing more to read
    assert loop_thread not in threads, threads


@pytest.mark.parametrize("given", ["²", "9" * 5000, "-1", "0", "8k"])
def test_a_max_model_len_that_is_no_plain_number_books_the_checkpoints_context(tmp_path, given):
    """The admin's flag counts only as ASCII digits of a sane length: "²" passed isdigit() and
    5,000 digits int(), and both then raised (a 500 on the admin API); anything else is booked at
    the checkpoint's context, capped as without the flag (the engine says what it makes of it)."""
    path = model_dir(tmp_path / "llama")
    d = booked(dep(model=str(path), args=["--max-model-len", given]))
    assert d.booking.max_model_len == 32768
    assert d.footprint_gib == pytest.approx(expected_gib(16 * GIB, 32768), abs=0.001)
