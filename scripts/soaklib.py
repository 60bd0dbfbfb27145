"""What the soak (scripts/soak.py) and the crash test (scripts/crash.py) share: a real
`ondemand serve` process with the process backend and the engine simulator, found and
killed through /proc, the way an operator would; nothing here reaches into ondemand's
memory. The admin API is called over the admin socket (ondemand.adminclient, what the
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

from ondemand import adminclient, config, keys  # noqa: E402


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(v: Any) -> str:
    return json.dumps(v)


class Ondemand:
    """One `python -m ondemand --config FILE serve` process, restartable on the same state dir."""

    def __init__(self, work: Path, settings: dict[str, Any], tables: dict[str, dict[str, Any]]):
        self.work = work
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
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else 0
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
    ``model``, ``ppid``, ``sid`` (session), ``state`` (R, S, Z ...). Zombies are left out."""
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
        found[int(entry)] = {"model": model, "ppid": int(stat[1]), "sid": int(stat[3]), "state": stat[0]}
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
