"""The zipapp's spec (ondemand.pyz.spec), read and checked: its [zipapp] and [shiv] tables and its
targets, each the pip flags and environment markers of one interpreter (scripts/build_pyz.py)."""
from __future__ import annotations

import platform
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = ROOT / "ondemand.pyz.spec"
NATIVE = "native"


class BuildError(Exception):
    """A failure with a message for the user. code 1 means the build failed,
    2 means bad usage or a bad spec."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclass
class Target:
    name: str
    description: str = ""
    python: str | None = None          # "3.12"; None for native
    implementation: str = "cp"
    abi: str = ""
    machine: str = ""
    platforms: list[str] = field(default_factory=list)

    @property
    def cross(self) -> bool:
        return self.python is not None

    def pip_args(self) -> list[str]:
        """The pip flags that select wheels for this target ([] for native)."""
        if self.python is None:  # native
            return []
        args = ["--python-version", self.python, "--implementation", self.implementation,
                "--abi", self.abi]
        for tag in self.platforms:
            args += ["--platform", tag]
        return args

    def marker_environment(self) -> dict[str, str] | None:
        """What environment markers see on the target (None: this interpreter)."""
        if self.python is None:  # native
            return None
        full = f"{self.python}.0"
        return {
            "implementation_name": "cpython",
            "implementation_version": full,
            "platform_python_implementation": "CPython",
            "python_version": self.python,
            "python_full_version": full,
            "platform_machine": self.machine,
            "platform_system": "Linux",
            "sys_platform": "linux",
            "os_name": "posix",
            "platform_release": "",
            "platform_version": "",
        }

    def identity(self) -> dict[str, object]:
        """What the cached resolution depends on besides the requirements."""
        if self.cross:
            return {"python": self.python, "implementation": self.implementation,
                    "abi": self.abi, "machine": self.machine, "platforms": self.platforms}
        return {"python": sys.version, "implementation": sys.implementation.cache_tag,
                "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
                "platform": sysconfig.get_platform(), "machine": platform.machine(),
                "libc": list(platform.libc_ver())}

    def summary(self) -> str:
        if not self.cross:
            return (f"{sys.implementation.name} {platform.python_version()} "
                    f"on {sysconfig.get_platform()} ({sys.executable})")
        return (f"CPython {self.python} ({self.abi}) on {self.machine}, "
                f"platform tags {self.platforms[0]} .. {self.platforms[-1]}")


@dataclass
class Spec:
    path: Path
    entry_point: str
    interpreter: str
    packages: list[str]
    output: str
    target_output: str
    compressed: bool
    reproducible: bool
    compile_pyc: bool
    root: str
    targets: dict[str, Target]

    @property
    def base(self) -> Path:
        return self.path.parent

    def output_for(self, target: Target) -> Path:
        rel = self.output if target.name == NATIVE else self.target_output.format(target=target.name)
        return self.base / rel


_SPEC_KEYS: dict[str, dict[str, type]] = {
    "zipapp": {"entry_point": str, "interpreter": str, "packages": list, "output": str,
               "target_output": str},
    "shiv": {"compressed": bool, "reproducible": bool, "compile_pyc": bool, "root": str},
}
_TARGET_KEYS: dict[str, type] = {"description": str, "python": str, "implementation": str,
                                 "abi": str, "machine": str, "platforms": list}


def _bad(path: Path, message: str) -> BuildError:
    return BuildError(f"{path}: {message}", 2)


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: tomli, if this interpreter has it
        try:
            import tomli as tomllib
        except ImportError:
            raise BuildError("reading the spec needs Python >= 3.11 (tomllib) or the tomli package",
                             2) from None
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise BuildError(f"{path}: no such spec file", 2) from None
    except tomllib.TOMLDecodeError as exc:
        raise _bad(path, f"not valid TOML: {exc}") from None


def load_spec(path: Path) -> Spec:
    raw = _read_toml(path)
    unknown = set(raw) - set(_SPEC_KEYS) - {"targets"}
    if unknown:
        raise _bad(path, f"unknown table(s): {', '.join(sorted(unknown))}")
    values = _tables(path, raw)
    mod, sep, fn = values["entry_point"].partition(":")
    if not sep or not all(p.isidentifier() for p in mod.split(".") + fn.split(".")):
        raise _bad(path, f"[zipapp] entry_point {values['entry_point']!r}: expected 'module:function'")
    if not values["packages"] or not all(isinstance(p, str) and p.isidentifier()
                                         for p in values["packages"]):
        raise _bad(path, "[zipapp] packages: expected a non-empty list of package names")
    if "{target}" not in values["target_output"]:
        raise _bad(path, "[zipapp] target_output must contain {target}")

    targets_raw = raw.get("targets")
    if not isinstance(targets_raw, dict) or NATIVE not in targets_raw:
        raise _bad(path, f"missing [targets.{NATIVE}]")
    targets = {name: _target(path, name, t) for name, t in targets_raw.items()}
    return Spec(path=path, targets=targets, **values)


def _tables(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The Spec fields, each checked against _SPEC_KEYS."""
    values: dict[str, Any] = {}
    for table, keys in _SPEC_KEYS.items():
        section = raw.get(table)
        if not isinstance(section, dict):
            raise _bad(path, f"missing table [{table}]")
        extra = set(section) - set(keys)
        if extra:
            raise _bad(path, f"[{table}]: unknown key(s): {', '.join(sorted(extra))}")
        for key, typ in keys.items():
            if key not in section:
                raise _bad(path, f"[{table}]: missing {key}")
            if not isinstance(section[key], typ):
                raise _bad(path, f"[{table}] {key}: expected {typ.__name__}")
            values[key] = section[key]
    return values


def _target(path: Path, name: str, t: Any) -> Target:
    """The table [targets.NAME], checked."""
    where = f"[targets.{name}]"
    if not isinstance(t, dict):
        raise _bad(path, f"{where}: expected a table")
    extra = set(t) - set(_TARGET_KEYS)
    if extra:
        raise _bad(path, f"{where}: unknown key(s): {', '.join(sorted(extra))}")
    for key, typ in _TARGET_KEYS.items():
        if key in t and not isinstance(t[key], typ):
            raise _bad(path, f"{where} {key}: expected {typ.__name__}")
    if name == NATIVE:
        if set(t) - {"description"}:
            raise _bad(path, f"{where}: native takes only a description; it is this interpreter")
        return Target(name, t.get("description", ""))
    missing = [k for k in ("python", "abi", "machine", "platforms") if k not in t]
    if missing:
        raise _bad(path, f"{where}: missing {', '.join(missing)}")
    python: str = t["python"]  # present and a str: checked against _TARGET_KEYS above
    target = Target(name, t.get("description", ""), python, t.get("implementation", "cp"),
                    t["abi"], t["machine"], list(t["platforms"]))
    if not re.fullmatch(r"3\.\d+", python):
        raise _bad(path, f"{where} python: expected 'X.Y', got {python!r}")
    if target.implementation != "cp":
        raise _bad(path, f"{where} implementation: only 'cp' (CPython) is supported")
    if target.abi != "cp" + python.replace(".", ""):
        raise _bad(path, f"{where} abi {target.abi!r} does not match python {python}")
    if not target.platforms:
        raise _bad(path, f"{where} platforms: empty")
    for tag in target.platforms:
        if not isinstance(tag, str) or not tag.endswith("_" + target.machine):
            raise _bad(path, f"{where} platforms: {tag!r} is not a tag for {target.machine}")
    return target
