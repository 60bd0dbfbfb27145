"""The zipapp: scripts/build_pyz.py builds what ondemand.pyz.spec says, and
the result runs with nothing but a python3 of its version.

Every test here is marked slow (make test-all, CI): building the zipapp is
the fast suite's largest single cost (about 15 s of a core on a fresh clone,
twice for the byte-identical rebuild), and make test on two cores with one of
them busy must stay within its three minutes. The native build's wheels come
from the build cache (${ONDEMAND_CACHE:-~/.cache/ondemand}/wheels/native)
after the first build; the cross builds download another platform's wheels on
their first run (about 12-21 s).

Each zipapp runs in a clean environment: a PATH holding only a `python3` (the
base interpreter, outside any venv) and /usr/bin:/bin, no PYTHONPATH, HOME and
SHIV_ROOT in the test's tmp dir, and cwd in tmp. So it cannot import the
source tree or the venv, and the probe below checks that it did not.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow

BUILD = ROOT / "scripts" / "build_pyz.py"
SOURCE_VERSION = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""",
                           (ROOT / "ondemand" / "__init__.py").read_text(), re.M).group(1)

# Runs inside the zipapp (SHIV_INTERPRETER=1 ... -c PROBE). It reports which
# loop the CLI's runner gives a coroutine, and where the modules came from.
PROBE = r"""
import asyncio, json, sys
import aiohttp, click, orjson, uvloop, ondemand, ondemand.cli.shared as cli

async def loop_type():
    loop = asyncio.get_running_loop()
    return type(loop).__module__ + "." + type(loop).__qualname__

print(json.dumps({
    "loop": cli._run(loop_type()),
    "files": {m.__name__: m.__file__ for m in (aiohttp, click, orjson, uvloop, ondemand)},
    "version": ondemand.__version__,
    "python": "%d.%d" % sys.version_info[:2],
}))
"""


