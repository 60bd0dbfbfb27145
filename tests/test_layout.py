"""Imports flow one way: request → gateway → control → engines → backends → the engine.
A module that reaches backwards is a sign the design wants a change (README, Layout).
The leaves (errors, events, tasks, ...) import nothing of ours; config only errors;
engines/dockerapi holds every aiodocker call and is used by the docker backend, the peers and doctor."""
import ast
import functools
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parent.parent / "ondemand"

# What each module may import from the package. Only app (the composition) and
# cli (the edge) may import everything. Grouped by package, in the order data flows:
# a request → gateway → control → engines → backends → the engine.
ALLOWED = {
    # At the top: what everyone shares.
    "model": set(), "errors": set(), "files": set(), "ratelog": set(), "config": {"errors"}, "events": {"model"}, "tasks": set(),
    # The HTTP layer (design.md, "The HTTP layer"): the errors' one renderer, nothing else of ours.
    "http": {"http.cycle", "http.limits"}, "http.limits": set(), "http.flow_control": set(), "http.body": set(),
    "http.headers": set(), "http.refusals": {"errors", "http.limits", "ratelog"}, "http.cycle": {"http.flow_control", "http.limits", "http.protocol"},
    "http.protocol": {"errors", "http.caps", "http.cycle", "http.flow_control", "http.front", "http.headers",
                      "http.linger", "http.refusals"},  # (front for types only)
    # What the front serves and its connections share; no aiohttp (aio for types only).
    "http.front": {"http.aio", "http.caps", "http.cycle", "http.limits", "http.protocol", "http.refusals"},
    "http.aio": {"errors", "http.caps", "http.limits", "http.refusals"}, "http.pool": {"http.connection", "http.limits"},
    "http.connection": {"http.body", "http.flow_control", "http.headers", "http.limits"},
    "http.server": {"http.aio", "http.caps", "http.front", "http.limits", "http.protocol"},
    "http.caps": {"http.limits", "http.refusals", "ratelog"}, "http.forward": {"http.headers"}, "http.linger": {"http.limits"},
    # gateway/: the routes and their checks.
    "gateway": set(),
    # The pipeline (checks, body, admission, answer): the deployments it knows are the admission's.
    "gateway.routes": {"control.admission", "errors", "gateway.answers", "gateway.exchange",
                       "gateway.keys", "gateway.notice", "gateway.paths", "gateway.ratelimit", "http.cycle",
                       "http.headers", "http.limits", "http.pool", "model"},
    # The answer kinds, each with its exchange with the engine.
    "gateway.answers": {"control.admission", "errors", "gateway.notice", "http.cycle", "http.forward", "http.limits",
                        "http.pool"},
    "gateway.paths": {"errors"}, "gateway.keys": {"errors", "events", "files"}, "gateway.ratelimit": set(),
    "gateway.peers": {"engines.dockerapi", "errors"}, "gateway.notice": set(),
    # A finished gateway request (leaf), and what hears of it: the metrics and the access log.
    "gateway.exchange": set(), "gateway.accesslog": {"gateway.exchange"},
    # control/: the decision core sees the world only through its Effects protocol.
    "control": set(),
    # The decision core: the coordinator and its parts (design.md, "The decision core").
    "control.controller": {"control.attempts", "control.keepwarm", "control.modes", "control.protocol",
                           "control.queue", "control.record", "control.rhythm", "control.scheduler", "control.slots",
                           "control.ticket", "control.verdicts", "control.warmth_policy", "engines.tiers", "errors",
                           "model"},
    # The slots part: records, slots, waiters, drains, backoff, idle gaps, the idle rule, counters.
    "control.slots": {"control.protocol", "control.record", "control.rhythm", "control.verdicts",
                      "control.warmth_policy", "errors", "model"},
    # The start side: each deployment's attempt, make-room for the queue's head, the queue's clock.
    "control.attempts": {"control.eviction", "control.placement", "control.protocol", "control.record", "control.relocation",
                         "control.scheduler", "control.slots", "control.verdicts", "errors", "model"},
    # The scheduler: the queue's order and holds, make-room's victims, placement (one class each).
    "control.scheduler": {"control.cost", "control.eviction", "control.placement", "control.queue", "control.record",
                          "control.value",
                          "control.warmth_policy", "model"},
    "control.value": {"control.record", "control.rhythm", "control.warmth_policy", "model"},
    "control.relocation": {"control.placement", "model"},
    # Make-room by cost (scheduler = "cost"): the take rule, pure; the core through its CoreView.
    "control.cost": {"control.rhythm", "model"},
    # How long an idle engine stays warm, per deployment: the policy's protocol and Fixed ...
    "control.warmth_policy": {"control.record", "model"},
    # ... and Adaptive: each idle period's plan (control.rhythm's), the pre-warm.
    "control.keepwarm": {"control.record", "control.rhythm", "control.slots", "engines.tiers", "engines.warmth",
                         "model"},
    # Adaptive warmth's decision: a deployment's idle gaps and the plan they give (pure; the
    # tiers it may rest in are engines.tiers').
    "control.rhythm": {"engines.tiers"},
    # What the core holds (per deployment, attempt, waiter, slot), its window onto the world,
    # its refusals, and the mode switch's plan.
    "control.record": {"control.protocol", "control.rhythm", "errors"}, "control.protocol": {"model"},
    "control.verdicts": {"control.placement", "control.ticket", "errors", "model"}, "control.modes": {"errors", "model"},
    # What a request is given: its ticket (deployment, upstream target, slot) and the words of its verdict.
    "control.ticket": {"model"},
    "control.placement": {"model"}, "control.eviction": set(), "control.queue": set(),
    "control.reaper": {"control.controller"},
    "control.admission": {"control.controller", "control.ticket", "control.verdicts", "engines.deployer", "errors",
                          "model"},
    "control.effects": {"control.budget", "control.controller", "control.keepwarm", "control.protocol",
                        "control.rhythm", "control.starts", "engines.deployer", "engines.metrics", "engines.warmth",
                        "errors", "events", "model", "tasks"},
    "control.budget": {"config", "control.placement", "errors", "model"},
    # Measures engines (budget's nvidia-smi, the backend's pids) and tells the deployer.
    "control.footprint": {"control.budget", "engines.deployer", "engines.memory", "model"},
    "control.starts": {"engines.tiers", "errors", "events", "state.store", "tasks"},
    # engines/: the deployer and how engines run.
    "engines": set(),
    # The deployer: the registry and the operations on its units (admit a start, stop, sleep, the
    # watchdog), deciding by its rules; the budget (control's) comes through engines.memory's protocol.
    "engines.deployer": {"engines.backends", "engines.client", "engines.memory", "engines.recipes",
                         "engines.registry", "engines.rules", "engines.sleeper", "engines.start", "engines.tiers",
                         "engines.unit", "engines.warmth", "errors", "events", "http.pool", "model", "state.store",
                         "tasks"},
    # The deployer's rules (may it start, approve a stop, which sleep level, a mark's fields, the
    # gates' order): pure, called by the deployer and by the replay's world.
    "engines.rules": {"engines.recipes", "engines.tiers", "engines.warmth", "errors", "model"},
    # What the deployer asks of the memory budget (protocols), and the arithmetic of a measured holding.
    "engines.memory": {"model"},
    # The units and the one writer of their rows (row + event + audit in one transaction); bookings.
    "engines.registry": {"engines.backends", "engines.memory", "engines.recipes", "engines.rules", "engines.start",
                         "engines.unit", "errors", "events", "model", "state.store"},
    # One deployment: its engine, its start, wake, stop, exit and take-back; writes through its owner.
    "engines.unit": {"engines.backends", "engines.client", "engines.readahead", "engines.recipes", "engines.sleeper",
                     "engines.start", "engines.warmth", "events", "model", "tasks"},
    # A start or wake under way (the unit's): its kind, level, beginning, GPUs, phases and caches; the
    # hooks told of a cold start.
    "engines.start": {"engines.backends", "engines.phases", "engines.readahead", "engines.recipes", "events",
                      "model"},
    # The engine calls of a sleep and a wake, and the wake check, beside warmth's rules.
    "engines.sleeper": {"engines.backends", "engines.client", "engines.tiers", "engines.warmth", "model"},
    # The one client to the engines: the traffic's pools (http.pool).
    "engines.client": {"engines.backends", "http.pool"},
    # Around a cold start: the compile cache, the weights read ahead, the phases in the engine's log.
    "engines.startwatch": {"config", "engines.backends", "engines.backends.logs", "engines.compile_cache", "engines.phases",
                           "engines.readahead", "engines.recipes", "engines.start", "engines.unit", "events", "model",
                           "tasks"},
    # Pure: a start's phases from its log lines, and their ETA.
    "engines.phases": set(),
    # One directory per configuration under deployer.compile_cache: the standard library only.
    "engines.compile_cache": set(),
    # A recipe's checkpoint files read into the page cache before its cold start.
    "engines.readahead": {"engines.checkpoint", "model", "tasks"},
    # What an engine runs (command line, environment, mounts): derived from the deployment and the box.
    "engines.recipes": {"config", "engines.checkpoint", "engines.compile_cache", "engines.tiers", "engines.warmth",
                        "model"},
    # Reads a checkpoint's safetensors headers and config.json on this host: the standard library only.
    "engines.checkpoint": set(),
    # The rest tiers, one object each (level, what it holds, the engine calls in and out, what
    # prices coming back), shallow to deep: the one place they are spelled.
    "engines.tiers": {"model"},
    # Pure as recipes: which tier an idle engine goes to, the host reserve's verdict, the wake check.
    "engines.warmth": {"engines.tiers", "model"}, "engines.metrics": {"engines.client", "http.pool", "model"}, "engines.dockerapi": set(),
    "engines.backends": {"engines.recipes", "errors", "model"},
    "engines.backends.process": {"engines.backends", "engines.backends.logs", "engines.backends.ports",
                                 "engines.recipes", "http.limits", "model", "tasks"},
    # The engines' ports, reserved against other pickers until the engine binds.
    "engines.backends.ports": set(),
    # A process engine's log file, its tail and its live followers.
    "engines.backends.logs": {"http.limits", "ratelog"},
    "engines.backends.docker": {"engines.backends", "engines.dockerapi", "engines.recipes", "model"},
    # state/: the SQLite file.
    "state": set(), "state.store": {"errors", "state.lock", "state.migrations"}, "state.migrations": set(),
    "state.retention": {"errors", "state.store"}, "state.lock": {"errors"},
    # litellm/: LiteLLM's admin API and the sync.
    "litellm": set(), "litellm.client": {"errors", "litellm.entries"},
    "litellm.entries": {"gateway.keys", "http.headers"},
    "litellm.sync": {"events", "litellm.client", "litellm.entries", "model", "tasks"},
    # admin/: an edge, as the command line is: the API, the page, the view, /metrics, the socket's client.
    "admin": set(),
    "admin.components": {"admin.telemetry", "config", "control.admission", "control.budget", "control.controller",
                         "control.effects",
                         "control.footprint", "control.starts", "engines.deployer", "engines.metrics",
                         "engines.recipes", "engines.startwatch", "engines.warmth", "events", "gateway.accesslog", "gateway.keys",
                         "gateway.peers", "gateway.routes", "litellm.sync", "model", "state.store", "tasks"},
    "admin.api": {"admin.actions", "admin.components", "admin.deployments", "admin.fields", "admin.replays", "admin.streams",
                  "admin.telemetry", "admin.wire", "config", "control.budget", "engines.deployer", "errors", "gateway.keys",
                  "http.aio", "http.headers", "http.limits", "http.server", "model"},
    "admin.wire": {"admin.components", "errors", "http.aio", "http.server", "model"},
    "admin.replays": {"admin.wire", "errors"},
    "admin.fields": {"config", "engines.recipes", "engines.warmth", "errors", "model"},
    "admin.deployments": {"admin.actions", "admin.components", "admin.fields", "admin.wire", "engines.deployer",
                          "engines.metrics", "engines.warmth", "errors", "model"},
    "admin.actions": {"admin.fields", "admin.wire", "engines.deployer", "engines.tiers", "errors", "model"},
    "admin.streams": {"admin.fields", "admin.wire", "engines.backends", "engines.deployer", "errors", "events",
                      "model"},
    "admin.telemetry": {"events", "gateway.exchange", "model"},
    # The GPU memory the metrics show, read in the background from the budget's snapshot.
    "admin.gpu_memory": {"control.budget", "engines.deployer", "errors", "tasks"},
    "admin.client": {"config", "state.store"},
    # recipes: the images the deployments run, and the checks of a deployment against the box.
    "admin.doctor": {"admin.client", "config", "control.budget", "control.verdicts", "engines.dockerapi",
                     "engines.metrics", "engines.recipes", "gateway.keys", "litellm.client", "model"},
    "sim": {"sim.engine"},
    "sim.engine": {"sim.faults", "sim.generation", "sim.memory", "sim.options", "sim.record", "sim.replies",
                   "sim.routes", "sim.server"},
    "sim.options": set(), "sim.phases": {"sim.options"}, "sim.faults": set(), "sim.record": set(), "sim.replies": set(),
    # Its HTTP: the lean front (http/), through the modules of it that import no aiohttp.
    "sim.server": {"http.cycle", "http.front", "http.limits", "http.refusals", "sim.replies"},
    "sim.memory": {"sim.faults", "sim.options", "sim.record", "sim.replies", "sim.server"},
    "sim.generation": {"sim.faults", "sim.memory", "sim.options", "sim.replies", "sim.server"},
    "sim.routes": {"sim.faults", "sim.generation", "sim.memory", "sim.options", "sim.phases", "sim.record",
                   "sim.replies", "sim.server"},
    # cli/: the command line, an edge (it may import anything).
    "cli.shared": {"admin.client", "config", "engines.recipes", "errors"},
    "cli.views": {"cli.shared", "control.budget", "engines.metrics", "engines.tiers", "engines.warmth", "model"},
    "cli.serve": {"app", "cli.shared", "config", "errors", "gateway.keys", "sim.engine", "state.lock", "state.migrations",
                  "state.store"},
    "cli.deploy": {"admin.client", "cli.shared", "cli.views", "engines.recipes", "model"},
    "cli.warmth": {"cli.deploy", "cli.shared", "cli.views", "engines.tiers"},
    "cli.keys": {"cli.shared", "config", "gateway.keys"},
    "cli.replay": {"cli.shared", "config", "control.budget", "errors", "files", "replay.deployments", "replay.live",
                   "replay.page", "replay.report", "replay.run", "replay.trace", "replay.types"},
    "cli.status": {"admin.client", "admin.doctor", "cli.shared", "cli.views", "model"},
    # replay/: a trace run on a virtual clock through the decision code; an edge like admin.
    "replay": set(), "replay.types": {"config", "engines.tiers", "model", "replay.sketch"},
    "replay.trace": {"replay.types"},
    # The percentiles' sketch (a leaf): memory flat in the trace's length.
    "replay.sketch": set(),
    "replay.deployments": {"config", "control.placement", "control.starts", "engines.tiers", "model", "replay.types",
                           "state.store"},
    "replay.clock": set(),
    "replay.world": {"control.budget", "control.controller", "control.keepwarm", "control.placement", "engines.rules",
                     "engines.tiers", "engines.warmth", "errors", "model", "replay.clock", "replay.engine",
                     "replay.types"},
    # The simulated engine: a KV cache, prefill shared by the engine, decode bounded per engine.
    "replay.engine": {"replay.clock", "replay.types"},
    "replay.flights": {"control.controller", "control.ticket", "errors", "model", "replay.clock", "replay.types",
                       "replay.world"},
    "replay.report": {"replay.sketch", "replay.types"}, "replay.page": {"replay.report", "replay.types"},
    "replay.live": {"engines.backends.ports", "model", "replay.types", "state.store", "tasks"},
    "replay.run": {"control.controller", "control.scheduler", "model", "replay.clairvoyant", "replay.clock", "replay.flights",
                   "replay.types", "replay.world"},
    # The clairvoyant reference: a scheduler, a warmth policy and early starts plugged into the core.
    "replay.clairvoyant": {"control.controller", "control.cost", "control.eviction", "control.placement",
                           "control.record", "control.warmth_policy",
                           "control.queue", "control.scheduler", "engines.tiers", "errors", "model", "replay.clock",
                           "replay.flights", "replay.foresight", "replay.types", "replay.world"},
    "replay.foresight": {"control.controller", "engines.tiers", "model", "replay.clock", "replay.world"},
}

