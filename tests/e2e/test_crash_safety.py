"""Crash safety's short version (scripts/crash.py: SIGKILLs of a real `ondemand serve` during
starts, stops, mode switches, syncs and key rotations, with a LiteLLM double; after each
restart the state file, the states, the engines and LiteLLM's entries are checked).
`make soak` runs 50 kills. About 15 s."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_crash_safety_short(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "crash.py"), "--seed", "5", "--kills", "8",
                           "--keep", str(tmp_path / "crash")], capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout
