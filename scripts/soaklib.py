"""What the soak (scripts/soak.py) and the crash test (scripts/crash.py) share: a real
`ondemand serve` process with the process backend and the engine simulator, found and
killed through /proc, the way an operator would; nothing here reaches into ondemand's
memory. The admin API is called over the admin socket (ondemand.admin.client, what the
command line uses) and the command line itself as a child process."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand import config  # noqa: E402
from ondemand.admin import client as adminclient  # noqa: E402
from ondemand.gateway import keys  # noqa: E402


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(v: Any) -> str:
    return json.dumps(v)


class Ondemand:
    """One `python -m ondemand --config FILE serve` process, restartable on the same state dir."""

    def __init__(self, work: Path, settings: dict[str, Any], tables: dict[str, dict[str, Any]],
                 env: dict[str, str] | None = None):
        self.work = work
        self.extra_env = dict(env or {})  # for ondemand and, through it, its engines
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/dgxmm"
        state = work / "state"
        base = {"state_dir": str(state), "listen": f"127.0.0.1:{self.port}", "internal_url": self.url,
                "instance": "soak", "ondemand_allowed_cidrs": ["127.0.0.0/8"]}
        lines = [f"{k} = {toml_value(v)}" for k, v in {**base, **settings}.items()]
        for table, values in tables.items():
            lines.append(f"[{table}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        self.config_path = work / "ondemand.toml"
        self.config_path.write_text("\n".join(lines) + "\n")
        self.cfg = config.load(self.config_path, env={})
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = work / "ondemand.stderr"
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
        env["PYTHONPATH"] = str(ROOT)
        env.update(self.extra_env)
        return env

    def write_key(self) -> str:
        key = keys.generate_key()
        keys.write_key_file(self.cfg.key_file, key)
        return key

    def key(self) -> str:
        return self.cfg.key_file.read_text().strip()

    def token(self) -> str:
        return self.cfg.token_file.read_text().strip()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout: float = 30) -> None:
        self.starts += 1
        with open(self.stderr_path, "ab") as err:
            err.write(f"--- soak: start {self.starts} of ondemand at {time.time():.3f}\n".encode())
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ondemand", "--config", str(self.config_path), "serve",
                cwd=ROOT, env=self.env(), stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"ondemand exited with {self.proc.returncode}: see {self.stderr_path}")
            with contextlib.suppress(adminclient.NoServer):
                status, _ = await adminclient.request(self.cfg, "GET", "/host")
                if status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ondemand did not answer within {timeout} s: see {self.stderr_path}")
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """SIGKILL: no cleanup of any kind (engines, socket, lock are left as they are)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()

    async def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; returns the exit code (a kill after ``timeout`` s counts as a failure)."""
        if self.proc is None:
            return 0
        if self.proc.returncode is not None:
            return self.proc.returncode
        self.proc.terminate()
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            return -9

    async def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await adminclient.request(self.cfg, method, path, body)

    async def cli(self, *args: str, timeout: float = 60) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ondemand", "--config", str(self.config_path), *args, cwd=ROOT, env=self.env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()


def sim_command(model: str, journal: Path, *extra: str) -> list[str]:
    return ["ondemand", "sim-engine", "--port", "{port}", "--model", model, "--journal", str(journal), *extra]


def sim_processes(journal: Path) -> dict[int, dict[str, Any]]:
    """The live engine simulators of this run (their command line names ``journal``), by pid:
    ``model``, ``port``, ``ppid``, ``sid`` (session), ``state`` (R, S, Z ...). Zombies are left out."""
    marker = str(journal).encode()
    found: dict[int, dict[str, Any]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if marker not in argv or b"sim-engine" not in argv or stat[0] == "Z":
            continue
        model = argv[argv.index(b"--model") + 1].decode() if b"--model" in argv else "?"
        port = argv[argv.index(b"--port") + 1].decode() if b"--port" in argv else ""
        found[int(entry)] = {"model": model, "port": int(port) if port.isdigit() else None, "ppid": int(stat[1]),
                             "sid": int(stat[3]), "state": stat[0]}
    return found


def kill_pid(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """``pid``'s open fds by kind: socket, pipe, anon_inode, or the file's name."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kind = target.split(":")[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) \
                else Path(target).name
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def tcp_peer_ports(pid: int) -> list[int]:
    """The remote ports of ``pid``'s established TCP connections (its socket fds, looked up in
    /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "01" and f[9] in inodes:  # 01: ESTABLISHED
                    ports.append(int(f[2].rpartition(":")[2], 16))
    return ports


def integrity(db: Path) -> str:
    """PRAGMA integrity_check of the state file, read-only ("ok" when intact)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return ", ".join(str(r[0]) for r in con.execute("PRAGMA integrity_check"))
    finally:
        con.close()


def rows(db: Path, sql: str) -> list[dict[str, Any]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(sql)]
    finally:
        con.close()


