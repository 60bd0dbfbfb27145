"""The checks of an admin's fields (beside the recipes' checks of the engine fields): a new
deployment's (``validate_new``), an edit's (``validate_changes``), and the form of their
refusal (``field_error``: 400 ``invalid_field``, naming the field)."""
from __future__ import annotations

import re
from typing import Any

from ..config import Config
from ..engines import recipes, warmth
from ..errors import OndemandError
from ..model import MAX_INFLIGHT, Deployment, IdleAction, KeepWarm, Priority

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*\Z")
# C0 and C1 controls and DEL: a served name is quoted in log lines and LiteLLM's entries, where a
# newline or an escape sequence would forge or hide a line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def field_error(field: str, message: str) -> OndemandError:
    return OndemandError(400, "invalid_field", f"{field}: {message}")


def validate_new(data: dict[str, Any], cfg: Config, existing: list[Deployment],
                 gpu_sizes: tuple[float, ...] | None = None, per_gpu: bool = True) -> tuple[dict[str, Any], bool]:
    """The row to insert, and whether to start it now (always on, not planned).
    ``gpu_sizes``: each GPU's total (or the one pool's), for the checks against the box
    (None: unknown, not checked here; the start says it)."""
    try:
        return _validate_new(data, cfg, existing, gpu_sizes, per_gpu)
    except recipes.FieldError as exc:
        raise field_error(exc.field, exc.message) from None


