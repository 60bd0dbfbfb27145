"""One contract for every engine backend (``ondemand/engines/backends``: start, wait_exit, stop,
remove, adopt, log_tail): the same tests, with the same assertions, against

- ``process``: the process backend, each engine a child process;
- ``docker-double``: the docker backend against the Docker Engine API double
  (tests/docker_double.py), whose containers run as host processes;
- ``docker``: the docker backend against a real dockerd (marked ``docker``: make test-docker;
  the image, network and clean-up are tests/docker_real.py's).

The engine is the engine simulator. Where a backend differs by design the harness says so:
``adopts`` is False for the process backend, whose engine is a child of the ondemand that
went away and cannot be taken back (its adopt kills it instead of leaving it to hold memory
nobody counts). What only one backend does (labels, port bindings, networks, GPUs) stays in
that backend's own tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pathlib
import shlex
import signal
import sys

import aiohttp
import docker_real
import pytest
from docker_double import DockerDouble
from helpers import sim_command, wait_for

from ondemand.engines.backends import Backend, BackendError, Engine
from ondemand.engines.backends.docker import DockerBackend
from ondemand.engines.backends.process import ProcessBackend
from ondemand.model import Deployment

READY_S = 20.0
_seq = itertools.count(1)
# An engine that writes numbered lines and exits with a code of its own: for log_tail.
NOISY = "import sys\nfor i in range({n}): print('line', i, file=sys.stderr, flush=True)\nsys.exit({code})"


class Harness:
    """A backend kind: new backend objects (a new one is ondemand after a restart),
    deployment rows for the simulator, and what is left of a deployment's engine."""
    kind: str
    adopts = True

    def __init__(self) -> None:
        self.made: list[Backend] = []

    def backend(self) -> Backend:
        self.made.append(self._make())
        return self.made[-1]

    def _make(self) -> Backend:
        raise NotImplementedError

    def dep(self, *sim_opts: str) -> Deployment:
        raise NotImplementedError

    def noisy(self, lines: int, code: int) -> Deployment:
        raise NotImplementedError

    async def leftover(self, dep: Deployment) -> bool:
        raise NotImplementedError

    async def close(self) -> None:
        for b in self.made:
            await b.close()


class ProcessHarness(Harness):
    kind = "process"
    adopts = False

    def __init__(self, state_dir) -> None:
        super().__init__()
        self.state_dir = state_dir

    def _make(self) -> Backend:
        return ProcessBackend(self.state_dir)

    def _row(self, command: list[str]) -> Deployment:
        n = next(_seq)
        return Deployment(id=n, name=f"c{n}", served_name=f"m{n}", engine="vllm", command=tuple(command))

    def dep(self, *sim_opts: str) -> Deployment:
        return self._row(sim_command("M", *sim_opts))

    def noisy(self, lines: int, code: int) -> Deployment:
        return self._row(["python", "-c", NOISY.format(n=lines, code=code)])

    async def leftover(self, dep: Deployment) -> bool:
        return (self.state_dir / "logs" / f"{dep.name}.pid").exists()  # an engine not waited for


class DockerDoubleHarness(Harness):
    kind = "docker-double"
    IMAGE = "ondemand-sim-engine:latest"
    NETWORK = "ondemand-test"

    def __init__(self, double: DockerDouble) -> None:
        super().__init__()
        self.double = double

    def _make(self) -> Backend:
        return DockerBackend(docker_url=self.double.url, network=self.NETWORK, gpus=False, in_container=False)

    def _row(self, args: list[str]) -> Deployment:
        n = next(_seq)
        return Deployment(id=n, name=f"c{n}", served_name=f"m{n}", engine="vllm", image=self.IMAGE,
                          args=tuple(args), port=8000)

    def dep(self, *sim_opts: str) -> Deployment:
        return self._row(["python3", "-m", "ondemand", "sim-engine", "--host", "127.0.0.1", "--port", "8000",
                          "--model", "M", *sim_opts])

    def noisy(self, lines: int, code: int) -> Deployment:
        return self._row(["python3", "-c", NOISY.format(n=lines, code=code)])

    async def leftover(self, dep: Deployment) -> bool:
        return self.double._container(f"ondemand-{dep.name}") is not None


