"""The fake nvidia-smi (tests/fakes/nvidia-smi), run as a process as the product runs
it: each query's exact output, and the engine simulator's ``--gpu-mib`` showing in it
while the simulator lives, and not after."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ondemand.sim.engine import visible_gpus

USED = ("--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits")
GPUS = ("--query-gpu=index,uuid,memory.total,memory.used", "--format=csv,noheader,nounits")
APPS = ("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
EIGHT = ["81920, 1024"] * 8


def smi(tool: str, *args: str) -> str:
    """The fake's stdout; it must succeed and say nothing on stderr."""
    p = subprocess.run([tool, *args], capture_output=True, text=True, timeout=10)
    assert (p.returncode, p.stderr) == (0, ""), p
    return p.stdout


def uuids(tool: str) -> list[str]:
    return [line.split(", ")[1] for line in smi(tool, *GPUS).splitlines()]


def until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


@pytest.fixture
def sim_engine(monkeypatch):
    """Start ``ondemand sim-engine --gpu-mib MiB`` as a real process with the given
    CUDA_VISIBLE_DEVICES (None: unset) and return it once its startup line is out."""
    procs: list[subprocess.Popen[str]] = []

    def start(cuda: str | None, mib: int = 1024) -> subprocess.Popen[str]:
        if cuda is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda)
        p = subprocess.Popen([sys.executable, "-m", "ondemand", "sim-engine", "--port", "0", "--model", "m",
                              "--gpu-mib", str(mib)], stderr=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stderr is not None
        line = p.stderr.readline()
        assert "serving m on 127.0.0.1:" in line, line
        return p
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stderr is not None:
            p.stderr.close()


def test_the_budget_query_prints_exactly_what_it_did(fake_nvidia_smi, monkeypatch):
    tool = fake_nvidia_smi("81920, 1024", "81920, 0")
    assert smi(tool, *USED) == "81920, 1024\n81920, 0\n"
    monkeypatch.delenv("FAKE_NVIDIA_SMI_APPS")  # as before the processes' directory existed
    assert smi(tool, *USED) == "81920, 1024\n81920, 0\n"
    fake_nvidia_smi("[N/A], [N/A]")  # DGX Spark
    assert smi(tool, *USED) == "[N/A], [N/A]\n"


def test_index_uuid_total_used_on_eight_gpus(fake_nvidia_smi):
    tool = fake_nvidia_smi(*EIGHT[:7], "81920, 512")
    lines = smi(tool, *GPUS).splitlines()
    assert len(lines) == 8
    for i, line in enumerate(lines):
        index, uuid, total, used = line.split(", ")
        assert (index, total, used) == (str(i), "81920", "512" if i == 7 else "1024")
        assert UUID.fullmatch(uuid), uuid
    ids = uuids(tool)
    assert len(set(ids)) == 8 and uuids(tool) == ids  # distinct, and stable between calls
    fake_nvidia_smi("81920, 0", "81920, 0")
    assert uuids(tool) == ids[:2]  # GPU i keeps its uuid whatever the file says
    assert smi(tool, "--list-gpus") == "".join(
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})\n" for i, u in enumerate(ids[:2]))
    assert smi(tool, "-L") == smi(tool, "--list-gpus")


def test_compute_apps_is_empty_without_processes(fake_nvidia_smi, fake_gpu_apps):
    tool = fake_nvidia_smi(*EIGHT)
    assert fake_gpu_apps == fake_nvidia_smi.apps and fake_gpu_apps.is_dir()
    assert smi(tool, *APPS) == ""


def test_failures_and_unknown_queries(fake_nvidia_smi, monkeypatch):
    tool = fake_nvidia_smi(*EIGHT)
    p = subprocess.run([tool, "--query-gpu=name", "--format=csv"], capture_output=True, text=True)
    assert p.returncode == 2 and "unsupported arguments" in p.stderr
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FAIL", "1")
    for query in (USED, GPUS, APPS, ("-L",)):
        p = subprocess.run([tool, *query], capture_output=True, text=True)
        assert (p.returncode, p.stdout) == (9, "") and "NVIDIA driver" in p.stderr


