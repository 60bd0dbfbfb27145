"""The process backend: each engine is a child process of ondemand.

For installs beside DGXMM without Docker, the embedded default of ``make run``
and the tests. ``command`` is an argv list whose ``{port}`` is replaced by a
free loopback port; the engine is reached at ``http://127.0.0.1:{port}``. Stop is
SIGTERM, then SIGKILL after the grace period.

Its output (stdout and stderr, one pipe) is read by a copier task of ours and
written to ``{state_dir}/logs/{name}.log``, which rotates at ``log_max_bytes``
(10 MiB) keeping ``log_keep`` (3) older files, ``{name}.log.1`` newest. The
copier is the file's only writer, so a rotation (a rename and a new file between
two of its writes) can lose no line of a running engine, which a size check on a
file the child writes itself could not promise: the child would keep writing to
the renamed file. The copier also hands every chunk to the live followers of
``logs(follow=True)``. The engine writes into a pipe: when ondemand dies, its next
write fails (SIGPIPE) rather than filling a file nobody rotates. A pid file beside the log lets the next ondemand kill
an engine it left behind when it died without stopping it: a child cannot be
re-adopted (its exit status belongs to the dead parent), and an orphan would
hold GPU memory the budget no longer counts. An engine started just before that
death may have no pid file yet; its environment's ``ONDEMAND_ENGINE`` (the pid
file's path) names it to the next ondemand's take-back all the same.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path

from ...http.limits import READ_SIZE
from ...model import Deployment
from ...tasks import TaskGroup
from ..recipes import Launch
from . import Backend, BackendError, Engine, visible_gpus
from .logs import LOG_KEEP, LOG_MAX_BYTES, RUN_MARKER, LogRun, RotatingLog, read_tail
from .ports import RESERVED, free_port, release_when_bound

log = logging.getLogger("ondemand.engines.backends.process")

# Set in each engine's environment to its pid file's path: an engine whose pid file was never
# written (ondemand died right after the fork) is still found, and only by the ondemand it is of.
MARKER = "ONDEMAND_ENGINE"
# How long wait_exit waits for the copier to write an exited engine's last lines.
DRAIN_S = 5.0


# How long the rest of a SIGKILLed group may take to die before stop returns.
GROUP_KILLED_S = 5.0


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the process's name: state, ppid, pgrp, session ... (field 3
    of proc(5) is [0]). OSError when it is gone."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, :func:`_stat`) of each process; one gone meanwhile is passed over."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat(entry)
        except OSError:
            continue
        yield int(entry), fields


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``, from /proc. Zombies are left out: an orphan
    is reaped by whoever is PID 1, late or (a container whose PID 1 never reaps) never."""
    return [pid for pid, fields in _stats()
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X")]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


async def _group_gone(pgid: int, within: float) -> bool:
    """Whether process group ``pgid`` has no live process left within ``within`` seconds (polled
    off the loop: a walk of /proc)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(within, 0.0)
    while await asyncio.to_thread(_group_members, pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def self_command() -> list[str]:
    """How to run this very ondemand again: the zipapp, or the package."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", "") or ""
    if ".pyz" in main_file or ".pyz" in (sys.argv[0] if sys.argv else ""):
        return [sys.executable, os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", "ondemand"]


def _child_env(dep: Deployment, launch: Launch) -> dict[str, str]:
    # `python -m ondemand` must find the package the same way we did.
    env = dict(os.environ)
    env.update(launch.env)  # the recipe's, the box's (HF_HOME, HF_TOKEN) and the deployment's own
    root = str(Path(__file__).resolve().parents[3])  # the directory that holds the ondemand package
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
    for child, fields in _stats():
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _marked_leaders(variable: str) -> dict[str, list[tuple[int, str]]]:
    """Session leaders whose environment sets ``variable``, by its value: (pid, start time)."""
    prefix = variable.encode() + b"="
    found: dict[str, list[tuple[int, str]]] = {}
    for pid, fields in _stats():
        if len(fields) < 20 or fields[3] != str(pid):  # not a session leader: an engine's worker, or not ours
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not readable by us
        for item in env:
            if item.startswith(prefix):
                found.setdefault(item[len(prefix):].decode(errors="replace"), []).append((pid, fields[19]))
    return found


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc/PID/stat field 22), or ""."""
    try:
        return _stat(pid)[19]
    except (OSError, IndexError):
        return ""


class ProcessBackend(Backend):
    kind = "process"

    def __init__(self, state_dir: Path, *, log_max_bytes: int = LOG_MAX_BYTES, log_keep: int = LOG_KEEP):
        self.log_dir = Path(state_dir) / "logs"
        self.log_max_bytes = log_max_bytes
        self.log_keep = log_keep
        self._runs: dict[str, LogRun] = {}  # by deployment name: the latest run's output
        self._run_of: dict[asyncio.subprocess.Process, LogRun] = {}
        self.tasks = TaskGroup("process logs")
        # Engines a dead ondemand left behind, found by their marker: read once, at the first take-back.
        self._left: dict[str, list[tuple[int, str]]] | None = None

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.log_dir / f"{name}.log", self.log_dir / f"{name}.pid"

    def _log_paths(self, name: str) -> list[Path]:
        """The log files of ``name``, newest first."""
        path = self._paths(name)[0]
        return [path] + [path.with_name(f"{path.name}.{n}") for n in range(1, self.log_keep + 1)]

    async def start(self, dep: Deployment, launch: Launch | None = None) -> Engine:
        launch = launch or self.as_given(dep)
        command = list(launch.args)
        if not command:
            raise BackendError(f"deployment {dep.name} has no command (the process backend runs `command`)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path, pid_path = self._paths(dep.name)
        await self._kill_leftover(dep.name)
        self._end_run(dep.name)
        run = LogRun(RotatingLog(log_path, self.log_max_bytes, self.log_keep))
        # Every run appends to the one log; the marker lets log_tail quote this run only.
        # (a full disk loses the line, not the engine: run.write says so, once a minute at most)
        run.write(f"{RUN_MARKER} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
        # Picked last, right before the exec: from here to release_when_bound's spawn the only
        # await is the exec, and whatever ends it (an error, a cancelled start) releases the port.
        port = free_port()
        argv = [str(a).replace("{port}", str(port)) for a in command]
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the interpreter running us, venv or zipapp
        elif argv[0] == "ondemand":
            argv[:1] = self_command()  # e.g. the engine simulator of the embedded default
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env={**_child_env(dep, launch), MARKER: str(pid_path)},
                start_new_session=True)  # our Ctrl-C is not the engine's
        except BaseException as exc:  # no engine to bind the port: it cannot run, or the start was cancelled
            RESERVED.release(port)
            if isinstance(exc, OSError):  # (best effort, as the marker: a full disk loses the line, not the error)
                run.write(f"cannot run {argv[0]}: {exc.strerror}\n".encode())
            run.end()
            if isinstance(exc, OSError):
                raise BackendError(f"cannot run {argv[0]}: {exc.strerror}") from exc
            raise
        assert proc.stdout is not None
        self.tasks.spawn(release_when_bound(port, lambda: proc.returncode is None), f"port {port} of {dep.name}")
        self._runs[dep.name] = self._run_of[proc] = run
        run.copier = self.tasks.spawn(self._copy(proc.stdout, run), f"copy {dep.name}")
        try:
            pid_path.write_text(f"{proc.pid} {_start_time(proc.pid)}")
        except OSError as exc:  # only a leftover after our own crash goes unnoticed then
            log.warning("cannot write %s: %s", pid_path, exc)
        log.info("started %s: pid %d on port %d", dep.name, proc.pid, port)
        return Engine(dep.id, dep.name, f"http://127.0.0.1:{port}", ref=proc)

    @staticmethod
    async def _copy(pipe: asyncio.StreamReader, run: LogRun) -> None:
        """The engine's output to its log file and followers, until the pipe closes."""
        try:
            while chunk := await pipe.read(READ_SIZE):
                run.write(chunk)  # a full disk drops it from the file, not from the pipe (run.write)
        finally:
            run.end()

    def _end_run(self, name: str) -> None:
        """Stop copying an earlier run's output (a leftover that still holds its pipe)."""
        run = self._runs.pop(name, None)
        if run is not None and run.copier is not None and not run.copier.done():
            run.copier.cancel("a new run of the engine")

    async def close(self) -> None:
        # The engines are stopped by now (the deployer stops them first): their copiers
        # write the last lines and see the pipe close; one that does not is cancelled.
        copiers = {run.copier for run in [*self._run_of.values(), *self._runs.values()]
                   if run.copier is not None and not run.copier.done()}
        if copiers:
            await asyncio.wait(copiers, timeout=DRAIN_S)
        # A child that has died unawaited (killed by pid: by the next ondemand's take-back, or
        # an admin's kill) is reaped here, while the loop runs: a loop that ends first leaves
        # the child's transport unfinished, and it fails when collected.
        ended = [proc.wait() for proc in self._run_of if proc.returncode is None and not _alive(proc.pid)]
        if ended:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*ended), DRAIN_S)
        await self.tasks.close()

    async def wait_exit(self, engine: Engine) -> int | None:
        code: int | None = await engine.ref.wait()
        with contextlib.suppress(FileNotFoundError):
            self._paths(engine.name)[1].unlink()
        run = self._run_of.pop(engine.ref, None)
        if run is not None and run.copier is not None:
            # Its last lines are in the file before anyone reads the tail for the reason.
            await asyncio.wait({run.copier}, timeout=DRAIN_S)
        return code

    async def pids(self, engine: Engine) -> list[int]:
        proc = engine.ref
        if not isinstance(proc, asyncio.subprocess.Process) or proc.returncode is not None:
            return []
        return await asyncio.to_thread(_tree, proc.pid)  # a walk of /proc: off the loop

    async def stop(self, engine: Engine, timeout: float) -> None:
        """SIGTERM to the engine's process group, SIGKILL to what is left of it after ``timeout``.
        It returns once the whole group is gone, not when its leader exits: vLLM's API server
        leads its engine core and its worker, which hold the GPU memory and may outlive it."""
        proc: asyncio.subprocess.Process = engine.ref
        if proc.returncode is not None:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
            if await _group_gone(proc.pid, deadline - asyncio.get_running_loop().time()):
                return
            log.warning("%s: processes of the engine outlived it by %gs after SIGTERM: killing them",
                        engine.name, timeout)
        except asyncio.TimeoutError:
            log.warning("%s did not exit within %gs of SIGTERM: killing it", engine.name, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        await _group_gone(proc.pid, GROUP_KILLED_S)

    async def remove(self, dep: Deployment) -> None:
        await self._kill_leftover(dep.name)

    async def adopt(self, dep: Deployment, launch: Launch | None = None, *, compare: bool = True) -> Engine | None:
        # An engine started just before our death may have no pid file yet (ondemand died between
        # the fork and the write): its marker in its environment names it all the same.
        if self._left is None:
            self._left = await asyncio.to_thread(_marked_leaders, MARKER)
        killed = set()
        for pid, started in self._left.pop(str(self._paths(dep.name)[1]), []):
            self._kill(dep.name, pid, started)
            killed.add(pid)
        await self._kill_leftover(dep.name, killed)
        return None

    async def _kill_leftover(self, name: str, killed: Collection[int] = ()) -> None:
        pid_path = self._paths(name)[1]
        try:
            pid_text, started = pid_path.read_text().split()
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return
        if pid not in killed:
            self._kill(name, pid, started)
        pid_path.unlink(missing_ok=True)  # after the kill: a death between the two leaves the file to the next

    @staticmethod
    def _kill(name: str, pid: int, started: str) -> None:
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

    def followers(self, name: str) -> int:
        """How many readers follow the log of ``name``'s latest run now (``logs(follow=True)``);
        each leaves when its reader goes (a client that hung up, a Ctrl-C)."""
        run = self._runs.get(name)
        return 0 if run is None else len(run.followers)

    async def logs(self, dep: Deployment, *, tail: int, follow: bool) -> AsyncIterator[bytes]:
        # The tail is read and the follower added in one step (no await between them), and
        # the copier writes in steps of its own: no chunk is missed, none is sent twice.
        # A local file, at most TAIL_MAX_BYTES read back: no need to move it off the loop.
        data = read_tail(self._log_paths(dep.name), tail)
        run = self._runs.get(dep.name) if follow else None
        follower = run.follow() if run is not None and not run.ended else None
        try:
            if data:
                yield data
            if follower is not None:
                async for chunk in follower.chunks():
                    yield chunk
        finally:
            if follower is not None and run is not None:
                run.followers.discard(follower)