def _base_python() -> str:
    """The interpreter behind this venv: it has the zipapp's Python version
    and none of the project's dependencies."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if Path(base).exists() else sys.executable


def _find_python(version: str) -> str | None:
    """A working pythonX.Y on this machine, or None."""
    candidates = [shutil.which(f"python{version}"), f"/usr/bin/python{version}",
                  *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    return None


def _build_module():
    spec = importlib.util.spec_from_file_location("build_pyz", BUILD)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return sys.modules[spec.name]


_NETWORK_TROUBLE = re.compile(
    r"NewConnectionError|connection broken|Could not fetch URL|ConnectTimeout|ReadTimeout|"
    r"Read timed out|Name or service not known|Temporary failure in name resolution|"
    r"Network is unreachable|ProxyError|SSLError")


def _registry_problem(target: str) -> str | None:
    """Why pip cannot reach the registry for this target's wheels, or None if
    it can. It downloads one platform-specific wheel for the target, bypassing
    pip's cache, and blames the network only if pip's output says so: a build
    that fails for any other reason fails the test."""
    build_pyz = _build_module()
    pin = next(r for r in build_pyz.load_requirements() if r.startswith("uvloop=="))
    pip_args = build_pyz.load_spec(build_pyz.DEFAULT_SPEC).targets[target].pip_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                               "--only-binary", ":all:", "--dest", tmp, *pip_args, pin],
                              capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    trouble = _NETWORK_TROUBLE.search(output)
    if proc.returncode == 0 or not trouble:
        return None
    line = next(ln for ln in output.splitlines() if trouble.group(0) in ln)
    return line.strip()[:300]


def build(tmp_path_factory, target: str) -> Path:
    out = tmp_path_factory.mktemp(f"pyz-{target}") / f"ondemand-{target}.pyz"
    proc = subprocess.run([sys.executable, str(BUILD), "--target", target, "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode != 0:
        problem = _registry_problem(target)
        if problem is not None:
            pytest.skip(f"pip cannot reach the package registry for {target}: {problem}")
        pytest.fail(f"build_pyz.py --target {target} failed (exit {proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}")
    assert out.is_file(), proc.stdout
    assert f"built {out}" in proc.stdout  # it says what it built
    return out


class Sandbox:
    """Runs a zipapp as a user would on a machine with only Python."""

    def __init__(self, root: Path, python: str):
        self.root = root
        self.home = root / "home"
        self.shiv_root = root / "shiv"
        self.bin = root / "bin"
        for d in (self.home, self.bin):
            d.mkdir(parents=True, exist_ok=True)
        (self.bin / "python3").symlink_to(python)
        self.env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home),
                    "SHIV_ROOT": str(self.shiv_root), "LANG": "C.UTF-8"}

    def run(self, pyz: Path, *args: str, direct: bool = False, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        # direct: exec the file itself, so its `#!/usr/bin/env python3` line picks bin/python3
        cmd = [str(pyz), *args] if direct else [str(self.bin / "python3"), str(pyz), *args]
        proc = subprocess.run(cmd, cwd=self.root, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=120)
        if check:
            assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def probe(self, pyz: Path) -> dict:
        proc = self.run(pyz, "-c", PROBE, env={"SHIV_INTERPRETER": "1"})
        return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_demo_and_chat(sandbox: Sandbox, pyz: Path) -> dict:
    """`serve --demo` from the zipapp (process backend, engines are the zipapp's own
    simulator), then one chat through the gateway: a cold start and a forwarded answer."""
    import signal
    import socket
    import time
    import urllib.error
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = sandbox.root / "demo-state"
    config = sandbox.root / "demo.toml"
    config.write_text(f'state_dir = "{state}"\nlisten = "127.0.0.1:{port}"\n'
                      'ondemand_allowed_cidrs = ["127.0.0.0/8"]\nshutdown_grace_s = 2\n'
                      '[budget]\nsource = "static"\ncapacity_gib = 24\n'
                      '[deployer]\nbackend = "process"\nstart_timeout_s = 60\n'
                      '[deployer.commands]\nvllm = ["ondemand", "sim-engine"]\n')  # the demo's recipe
    proc = subprocess.Popen([str(sandbox.bin / "python3"), str(pyz), "--config", str(config), "serve", "--demo"],
                            cwd=sandbox.root, env=sandbox.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        body = json.dumps({"model": "demo-small", "messages": [{"role": "user", "content": "hi"}]}).encode()
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/dgxmm/ondemand/1/v1/chat/completions", data=body,
                    headers={"Authorization": f"Bearer {(state / 'ondemand.key').read_text().strip()}",
                             "Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    return json.loads(r.read())
            except (FileNotFoundError, ConnectionError, urllib.error.URLError) as exc:
                if isinstance(exc, urllib.error.HTTPError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # not listening yet: the poll interval of this (synchronous) wait
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0, proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def so_names(pyz: Path) -> list[str]:
    with zipfile.ZipFile(pyz) as zf:
        return [n for n in zf.namelist() if n.endswith(".so")]


# --- the native zipapp -------------------------------------------------------------

@pytest.fixture(scope="module")
def native_pyz(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "native")


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(tmp_path, _base_python())


def test_help_lists_the_commands(native_pyz, sandbox):
    assert os.access(native_pyz, os.X_OK)
    with open(native_pyz, "rb") as fh:
        assert fh.readline() == b"#!/usr/bin/env python3\n"
    out = sandbox.run(native_pyz, "--help", direct=True).stdout
    commands = re.search(r"^Commands:\n((?:  .*\n?)+)", out, re.M)
    assert commands, out
    names = {line.split()[0] for line in commands.group(1).splitlines()}
    assert {"serve", "key", "migrate"} <= names, out
    assert sandbox.run(native_pyz, "--version").stdout.strip() == f"ondemand, version {SOURCE_VERSION}"


def test_key_init_then_show(native_pyz, sandbox, tmp_path):
    state = tmp_path / "state"
    config = tmp_path / "ondemand.toml"
    config.write_text(f'state_dir = "{state}"\n')
    init = json.loads(sandbox.run(native_pyz, "--config", str(config), "key", "init", "--json").stdout)
    show = sandbox.run(native_pyz, "--config", str(config), "key", "show").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{12}", show), show
    assert show == init["fingerprint"]
    key_file = Path(init["file"])
    assert key_file.parent == state
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # a second init refuses to overwrite, with the CLI's exit code 1
    again = sandbox.run(native_pyz, "--config", str(config), "key", "init", check=False)
    assert again.returncode == 1 and "already holds a key" in again.stderr


def test_serves_the_demo_through_the_gateway(native_pyz, sandbox):
    answer = serve_demo_and_chat(sandbox, native_pyz)
    assert answer["object"] == "chat.completion" and answer["model"] == "demo-small"


def test_runs_on_uvloop_from_its_own_site_packages(native_pyz, sandbox):
    suffix = sysconfig.get_config_var("EXT_SUFFIX")  # the base python has the same one
    names = so_names(native_pyz)
    assert f"site-packages/uvloop/loop{suffix}" in names, names
    assert f"site-packages/orjson/orjson{suffix}" in names, names

    report = sandbox.probe(native_pyz)
    assert report["loop"] == "uvloop.Loop"
    assert report["version"] == SOURCE_VERSION
    for module, path in report["files"].items():
        assert Path(path).is_relative_to(sandbox.shiv_root), f"{module} came from {path}"
    # extracted once, under SHIV_ROOT, named after the file and its build id
    extracted = [p.name for p in sandbox.shiv_root.iterdir() if p.is_dir()]
    assert len(extracted) == 1 and extracted[0].startswith(native_pyz.name + "_"), extracted


def test_zip_holds_the_package_without_bytecode(native_pyz):
    with zipfile.ZipFile(native_pyz) as zf:
        names = zf.namelist()
        env = json.loads(zf.read("environment.json"))
    assert env["entry_point"] == "ondemand.cli:main"
    assert env["reproducible"] is True
    assert "site-packages/ondemand/__init__.py" in names
    assert "site-packages/ondemand/cli/__init__.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_rebuild_is_byte_identical(native_pyz, tmp_path_factory):
    assert build(tmp_path_factory, "native").read_bytes() == native_pyz.read_bytes()


# --- cross builds -------------------------------------------------------------------

def test_cross_build_for_dgx_spark_holds_aarch64_cp312_wheels(tmp_path_factory):
    pyz = build(tmp_path_factory, "py312-aarch64")
    names = so_names(pyz)
    for module in ("uvloop/loop", "orjson/orjson", "aiohttp/_http_parser"):
        assert f"site-packages/{module}.cpython-312-aarch64-linux-gnu.so" in names, names
    wrong = [n for n in names if "aarch64" not in n or "x86_64" in n
             or ("cpython-3" in n and "cpython-312-" not in n)]
    assert not wrong, wrong
    with zipfile.ZipFile(pyz) as zf:
        listing = zf.namelist()
        assert json.loads(zf.read("environment.json"))["entry_point"] == "ondemand.cli:main"
    assert "site-packages/ondemand/__init__.py" in listing
    # 3.12 has tomllib: the `python_version < "3.11"` pins are not bundled
    assert not [n for n in listing if n.startswith(("site-packages/tomli/", "site-packages/async_timeout/"))]


def test_cross_build_for_python310_bundles_its_markers_and_runs(tmp_path_factory, tmp_path):
    """Built by this (newer) Python for 3.10: pip alone would drop tomli and
    async-timeout, whose markers it evaluates for the building interpreter."""
    pyz = build(tmp_path_factory, "py310-x86_64")
    with zipfile.ZipFile(pyz) as zf:
        listing = zf.namelist()
    assert "site-packages/tomli/__init__.py" in listing
    assert "site-packages/async_timeout/__init__.py" in listing
    assert "site-packages/uvloop/loop.cpython-310-x86_64-linux-gnu.so" in listing

    python310 = _find_python("3.10")
    if python310 is None:
        pytest.skip("no python3.10 on this machine to run the py310 zipapp with")
    sandbox = Sandbox(tmp_path, python310)
    assert "serve" in sandbox.run(pyz, "--help", direct=True).stdout
    config = tmp_path / "ondemand.toml"  # read with tomli on 3.10
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    sandbox.run(pyz, "--config", str(config), "key", "init")
    assert re.fullmatch(r"[0-9a-f]{12}", sandbox.run(pyz, "--config", str(config), "key", "show").stdout.strip())
    report = sandbox.probe(pyz)
    assert report["python"] == "3.10" and report["loop"] == "uvloop.Loop"
    # The whole path on 3.10: controller, process backend, the gateway's engine pool.
    answer = serve_demo_and_chat(sandbox, pyz)
    assert answer["object"] == "chat.completion" and answer["model"] == "demo-small"