def write_learned(db: Path, dep_id: int, gaps: list[float], start_s: float) -> None:
    """What ``dep_id`` learned before, into a state file no server has open (as the controller's
    effects and the start history keep it): idle gaps, and a cold start's duration (what its rest
    stopped costs). A restart takes them back."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.executemany("INSERT INTO idle_gaps (deployment_id, at, gap_s) VALUES (?, ?, ?)",
                             [(dep_id, time.time(), gap) for gap in gaps])
            conn.execute("INSERT INTO starts (deployment_id, at, duration_s, kind) VALUES (?, ?, ?, 'start')",
                         (dep_id, time.time(), start_s))
    finally:
        conn.close()


def log_files(work: Path) -> list[Path]:
    """Every log of the run: ondemand's stderr, the engines' logs (rotated ones too), the journal."""
    return sorted(p for p in work.rglob("*") if p.is_file() and (
        p.name == "ondemand.stderr" or ".log" in p.name or p.suffix == ".jsonl"))


def secrets_found(files: list[Path], secrets: list[str]) -> list[str]:
    """``file: which secret`` for every secret found in a file (named by its first 6 characters)."""
    hits = []
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            if secret and secret.encode() in data:
                hits.append(f"{path.name}: {secret[:6]}...")
    return hits


def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def table(title: str, rows_: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows_]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [f"**{title}**", "",
             "| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


# --- the fake GPU box ------------------------------------------------------------------------

FAKE_NVIDIA_SMI = ROOT / "tests" / "fakes" / "nvidia-smi"


def fake_gpu_box(work: Path, gpus_mib: list[int]) -> dict[str, str]:
    """A box of GPUs for the fake nvidia-smi (tests/fakes/nvidia-smi), nothing used on them
    but by the engine simulators' ``--gpu-mib``; returns the environment ondemand (and so its
    engines) must get: ``FAKE_NVIDIA_SMI_FILE`` and ``FAKE_NVIDIA_SMI_APPS``."""
    gpus, apps = work / "gpus.csv", work / "gpu-apps"
    apps.mkdir(parents=True, exist_ok=True)
    gpus.write_text("".join(f"{mib}, 0\n" for mib in gpus_mib))
    return {"FAKE_NVIDIA_SMI_FILE": str(gpus), "FAKE_NVIDIA_SMI_APPS": str(apps)}


def gpu_claims(apps: Path) -> dict[int, dict[int, int]]:
    """What the live engine simulators hold, as the fake nvidia-smi counts it: {gpu: {pid: MiB}}
    (a dead or zombie pid's file is left out, as the fake leaves it out)."""
    out: dict[int, dict[int, int]] = {}
    try:
        names = os.listdir(apps)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0]
            text = (apps / name).read_text()
        except (OSError, IndexError):
            continue
        if state in ("Z", "X"):
            continue
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                out.setdefault(int(parts[0]), {})[int(name)] = int(parts[1])
    return out


# --- what the engines' journal says about sleeps and wakes ----------------------------------

# The simulator's generation routes (ondemand/sim/engine.py, GENERATION): what "a request in
# flight" means for its journal's sigterm line, and what it refuses (503) while asleep.
GENERATION = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    "/v1/audio/transcriptions", "/v1/chat/completions/batch"))
SLEEP_CALLS = frozenset(("/sleep", "/release_memory_occupation"))  # vLLM's, SGLang's
WAKE_CALLS = frozenset(("/wake_up", "/resume_memory_occupation"))
PARTS = frozenset(("weights", "kv_cache"))


class Wake:
    """One wake of one engine process, from its first wake call on, as its journal tells it.

    ``result``: ``ready`` (woken, its wake check answered, then it served or slept again),
    ``refused`` (a wake call ended without waking anything: the engine answered it with an
    error), ``mismatch`` (it woke, its wake check was answered, and it was stopped before it
    served anything: the check's answer differed), ``stopped`` (SIGTERM before the wake or its
    check ended: a stop during the wake), ``killed`` (the process vanished without SIGTERM
    before its check was answered), ``killed after`` (it vanished once the check was answered),
    ``open`` (not ended yet)."""

    def __init__(self, pid: int, model: str, t: float, level: int):
        self.pid, self.model, self.t, self.level = pid, model, t, level
        self.call: int | None = None  # the journal number of the wake call in flight
        self.woke_in_call = False  # a ``wake`` line came during that call
        self.awake = False  # every part woke (a ``wake`` line emptied them)
        self.check_n: int | None = None  # the journal number of its wake check (the first generation after)
        self.checked = False  # that check's ``end`` came
        self.result = "open"
        self.end_t = t

    def close(self, result: str, t: float) -> None:
        if self.result == "open":
            self.result, self.end_t = result, t

    @property
    def failed(self) -> bool:
        """A wake ondemand must see fail (and audit ``ondemand_wake_failed``)."""
        return self.result in ("refused", "mismatch", "killed")


