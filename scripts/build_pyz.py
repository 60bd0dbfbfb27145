#!/usr/bin/env python3
"""Build the ondemand zipapp as ondemand.pyz.spec says.

    build_pyz.py                          native: dist/ondemand.pyz
    build_pyz.py --target py312-aarch64   dist/ondemand-py312-aarch64.pyz
    build_pyz.py --list                   the spec's targets
    options: --spec FILE, --out PATH, --refresh (resolve again even if cached)

Run it with the interpreter whose pip and shiv should do the work (the venv's:
`.venv/bin/python scripts/build_pyz.py`). For `native` that interpreter is also
the Python the zipapp is for. The spec's comments explain the steps. In short:
resolve the setup.cfg pins for the target (markers evaluated for the target),
cache the wheels in ${ONDEMAND_CACHE:-~/.cache/ondemand}/wheels/<target>/,
install them into a temporary site-packages, add our packages, zip with shiv.

Exit codes: 0 built, 1 the build failed (pip, shiv), 2 bad usage or spec.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyz_spec import DEFAULT_SPEC, NATIVE, ROOT, BuildError, Spec, Target, load_spec  # noqa: E402

if TYPE_CHECKING:
    # mypy checks against packaging itself; pip's vendored copy is the same code.
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import NormalizedName, canonicalize_name
else:
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.utils import canonicalize_name
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.markers import Marker
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.utils import canonicalize_name


def log(message: str) -> None:
    print(f"build_pyz: {message}", flush=True)


# --- the spec ------------------------------------------------------------------

def load_requirements() -> list[str]:
    """setup.cfg's install_requires, through scripts/requirements.py."""
    path = ROOT / "scripts" / "requirements.py"
    spec = importlib.util.spec_from_file_location("_ondemand_requirements", path)
    if spec is None or spec.loader is None:
        raise BuildError(f"{path}: cannot be loaded as a module", 2)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reqs: list[str] = module.requirements()  # requirements.py: def requirements(...) -> list[str]
    if not reqs:
        raise BuildError("setup.cfg [options] install_requires is empty", 2)
    return reqs


def package_version(spec: Spec, package: str) -> str:
    init = spec.base / package / "__init__.py"
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""",
                      init.read_text(encoding="utf-8"), re.M) if init.is_file() else None
    if not match:
        raise BuildError(f"{init}: no __version__ = '...' line (the zipapp must carry a version)", 2)
    return match.group(1)


# --- pip -----------------------------------------------------------------------

def pip(args: list[str], what: str) -> str:
    """Run this interpreter's pip; return its output, or raise with it."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    for var in ("PIP_TARGET", "PIP_USER", "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "pip", *args], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-25:])
        hint = ""
        if "No matching distribution" in proc.stdout:
            hint = ("\n(either pip cannot reach the package index, or a requirement has no wheel "
                    "for this target's Python and platform tags)")
        raise BuildError(f"{what} failed (pip exit {proc.returncode}):\n{tail}{hint}")
    return proc.stdout


def _stripped(req: Requirement) -> str:
    """The requirement without its marker (already evaluated for the target)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _applies(marker: Marker | None, env: dict[str, str] | None, extra: str = "") -> bool:
    if marker is None:
        return True
    return marker.evaluate({**(env or {}), "extra": extra})


def resolve(target: Target, requirements: list[str], work: Path) -> list[str]:
    """Pin the full set of distributions the target needs: ["name==version", ...].

    pip resolves (with the target's version and platform tags), but evaluates
    markers for the interpreter running it. So: walk pip's report with the
    target's markers; whatever the target needs that pip left out (tomli, say,
    for 3.10 when this is 3.11) becomes a top-level requirement, and pip
    resolves again. What pip added only for this interpreter is not reached by
    the walk and is left out."""
    env = target.marker_environment()
    roots: dict[NormalizedName, Requirement] = {}
    for line in requirements:
        req = Requirement(line)
        if _applies(req.marker, env):
            roots[canonicalize_name(req.name)] = req
    for round_ in range(1, 11):
        report_path = work / f"report-{round_}.json"
        pip(["install", "--dry-run", "--ignore-installed", "--only-binary", ":all:",
             "--report", str(report_path), *target.pip_args(),
             *[_stripped(r) for r in roots.values()]],
            f"resolving the requirements for target {target.name}")
        report = json.loads(report_path.read_text())
        resolved: dict[NormalizedName, dict[str, Any]] = {}  # the report's metadata (JSON)
        for item in report.get("install", []):
            meta = item["metadata"]
            resolved[canonicalize_name(meta["name"])] = meta
        needed: dict[NormalizedName, set[str]] = {}
        missing: list[Requirement] = []
        queue = list(roots.values())
        while queue:
            req = queue.pop()
            name = canonicalize_name(req.name)
            meta = resolved.get(name)
            if meta is None or not req.specifier.contains(meta["version"], prereleases=True):
                missing.append(req)
                continue
            if name in needed and req.extras <= needed[name]:
                continue
            needed.setdefault(name, set()).update(req.extras)
            for dep_line in meta.get("requires_dist") or []:
                dep = Requirement(dep_line)
                if any(_applies(dep.marker, env, e) for e in ["", *needed[name]]):
                    queue.append(Requirement(_stripped(dep)))
        if not missing:
            return sorted(f"{resolved[n]['name']}=={resolved[n]['version']}" for n in needed)
        for req in missing:
            name = canonicalize_name(req.name)
            old = roots.get(name)
            if old is not None:
                merged = Requirement(_stripped(old))
                merged.specifier = SpecifierSet(str(old.specifier & req.specifier))
                merged.extras = set(old.extras) | set(req.extras)
                req = merged
            roots[name] = Requirement(_stripped(req))
        log(f"  the target also needs: {', '.join(_stripped(r) for r in missing)}; resolving again")
    raise BuildError(f"resolving for target {target.name} did not settle after 10 rounds")


def cache_root() -> Path:
    return Path(os.environ.get("ONDEMAND_CACHE") or "~/.cache/ondemand").expanduser()


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install_from_cache(target: Target, pins: list[str], wheels: Path, stage: Path) -> None:
    pip(["install", "--no-index", "--find-links", str(wheels), "--no-deps", "--no-compile",
         "--only-binary", ":all:", "--target", str(stage), *target.pip_args(), *pins],
        f"installing the wheels for target {target.name} from {wheels}")


def stage_dependencies(target: Target, requirements: list[str], stage: Path, work: Path,
                       refresh: bool) -> list[str]:
    """Fill stage with the target's wheels; return the pins."""
    wheels = cache_root() / "wheels" / target.name
    lock_file = wheels / "resolved.json"
    key = hashlib.sha256(json.dumps({"requirements": requirements, "target": target.identity()},
                                    sort_keys=True).encode()).hexdigest()
    with locked(wheels):
        if not refresh:
            try:
                cached = json.loads(lock_file.read_text())
            except (OSError, ValueError):
                cached = {}
            if cached.get("key") == key:
                cached_pins: list[str] = cached["pins"]  # as written below, under this key
                try:
                    install_from_cache(target, cached_pins, wheels, stage)
                    log(f"wheels from the cache {wheels} (--refresh resolves again)")
                    return cached_pins
                except BuildError:
                    log("the cached wheels are incomplete; resolving again")
                    shutil.rmtree(stage, ignore_errors=True)
                    stage.mkdir()
        log(f"resolving {len(requirements)} requirements for {target.name} ...")
        pins = resolve(target, requirements, work)
        log(f"downloading {len(pins)} wheels to {wheels} ...")
        pip(["download", "--no-deps", "--only-binary", ":all:", "--dest", str(wheels),
             *target.pip_args(), *pins], f"downloading the wheels for target {target.name}")
        install_from_cache(target, pins, wheels, stage)
        tmp = lock_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "target": target.name, "pins": pins,
                                   "resolved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                  indent=2) + "\n")
        os.replace(tmp, lock_file)
        return pins


