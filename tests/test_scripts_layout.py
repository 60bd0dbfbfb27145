"""scripts/ under the package's caps (tests/test_layout.py holds them for ondemand/): no module over
500 lines, no function over 60 (from its first decorator to its last line, nested ones too). A
script is a short entry point; what the soak, the benchmarks and the build share lives in small
modules of their own (scripts/soakkit/, scripts/benchkit/, scripts/soaklib.py, scripts/pyz_spec.py)."""
from __future__ import annotations

import ast
import pathlib

from helpers import ROOT

SCRIPTS = ROOT / "scripts"
MAX_MODULE_LINES = 500  # as tests/test_layout.py's test_no_module_over_500_lines
MAX_FUNCTION_LINES = 60  # as tests/test_layout.py's MAX_FUNCTION_LINES


def long_modules(root: pathlib.Path) -> dict[str, int]:
    """The modules under ``root`` over MAX_MODULE_LINES, with their length."""
    lengths = {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: n for name, n in sorted(lengths.items()) if n > MAX_MODULE_LINES}


def long_functions(root: pathlib.Path) -> list[str]:
    """``path:line name (length)`` of every function under ``root`` over MAX_FUNCTION_LINES."""
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return long


def test_no_script_module_over_500_lines():
    assert long_modules(SCRIPTS) == {}, "split these by what they hold (a module of their own under scripts/)"


def test_no_script_function_over_60_lines():
    assert long_functions(SCRIPTS) == [], "split these into named steps"


def test_the_caps_catch_a_script_that_grows(tmp_path):
    """The checks above see a script grown past either cap (and one just at them passes)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "at_cap.py").write_text(f"def f():\n{body}\n")  # 60 lines: the function and the module
    assert long_functions(tmp_path) == [] and long_modules(tmp_path) == {}
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "grown.py").write_text(f"@staticmethod\ndef g():\n{body}\n    return 1\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_functions(tmp_path) == ["kit/grown.py:2 g (62 lines)"]
    assert long_modules(tmp_path) == {"big.py": MAX_MODULE_LINES + 1}
