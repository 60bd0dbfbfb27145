"""One `make bench` writes every section of bench/results.md: scripts/bench.py rewrites its own
part and keeps the sections the other benchmarks wrote: the cold path (bench_cold.py), the wake
path (bench_wake.py), the start phases (bench_phases.py) and the real vLLM's warm compile cache
(tests/heavy/test_vllm_cache.py, under make test-vllm)."""
import importlib.util
import sys

from helpers import ROOT


def _load(name):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_proxy_bench_keeps_the_cold_and_wake_sections(tmp_path):
    bench, cold = _load("bench"), _load("bench_cold")
    out = tmp_path / "results.md"
    bench.write_keeping("# ondemand gateway benchmark\n\n## Targets\nold figures\n", out)
    cold.write_section("## Cold path\ncold table\n", out)
    cold.write_section("## Wake path\nwake table\n", out, "## Wake path")
    cold.write_section("## Start phases\nphase table\n", out, "## Start phases")
    cold.write_section("## Warm compile cache, a real vLLM\nvllm table\n```\nINFO a line\n```\n", out,
                       "## Warm compile cache, a real vLLM")
    bench.write_keeping("# ondemand gateway benchmark\n\n## Targets\nnew figures\n\n## Set-up\nmachine\n", out)
    text = out.read_text()
    assert "old figures" not in text and "new figures" in text and "machine" in text
    assert text.count("## Cold path") == 1 and "cold table" in text
    assert text.count("## Wake path") == 1 and "wake table" in text
    assert text.count("## Start phases") == 1 and "phase table" in text
    assert text.count("## Warm compile cache, a real vLLM") == 1 and "INFO a line" in text
    bench.write_keeping("# ondemand gateway benchmark\n", out)  # again: still one of each
    text = out.read_text()
    for section in ("## Cold path", "## Wake path", "## Start phases", "## Warm compile cache, a real vLLM"):
        assert text.count(section) == 1, section
    assert text.index("## Cold path") > text.index("# ondemand gateway benchmark")


def test_a_first_run_writes_only_its_own_part(tmp_path):
    bench = _load("bench")
    out = tmp_path / "results.md"
    bench.write_keeping("# ondemand gateway benchmark\n", out)
    assert out.read_text() == "# ondemand gateway benchmark\n"