# Which packages each package's modules may import (besides its own and the shared top: model,
# errors, config, events, tasks): the flow, one way. admin and the command line are edges.
FLOW = {
    "gateway": {"control", "engines", "http"},
    "control": {"engines", "state"},
    "engines": {"http", "state"},  # http: the engine client (its pool, its bounds)
    "litellm": {"gateway", "http"},  # the key it registers with, the header parsers
    "admin": {"control", "engines", "gateway", "http", "litellm", "state"},
    "state": set(), "http": set(),
    "sim": {"http"},  # the lean front it serves on, as the gateway does (sim/server.py)
    "replay": {"control", "engines", "state"},  # the decisions it replays, the state file it reads
}
# The imports against the flow that remain, each with the reason it is still there.
BACKWARD: dict[tuple[str, str], str] = {}


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """A module's syntax tree, parsed once for all of this file's tests (read, never changed)."""
    return ast.parse(path.read_text())


@functools.cache
def _modules() -> frozenset[str]:
    return frozenset(".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
                     for p in PKG.rglob("*.py"))


def ours(path: pathlib.Path) -> set[str]:
    """The package's modules that path imports (``from .engines import recipes`` imports
    engines.recipes, not the engines package)."""
    mod = ".".join(path.relative_to(PKG).with_suffix("").parts)
    package = mod.rsplit(".", 1)[0] if "." in mod else ""
    modules = _modules()
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ondemand")):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = [b for b in base if b]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module.removeprefix("ondemand").lstrip(".")
            subs = {f"{target}.{a.name}".lstrip(".") for a in node.names} & modules
            found |= subs
            if len(subs) < len(node.names):
                found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ondemand.") for a in node.names if a.name.startswith("ondemand.")}
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
    assert ALLOWED["engines.dockerapi"] == set()
    users = set()
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        if "engines.dockerapi" in ours(path):
            users.add(mod)
    assert users <= {"engines.backends.docker", "gateway.peers", "admin.doctor"}, users