def _validate_new(data: dict[str, Any], cfg: Config, existing: list[Deployment],
                  gpu_sizes: tuple[float, ...] | None, per_gpu: bool) -> tuple[dict[str, Any], bool]:
    allowed = {"name", "served_name", "engine", "model", "image", "args", "command", "port", "memory_gib",
               "gpu_count", "gpu_ids", "env", "volumes", "role", "mode", "idle_timeout_s", "start",
               "priority", "max_inflight", "idle_action", "keep_warm"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise field_error(unknown[0], f"unknown field; known: {', '.join(sorted(allowed))}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 63:
        raise field_error("name", "required; lower-case letters, digits, '.', '_' and '-', starting with a "
                                   "letter or digit, at most 63 characters")
    if any(d.name == name for d in existing):
        raise OndemandError(409, "name_taken", f"name: a deployment named {name!r} exists")
    served = data.get("served_name", name)
    if not isinstance(served, str) or not served.strip() or len(served) > 256 or _CONTROL.search(served):
        raise field_error("served_name", "a non-empty string of at most 256 characters, without control characters")
    run = _validate_engine(data, cfg)
    model = run["model"]
    role = data.get("role", "model")
    if role not in ("model", "decision", "system"):
        raise field_error("role", "model, decision or system")
    mode = data.get("mode", "always_on")
    if mode not in ("on_demand", "always_on"):
        raise field_error("mode", "on_demand or always_on")
    if role != "model" and mode == "on_demand":
        raise field_error("mode", f"a {role} deployment is always always_on")
    port = data.get("port", 8000)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise field_error("port", "1 to 65535")
    memory = data.get("memory_gib", 0)
    if not isinstance(memory, (int, float)) or isinstance(memory, bool) or not 0 <= memory <= 1e6:
        raise field_error("memory_gib", "GiB, 0 or more")
    gpu_count, gpu_ids = _validate_gpus(data.get("gpu_count"), data.get("gpu_ids"))
    if model is not None and "gpu_count" not in data and gpu_ids is None:
        gpu_count = 1  # a recipe's engine uses one GPU unless told (NULL would book all of them)
    if not per_gpu and gpu_count is not None and gpu_count > 1:
        # Named as sent: several gpu_ids (their count follows from them) or a gpu_count.
        named, bound = ("gpu_ids", "one GPU at most") if gpu_ids else ("gpu_count", "0 or 1 (or null)")
        raise field_error(named, f"{bound}: this box's budget is one pool (meminfo, or static "
                                 "with capacity_gib), which cannot place an engine on several GPUs")
    if gpu_sizes:
        recipes.check_fits_box(float(memory), gpu_count, gpu_sizes, per_gpu, model is not None)
        if per_gpu and gpu_ids and max(gpu_ids) >= len(gpu_sizes):
            raise field_error("gpu_ids", f"this box has GPUs 0 to {len(gpu_sizes) - 1}")
    idle = data.get("idle_timeout_s")
    if idle is not None and (not isinstance(idle, int) or isinstance(idle, bool)
                             or not cfg.min_idle_timeout_s <= idle <= 86400):
        raise field_error("idle_timeout_s", f"null or {cfg.min_idle_timeout_s} to 86400 seconds")
    start = data.get("start", True)
    if not isinstance(start, bool):
        raise field_error("start", "true or false")
    state = "planned" if not start else ("stopped" if mode == "on_demand" else "planned")
    return {"name": name, "served_name": served, **run, "port": port,
            "memory_gib": float(memory), "gpu_count": gpu_count, "gpu_ids": gpu_ids,
            "role": role, "mode": mode, "idle_timeout_s": idle, **_validate_limits(data),
            "idle_action": _validate_idle_action(data.get("idle_action", "auto"), run["engine"]),
            "keep_warm": _validate_keep_warm(data.get("keep_warm", "fixed")),
            "state": state}, start and mode == "always_on"


def _validate_engine(data: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """What the engine runs: its engine and model (a recipe), or its image and args or command
    as given; its env and volumes."""
    engine = recipes.check_engine(data.get("engine", "vllm"))
    model = recipes.check_model(engine, data.get("model"))
    for field in ("args", "command"):
        value = data.get(field, [])
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise field_error(field, "a list of strings")
    image = data.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise field_error("image", "a container image name")
    if cfg.deployer.backend == "docker" and not image and model is None:
        if engine == "custom" or "image" in data:
            raise field_error("image", "required with the docker backend")
        raise field_error("model", "required: the model the engine loads (or an image and args, as given)")
    if cfg.deployer.backend == "process" and not data.get("command") and model is None:
        if engine == "custom" or "command" in data:
            raise field_error("command", "required with the process backend (argv with {port})")
        raise field_error("model", "required: the model the engine loads (or a command with {port}, as given)")
    return {"engine": engine, "model": model, "image": image, "args": data.get("args", []),
            "command": data.get("command", []), "env": recipes.check_env(data.get("env", {})),
            "volumes": recipes.check_volumes(data.get("volumes", []), recipes.Box.from_config(cfg))}


MAX_GPUS = 64


def _validate_idle_action(action: Any, engine: str) -> str:
    """``idle_action``: auto, stop, sleep (level 1) or sleep2 (level 2); the two sleeps only
    for an engine with a sleep API (vLLM, SGLang)."""
    values = [a.value for a in IdleAction]
    if action not in values:
        raise field_error("idle_action", ", ".join(values[:-1]) + " or " + values[-1])
    if action in (IdleAction.SLEEP.value, IdleAction.SLEEP2.value) and engine not in warmth.SLEEP_ENGINES:
        raise field_error("idle_action", f"{action} needs an engine with a sleep API "
                                          f"({', '.join(sorted(warmth.SLEEP_ENGINES))}); {engine} has none: "
                                          "use auto or stop")
    return str(action)


def _validate_keep_warm(value: Any) -> str:
    """``keep_warm``: ``fixed`` (idle after its idle timeout) or ``adaptive`` (its learned
    rhythm's plan, within that timeout: control/keepwarm.py)."""
    if value not in [k.value for k in KeepWarm]:
        raise field_error("keep_warm", "fixed or adaptive")
    return str(value)


def _validate_limits(data: dict[str, Any]) -> dict[str, Any]:
    """``priority`` (low, normal, high) and ``max_inflight`` (null: no limit, else 1..10000)."""
    priority, max_inflight = data.get("priority", "normal"), data.get("max_inflight")
    if priority not in [p.value for p in Priority]:
        raise field_error("priority", "low, normal or high")
    if max_inflight is not None and (not isinstance(max_inflight, int) or isinstance(max_inflight, bool)
                                     or not 1 <= max_inflight <= MAX_INFLIGHT):
        raise field_error("max_inflight", f"null (no limit) or 1 to {MAX_INFLIGHT} requests at once")
    return {"priority": priority, "max_inflight": max_inflight}


def _validate_gpus(count: Any, ids: Any) -> tuple[int | None, list[int] | None]:
    """``gpu_count`` (null: every GPU; 0: none) and ``gpu_ids`` (null, or the GPU indices it
    must run on). A pin alone sets the count to its length."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_GPUS):
        raise field_error("gpu_count", f"null (every GPU), 0 (no GPU) or 1 to {MAX_GPUS}")
    if ids is None:
        return count, None
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_GPUS for i in ids) or \
            len(set(ids)) != len(ids):
        raise field_error("gpu_ids", "null, or a list of distinct GPU indices (0, 1, ...)")
    if count is not None and count != len(ids):
        raise field_error("gpu_ids", f"lists {len(ids)} GPUs but gpu_count is {count}")
    return len(ids), sorted(ids)


# What PATCH /api/deployments/{id} may change: what a creation sets, but the id and the
# mode. A mode switch has its own route (PATCH .../mode, `mode set`): it may start the
# deployment and is audited ondemand_mode, which an edit of the record must not bypass.
EDITABLE = ("name", "served_name", "engine", "model", "image", "args", "command", "port", "memory_gib",
            "gpu_count", "gpu_ids", "env", "volumes", "role", "idle_timeout_s", "priority", "max_inflight",
            "idle_action", "keep_warm")


def validate_changes(data: dict[str, Any], cfg: Config, dep: Deployment, existing: list[Deployment],
                     gpu_sizes: tuple[float, ...] | None = None, per_gpu: bool = True) -> dict[str, Any]:
    """The fields an edit changes, validated by ``validate_new`` as the creation of
    the edited deployment (so the same rules, messages and codes apply, including
    the rules between fields), other deployments' names taken."""
    if "mode" in data:
        raise field_error("mode", "switched with PATCH /api/deployments/{id}/mode (ondemand mode set)")
    unknown = sorted(set(data) - set(EDITABLE))
    if unknown:
        raise field_error(unknown[0], f"not editable; editable: {', '.join(EDITABLE)}")
    plain = dep.as_dict()
    current = {k: plain[k] for k in (*EDITABLE, "mode") if plain[k] is not None}
    data = dict(data)
    if isinstance(data.get("gpu_ids"), list) and "gpu_count" not in data:
        # A new pin sets the count with it; a pin of another type is refused below, naming
        # gpu_ids (len() of a number was a 500).
        data["gpu_count"] = len(data["gpu_ids"])
    if isinstance(data.get("env"), dict):
        # A secret shown masked ("***", as views show it) and sent back unchanged keeps its value.
        data["env"] = {k: plain["env"][k] if v == recipes.MASK and k in plain["env"] else v
                       for k, v in data["env"].items()}
    if "model" in data and data["model"] is not None and "gpu_count" not in current and "gpu_count" not in data:
        data["gpu_count"] = 1  # as for a new deployment with a model
    fields, _ = validate_new({**current, **data, "start": False}, cfg, [d for d in existing if d.id != dep.id],
                             gpu_sizes, per_gpu)
    return {k: fields[k] for k in EDITABLE if k in data and fields[k] != plain[k]}