def test_a_live_process_file_adds_to_used_and_lists_in_compute_apps(fake_nvidia_smi, fake_gpu_apps):
    tool = fake_nvidia_smi("81920, 1000", "81920, 0", "[N/A], [N/A]")
    me = os.getpid()
    (fake_gpu_apps / str(me)).write_text("1 300\n0 200\n2 100\n")
    ids = uuids(tool)
    assert smi(tool, *USED) == "81920, 1200\n81920, 300\n[N/A], [N/A]\n"
    assert smi(tool, *GPUS).splitlines()[:2] == [f"0, {ids[0]}, 81920, 1200", f"1, {ids[1]}, 81920, 300"]
    # one line per (process, GPU), by GPU; unified memory still lists the process
    assert smi(tool, *APPS) == f"{me}, {ids[0]}, 200\n{me}, {ids[1]}, 300\n{me}, {ids[2]}, 100\n"


def test_a_dead_or_zombie_process_uses_nothing(fake_nvidia_smi, fake_gpu_apps):
    tool = fake_nvidia_smi("81920, 1000")
    zombie = subprocess.Popen(["sleep", "60"])
    try:
        (fake_gpu_apps / str(zombie.pid)).write_text("0 500\n")
        assert smi(tool, *USED) == "81920, 1500\n"
        zombie.kill()  # not waited for: a zombie, whose GPU memory the driver has freed
        until(lambda: open(f"/proc/{zombie.pid}/stat").read().rsplit(") ", 1)[1].startswith("Z"))
        assert smi(tool, *USED) == "81920, 1000\n"
        assert smi(tool, *APPS) == ""
    finally:
        zombie.wait()
    dead = zombie.pid
    (fake_gpu_apps / str(dead)).write_text("0 500\n")  # a stale file of a dead pid
    assert smi(tool, *APPS) == "" and smi(tool, *USED) == "81920, 1000\n"
    assert not (fake_gpu_apps / str(dead)).exists()  # and the fake cleaned it up


def test_a_simulator_uses_its_visible_gpus_until_sigterm(fake_nvidia_smi, fake_gpu_apps, sim_engine):
    tool = fake_nvidia_smi(*EIGHT)
    ids = uuids(tool)
    engine = sim_engine("2,5", 1024)
    assert (fake_gpu_apps / str(engine.pid)).read_text() == "2 1024\n5 1024\n"
    assert smi(tool, *APPS) == f"{engine.pid}, {ids[2]}, 1024\n{engine.pid}, {ids[5]}, 1024\n"
    used = [line.split(", ")[3] for line in smi(tool, *GPUS).splitlines()]
    assert used == ["1024", "1024", "2048", "1024", "1024", "2048", "1024", "1024"]
    engine.send_signal(signal.SIGTERM)
    assert engine.wait(10) == 0
    assert not (fake_gpu_apps / str(engine.pid)).exists()
    assert smi(tool, *APPS) == ""
    assert smi(tool, *USED) == "81920, 1024\n" * 8


def test_a_killed_simulator_leaves_a_stale_file_that_counts_for_nothing(fake_nvidia_smi, fake_gpu_apps,
                                                                         sim_engine):
    tool = fake_nvidia_smi(*EIGHT)
    engine = sim_engine("2,5", 1024)
    assert smi(tool, *APPS).count(f"{engine.pid}, ") == 2
    engine.kill()
    engine.wait(10)
    assert (fake_gpu_apps / str(engine.pid)).exists()  # SIGKILL: no clean-up
    assert smi(tool, *APPS) == ""
    assert smi(tool, *USED) == "81920, 1024\n" * 8


def test_a_simulator_without_cuda_visible_devices_uses_gpu_0(fake_nvidia_smi, fake_gpu_apps, sim_engine):
    tool = fake_nvidia_smi("81920, 0", "81920, 0")
    engine = sim_engine(None, 512)
    assert smi(tool, *USED) == "81920, 512\n81920, 0\n"
    none = sim_engine("", 512)  # CUDA_VISIBLE_DEVICES="": no GPU, so no file
    assert not (fake_gpu_apps / str(none.pid)).exists()
    assert sorted(p.name for p in fake_gpu_apps.iterdir()) == [str(engine.pid)]


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does():
    assert visible_gpus(None) == [0]
    assert visible_gpus("") == []
    assert visible_gpus("2,5") == [2, 5]
    assert visible_gpus("3, 1") == [3, 1]
    assert visible_gpus("1,GPU-abc,2") == [1]  # CUDA stops at the first entry it cannot read