SHARED = {"model", "errors", "config", "events", "tasks", "files", "ratelog"}


def test_packages_import_along_the_flow():
    """Each package imports only the packages after it in the flow (FLOW), and the shared top;
    the imports against it are the ones BACKWARD names, with their reasons."""
    bad, backward = [], set()
    for mod, allowed in ALLOWED.items():
        package = mod.split(".")[0]
        if package in SHARED or package not in FLOW:
            continue
        for target in allowed:
            other = target.split(".")[0]
            if other in SHARED or other == package or other in FLOW[package]:
                continue
            if (mod, target) in BACKWARD:
                backward.add((mod, target))
            else:
                bad.append(f"{mod} → {target}")
    assert bad == []
    assert backward == set(BACKWARD), "a BACKWARD entry no longer needed: remove it"


def test_no_import_runs_back_up():
    """Issue 41: nothing in engines/ imports control/; the deployer's fit check is the budget's
    (control's), given to it by app.py through engines.memory's protocol. BACKWARD stays empty."""
    assert BACKWARD == {}
    for path in sorted((PKG / "engines").rglob("*.py")):
        up = sorted(m for m in ours(path) if m.split(".")[0] in ("control", "gateway", "admin"))
        assert up == [], f"{path.relative_to(PKG)} imports {up}"