class RealDockerHarness(Harness):
    kind = "docker"

    def __init__(self, env: dict) -> None:
        super().__init__()
        self.env = env

    def _make(self) -> Backend:
        return DockerBackend(docker_url=None, network=self.env["network"], gpus=False, in_container=False)

    def dep(self, *sim_opts: str) -> Deployment:
        return docker_real.deployment(self.env, *sim_opts)

    def noisy(self, lines: int, code: int) -> Deployment:
        if self.env["entrypoint"]:
            pytest.skip("the engine image has an entrypoint: no other program runs in it")
        return docker_real.deployment(self.env, args=["python3", "-c", NOISY.format(n=lines, code=code)])

    async def leftover(self, dep: Deployment) -> bool:
        return await asyncio.to_thread(docker_real.inspect, f"ondemand-{dep.name}") is not None


@pytest.fixture(params=["process", "docker-double", pytest.param("docker", marks=pytest.mark.docker)])
async def h(request, tmp_path):
    if request.param == "process":
        harness: Harness = ProcessHarness(tmp_path / "state")
    elif request.param == "docker-double":
        double = DockerDouble()
        double.add_network(DockerDoubleHarness.NETWORK, [("172.30.0.0/16", "172.30.0.1")])
        double.add_image(DockerDoubleHarness.IMAGE, [])
        await double.__aenter__()
        harness = DockerDoubleHarness(double)
    else:
        harness = RealDockerHarness(request.getfixturevalue("docker_env"))
    try:
        yield harness
    finally:
        await harness.close()
        if request.param == "docker-double":
            await harness.double.__aexit__(None, None, None)  # stops every container left


