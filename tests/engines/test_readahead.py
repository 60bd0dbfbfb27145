"""engines/readahead.py: a recipe's weights read into the page cache before its cold start, only
when the host can spare the memory, and never delaying the start."""
from __future__ import annotations

import asyncio
import threading
import time

from ondemand.engines.readahead import ReadAhead, decide, read_files, weight_files
from ondemand.model import Deployment

GIB = 2**30


def dep(model: str, **kw) -> Deployment:
    fields = dict(id=1, name="tiny", served_name="tiny", engine="vllm", model=model, memory_gib=20, gpu_count=1)
    fields.update(kw)
    return Deployment.from_row(fields)


def checkpoint(tmp_path, sizes=(3000, 5000)):
    d = tmp_path / "model"
    d.mkdir()
    for i, n in enumerate(sizes):
        (d / f"model-{i}.safetensors").write_bytes(b"\0" * n)
    (d / "config.json").write_text("{}")
    return d


def test_the_weight_files_of_a_local_checkpoint_a_cached_repo_and_a_gguf(tmp_path):
    d = checkpoint(tmp_path)
    assert [f.name for f in weight_files(str(d), None)] == ["model-0.safetensors", "model-1.safetensors"]
    snap = tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"x")
    assert weight_files("org/tiny", tmp_path / "cache") == [snap / "model.safetensors"]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert weight_files(str(gguf), None) == [gguf]
    assert weight_files("org/absent", tmp_path / "cache") == [] and weight_files("org/tiny", None) == []


def test_decide_reads_only_when_the_host_can_spare_it():
    assert decide(10 * GIB, 30.0, 16.0) is None
    assert "memory is short" in decide(10 * GIB, 20.0, 16.0)  # 4 GiB to spare for 10
    assert "cannot be read" in decide(GIB, None, 16.0)
    assert "no weight files" in decide(0, 100.0, 16.0)


def test_read_files_reads_every_byte_and_stops_between_chunks(tmp_path):
    d = checkpoint(tmp_path, (3000, 5000))
    files = weight_files(str(d), None)
    assert read_files(files, threading.Event(), chunk=1024) == 8000
    stop = threading.Event()
    stop.set()
    assert read_files(files, stop, chunk=1024) == 0
    assert read_files([tmp_path / "gone.safetensors"], threading.Event()) == 0  # skipped, not raised


async def test_skipped_when_memory_is_short(tmp_path):
    d = checkpoint(tmp_path)
    calls = []
    ahead = ReadAhead(model_cache=None, available_gib=lambda: 16.0, reserve_gib=16.0,
                      reader=lambda files, stop: calls.append(files) or 0)
    outcome = ahead.warm(dep(str(d)))
    assert outcome.state == "skipped" and "memory is short" in outcome.why and calls == []
    assert outcome.as_dict()["state"] == "skipped"
    await ahead.close()


async def test_a_slow_read_never_delays_the_start_and_is_left_to_go_on(tmp_path):
    d = checkpoint(tmp_path)
    release = threading.Event()

    def slow(files, stop):  # as a cold disk: it takes as long as the test says
        release.wait(10)
        return read_files(files, stop)
    ahead = ReadAhead(model_cache=None, available_gib=lambda: 64.0, reserve_gib=16.0, reader=slow)
    began = time.monotonic()
    outcome = ahead.warm(dep(str(d)))
    assert time.monotonic() - began < 0.5 and outcome.state == "reading"  # returned at once
    assert ahead.warm(dep(str(d)), outcome) is outcome  # one read per deployment at a time (its last handed back)
    release.set()
    for _ in range(200):
        if outcome.state == "done":
            break
        await asyncio.sleep(0.01)
    assert outcome.state == "done" and outcome.bytes == 8000
    await ahead.close()


async def test_close_stops_a_read_under_way(tmp_path):
    d = checkpoint(tmp_path, (4 * 2**20,))
    started = threading.Event()

    def reader(files, stop):
        started.set()
        stop.wait(10)  # until close sets it
        return read_files(files, stop)
    ahead = ReadAhead(model_cache=None, available_gib=lambda: 64.0, reserve_gib=0.0, reader=reader)
    ahead.warm(dep(str(d)))
    await asyncio.to_thread(started.wait, 5)
    began = time.monotonic()
    await ahead.close()
    assert time.monotonic() - began < 5
