"""Imports flow one way: request → gateway → controller → deployer → backends.
A module that reaches backwards is a sign the design wants a change (README, Layout).
The leaves (errors, events, tasks, ...) import nothing of ours; config only errors;
dockerapi holds every aiodocker call and is used by backends.docker, peers and doctor."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "ondemand"

# What each module may import from the package. Only app (the composition) and
# cli (the edge) may import everything.
ALLOWED = {
    "model": set(), "placement": {"model"}, "errors": set(), "config": {"errors"}, "events": {"model"}, "tasks": set(),
    "paths": {"errors"}, "keys": {"errors", "events"}, "ratelimit": set(), "peers": {"dockerapi", "errors"},
    "dockerapi": set(), "notice": set(), "forward": {"http.headers"}, "migrations": set(),
    # The HTTP layer (design.md, "The HTTP layer"): the errors' one renderer, nothing else of ours.
    "http": {"http.cycle", "http.limits"}, "http.limits": set(), "http.flow_control": set(), "http.body": set(),
    "http.headers": set(), "http.refusals": {"errors"}, "http.cycle": {"http.flow_control", "http.protocol"},
    "http.protocol": {"http.cycle", "http.flow_control", "http.headers", "http.refusals",
                      "http.server"},  # (server for types only)
    "http.aio": {"errors", "http.limits", "http.refusals"}, "http.pool": {"http.connection"}, "http.connection": {"http.body", "http.headers"},
    "http.server": {"http.aio", "http.caps", "http.cycle", "http.limits", "http.protocol", "http.refusals"},
    "http.caps": {"http.limits", "http.refusals"},
    "store": {"errors", "migrations"},
    "budget": {"config", "errors", "model", "placement"}, "metrics": {"model"}, "eviction": set(), "queue": set(),
    # What an engine runs (command line, environment, mounts): derived from the deployment and the box.
    "recipes": {"checkpoint", "config", "model", "warmth"},
    # Reads a checkpoint's safetensors headers and config.json on this host: the standard library only.
    "checkpoint": set(),
    # Pure as recipes: how deep an idle engine sleeps, and the engines' sleep and wake calls.
    "warmth": {"model"},
    "backends": {"errors", "model", "recipes"}, "backends.process": {"backends", "model", "recipes", "tasks"},
    "backends.docker": {"backends", "dockerapi", "model", "recipes"},
    "deployer": {"backends", "budget", "errors", "events", "model", "recipes", "store", "tasks", "warmth"},
    # The decision core sees the world only through its Effects protocol.
    "controller": {"errors", "eviction", "model", "placement", "queue"},
    # Measures engines (budget's nvidia-smi, the backend's pids) and tells the deployer.
    "footprint": {"budget", "deployer", "model"},
    "effects": {"budget", "controller", "deployer", "errors", "events", "metrics", "model", "tasks", "warmth"},
    "admission": {"controller", "deployer", "errors", "model"},
    "reaper": {"controller"},
    "gateway": {"admission", "notice", "controller", "deployer", "errors", "exchange", "forward", "http.cycle",
                "http.headers", "http.pool",
                "keys", "model", "paths", "ratelimit"},
    # A finished gateway request (leaf), and what hears of it: the metrics and the access log.
    "exchange": set(), "telemetry": {"events", "exchange", "model"}, "accesslog": {"exchange"},
    "litellm": {"errors", "http.headers", "keys"}, "litellm_sync": {"litellm", "tasks"},
    "components": {"accesslog", "admission", "config", "controller", "deployer", "effects", "events", "footprint",
                   "gateway", "keys", "litellm_sync", "metrics", "model", "peers", "recipes", "starts", "store", "tasks", "warmth",
                   "telemetry"},
    "starts": {"model", "store", "tasks"},
    "admin": {"backends", "components", "keys", "config", "deployer", "errors", "events", "http.aio", "http.headers",
              "http.server", "metrics", "model", "recipes", "telemetry", "warmth"},
    "sim": {"sim.engine"}, "sim.engine": set(),
    # The command line's parts (cli itself may import everything).
    "adminclient": {"config", "store"},
    # recipes: the images the deployments run, and the checks of a deployment against the box.
    "doctor": {"adminclient", "budget", "config", "dockerapi", "keys", "litellm", "metrics", "model", "recipes"},
}


def ours(path: pathlib.Path) -> set[str]:
    mod = ".".join(path.relative_to(PKG).with_suffix("").parts)
    package = mod.rsplit(".", 1)[0] if "." in mod else ""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
            base = [b for b in base if b]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:
                found |= {".".join(base + [a.name]) for a in node.names}
            else:
                found.add(target)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ondemand"):
            found.add(node.module.removeprefix("ondemand").lstrip("."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ondemand.") for a in node.names if a.name.startswith("ondemand.")}
    modules = {".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
               for p in PKG.rglob("*.py")}
    return {f for f in found if f in modules}


def test_imports_flow_one_way():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        if mod in ("app", "cli", "__main__", "__init__"):
            continue
        assert mod in ALLOWED, f"new module {mod}: say in ALLOWED what it may import"
        extra = ours(path) - ALLOWED[mod]
        if extra:
            bad.append(f"{mod} imports {sorted(extra)}")
    assert bad == []


def test_dockerapi_is_a_leaf_for_docker_backend_peers_and_doctor():
    assert ALLOWED["dockerapi"] == set()
    users = set()
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        if "dockerapi" in ours(path):
            users.add(mod)
    assert users <= {"backends.docker", "peers", "doctor"}, users


def test_aiodocker_is_used_in_dockerapi_only():
    for path in PKG.rglob("*.py"):
        if path.name == "dockerapi.py":
            continue
        tree = ast.parse(path.read_text())
        used = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "aiodocker" not in used, f"{path.relative_to(PKG)} imports aiodocker: use ondemand.dockerapi"


def test_only_the_composition_reads_the_environment():
    for path in PKG.rglob("*.py"):
        # config reads it once; the simulator (sim/) is a program of its own; the process
        # backend hands it on to the engines it starts (their PATH, CUDA_VISIBLE_DEVICES ...).
        name = path.relative_to(PKG).as_posix()
        if name in ("config.py", "backends/process.py") or name.startswith("sim/"):
            continue
        assert "os.environ" not in path.read_text(), path.name


MAX_FUNCTION_LINES = 60


def test_no_long_function_without_a_reason():
    """A function over 60 lines (from its first decorator to its last line) is split into
    named steps, or says why it stays whole: a comment starting with ``# Long:`` on the
    line right above it (above its decorators, if any)."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            above = lines[start - 2].strip() if start >= 2 else ""
            if length > MAX_FUNCTION_LINES and not above.startswith("# Long:"):
                long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({length} lines)")
    assert long == [], "split these, or say why above them with '# Long: ...'"