async def answers(base_url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            async with http.get(base_url + "/v1/models") as r:
                return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def _not(awaitable) -> bool:
    return not await awaitable


async def until_answers(engine: Engine) -> None:
    await wait_for(lambda: answers(engine.base_url), timeout=READY_S, interval=0.05,
                   what=f"{engine.name} answering at {engine.base_url}")


async def test_start_answers_then_stop_ends_it_idempotently(h):
    b = h.backend()
    dep = h.dep()
    engine = await b.start(dep)
    assert isinstance(engine, Engine) and not engine.adopted
    assert (engine.deployment_id, engine.name) == (dep.id, dep.name)
    assert engine.base_url.startswith("http://127.0.0.1:")  # never on another address
    await until_answers(engine)
    exit_code = asyncio.ensure_future(b.wait_exit(engine))
    await b.stop(engine, 5)
    assert await asyncio.wait_for(exit_code, 10) == 0  # SIGTERM: the simulator ends cleanly
    assert not await answers(engine.base_url)
    await b.stop(engine, 5)  # stopped already: fine
    assert await asyncio.wait_for(b.wait_exit(engine), 10) == 0  # asked again, the same code
    assert "serving" in await b.log_tail(engine, dep)  # an ended engine keeps its log


def _cmdlines(pids: list[int]) -> list[bytes]:
    """The command lines of those of ``pids`` still alive. A process can be reaped between any
    two reads of /proc (ENOENT or ESRCH then): it is simply not listed."""
    out = []
    for pid in pids:
        try:
            out.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    """A live process (not gone, not a zombie waiting for PID 1 to reap it)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def test_pids_are_the_engines_processes_while_it_runs(h):
    """What the measured footprint matches nvidia-smi's processes against: the host pids
    of the engine's process tree (child process, or the container's processes)."""
    b = h.backend()
    engine = await b.start(h.dep())
    await until_answers(engine)
    pids = await b.pids(engine)
    cmdlines = _cmdlines(pids)
    assert pids and len(cmdlines) == len(pids)  # every one of them a live process
    assert any(b"sim" in c for c in cmdlines), cmdlines  # the engine simulator is among them
    await b.stop(engine, 5)
    await asyncio.wait_for(b.wait_exit(engine), 10)
    assert await b.pids(engine) == []


async def test_an_engine_that_exits_by_itself_is_seen_by_wait_exit(h):
    b = h.backend()
    dep = h.dep("--fail", "exit-at-start")
    engine = await b.start(dep)
    assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 3
    line = "simulated failure: exit at start"
    assert line in await b.log_tail(engine, dep)
    assert line in await h.backend().log_tail(None, dep)  # by name, after a restart
    await b.stop(engine, 5)  # exited already: fine


async def test_log_tail_is_the_last_lines(h):
    b = h.backend()
    dep = h.noisy(lines=100, code=7)
    engine = await b.start(dep)
    assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 7
    assert (await b.log_tail(engine, dep, lines=5)).splitlines() == [f"line {i}" for i in range(95, 100)]
    assert (await b.log_tail(engine, dep)).splitlines() == [f"line {i}" for i in range(60, 100)]  # 40 by default


async def test_adopt_after_a_restart(h):
    first_life = h.backend()
    dep = h.dep()
    first = await first_life.start(dep)
    await until_answers(first)

    restarted = h.backend()  # a new ondemand: nothing in memory
    assert await restarted.adopt(h.dep()) is None  # a deployment with no engine: nothing
    engine = await restarted.adopt(dep)
    if h.adopts:
        assert engine is not None and engine.adopted
        assert (engine.deployment_id, engine.name, engine.base_url) == (dep.id, dep.name, first.base_url)
        await until_answers(engine)
        exit_code = asyncio.ensure_future(restarted.wait_exit(engine))
        await restarted.stop(engine, 5)  # the new ondemand drives what it took back
        assert await asyncio.wait_for(exit_code, 10) == 0
    else:
        assert engine is None
        # Not left behind either: killed, so it holds no memory the budget no longer counts.
        assert await asyncio.wait_for(first_life.wait_exit(first), 10) != 0
        assert not await answers(first.base_url)
    assert await h.backend().adopt(dep) is None  # it no longer runs: nothing to adopt


async def test_an_engine_whose_pid_file_was_never_written_is_killed_at_the_take_back(tmp_path):
    """ondemand killed between the fork and the pid file's write (the crash test's kill at a spawn)
    left an engine no pid file names: the next ondemand finds it by the marker in its environment,
    and only its own (another state directory's engine of the same name lives on)."""
    mine, other = ProcessHarness(tmp_path / "mine"), ProcessHarness(tmp_path / "other")
    dep = mine.dep()
    try:
        first, theirs = await mine.backend().start(dep), await other.backend().start(dep)
        await until_answers(first)
        await until_answers(theirs)
        (tmp_path / "mine" / "logs" / f"{dep.name}.pid").unlink()  # as if never written
        assert await mine.backend().adopt(dep) is None
        assert await asyncio.wait_for(mine.made[0].wait_exit(first), 10) != 0
        assert await answers(theirs.base_url)
    finally:
        await other.made[0].stop(theirs, 5)
        await mine.close()
        await other.close()


async def test_a_process_stop_ends_the_engines_whole_group(tmp_path):
    """vLLM's API server leads its engine core and its worker, which hold the GPU memory: a stop
    returns once the whole process group is gone, not when its leader exits, and what outlives
    the leader past the stop's timeout (here a child that ignores SIGTERM) is killed."""
    h = ProcessHarness(tmp_path / "state")
    pidfile = tmp_path / "child.pid"
    child = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    sim = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ondemand", "sim-engine", "--port", "{port}",
                                             "--model", "M"])
    dep = h._row(["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(child)} & exec {sim}"])
    b = h.backend()
    child_pid = None
    try:
        engine = await b.start(dep)
        await until_answers(engine)
        await wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="the engine's child")
        child_pid = int(pidfile.read_text())
        await b.stop(engine, 1)
        assert await b.pids(engine) == []
        assert not _alive(child_pid), "the engine's child outlived its stop"
    finally:
        if child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)
        await h.close()


