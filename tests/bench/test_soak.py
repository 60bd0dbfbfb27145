"""The soak's short version (scripts/soak.py: a real `ondemand serve` on a fake GPU box, 1,000
requests from 50 clients, real faults, engines that sleep and wake and some whose wakes fail, then
the invariants); `make soak` runs the full 10,000. About 80 s. And how the soak reads the
engines' journal for sleeps and wakes (scripts/soaklib.py, WarmthJournal), on made-up journals."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
try:
    import soaklib
finally:
    sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["seed", "cost"])
def test_soak_short(tmp_path, scheduler):
    """The invariants (no busy model stopped, priorities, pre-warms never take memory, ...) hold
    under each scheduler: the cost scheduler takes victims before their timeout, rests models
    early and relocates sleepers, all through the same prechecks."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seed", "7", "--requests", "1000",
                           "--scheduler", scheduler, "--keep", str(tmp_path / "soak")],
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "| ok" in proc.stdout and "FAILED" not in proc.stdout
    assert f"scheduler {scheduler}," in proc.stdout
    assert "| no pre-warm began while a request waited for memory" in proc.stdout  # adaptive warmth's
    for row in ("sleeps at level 1", "sleeps at level 2", "wakes: ready", "wakes: refused", "wakes: mismatch",
                "wake failures audited", "cold starts"):
        assert f"| {row}" in proc.stdout


class Journal:
    """A made-up journal, as the simulators write it (``--journal``): one process at a time."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.t = 1000.0
        self.n: dict[int, int] = {}

    def add(self, pid: int, ev: str, **fields) -> None:
        self.t += 0.01
        self.lines.append({"ev": ev, "pid": pid, "t": self.t, **fields})

    def boot(self, pid: int, model: str) -> None:
        self.add(pid, "boot", model=model)

    def req(self, pid: int, path: str) -> int:
        self.n[pid] = self.n.get(pid, 0) + 1
        self.add(pid, "req", n=self.n[pid], path=path, h=[])
        return self.n[pid]

    def call(self, pid: int, path: str, *then: tuple) -> None:
        """A request, the lines its handler writes (``(ev, fields)``), its end."""
        n = self.req(pid, path)
        for ev, fields in then:
            self.add(pid, ev, **fields)
        self.add(pid, "end", n=n)

    def sleep(self, pid: int, level: int = 1) -> None:
        self.call(pid, "/sleep", ("sleep", {"level": level}))

    def wake(self, pid: int, tags=("weights", "kv_cache")) -> None:
        self.call(pid, "/wake_up", ("wake", {"tags": list(tags)}))

    def read(self) -> soaklib.WarmthJournal:
        return soaklib.WarmthJournal(self.lines)


def test_the_journal_tells_each_wake_by_how_it_ended():
    j = Journal()
    j.boot(1, "ALPHA")  # woken, checked, serves: ready
    j.call(1, "/v1/chat/completions")
    j.sleep(1)
    j.wake(1)
    j.call(1, "/v1/completions")  # the wake check
    j.call(1, "/v1/chat/completions")
    j.boot(2, "CHARLIE")  # --fail wake-fails: the call ends, nothing woke; then stopped
    j.sleep(2)
    j.call(2, "/wake_up")
    j.add(2, "sigterm", model="CHARLIE", inflight=0)
    j.boot(3, "GOLF")  # --fail wake-garbage: woke, its check answered, stopped before serving
    j.sleep(3)
    j.wake(3)
    j.call(3, "/v1/completions")
    j.add(3, "sigterm", model="GOLF", inflight=0)
    j.boot(4, "BRAVO")  # level 2 in vLLM's order, then slept again before any request: ready
    j.sleep(4, level=2)
    j.wake(4, ["weights"])
    j.call(4, "/collective_rpc")
    j.wake(4, ["kv_cache"])
    j.call(4, "/reset_prefix_cache")
    j.call(4, "/v1/completions")
    j.sleep(4, level=2)
    j.add(4, "sigterm", model="BRAVO", inflight=0)  # stopped asleep
    j.boot(5, "ECHO")  # SIGKILLed during the wake call: killed (ondemand's wake fails)
    j.sleep(5)
    j.req(5, "/wake_up")
    j.boot(6, "ALPHA")  # SIGKILLed once its check was answered: not a failed wake
    j.sleep(6)
    j.wake(6)
    j.call(6, "/v1/completions")
    j.boot(7, "ALPHA")  # stopped during the wake's check
    j.sleep(7)
    j.wake(7)
    j.req(7, "/v1/completions")
    j.add(7, "sigterm", model="ALPHA", inflight=1)
    j.boot(8, "FOXTROT")  # SIGKILLed asleep, before any wake call: no wake of its own
    j.sleep(8, level=2)
    j.boot(9, "GOLF")  # stopped asleep
    j.sleep(9)
    j.add(9, "sigterm", model="GOLF", inflight=0)
    w = j.read()
    results = [(x.model, x.result, x.level) for x in w.wakes]
    assert results == [("ALPHA", "ready", 1), ("CHARLIE", "refused", 1), ("GOLF", "mismatch", 1),
                       ("BRAVO", "ready", 2), ("ECHO", "killed", 1), ("ALPHA", "killed after", 1),
                       ("ALPHA", "stopped", 1)]
    assert [x.failed for x in w.wakes] == [False, True, True, False, True, False, False]
    assert [level for *_, level in w.sleeps] == [1, 1, 1, 2, 2, 1, 1, 1, 2, 1]
    assert [(pid, model) for pid, model, _ in w.vanished_asleep] == [(8, "FOXTROT")]
    assert len(w.boots) == 9 and not w.busy_sleeps and not w.asleep_served


def test_the_journal_shows_a_busy_sleep_and_a_request_that_reached_an_asleep_engine():
    j = Journal()
    j.boot(1, "ALPHA")
    j.req(1, "/v1/chat/completions")  # still in flight at the sleep call
    j.call(1, "/metrics")  # not a generation: no matter
    j.sleep(1)
    j.boot(2, "BRAVO")
    j.sleep(2, level=2)
    j.call(2, "/v1/embeddings")  # asleep
    j.wake(2, ["weights"])
    j.call(2, "/v1/completions")  # the KV cache still asleep: asleep still
    j.wake(2, ["kv_cache"])
    j.call(2, "/v1/completions")  # awake: the wake check
    j.boot(3, "ECHO")
    n = j.req(3, "/release_memory_occupation")
    j.call(3, "/v1/chat/completions")  # during the sleep call, before its sleep line: asleep already
    j.add(3, "sleep", level=1)
    j.add(3, "end", n=n)
    w = j.read()
    assert len(w.busy_sleeps) == 1 and w.busy_sleeps[0].startswith("ALPHA pid 1 ")
    assert "['/v1/chat/completions'] in flight" in w.busy_sleeps[0]
    assert [s.split(" at ")[0] for s in w.asleep_served] == [
        "BRAVO pid 2 /v1/embeddings", "BRAVO pid 2 /v1/completions", "ECHO pid 3 /v1/chat/completions"]
    assert [x.result for x in w.wakes] == ["killed after"]  # bravo's: checked, then the journal ends


def test_the_gpu_claims_leave_out_dead_processes(tmp_path):
    import os
    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / str(os.getpid())).write_text("0 10240\n1 512\n")
    (apps / "999999999").write_text("0 4096\n")  # no such process
    (apps / ".123.tmp").write_text("0 1\n")  # a file being written
    assert soaklib.gpu_claims(apps) == {0: {os.getpid(): 10240}, 1: {os.getpid(): 512}}
