"""The process backend: each engine is a child process of ondemand.

For installs beside DGXMM without Docker, the embedded default of ``make run``
and the tests. ``command`` is an argv list whose ``{port}`` is replaced by a
free loopback port; the engine is reached at ``http://127.0.0.1:{port}``. Its
output goes to ``{state_dir}/logs/{name}.log``. Stop is SIGTERM, then SIGKILL
after the grace period. A pid file beside the log lets the next ondemand kill
an engine it left behind when it died without stopping it: a child cannot be
re-adopted (its exit status belongs to the dead parent), and an orphan would
hold GPU memory the budget no longer counts.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ..model import Deployment
from . import Backend, BackendError, Engine, visible_gpus

log = logging.getLogger("ondemand.backends.process")

# The first line of each run in an engine's log file.
RUN_MARKER = "--- ondemand started this engine at"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def self_command() -> list[str]:
    """How to run this very ondemand again: the zipapp, or the package."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", "") or ""
    if ".pyz" in main_file or ".pyz" in (sys.argv[0] if sys.argv else ""):
        return [sys.executable, os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", "ondemand"]


def _child_env(dep: Deployment) -> dict[str, str]:
    # `python -m ondemand` must find the package the same way we did.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    gpus = visible_gpus(dep)
    if gpus is not None:
        # The engine sees only its GPUs, numbered as nvidia-smi numbers them (PCI bus
        # order; CUDA's default order is fastest first). Empty: no GPU at all.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc (an engine's workers are its children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc/PID/stat field 22), or ""."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


class ProcessBackend(Backend):
    kind = "process"

    def __init__(self, state_dir: Path):
        self.log_dir = Path(state_dir) / "logs"

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.log_dir / f"{name}.log", self.log_dir / f"{name}.pid"

    async def start(self, dep: Deployment) -> Engine:
        command = list(dep.command)
        if not command:
            raise BackendError(f"deployment {dep.name} has no command (the process backend runs `command`)")
        port = free_port()
        argv = [str(a).replace("{port}", str(port)) for a in command]
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the interpreter running us, venv or zipapp
        elif argv[0] == "ondemand":
            argv[:1] = self_command()  # e.g. the engine simulator of the embedded default
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path, pid_path = self._paths(dep.name)
        await self._kill_leftover(dep.name)
        # A local log file, opened once per start: no need to move it off the loop.
        with open(log_path, "ab") as out:  # noqa: ASYNC230
            # Every run appends to the one file; the marker lets log_tail quote this run only.
            out.write(f"{RUN_MARKER} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
            out.flush()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                    env=_child_env(dep), start_new_session=True)  # our Ctrl-C is not the engine's
            except OSError as exc:
                raise BackendError(f"cannot run {argv[0]}: {exc.strerror}") from exc
        pid_path.write_text(f"{proc.pid} {_start_time(proc.pid)}")
        log.info("started %s: pid %d on port %d", dep.name, proc.pid, port)
        return Engine(dep.id, dep.name, f"http://127.0.0.1:{port}", ref=proc)

    async def wait_exit(self, engine: Engine) -> int | None:
        code: int | None = await engine.ref.wait()
        with contextlib.suppress(FileNotFoundError):
            self._paths(engine.name)[1].unlink()
        return code

    async def pids(self, engine: Engine) -> list[int]:
        proc = engine.ref
        if not isinstance(proc, asyncio.subprocess.Process) or proc.returncode is not None:
            return []
        return await asyncio.to_thread(_tree, proc.pid)  # a walk of /proc: off the loop

    async def stop(self, engine: Engine, timeout: float) -> None:
        proc: asyncio.subprocess.Process = engine.ref
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
        except asyncio.TimeoutError:
            log.warning("%s did not exit within %gs of SIGTERM: killing it", engine.name, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def remove(self, dep: Deployment) -> None:
        await self._kill_leftover(dep.name)

    async def adopt(self, dep: Deployment) -> Engine | None:
        await self._kill_leftover(dep.name)
        return None

    async def _kill_leftover(self, name: str) -> None:
        pid_path = self._paths(name)[1]
        try:
            pid_text, started = pid_path.read_text().split()
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return
        pid_path.unlink(missing_ok=True)
        if _start_time(pid) != started:
            return  # gone, or the pid now belongs to someone else
        try:
            os.killpg(pid, signal.SIGKILL)  # a session leader: the group is the engine's
            log.warning("killed engine %s (pid %d) left behind by an earlier ondemand", name, pid)
        except (ProcessLookupError, PermissionError):
            pass

    async def log_tail(self, engine: Engine | None, dep: Deployment, lines: int = 40) -> str:
        path = self._paths(dep.name)[0]
        try:
            # The last 16 KiB of a local file, once per failure: no need to move it off the loop.
            with open(path, "rb") as fh:  # noqa: ASYNC230
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - 16384))
                data = fh.read()
        except FileNotFoundError:
            return ""
        text = data.decode("utf-8", "replace").splitlines()
        starts = [i for i, line in enumerate(text) if line.startswith(RUN_MARKER)]
        if starts:
            text = text[starts[-1] + 1:]  # this run's lines, never an earlier run's
        return "\n".join(text[-lines:])