async def test_a_process_backend_closes_with_its_dead_children_reaped(tmp_path):
    """An engine killed by pid, its exit not yet heard by the loop (the next ondemand's take-back,
    an admin's kill), is reaped by the backend's close while the loop runs: a loop that ended
    first would leave the child's transport to fail when collected, in whatever runs next."""
    h = ProcessHarness(tmp_path / "state")
    b = h.backend()
    engine = await b.start(h.dep())
    await until_answers(engine)
    os.killpg(engine.ref.pid, signal.SIGKILL)
    await wait_for(lambda: not _alive(engine.ref.pid), what="the engine dead")
    # Nobody awaits it: the close must. (Without the close's reap, the loop has not yet heard of
    # the exit here five times in six, and the returncode stays None.)
    await h.close()
    assert engine.ref.returncode == -signal.SIGKILL


async def test_a_process_engines_port_reservation_ends_once_it_listens(tmp_path):
    """The process backend holds no file for a running engine: the port's reservation ends as soon
    as the engine listens on it (its bind keeps the port then); for an engine that never binds,
    once it is gone, or when the backend closes (its watch cancelled, the reservation released)."""
    from ondemand.engines.backends import ports
    h = ProcessHarness(tmp_path / "state")
    b = h.backend()
    silent = None
    try:
        engine = await b.start(h.dep())
        port = int(engine.base_url.rpartition(":")[2])
        await until_answers(engine)
        assert await ports.listening(port)
        await wait_for(lambda: not ports.RESERVED.holds(port), what="the reservation ended")
        await b.stop(engine, 5)
        never = await b.start(h.noisy(1, 0))  # exits without binding
        port = int(never.base_url.rpartition(":")[2])
        await asyncio.wait_for(b.wait_exit(never), READY_S)
        await wait_for(lambda: not ports.RESERVED.holds(port), what="the reservation ended")
        silent = await b.start(h._row([sys.executable, "-c", "import time; time.sleep(60)"]))  # runs, never binds
        port = int(silent.base_url.rpartition(":")[2])
        assert ports.RESERVED.holds(port)
        await b.close()  # its watch is cancelled with the backend's tasks: the reservation goes with it
        assert not ports.RESERVED.holds(port)
    finally:
        if silent is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(silent.ref.pid, signal.SIGKILL)
            await silent.ref.wait()
        await h.close()


async def test_a_start_cancelled_while_its_engine_is_spawned_releases_its_port(tmp_path, monkeypatch):
    """The port is picked just before the exec; a start cancelled during the exec (the deployer's
    start timeout, a shutdown) leaves no engine to bind it, and its reservation goes at once."""
    from ondemand.engines.backends import ports
    from ondemand.engines.backends import process as process_mod
    h = ProcessHarness(tmp_path / "state")
    b = h.backend()
    entered, argv_seen = asyncio.Event(), []

    async def slow_exec(*argv, **kw):  # an exec that has not returned yet when the start is cancelled
        argv_seen.extend(argv)
        entered.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(process_mod.asyncio, "create_subprocess_exec", slow_exec)
    try:
        start = asyncio.ensure_future(b.start(h.dep()))
        await asyncio.wait_for(entered.wait(), 10)
        port = int(argv_seen[argv_seen.index("--port") + 1])
        assert ports.RESERVED.holds(port)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert not ports.RESERVED.holds(port)
    finally:
        monkeypatch.undo()
        await h.close()


async def test_an_exited_engine_is_not_adopted(h):
    b = h.backend()
    dep = h.dep("--fail", "exit-at-start")
    engine = await b.start(dep)
    assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 3
    assert await h.backend().adopt(dep) is None


