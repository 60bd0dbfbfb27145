"""The start-phases benchmark runs (a smoke test of scripts/bench_phases.py --quick, slow): the ETA's
error over its starts and the read-ahead's cases come out, and a second run replaces its section."""
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_start_phases_benchmark_runs(tmp_path):
    out = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "scripts/bench_phases.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("## Start phases") == 1 and "| By phase (ondemand's) |" in text
    assert "6 cold starts of one deployment" in text
    assert text.count("| loads at once |") == 2 and text.count("| loads after 1 s of start-up |") == 2
    again = subprocess.run([sys.executable, "scripts/bench_phases.py", "--quick", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and out.read_text().count("## Start phases") == 1  # replaced, not added
