"""One ondemand per state directory, and a directory only its owner may look into.

``lock_state_dir`` holds ``{state_dir}/ondemand.lock`` (an flock) for the life of the process;
``serve`` takes it before anything else reads the directory, and ``make_state_dir`` makes the
directory before the admin token is written into it. Imports nothing of ours but the
error it raises.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path

from ..errors import StartupError

log = logging.getLogger("ondemand.app")


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``{state_dir}/ondemand.lock`` for the life of this process (an flock: the kernel
    releases it when the process dies, however it dies).

    Only one ondemand may own a state directory: at start-up the deployer adopts the engines it
    finds and kills the process backend's leftovers, so a second ``serve`` (a second terminal, an
    overlapping restart) would kill the engines of the one already running, busy or not."""
    make_state_dir(state_dir)
    _private_dir(state_dir)
    path = state_dir / "ondemand.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StartupError(f"another ondemand (pid {holder or 'unknown'}) is running with state_dir "
                           f"{state_dir}: stop it first, or give this one its own state_dir") from None
    try:  # the holder's pid, for the message above; a disk that takes no write fails the start
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        os.close(fd)  # and with it the lock: the start fails, and nothing is left held
        raise
    return fd


def make_state_dir(state_dir: Path) -> None:
    """Make the state directory (0700) unless it is there. A state_dir that names a file, or lies
    under one, is a StartupError in one line naming that file: mkdir's FileExistsError or
    NotADirectoryError would end ``serve`` in a traceback."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except (FileExistsError, NotADirectoryError):
        raise StartupError(f"state_dir {state_dir} {not_a_directory(state_dir)}; "
                           "give state_dir a directory's path") from None


def not_a_directory(path: Path) -> str:
    """Why mkdir refused ``path`` (FileExistsError, NotADirectoryError), to follow its name: it
    is a file, or one of the directories above it is."""
    file = next((p for p in [*reversed(path.parents), path] if p.exists() and not p.is_dir()), path)
    return "is a file, not a directory" if file == path else f"cannot be made: {file} is a file"


def _private_dir(state_dir: Path) -> None:
    """The state directory holds the key, the admin token, the socket and the state file:
    only its owner may look inside (0700). One of ours that others can read is tightened."""
    st = state_dir.stat()
    if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.getuid():
        os.chmod(state_dir, 0o700)
        log.warning("state_dir %s was open to others (mode %o): now 0700", state_dir, stat.S_IMODE(st.st_mode))