@pytest.mark.parametrize("running", [True, False], ids=["running", "exited"])
async def test_remove_cleans_up(h, running):
    b = h.backend()
    dep = h.dep() if running else h.dep("--fail", "exit-at-start")
    engine = await b.start(dep)
    if running:
        await until_answers(engine)
    else:
        assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 3
    assert running or h.kind == "process" or await h.leftover(dep)  # a container stays for its log
    await h.backend().remove(dep)  # after a restart: whatever is left of it goes
    assert not await h.leftover(dep)
    await wait_for(lambda: _not(answers(engine.base_url)), what="the removed engine gone")
    await h.backend().remove(dep)  # nothing left: fine
    assert await h.backend().adopt(dep) is None


async def test_docker_backend_names_the_container_when_waiting_or_stopping_fails(tmp_path):
    """wait_exit and stop report an unreachable Docker as a BackendError naming the container
    (they once built the name from a dict, which a Deployment-typed helper cannot read)."""
    backend = DockerBackend(docker_url=f"unix://{tmp_path}/no-docker.sock", network="n",
                            in_container=False, gpus=False)
    engine = Engine(1, "gone", "http://127.0.0.1:9", ref="0123456789ab")
    try:
        with pytest.raises(BackendError, match="ondemand-gone"):
            await backend.wait_exit(engine)
        with pytest.raises(BackendError, match="ondemand-gone"):
            await backend.stop(engine, 1.0)
    finally:
        await backend.close()


async def test_log_tail_is_of_the_last_run_only(h):
    """A failure reason must not quote an earlier run: the tail of a second run of the
    same deployment holds only that run's lines."""
    b = h.backend()
    first = h.noisy(lines=30, code=1)
    engine = await b.start(first)
    assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 1
    await b.stop(engine, 5)
    again = first.replace(command=tuple(a.replace("'line'", "'again'") for a in first.command),
                          args=tuple(a.replace("'line'", "'again'") for a in first.args))
    engine = await b.start(again)
    assert await asyncio.wait_for(b.wait_exit(engine), READY_S) == 1
    tail = await b.log_tail(engine, again)
    assert "again 29" in tail and "line " not in tail, tail


# An engine that writes lines in two batches, a pause apart, then exits: for logs().
TWO_BATCHES = ("import sys, time\n"
               "for i in range(5): print('line', i, file=sys.stderr, flush=True)\n"
               "time.sleep({pause})\n"
               "for i in range(5, 10): print('line', i, file=sys.stderr, flush=True)\n")


def _two_batches(h, pause: float) -> Deployment:
    dep = h.noisy(lines=0, code=0)
    script = TWO_BATCHES.format(pause=pause)
    return dep.replace(command=tuple(script if a.startswith("import sys") else a for a in dep.command),
                       args=tuple(script if a.startswith("import sys") else a for a in dep.args))


async def _read(stream, limit: float = READY_S) -> list[str]:
    """All of a logs() stream, as lines (it must end within ``limit``)."""
    async def collect() -> bytes:
        out = b""
        async for chunk in stream:
            out += chunk
        return out
    return (await asyncio.wait_for(collect(), limit)).decode().splitlines()


async def test_logs_tail_then_follow_until_the_engine_ends(h):
    """follow: the last lines so far, then every new line, and the end when the engine exits."""
    b = h.backend()
    dep = _two_batches(h, pause=1.0)
    engine = await b.start(dep)
    await wait_for(lambda: _has(b.log_tail(engine, dep), "line 4"), timeout=READY_S, what="the first batch")
    lines = await _read(b.logs(dep, tail=3, follow=True))
    assert lines == [f"line {i}" for i in range(2, 10)], lines
    assert await asyncio.wait_for(b.wait_exit(engine), 10) == 0
    # Without follow, an ended engine's log is still there; tail=0 gives nothing.
    assert await _read(b.logs(dep, tail=4, follow=False)) == [f"line {i}" for i in range(6, 10)]
    assert await _read(b.logs(dep, tail=0, follow=False)) == []
    # After a restart of ondemand, by name.
    assert await _read(h.backend().logs(dep, tail=2, follow=True)) == ["line 8", "line 9"]