class WarmthJournal:
    """The engines' journal (``--journal``) read for tiered warmth, one process at a time, in
    the file's order (each line one O_APPEND write: the order they happened in). Read it once
    every engine has ended (a wake still open at the end of the journal is one whose process
    vanished):

    - ``sleeps``: (pid, model, t, level) of each ``sleep`` line;
    - ``busy_sleeps``: a sleep call (``/sleep``, ``/release_memory_occupation``) that came while a
      generation request of that process was in flight (``req`` without its ``end``);
    - ``asleep_served``: a generation request that reached a process between its sleep call and
      the ``wake`` line that woke its last part (it answers 503 "The engine is sleeping");
    - ``wakes``: every ``Wake``;
    - ``vanished_asleep``: (pid, model, t of its last line) of each process that vanished
      without SIGTERM while asleep, before any wake call (SIGKILLed asleep; if ondemand was
      waking it, its wake fails with "no engine to wake");
    - ``boots``: (pid, model, t) of each process start (a cold start)."""

    def __init__(self, events: list[dict[str, Any]]):
        self.sleeps: list[tuple[int, str, float, int]] = []
        self.busy_sleeps: list[str] = []
        self.asleep_served: list[str] = []
        self.wakes: list[Wake] = []
        self.vanished_asleep: list[tuple[int, str, float]] = []
        self.boots: list[tuple[int, str, float]] = []
        procs: dict[int, dict[str, Any]] = {}
        for e in events:
            pid, ev, t = int(e.get("pid") or 0), e.get("ev"), float(e.get("t", 0.0))
            if ev == "boot":
                procs[pid] = {"model": e.get("model", "?"), "inflight": {}, "asleep": set(), "window": False,
                              "level": 0, "wake": None, "last_t": t, "sigterm": False}
                self.boots.append((pid, e.get("model", "?"), t))
                continue
            p = procs.get(pid)
            if p is None:  # the soak's own lines, or a process whose boot line is not ours
                continue
            p["last_t"] = t
            if ev == "req":
                self._request(pid, p, e, t)
            elif ev == "end":
                self._end(p, e, t)
            elif ev == "sleep":
                level = int(e.get("level", 1))
                p["asleep"], p["level"] = set(PARTS), level
                self.sleeps.append((pid, p["model"], t, level))
            elif ev == "wake":
                self._woke(p, e)
            elif ev == "sigterm":
                wake = p["wake"]
                if wake is not None:
                    wake.close("mismatch" if wake.checked else "stopped", t)
                p["wake"], p["sigterm"] = None, True
        for pid, p in procs.items():  # the journal ends: the process vanished without SIGTERM (a SIGKILL)
            wake = p["wake"]
            if wake is not None:
                wake.close("killed after" if wake.checked else "killed", p["last_t"])
            elif p["window"] and not p["sigterm"]:
                self.vanished_asleep.append((pid, p["model"], p["last_t"]))

    def _request(self, pid: int, p: dict[str, Any], e: dict[str, Any], t: float) -> None:
        """A ``req`` line of process ``p``: a generation request, a sleep call or a wake call."""
        wake: Wake | None = p["wake"]
        path, n = e.get("path", ""), e.get("n")
        if path in GENERATION:
            if p["window"]:
                self.asleep_served.append(f"{p['model']} pid {pid} {path} at {t:.2f}")
            elif wake is not None and wake.awake and wake.check_n is None:
                wake.check_n = n
            elif wake is not None and wake.checked:
                wake.close("ready", t)  # it serves
                p["wake"] = None
            p["inflight"][n] = path
        elif path in SLEEP_CALLS:
            if p["inflight"]:
                self.busy_sleeps.append(f"{p['model']} pid {pid} at {t:.2f} with "
                                        f"{sorted(p['inflight'].values())} in flight")
            if wake is not None:
                wake.close("ready" if wake.checked else "stopped", t)  # asleep again
            p["window"], p["wake"] = True, None
        elif path in WAKE_CALLS and p["window"]:
            if wake is None:
                wake = p["wake"] = Wake(pid, p["model"], t, p["level"])
                self.wakes.append(wake)
            wake.call, wake.woke_in_call = n, False

    @staticmethod
    def _end(p: dict[str, Any], e: dict[str, Any], t: float) -> None:
        """An ``end`` line: a request of process ``p`` answered (a wake call, a wake check)."""
        wake: Wake | None = p["wake"]
        n = e.get("n")
        p["inflight"].pop(n, None)
        if wake is not None and n == wake.call:
            wake.call = None
            if not wake.woke_in_call and p["asleep"]:
                wake.close("refused", t)  # answered, and nothing woke: an error
        if wake is not None and wake.check_n is not None and n == wake.check_n:
            wake.checked = True

    @staticmethod
    def _woke(p: dict[str, Any], e: dict[str, Any]) -> None:
        """A ``wake`` line: parts of process ``p`` woke; all of them, and it is awake."""
        wake: Wake | None = p["wake"]
        p["asleep"] -= set(e.get("tags", ()))
        if wake is not None:
            wake.woke_in_call = True
        if not p["asleep"]:
            p["window"] = False
            if wake is not None:
                wake.awake = True
