"""Docs that cannot drift (issue 44): the README's Layout table names every package and module of
``ondemand/`` and nothing that is not there; every module path a doc names in backticks exists;
every ``ondemand_*`` metric the code defines and every configuration key it accepts is in the
README's tables. Reads files only: no server, no I/O beyond them."""
import ast
import re
from pathlib import Path

from ondemand import config

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ondemand"
README = ROOT / "README.md"
DOCS = [README, PKG / "design.md", PKG / "BEHAVIOUR.md", *sorted((ROOT / "bench").glob("*.md"))]
PACKAGES = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())


def section(text: str, heading: str) -> str:
    """The text under a Markdown heading (any level), up to the next heading of that level or higher."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The rows of the Markdown tables in ``text`` (header and rule rows left out), cell by cell.
    A ``|`` escaped as ``\\|`` stays inside its cell."""
    lines = text.splitlines()
    rule = re.compile(r"\|[\s:|-]+")
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            for line, after in zip(lines, lines[1:] + [""])
            if line.startswith("|") and not rule.fullmatch(line) and not rule.fullmatch(after)]  # no header, no rule


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --- (a) the Layout table ---------------------------------------------------------------

def layout() -> dict[str, str]:
    """The Layout table: its first cell (a package `name/`, or top-level modules `x.py`) → its second."""
    rows = table_rows(section(README.read_text(), "Layout"))
    return {row[0]: row[1] for row in rows}


def test_the_layout_table_names_every_top_level_module_and_nothing_else():
    named = {name for first in layout() for name in ticked(first) if name.endswith(".py")}
    there = {p.name for p in PKG.glob("*.py") if not p.name.startswith("__")}
    assert named - there == set(), f"the Layout table names modules that do not exist: {sorted(named - there)}"
    assert there - named == set(), f"the Layout table lacks {sorted(there - named)}"


def test_the_layout_table_has_a_row_per_package_and_nothing_else():
    packages = {name.rstrip("/") for first in layout() for name in ticked(first) if name.endswith("/")}
    assert packages == set(PACKAGES), f"rows {sorted(packages)}, packages {PACKAGES}"


# A module named in a package's row: a lower-case identifier in backticks (a folder with a `/`).
# Classes are capitalised and paths start with / or {, so neither is taken for a module.
MODULE = re.compile(r"[a-z_][a-z0-9_]*/?")


def test_each_package_row_names_every_module_of_the_package_and_nothing_else():
    rows = {name.rstrip("/"): text for first, text in layout().items() for name in ticked(first) if name.endswith("/")}
    bad = []
    for package, text in rows.items():
        root = PKG / package
        named = {n for n in ticked(text) if MODULE.fullmatch(n)}
        for name in sorted(named):
            found = list(root.rglob(f"{name.rstrip('/')}.py")) + [d for d in root.rglob(name.rstrip("/")) if d.is_dir()]
            if not found:
                bad.append(f"{package}/ names `{name}`, which is not in ondemand/{package}/")
        modules = {p.stem for p in root.rglob("*.py") if p.stem != "__init__"}
        folders = {f"{d.name}/" for d in root.rglob("*") if d.is_dir() and d.name != "__pycache__"}
        for missing in sorted((modules | folders) - named):
            bad.append(f"{package}/'s row does not name `{missing}`")
    assert bad == []


# --- (b) module paths in the docs ----------------------------------------------------------

# `control/slots.py`, `ondemand/http/limits.py`, `engines/backends/`: a path into the package.
PATH = re.compile(rf"(?:ondemand/)?(?:{'|'.join(PACKAGES)})/[\w/]*(?:\.py)?")


def named_paths(text: str) -> set[str]:
    """The package paths ``text`` names in backticks. ``state/...`` without ``.py`` is the state
    directory (``state/demo/``), not the package, unless it says ``ondemand/``."""
    return {span for span in re.findall(r"`([^`\s]+)`", text) if PATH.fullmatch(span)
            and not (span.startswith("state/") and not span.endswith(".py"))}


def test_every_module_path_a_doc_names_exists():
    bad = []
    for doc in DOCS:
        for path in sorted(named_paths(doc.read_text())):
            if not (PKG / path.removeprefix("ondemand/")).exists():
                bad.append(f"{doc.relative_to(ROOT)} names `{path}`")
    assert bad == [], "no such module: " + "; ".join(bad)


def test_the_path_check_sees_a_path_that_is_not_there():
    """The check above finds what it must: a made-up module in backticks, with or without the prefix."""
    text = "the slots (`control/slots.py`), and `ondemand/control/nowhere.py`, `gateway/gone/`, `state/demo/`"
    assert named_paths(text) == {"control/slots.py", "ondemand/control/nowhere.py", "gateway/gone/"}
    assert not (PKG / "control" / "nowhere.py").exists()


# --- (c) metrics and configuration keys in the README's tables ---------------------------------

COUNTERS = {"Counter", "CounterMetricFamily"}
METRIC_CLASSES = COUNTERS | {"Gauge", "GaugeMetricFamily", "Histogram", "HistogramMetricFamily", "Summary"}


def defined_metrics() -> set[str]:
    """Every ``ondemand_*`` metric the package defines, as Prometheus exposes it (a counter's name
    gets ``_total``)."""
    found = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            value = node.args[0].value
            if name in METRIC_CLASSES and isinstance(value, str) and value.startswith("ondemand_"):
                found.add(value + "_total" if name in COUNTERS else value)
    return found


def test_every_metric_is_in_the_readmes_metrics_table():
    defined = defined_metrics()
    assert {"ondemand_requests_total", "ondemand_inflight", "ondemand_start_duration_seconds"} <= defined
    rows = table_rows(section(README.read_text(), "Metrics"))
    documented = {ticked(row[0])[0] for row in rows if ticked(row[0])}
    assert defined - documented == set(), f"the README's metrics table lacks {sorted(defined - documented)}"
    assert documented - defined == set(), f"the README documents metrics the code lacks: {sorted(documented - defined)}"


def test_every_configuration_key_is_in_the_readmes_configuration_table():
    keys = {row[0] for row in config.describe()}
    rows = table_rows(section(README.read_text(), "Configuration"))
    first = {ticked(row[0])[0] for row in rows if ticked(row[0])}
    cells = {name for row in rows for name in ticked(row[0]) + ticked(row[-1])}
    assert keys - cells == set(), f"the README's configuration table lacks {sorted(keys - cells)}"
    assert first - keys == set(), f"the README's configuration table has keys the code lacks: {sorted(first - keys)}"


# --- links between the docs ---------------------------------------------------------------

def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file: GitHub's slug of each heading, and each ``<a id>``."""
    text = path.read_text()
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.*)$", text, re.M)}
    return slugs | set(re.findall(r'<a id="([^"]+)"', text))


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            bad.append(f"{doc.relative_to(ROOT)}: {target} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{doc.relative_to(ROOT)}: {target or doc.name}#{anchor} is no heading there")
    return bad


def test_every_link_between_the_docs_lands():
    docs = [*DOCS, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert [b for doc in docs for b in broken_links(doc)] == []