# aiohttp's public surface (its documentation's modules); anything else is its inside (issue 23).
AIOHTTP_PUBLIC = {"aiohttp", "aiohttp.web", "aiohttp.typedefs", "aiohttp.hdrs", "aiohttp.abc"}


def _aiohttp_private_names() -> set[str]:
    """The underscore attributes of aiohttp's classes that ondemand meets: its server's,
    runner's, connection's, request's, response's, client's and streams'."""
    import aiohttp
    from aiohttp import web
    names: set[str] = set()
    for cls in (web.Application, web.AppRunner, web.Server, web.RequestHandler, web.BaseRequest, web.Request,
                web.StreamResponse, web.Response, aiohttp.ClientSession, aiohttp.ClientResponse,
                aiohttp.StreamReader, aiohttp.TCPConnector):
        for klass in cls.__mro__:
            if klass.__module__.startswith("aiohttp"):
                names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
                names |= {n for n in getattr(klass, "__slots__", ()) if n.startswith("_") and not n.startswith("__")}
    return names


def test_no_aiohttp_private_module_attribute_or_class_swap():
    """A connection belongs to one stack; nothing reaches into aiohttp (STYLE.md, habit 13):
    no import of its private modules (``aiohttp.web_protocol``, ``aiohttp.http_parser`` ...),
    no underscore attribute of aiohttp's that ondemand does not define itself, no class swap,
    and no override of aiohttp's underscore methods in a subclass."""
    private = _aiohttp_private_names()
    trees = {p: ast.parse(p.read_text()) for p in PKG.rglob("*.py")}
    ours = set()  # underscore attributes and methods of ondemand's own classes (not aiohttp's subclasses)
    for tree in trees.values():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or any(ast.unparse(b).startswith(("web.", "aiohttp."))
                                                        for b in cls.bases):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    ours.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    ours.add(node.name)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    ours.add(node.value)  # __slots__
    bad = []
    for path, tree in trees.items():
        where = path.relative_to(PKG).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aiohttp") \
                    and node.module not in AIOHTTP_PUBLIC:
                bad.append(f"{where}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                        if a.name.startswith("aiohttp") and a.name not in AIOHTTP_PUBLIC]
            elif isinstance(node, ast.Attribute):
                if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                    bad.append(f"{where}:{node.lineno} swaps a class")
                elif node.attr == "transport" and isinstance(node.ctx, ast.Store) \
                        and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    bad.append(f"{where}:{node.lineno} sets another object's transport")
                elif node.attr in private and node.attr not in ours:
                    bad.append(f"{where}:{node.lineno} touches aiohttp's {node.attr}")
                elif node.attr in private and isinstance(node.value, ast.Name) and node.value.id in ("super",):
                    bad.append(f"{where}:{node.lineno} calls aiohttp's {node.attr}")
            elif isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if any(b.startswith(("web.", "aiohttp.")) for b in bases):
                    # None of aiohttp's underscore methods, and no underscore method of its own
                    # (it could meet one of aiohttp's in its next version).
                    bad += [f"{where}:{f.lineno} defines {f.name} in a subclass of aiohttp's" for f in node.body
                            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and f.name.startswith("_") and not f.name.startswith("__")]
    assert bad == []


def test_the_http_package_is_small_modules():
    """http/: each module named after a noun and under 400 lines (issue 23), so that none
    grows into the one room everything passes through again."""
    big = {p.name: n for p in (PKG / "http").glob("*.py") if (n := len(p.read_text().splitlines())) >= 400}
    assert big == {}, f"split these: {big}"