# --- the build -----------------------------------------------------------------

def add_packages(spec: Spec, stage: Path) -> None:
    for package in spec.packages:
        src = spec.base / package
        if not (src / "__init__.py").is_file():
            raise BuildError(f"{src}: not a package (no __init__.py)", 2)
        dest = stage / package
        if dest.exists():
            raise BuildError(f"a dependency also installs a top-level {package!r}")
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo"))


def check_tools() -> None:
    """Fail before any download if this interpreter cannot do the build."""
    for module, hint in (("pip", "python3 -m ensurepip"),
                         ("shiv", "pip install shiv==1.0.8 (setup.cfg's test extra)")):
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"{module} is not installed for {sys.executable}: {hint}; "
                             "or run this script with the venv's python (.venv/bin/python)")


def run_shiv(spec: Spec, stage: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    cmd = [sys.executable, "-m", "shiv", "--site-packages", str(stage),
           "--entry-point", spec.entry_point, "--python", spec.interpreter,
           "--output-file", str(partial),
           "--compressed" if spec.compressed else "--uncompressed"]
    if spec.reproducible:
        cmd.append("--reproducible")
    if spec.compile_pyc:
        cmd.append("--compile-pyc")
    if spec.root:
        cmd += ["--root", spec.root]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise BuildError(f"shiv failed (exit {proc.returncode}):\n{proc.stdout.strip()}")
    os.replace(partial, out)  # a running copy of the old file keeps its inode


def build(spec: Spec, target: Target, out: Path, refresh: bool = False) -> Path:
    started = time.monotonic()
    check_tools()
    requirements = load_requirements()
    version = package_version(spec, spec.entry_point.split(".")[0].split(":")[0])
    log(f"target {target.name}: {target.summary()}")
    with tempfile.TemporaryDirectory(prefix=f"ondemand-pyz-{target.name}-") as tmp:
        work = Path(tmp)
        stage = work / "site-packages"
        stage.mkdir()
        pins = stage_dependencies(target, requirements, stage, work, refresh)
        log(f"bundling: {' '.join(pins)}")
        add_packages(spec, stage)
        run_shiv(spec, stage, out)
    size = out.stat().st_size
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    try:
        shown = out.resolve().relative_to(Path.cwd())
    except ValueError:
        shown = out
    log(f"built {shown}: ondemand {version}, {size / 2**20:.1f} MiB ({size} bytes), "
        f"sha256 {digest[:16]}, {time.monotonic() - started:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build_pyz.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=NATIVE, help="a [targets.NAME] of the spec (default: native)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="the spec file (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="output path (default: the spec's output for the target)")
    parser.add_argument("--refresh", action="store_true",
                        help="resolve and download again instead of using the cached resolution")
    parser.add_argument("--list", action="store_true", help="list the spec's targets and exit")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec.resolve())
        if args.list:
            for name, listed in spec.targets.items():
                print(f"{name:16} {listed.description}")
            return 0
        target = spec.targets.get(args.target)
        if target is None:
            raise BuildError(f"unknown target {args.target!r}; the spec has: "
                             f"{', '.join(spec.targets)}", 2)
        out = args.out.resolve() if args.out else spec.output_for(target)
        build(spec, target, out, refresh=args.refresh)
        return 0
    except BuildError as exc:
        print(f"build_pyz: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
