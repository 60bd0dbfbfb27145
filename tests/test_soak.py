"""The soak's short version (scripts/soak.py: a real `ondemand serve`, 1,000 requests from 50
clients, real faults, then the invariants); `make soak` runs the full 10,000. About 35 s."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_soak_short(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seed", "7", "--requests", "1000",
                           "--keep", str(tmp_path / "soak")], capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "| ok" in proc.stdout and "FAILED" not in proc.stdout
