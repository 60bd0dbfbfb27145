"""The benchmarks' subprocesses: started in a session of their own, stopped on exit (and on the
bench's death), with an environment that reaches this clone's package; free ports, the fd limit."""
from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench dies (Linux), own session (Ctrl-C is ours)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Procs:
    """The subprocesses of this run; ``cleanup()`` stops every one (idempotent)."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=ROOT, env=env,
                                    preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def cleanup(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # the gateway stops its engines on SIGTERM
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Engines the gateway could not stop (it was killed): their pid files name them.
        for pid_file in (self.state_dir / "logs").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError, ProcessLookupError, PermissionError):
                pid = int(pid_file.read_text().split()[0])
                if b"sim-engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.killpg(pid, signal.SIGKILL)


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def children(pid: int) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        for _ in range(50):
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if kids:
                return [int(k) for k in kids]
            time.sleep(0.02)
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