def _calls_of(tree: ast.Module, module: str) -> set[str]:
    """The names called as ``module.name(...)`` in ``tree``."""
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == module}


def test_the_deployer_and_the_replay_world_call_one_set_of_rules():
    """Issue 41: the deployer's decisions are engines/rules.py's, and replay/world.py calls them
    instead of keeping copies (they had drifted): every rule is called by the deployer or its
    registry, the world calls each one the deployer's steps call, and names nothing only a copy
    would need (tests/engines/test_rules.py patches rules and sees the replay change)."""
    public = {n.name for n in _tree(PKG / "engines" / "rules.py").body
              if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    deployer = _calls_of(_tree(PKG / "engines" / "deployer.py"), "rules")
    deployer |= _calls_of(_tree(PKG / "engines" / "registry.py"), "rules")
    assert deployer == public
    world = _tree(PKG / "replay" / "world.py")
    assert _calls_of(world, "rules") == public - {"may_start"}  # rules.admit asks it
    names = {n.id for n in ast.walk(world) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(world) if isinstance(n, ast.Attribute)}
    copied = names & {"ADMIN_STARTABLE", "has_sleep_api", "deepest_level", "host_level", "pending_mode",
                      "wake_check", "log_tail"}
    assert copied == set(), f"replay/world.py decides as the deployer does itself: call engines.rules ({copied})"



def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of ``tree``'s docstrings (prose may name what the code may not)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def test_the_rest_tiers_are_spelled_in_one_place():
    """Issue 41: a rest tier is one object (engines/tiers.py: its name and level, what it holds,
    the engine calls in and out, which start history prices coming back), and the rest of the
    package asks it: no other module names a tier in code ("asleep_1", f"asleep_{level}"), lists
    the sleep levels ((1, 2), [1, 2]) or keeps a LEVELS or TIERS table of its own or another
    module's (rhythm.TIERS, tiers' names, is there for its tests). A new tier is then one object
    there, not a search of 22 modules."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        name = path.relative_to(PKG).as_posix()
        if name == "engines/tiers.py":
            continue
        tree = _tree(path)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and re.search(r"\basleep_(\d|$)", node.value):
                bad.append(f"{name}:{node.lineno} names a tier: {node.value!r}")
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) == 2 and all(
                    isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts) \
                    and [e.value for e in node.elts if isinstance(e, ast.Constant)] == [1, 2]:
                bad.append(f"{name}:{node.lineno} lists the sleep levels")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id in ("LEVELS", "TIERS") for t in targets):
                    bad.append(f"{name}:{node.lineno} keeps a table of tiers of its own")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] != "tiers" \
                    and any(a.name in ("LEVELS", "TIERS") for a in node.names):
                bad.append(f"{name}:{node.lineno} takes a table of tiers from {node.module}, not engines/tiers.py")
    assert bad == [], "ask engines/tiers.py (TIERS, LEVELS, BY_NAME, asleep(level))"


def _behaviour(cls: type) -> bool:
    """Does a subclass of ours inherit behaviour? Not an exception (it carries data), a protocol
    (it declares an interface), an enum, or a dataclass whose only methods are properties."""
    import dataclasses
    import enum
    if issubclass(cls, (BaseException, enum.Enum)) or getattr(cls, "_is_protocol", False):
        return False
    if dataclasses.is_dataclass(cls):
        return any(callable(v) and not (k.startswith("__") and k.endswith("__")) for k, v in vars(cls).items())
    return True


def test_the_decision_core_composes_its_parts():
    """No class in control/ inherits behaviour from another class of the package (issue 41): the
    controller owns its parts behind small protocols (slots, the start side, the scheduler, the
    warmth policies) instead of a chain of subclasses whose hooks are filled two files away."""
    import importlib
    import inspect
    stacked = []
    for path in sorted((PKG / "control").glob("*.py")):
        name = "ondemand." + ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name or not _behaviour(cls):
                continue
            ours = [b.__qualname__ for b in cls.__mro__[1:] if b.__module__.startswith("ondemand.")]
            if ours:
                stacked.append(f"{name}.{cls.__qualname__} inherits {ours}")
    assert stacked == [], "compose: make the base a part the class owns, behind a protocol if it varies"

# The modules still over the cap, and their size when the cap came: they may only shrink.
OVER_THE_CAP: dict[str, int] = {}


def test_no_module_over_500_lines():
    """A module over 500 lines is a room that holds too much: split it by what it holds."""
    over = {}
    for path in PKG.rglob("*.py"):
        name = path.relative_to(PKG).as_posix()
        n = len(path.read_text().splitlines())
        if n > 500 and not (name in OVER_THE_CAP and n <= OVER_THE_CAP[name]):
            over[name] = n
    assert over == {}, f"split these (or, for one already listed, shrink it): {over}"


def test_aiodocker_is_used_in_dockerapi_only():
    for path in PKG.rglob("*.py"):
        if path.name == "dockerapi.py":
            continue
        tree = _tree(path)
        used = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "aiodocker" not in used, f"{path.relative_to(PKG)} imports aiodocker: use ondemand.engines.dockerapi"


def test_the_engines_are_called_through_one_client():
    """Every call of ondemand's own to an engine goes through engines/client.py, on http/pool.py's
    pools, the ones the gateway forwards on (issue 30): no aiohttp in engines/ but for Docker's
    API (dockerapi, and the docker backend's errors and timeouts)."""
    for path in (PKG / "engines").rglob("*.py"):
        name = path.relative_to(PKG).as_posix()
        if name in ("engines/dockerapi.py", "engines/backends/docker.py"):
            continue
        tree = _tree(path)
        used = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "aiohttp" not in used, f"{name} imports aiohttp: call engines through engines.client"


def test_only_the_composition_reads_the_environment():
    for path in PKG.rglob("*.py"):
        # config reads it once; the simulator (sim/) is a program of its own; the process
        # backend hands it on to the engines it starts (their PATH, CUDA_VISIBLE_DEVICES ...);
        # replay --live hands it on to the serve it starts, without the caller's ONDEMAND_ keys
        # (they would override that serve's own configuration).
        name = path.relative_to(PKG).as_posix()
        if name in ("config.py", "engines/backends/process.py", "replay/live.py") or name.startswith("sim/"):
            continue
        assert "os.environ" not in path.read_text(), path.name


MAX_FUNCTION_LINES = 60


def test_no_function_over_60_lines():
    """A function over 60 lines (from its first decorator to its last line), nested ones too, in
    every module of the package, is split into named steps (issue 30): no exceptions."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({length} lines)")
    assert long == [], "split these into named steps"


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
    """A connection belongs to one stack; nothing reaches into aiohttp (design.md, "The HTTP layer"):
    no import of its private modules (``aiohttp.web_protocol``, ``aiohttp.http_parser`` ...),
    no underscore attribute of aiohttp's that ondemand does not define itself, no class swap,
    and no override of aiohttp's underscore methods in a subclass."""
    private = _aiohttp_private_names()
    trees = {p: _tree(p) for p in PKG.rglob("*.py")}
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


def test_the_files_make_test_hands_out_first_exist():
    """helpers.FIRST, the order tests/conftest.py gives: a file renamed or moved would silently lose
    its place (and its worker would end alone again)."""
    from helpers import FIRST
    tests = pathlib.Path(__file__).parent
    assert [name for name in FIRST if not (tests / name).is_file()] == []
