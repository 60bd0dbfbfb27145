"""What the benchmarks read of a process and of the machine (/proc, getrusage, ss), and their
statistics (a nearest-rank percentile)."""
from __future__ import annotations

import os
import resource
import subprocess

PAGE = os.sysconf("SC_PAGE_SIZE")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int, key: str) -> float:
    """A kB field of /proc/PID/status in MiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * PAGE / 2**20


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rpartition(")")[2].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / CLK_TCK


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def listen_backlog(port: int) -> int | None:
    """The listen backlog of the socket on ``port`` (``ss``'s Send-Q for a listening socket)."""
    try:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
        return int(out.split()[2])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def n_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- statistics ---------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))  # nearest rank
    return s[k]


def median(values: list[float]) -> float:
    return pct(values, 50)

