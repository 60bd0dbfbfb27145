"""The wake-path benchmark runs (a smoke test of scripts/bench_wake.py --quick, slow, no
timing asserted): both budgets' tables come out with every case, each round is cut into its
steps, and the section replaces itself in the results file, the others kept."""
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow

CASES = ("Awake", "Asleep, level 1", "Asleep, level 2", "Stopped (cold start)", "Make-room swap")


def test_the_wake_path_benchmark_runs(tmp_path):
    out = tmp_path / "results.md"
    out.write_text("# Results\n\n## Cold path\n\nkept\n")
    proc = subprocess.run([sys.executable, "scripts/bench_wake.py", "--quick", "--rounds", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("## Wake path") == 1 and "## Cold path\n\nkept" in text
    for budget in ("Static budget", "Measured budget"):
        assert f"**{budget}" in text
    for case in CASES[1:]:  # each round cut into its steps, on both budgets
        assert sum(ln.startswith("- ") and f", {case.lower()}: " in ln for ln in text.splitlines()) == 2
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| Case")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(CASES) * 2
    assert all(("PASS" in r or "MISS" in r) for r in rows if "swap" in r or "Asleep" in r)
    assert "request → the victim's `/sleep` arrives" in text and "the wake check answered" in text

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_wake
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    section = text[text.index("## Wake path"):]
    bench_wake.write_section(section, out)
    again = out.read_text()
    assert again.count("## Wake path") == 1 and "## Cold path\n\nkept" in again  # replaced, not added