async def _has(awaitable, text: str) -> bool:
    return text in await awaitable


async def test_logs_of_a_deployment_that_never_ran_are_empty(h):
    b = h.backend()
    dep = h.dep()
    assert await _read(b.logs(dep, tail=100, follow=False)) == []
    assert await _read(b.logs(dep, tail=100, follow=True)) == []  # nothing runs: ends at once


async def test_a_follower_that_closes_early_stops_the_stream(h):
    b = h.backend()
    dep = h.dep()
    engine = await b.start(dep)
    await until_answers(engine)
    stream = b.logs(dep, tail=50, follow=True)
    first = await asyncio.wait_for(stream.__anext__(), 10)
    assert b"serving" in first
    await asyncio.wait_for(stream.aclose(), 5)  # the engine still runs: only the reader goes
    if h.kind == "process":
        assert b.followers(dep.name) == 0
    await b.stop(engine, 5)


async def test_the_environment_mounts_and_shm_reach_the_engine(h, tmp_path):
    """What a recipe and the box give an engine (``Launch.env``, ``.mounts``, the backend's
    /dev/shm) is what the engine gets: the simulator tells its environment at /_sim/launch;
    a container's mount and /dev/shm are read inside it (real dockerd) or in its create
    request (the double). A child process has no mounts of its own."""
    import dataclasses
    import json
    import subprocess

    from ondemand.engines.recipes import Mount
    src = tmp_path / "models"
    src.mkdir()
    (src / "weights.txt").write_text("the weights\n")
    b = h.backend()
    dep = h.dep()
    how = dataclasses.replace(b.as_given(dep), env=(("HF_HOME", "/cache"), ("ONDEMAND_T_ENV", "v=1 two")),
                              mounts=() if h.kind == "process" else (Mount(str(src), "/srv/t-models", True),))
    if h.kind == "docker":
        b.shm_size = 2**30  # 1 GiB: tensor parallelism needs more than Docker's 64 MiB
    engine = await b.start(dep, how)
    try:
        await until_answers(engine)
        async with aiohttp.ClientSession() as http, http.get(engine.base_url + "/_sim/launch") as r:
            env = (await r.json())["env"]
        assert env["ONDEMAND_T_ENV"] == "v=1 two" and env["HF_HOME"] == "/cache"
        if h.kind == "docker-double":
            config = h.double._container(f"ondemand-{dep.name}")["HostConfig"]
            assert config["Binds"] == [f"{src}:/srv/t-models:ro"]
            assert config["ShmSize"] == 16 * 2**30  # the backend's default
        elif h.kind == "docker":
            name = f"ondemand-{dep.name}"
            out = await asyncio.to_thread(subprocess.run, ["docker", "exec", name, "cat", "/srv/t-models/weights.txt"],
                                          capture_output=True, text=True, timeout=30)
            assert out.stdout == "the weights\n", out.stderr
            wrote = await asyncio.to_thread(subprocess.run, ["docker", "exec", name, "sh", "-c", "echo x > "
                                                             "/srv/t-models/new"], capture_output=True, timeout=30)
            assert wrote.returncode != 0 and not (src / "new").exists()  # read-only
            mounts = await asyncio.to_thread(subprocess.run, ["docker", "exec", name, "cat", "/proc/mounts"],
                                             capture_output=True, text=True, timeout=30)
            shm = [line for line in mounts.stdout.splitlines() if " /dev/shm " in line]
            assert shm and "size=1048576k" in shm[0], shm
            info = json.loads((await asyncio.to_thread(subprocess.run, ["docker", "inspect", name],
                                                       capture_output=True, text=True, timeout=30)).stdout)[0]
            assert info["HostConfig"]["ShmSize"] == 2**30
    finally:
        await b.stop(engine, 5)
