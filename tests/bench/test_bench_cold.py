"""The cold-path benchmark runs (a smoke test of scripts/bench_cold.py --quick, slow): its
figures come out, a burst of first requests makes one start and is answered in full."""
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_cold_path_benchmark_runs(tmp_path):
    out = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "scripts/bench_cold.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("## Cold path") == 1 and "Engine ready → first byte" in text
    assert "1 start, 200 answered 200" in text
    again = subprocess.run([sys.executable, "scripts/bench_cold.py", "--quick", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and out.read_text().count("## Cold path") == 1  # replaced, not added
