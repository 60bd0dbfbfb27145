"""The benchmarks' results file (bench/results.md): each benchmark writes its own section of it
and keeps the others' (one `make bench` writes them all)."""
from __future__ import annotations

from pathlib import Path

# The sections the other benchmarks (bench_cold.py, bench_wake.py, bench_phases.py, and
# tests/test_vllm_cache.py) write into the file: a run of bench.py rewrites its own part and keeps theirs.
KEPT_SECTIONS = ("## Cold path", "## Wake path", "## Start phases", "## Warm compile cache, a real vLLM")


def kept_sections(old: str) -> str:
    """The sections of ``old`` named in KEPT_SECTIONS, each up to the next ``## `` heading."""
    parts = []
    for section in KEPT_SECTIONS:
        if section in old:
            body = old.split(section, 1)[1].split("\n## ", 1)[0]
            parts.append(section + body.rstrip("\n") + "\n")
    return "\n".join(parts)


def write_keeping(text: str, out: Path) -> None:
    """``out`` becomes ``text`` followed by the sections of the other benchmarks it held (KEPT_SECTIONS)."""
    kept = kept_sections(out.read_text()) if out.exists() else ""
    out.write_text(text.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))


def write_section(text: str, out: Path, section: str) -> None:
    """Put ``text`` (which begins with ``section``) in ``out`` in place of that section."""
    old = out.read_text() if out.exists() else ""
    if section in old:
        head, _, rest = old.partition(section)
        tail = rest.split("\n## ", 1)
        old = head + (("## " + tail[1]) if len(tail) > 1 else "")
    out.write_text(old.rstrip("\n") + "\n\n" + text)
