"""The admin API: ``{base_path}/api/...``, JSON in and out.

Behind the admin token on TCP (``Authorization: Bearer``, constant-time
compare; the on-demand key never opens it) and open on the Unix socket
``{state_dir}/admin.sock`` (mode 0600), which the command line uses.
Errors use the gateway's ``{"error": {"message", "type", "code"}}`` form;
validation errors name the field.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pathlib
import re
import socket
from collections.abc import Callable
from types import ModuleType
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .. import __version__
from ..config import Config
from ..engines import metrics, recipes, warmth
from ..engines.backends import BackendError
from ..engines.deployer import Deployer, StartFailed, StartInterrupted
from ..errors import (
    BudgetError,
    DeployerError,
    DeploymentBusy,
    InsufficientMemory,
    NameTaken,
    OndemandError,
    StateFileError,
)
from ..events import Resync, ViewPublished
from ..gateway import keys as keys_mod
from ..http.aio import read_body
from ..http.headers import bearer, token_bytes
from ..http.server import LIMITS
from ..model import MAX_INFLIGHT, Deployment, IdleAction, Priority, State
from . import components
from .telemetry import CONTENT_TYPE

log = logging.getLogger("ondemand.admin.api")

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*\Z")
_JSON = "application/json"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS),
                        content_type=_JSON)


def _field_error(field: str, message: str) -> OndemandError:
    return OndemandError(400, "invalid_field", f"{field}: {message}")


def _is_unix(request: web.BaseRequest) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


# aiohttp's own refusals (no route, wrong method, body over client_max_size),
# in the API's error form: scripts read error.code.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _http_error(exc: web.HTTPException) -> web.Response:
    code = _HTTP_CODES.get(exc.status, exc.reason.lower().replace(" ", "_"))
    allow = exc.headers.get("Allow")
    message = {405: f"{exc.reason}; allowed: {allow}", 413: "The request body is larger than 16 MiB"}
    err = OndemandError(exc.status, code, message.get(exc.status, exc.reason))
    return web.Response(status=exc.status, body=err.body(), content_type=_JSON,
                        headers={"Allow": allow} if allow else None)


def _refusal(err: OndemandError, *, close: bool = False) -> web.Response:
    """An error in the documented form; its ``Connection: close`` closes the connection."""
    headers = {k: v for k, v in err.headers.items() if k != "Connection"}
    resp = web.Response(status=err.status, body=err.body(), content_type=_JSON, headers=headers or None)
    if close or err.headers.get("Connection") == "close":
        resp.force_close()
    return resp


def auth_middleware(cfg: Config) -> Middleware:
    """The admin token, and what aiohttp's application never serves (design.md, "The HTTP
    layer"): gateway requests (the lean front's alone) and upgrades."""
    api = cfg.base_path + "/api"
    gateway = cfg.base_path + "/ondemand"
    metrics_path = cfg.base_path + "/metrics"

    def guarded(path: str) -> bool:
        # The UI page itself is static and holds no data: it asks for the token.
        return path.startswith(api) or (path == metrics_path and not cfg.metrics_public)

    @web.middleware
    async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "Upgrade" in request.headers and "upgrade" in request.headers.get("Connection", "").lower():
            # aiohttp would take what follows for the new protocol's, and lose the requests
            # pipelined behind it (issue 23): nothing here switches protocols.
            return _refusal(OndemandError(400, "invalid_request", "ondemand switches to no other protocol (Upgrade)"),
                            close=True)
        if request.raw_path.startswith(gateway + "/"):
            # This connection carries admin requests: the gateway serves only connections
            # that began with one of its own (RFC 9110's 421: retry on another connection).
            return _refusal(OndemandError(421, "misdirected_request",
                                          "A gateway request on a connection that carries admin requests: "
                                          "send it on a connection of its own"))
        if request.path.startswith(gateway):
            return _refusal(OndemandError(404, "not_found", "Not found"))  # ondemand%2F1, say
        if guarded(request.path) and not _is_unix(request):
            token = keys_mod.read_key_file(cfg.token_file)
            presented = bearer(request.headers) or ""
            # The presented bytes as they came: .encode() raised on a non-UTF-8 byte (issue 23).
            if token is None or not hmac.compare_digest(token_bytes(presented), token.encode()):
                telemetry = request.app.get(components.TELEMETRY)
                if telemetry is not None:
                    telemetry.auth_failed()
                err = OndemandError(401, "invalid_admin_token",
                                    "The admin API needs the admin token (admin_token_file), or the admin socket")
                return web.Response(status=401, body=err.body(), content_type=_JSON)
        try:
            return await handler(request)
        except StateFileError as exc:
            err = OndemandError(503, "state_file_unwritable", str(exc), headers={"Retry-After": "30"})
            return web.Response(status=err.status, body=err.body(), content_type=_JSON, headers=err.headers)
        except OndemandError as err:
            return _refusal(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _http_error(exc)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if request.writer is None or request.writer.output_size:
                raise  # an answer (an event stream) is under way: aiohttp cuts the connection
            internal = OndemandError(500, "internal_error", "ondemand failed on this request; see its log")
            return web.Response(status=500, body=internal.body(), content_type=_JSON)
    return admin_auth


def _app_parts(request: web.Request) -> tuple[ModuleType, web.Application]:
    return components, request.app


def _dep_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not raw.isdigit():
        raise OndemandError(404, "not_found", f"no deployment {raw!r}")
    app_mod, app = _app_parts(request)
    dep_id = int(raw)
    if app[app_mod.DEPLOYER].get(dep_id) is None:
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    return dep_id


async def _body(request: web.Request) -> dict[str, Any]:
    # A time limit as the gateway's (issue 23: an admin body could trickle for ever).
    raw = await read_body(request, request.app[LIMITS])
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        raise OndemandError(400, "invalid_json", "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OndemandError(400, "invalid_json", "the body must be a JSON object")
    return data


def _user(request: web.Request) -> str:
    return "socket" if _is_unix(request) else "token"


# --- host -------------------------------------------------------------------------

async def host(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    cfg: Config = app[app_mod.CONFIG]
    deployer = app[app_mod.DEPLOYER]
    try:
        snap = (await deployer.budget.snapshot(deployer.all())).as_dict()
        budget: dict[str, Any] = {"source": deployer.budget.source, **snap}
    except BudgetError as exc:
        budget = {"source": deployer.budget.source, "error": str(exc)}
    key = app[app_mod.KEYS].current()
    sync = app[app_mod.SYNC]
    last = getattr(sync, "last_result", None) or {}
    return _json({
        "version": __version__,
        "hostname": socket.gethostname(),
        "instance": cfg.instance,
        "listen": cfg.listen,
        "backend": deployer.backend.kind,
        "budget": budget,
        "host_memory": host_memory(deployer),
        "ondemand": {
            "configured": key is not None,
            "key_fingerprint": keys_mod.fingerprint(key) if key else None,
            "litellm_enabled": sync.enabled,
            "litellm_ready": sync.last_ok,
            "litellm_error": last.get("error") if isinstance(last, dict) else None,
            "queued": app[app_mod.CONTROLLER].waiting(),
            "queue": app[app_mod.CONTROLLER].queue.ids(),
        },
    })


def host_memory(deployer: Deployer) -> dict[str, float | None]:
    """The host memory tiered warmth watches (GiB): the box's total and what is available
    (``MemAvailable`` of ``budget.meminfo_path``; null when unreadable), what the asleep
    engines were measured to hold, and the reserve a level-1 sleep must leave."""
    budget = deployer.budget
    try:
        mem = budget._meminfo()
        total: float | None = round(mem.total, 3)
        available: float | None = round(mem.total - mem.used, 3)
    except BudgetError:
        total = available = None
    asleep = sum(d.host_gib or 0.0 for d in deployer.all() if d.state is State.ASLEEP)
    return {"total_gib": total, "available_gib": available, "asleep_gib": round(asleep, 3),
            "reserve_gib": budget.host_reserve_gib}


# --- deployments ------------------------------------------------------------------

async def list_deployments(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    return _json([app_mod.view(app, d) for d in app[app_mod.DEPLOYER].all()])


async def get_deployment(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    return _json(app_mod.view(app, app[app_mod.DEPLOYER].get(dep_id)))


def validate_new(data: dict[str, Any], cfg: Config, existing: list[Deployment],
                 gpu_sizes: tuple[float, ...] | None = None, per_gpu: bool = True) -> tuple[dict[str, Any], bool]:
    """The row to insert, and whether to start it now (always on, not planned).
    ``gpu_sizes``: each GPU's total (or the one pool's), for the checks against the box
    (None: unknown, not checked here; the start says it)."""
    try:
        return _validate_new(data, cfg, existing, gpu_sizes, per_gpu)
    except recipes.FieldError as exc:
        raise _field_error(exc.field, exc.message) from None


def _validate_new(data: dict[str, Any], cfg: Config, existing: list[Deployment],
                  gpu_sizes: tuple[float, ...] | None, per_gpu: bool) -> tuple[dict[str, Any], bool]:
    allowed = {"name", "served_name", "engine", "model", "image", "args", "command", "port", "memory_gib",
               "gpu_count", "gpu_ids", "env", "volumes", "role", "mode", "idle_timeout_s", "start",
               "priority", "max_inflight", "idle_action"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise _field_error(unknown[0], f"unknown field; known: {', '.join(sorted(allowed))}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 63:
        raise _field_error("name", "required; lower-case letters, digits, '.', '_' and '-', starting with a "
                                   "letter or digit, at most 63 characters")
    if any(d.name == name for d in existing):
        raise OndemandError(409, "name_taken", f"name: a deployment named {name!r} exists")
    served = data.get("served_name", name)
    if not isinstance(served, str) or not served.strip() or len(served) > 256:
        raise _field_error("served_name", "a non-empty string")
    run = _validate_engine(data, cfg)
    model = run["model"]
    role = data.get("role", "model")
    if role not in ("model", "decision", "system"):
        raise _field_error("role", "model, decision or system")
    mode = data.get("mode", "always_on")
    if mode not in ("on_demand", "always_on"):
        raise _field_error("mode", "on_demand or always_on")
    if role != "model" and mode == "on_demand":
        raise _field_error("mode", f"a {role} deployment is always always_on")
    port = data.get("port", 8000)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise _field_error("port", "1 to 65535")
    memory = data.get("memory_gib", 0)
    if not isinstance(memory, (int, float)) or isinstance(memory, bool) or not 0 <= memory <= 1e6:
        raise _field_error("memory_gib", "GiB, 0 or more")
    gpu_count, gpu_ids = _validate_gpus(data.get("gpu_count"), data.get("gpu_ids"))
    if model is not None and "gpu_count" not in data and gpu_ids is None:
        gpu_count = 1  # a recipe's engine uses one GPU unless told (NULL would book all of them)
    if not per_gpu and gpu_count is not None and gpu_count > 1:
        raise _field_error("gpu_count", "0 or 1 (or null): this box's budget is one pool (meminfo, or static "
                                        "with capacity_gib), which cannot place an engine on several GPUs")
    if gpu_sizes:
        recipes.check_fits_box(float(memory), gpu_count, gpu_sizes, per_gpu, model is not None)
        if per_gpu and gpu_ids and max(gpu_ids) >= len(gpu_sizes):
            raise _field_error("gpu_ids", f"this box has GPUs 0 to {len(gpu_sizes) - 1}")
    idle = data.get("idle_timeout_s")
    if idle is not None and (not isinstance(idle, int) or isinstance(idle, bool)
                             or not cfg.min_idle_timeout_s <= idle <= 86400):
        raise _field_error("idle_timeout_s", f"null or {cfg.min_idle_timeout_s} to 86400 seconds")
    start = data.get("start", True)
    if not isinstance(start, bool):
        raise _field_error("start", "true or false")
    state = "planned" if not start else ("stopped" if mode == "on_demand" else "planned")
    return {"name": name, "served_name": served, **run, "port": port,
            "memory_gib": float(memory), "gpu_count": gpu_count, "gpu_ids": gpu_ids,
            "role": role, "mode": mode, "idle_timeout_s": idle, **_validate_limits(data),
            "idle_action": _validate_idle_action(data.get("idle_action", "auto"), run["engine"]),
            "state": state}, start and mode == "always_on"


def _validate_engine(data: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """What the engine runs: its engine and model (a recipe), or its image and args or command
    as given; its env and volumes."""
    engine = recipes.check_engine(data.get("engine", "vllm"))
    model = recipes.check_model(engine, data.get("model"))
    for field in ("args", "command"):
        value = data.get(field, [])
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise _field_error(field, "a list of strings")
    image = data.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise _field_error("image", "a container image name")
    if cfg.deployer.backend == "docker" and not image and model is None:
        if engine == "custom" or "image" in data:
            raise _field_error("image", "required with the docker backend")
        raise _field_error("model", "required: the model the engine loads (or an image and args, as given)")
    if cfg.deployer.backend == "process" and not data.get("command") and model is None:
        if engine == "custom" or "command" in data:
            raise _field_error("command", "required with the process backend (argv with {port})")
        raise _field_error("model", "required: the model the engine loads (or a command with {port}, as given)")
    return {"engine": engine, "model": model, "image": image, "args": data.get("args", []),
            "command": data.get("command", []), "env": recipes.check_env(data.get("env")),
            "volumes": recipes.check_volumes(data.get("volumes"), recipes.Box.from_config(cfg))}


MAX_GPUS = 64


def _validate_idle_action(action: Any, engine: str) -> str:
    """``idle_action``: auto, stop, sleep (level 1) or sleep2 (level 2); the two sleeps only
    for an engine with a sleep API (vLLM, SGLang)."""
    values = [a.value for a in IdleAction]
    if action not in values:
        raise _field_error("idle_action", ", ".join(values[:-1]) + " or " + values[-1])
    if action in (IdleAction.SLEEP.value, IdleAction.SLEEP2.value) and engine not in warmth.SLEEP_ENGINES:
        raise _field_error("idle_action", f"{action} needs an engine with a sleep API "
                                          f"({', '.join(sorted(warmth.SLEEP_ENGINES))}); {engine} has none: "
                                          "use auto or stop")
    return str(action)


def _validate_limits(data: dict[str, Any]) -> dict[str, Any]:
    """``priority`` (low, normal, high) and ``max_inflight`` (null: no limit, else 1..10000)."""
    priority, max_inflight = data.get("priority", "normal"), data.get("max_inflight")
    if priority not in [p.value for p in Priority]:
        raise _field_error("priority", "low, normal or high")
    if max_inflight is not None and (not isinstance(max_inflight, int) or isinstance(max_inflight, bool)
                                     or not 1 <= max_inflight <= MAX_INFLIGHT):
        raise _field_error("max_inflight", f"null (no limit) or 1 to {MAX_INFLIGHT} requests at once")
    return {"priority": priority, "max_inflight": max_inflight}


def _validate_gpus(count: Any, ids: Any) -> tuple[int | None, list[int] | None]:
    """``gpu_count`` (null: every GPU; 0: none) and ``gpu_ids`` (null, or the GPU indices it
    must run on). A pin alone sets the count to its length."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_GPUS):
        raise _field_error("gpu_count", f"null (every GPU), 0 (no GPU) or 1 to {MAX_GPUS}")
    if ids is None:
        return count, None
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_GPUS for i in ids) or \
            len(set(ids)) != len(ids):
        raise _field_error("gpu_ids", "null, or a list of distinct GPU indices (0, 1, ...)")
    if count is not None and count != len(ids):
        raise _field_error("gpu_ids", f"lists {len(ids)} GPUs but gpu_count is {count}")
    return len(ids), sorted(ids)


# What PATCH /api/deployments/{id} may change: what a creation sets, but the id and the
# mode. A mode switch has its own route (PATCH .../mode, `mode set`): it may start the
# deployment and is audited ondemand_mode, which an edit of the record must not bypass.
EDITABLE = ("name", "served_name", "engine", "model", "image", "args", "command", "port", "memory_gib",
            "gpu_count", "gpu_ids", "env", "volumes", "role", "idle_timeout_s", "priority", "max_inflight",
            "idle_action")


def validate_changes(data: dict[str, Any], cfg: Config, dep: Deployment, existing: list[Deployment],
                     gpu_sizes: tuple[float, ...] | None = None, per_gpu: bool = True) -> dict[str, Any]:
    """The fields an edit changes, validated by ``validate_new`` as the creation of
    the edited deployment (so the same rules, messages and codes apply, including
    the rules between fields), other deployments' names taken."""
    if "mode" in data:
        raise _field_error("mode", "switched with PATCH /api/deployments/{id}/mode (ondemand mode set)")
    unknown = sorted(set(data) - set(EDITABLE))
    if unknown:
        raise _field_error(unknown[0], f"not editable; editable: {', '.join(EDITABLE)}")
    plain = dep.as_dict()
    current = {k: plain[k] for k in (*EDITABLE, "mode") if plain[k] is not None}
    data = dict(data)
    if data.get("gpu_ids") is not None and "gpu_count" not in data:
        data["gpu_count"] = len(data["gpu_ids"])  # a new pin sets the count with it
    if isinstance(data.get("env"), dict):
        # A secret shown masked ("***", as views show it) and sent back unchanged keeps its value.
        data["env"] = {k: plain["env"][k] if v == recipes.MASK and k in plain["env"] else v
                       for k, v in data["env"].items()}
    if "model" in data and data["model"] is not None and "gpu_count" not in current and "gpu_count" not in data:
        data["gpu_count"] = 1  # as for a new deployment with a model
    fields, _ = validate_new({**current, **data, "start": False}, cfg, [d for d in existing if d.id != dep.id],
                             gpu_sizes, per_gpu)
    return {k: fields[k] for k in EDITABLE if k in data and fields[k] != plain[k]}


async def edit_deployment(request: web.Request) -> web.Response:
    """Edit a stopped, failed or planned deployment in place; the id stays."""
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    deployer = app[app_mod.DEPLOYER]
    data = await _body(request)
    dep = deployer.get(dep_id)
    if dep is None:  # removed while the body was read
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    changes = validate_changes(data, app[app_mod.CONFIG], dep, deployer.all(), *await _box_sizes(deployer))
    try:
        dep = await deployer.edit(dep_id, changes, actor="admin", user=_user(request))
    except DeploymentBusy as exc:
        raise OndemandError(409, "deployment_busy", str(exc)) from exc
    except NameTaken as exc:
        raise OndemandError(409, "name_taken", str(exc)) from exc
    except DeployerError as exc:  # removed while the edit waited for the deployer
        raise OndemandError(404, "not_found", str(exc)) from exc
    # (the LiteLLM sync follows the change on its own: app.py, _sync_needed)
    if changes and metrics.blind(dep):
        log.warning("%s: %s", dep.name, metrics.BLIND_WARNING)
    return _json(app_mod.view(app, dep))


async def create_deployment(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    deployer = app[app_mod.DEPLOYER]
    data = await _body(request)
    fields, start_now = validate_new(data, app[app_mod.CONFIG], deployer.all(), *await _box_sizes(deployer))
    if request.query.get("dry_run") not in (None, "0", "false"):
        # What it would be and run, with nothing written (deploy add --dry-run).
        dep = await deployer.book(Deployment.from_row({**fields, "id": 0}))  # its checkpoint read in a thread
        return _json({**dep.as_dict(), **components.launch_fields(deployer, dep), **components.memory_fields(dep),
                      "idle_level": warmth.idle_level(dep, deployer.budget.per_gpu), "dry_run": True})
    dep = await deployer.create(fields, actor="admin", user=_user(request))
    if metrics.blind(dep):
        log.warning("%s: %s", dep.name, metrics.BLIND_WARNING)
    if start_now:
        await _admit(deployer, dep.id, request)
    return _json(app_mod.view(app, deployer.get(dep.id) or dep), status=201)


async def _box_sizes(deployer: Deployer) -> tuple[tuple[float, ...] | None, bool]:
    """The GPUs' sizes for the checks against the box, or None when they cannot be read now."""
    try:
        return await deployer.budget.box_sizes(), deployer.budget.per_gpu
    except BudgetError as exc:
        log.warning("the GPUs cannot be read (%s): a new deployment is not checked against the box", exc)
        return None, deployer.budget.per_gpu


async def _admit(deployer: Deployer, dep_id: int, request: web.Request) -> None:
    try:
        await deployer.admit_start(dep_id, actor="admin", user=_user(request), text="started by an administrator")
    except InsufficientMemory as exc:
        raise OndemandError(409, "insufficient_memory", f"it does not fit now: {exc}") from exc
    except BudgetError as exc:
        raise OndemandError(503, "budget_unavailable", f"the GPU memory budget cannot be read: {exc}",
                            headers={"Retry-After": "10"}) from exc
    except DeployerError as exc:
        raise OndemandError(409, "invalid_state", str(exc)) from exc


async def delete_deployment(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    await app[app_mod.DEPLOYER].remove(dep_id, actor="admin", user=_user(request))
    return _json({"id": dep_id, "removed": True})


async def set_mode(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    data = await _body(request)
    unknown = sorted(set(data) - {"mode", "idle_timeout_s"})
    if unknown:
        raise _field_error(unknown[0], "unknown field; known: mode, idle_timeout_s")
    mode = data.get("mode")
    if mode not in ("on_demand", "always_on"):
        raise _field_error("mode", "on_demand or always_on")
    idle = data.get("idle_timeout_s")
    if "idle_timeout_s" in data and idle is not None and (not isinstance(idle, int) or isinstance(idle, bool)):
        raise _field_error("idle_timeout_s", "null or whole seconds")
    try:
        await app[app_mod.ADMISSION].set_mode(dep_id, mode, idle_timeout_s=idle,
                                               set_idle_timeout="idle_timeout_s" in data, user=_user(request))
    except OndemandError as err:
        if err.code == "invalid_idle_timeout":
            raise _field_error("idle_timeout_s", err.message.removeprefix("idle_timeout_s ")) from None
        if err.code == "invalid_mode":
            raise _field_error("mode", err.message) from None
        raise
    return _json(app_mod.view(app, app[app_mod.DEPLOYER].get(dep_id)))


async def action(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    deployer = app[app_mod.DEPLOYER]
    verb = request.match_info["action"]
    user = _user(request)
    try:
        if verb == "start":
            if deployer.get(dep_id).state is State.ASLEEP:
                raise OndemandError(409, "invalid_state", "it is asleep: use wake")
            await _admit(deployer, dep_id, request)
        elif verb == "wake":
            if deployer.get(dep_id).state is not State.ASLEEP:
                raise OndemandError(409, "invalid_state", "it is not asleep")
            await _admit(deployer, dep_id, request)
        elif verb == "stop":
            await deployer.stop(dep_id, actor="admin", user=user, text="stopped by an administrator")
        elif verb == "sleep":
            await _drain_and_sleep(app[app_mod.CONTROLLER], deployer, dep_id, *await _sleep_body(request), user=user)
        else:
            raise OndemandError(404, "not_found", f"no action {verb!r}")
    except DeployerError as exc:
        raise OndemandError(409, "invalid_state", str(exc)) from exc
    wait = request.query.get("wait")
    if verb in ("start", "wake") and wait not in (None, "0", "false"):
        try:
            await deployer.wait_started(dep_id)
        except (StartFailed, StartInterrupted) as exc:
            raise OndemandError(409, "start_failed", str(exc)) from exc
    return _json(app_mod.view(app, deployer.get(dep_id)))


DRAIN_S = 30.0  # how long a sleep waits for the requests in flight, unless its body says
MAX_DRAIN_S = 3600.0


async def _sleep_body(request: web.Request) -> tuple[int | None, float, bool]:
    """The sleep's optional body, ``{"level": 1|2, "drain_s": S, "force": false}``: the level
    asked for (None: the deployment's idle level, else 1), how long to wait for the requests
    in flight, and whether to sleep at once."""
    data = await _body(request)
    unknown = sorted(set(data) - {"level", "drain_s", "force"})
    if unknown:
        raise _field_error(unknown[0], "unknown field; known: level, drain_s, force")
    level = data.get("level")
    if level is not None and (not isinstance(level, int) or isinstance(level, bool) or level not in warmth.LEVELS):
        raise _field_error("level", "1 (weights kept in host memory) or 2 (weights dropped), or null "
                                    "(its idle_action's level)")
    drain = data.get("drain_s", DRAIN_S)
    if drain is None:
        drain = DRAIN_S
    if not isinstance(drain, (int, float)) or isinstance(drain, bool) or not 0 <= drain <= MAX_DRAIN_S:
        raise _field_error("drain_s", f"seconds to wait for the requests in flight, 0 to {MAX_DRAIN_S:g} "
                                      f"(default {DRAIN_S:g})")
    force = data.get("force", False)
    if not isinstance(force, bool):
        raise _field_error("force", "true (sleep at once: the engine aborts what it runs) or false")
    return level, float(drain), force


async def _drain_and_sleep(controller: Any, deployer: Any, dep_id: int, level: int | None, drain_s: float,
                           force: bool, *, user: str | None) -> None:
    """A sleep drains first: no new slot is given to the deployment while its requests in flight
    end (at most ``drain_s``); then it sleeps, and the requests that came meanwhile wake it (the
    drain ends in the step of the mark to asleep). Requests still in flight at the deadline: nothing
    sleeps, 409 ``deployment_busy``, and it serves on. ``force`` sleeps at once (vLLM aborts what
    its engine runs). An administrator who hangs up during the drain ends it as its deadline
    would (nothing sleeps, it serves on); one who hangs up once the sleep has begun leaves it to
    finish."""
    deployer.check_sleep(dep_id, level)  # a sleep that would be refused is refused before the wait
    if force:
        await _sleep_to_the_end(deployer, dep_id, level, user=user,
                                text="put to sleep by an administrator (force: at once)")
        return
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def drained() -> None:
        if not done.done():
            done.set_result(None)
    ended = False

    def end() -> None:
        nonlocal ended
        if not ended:
            ended = True
            controller.undrain(dep_id, drained)
    controller.drain(dep_id, drained)
    sleeping = False
    try:
        try:
            await asyncio.wait_for(done, drain_s)  # cancelled at the deadline: drained() checks done()
        except asyncio.TimeoutError:
            n = controller.inflight(dep_id)
            name = getattr(deployer.get(dep_id), "name", f"deployment {dep_id}")
            raise OndemandError(409, "deployment_busy",
                                f"{name} still had {n} request{'s' if n != 1 else ''} in flight after {drain_s:g} s "
                                "(drain_s): nothing slept, it serves on; force sleeps at once (the engine aborts "
                                "what it runs)") from None
        sleeping = True  # from here the sleep's task ends the drain: at its mark, else when it ends
        await _sleep_to_the_end(deployer, dep_id, level, user=user, on_marked=end, ended=end)
    finally:
        if not sleeping:  # the deadline, or a hang-up during the drain: it serves on
            end()


async def _sleep_to_the_end(deployer: Any, dep_id: int, level: int | None, *, user: str | None,
                            ended: Callable[[], None] | None = None, **kw: Any) -> None:
    """``deployer.sleep`` as the deployer's own task, awaited through a shield: an administrator's
    hang-up cancels the request, never the sleep (``ended`` is called when the sleep is over)."""
    async def sleep() -> DeployerError | None:
        try:
            await deployer.sleep(dep_id, level, actor="admin", user=user, **kw)
        except DeployerError as exc:  # the request's answer (409), when it is still there to get it
            return exc
        finally:
            if ended is not None:
                ended()
        return None
    # Shielded: a hang-up must not cut a sleep between its mark and its engine call's end (event, measurement, row).
    refused = await asyncio.shield(deployer.tasks.spawn(sleep(), f"sleep {dep_id} by an administrator"))
    if refused is not None:
        raise refused


async def events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: one ``deployment`` event per change (the view). A reader that fell
    behind gets ``resync`` (every view, as a list) and then every view again as ``deployment``
    events, instead of the events it missed."""
    app_mod, app = _app_parts(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    bus = app[app_mod.BUS]

    async def all_views(resync: bool) -> None:
        views = [app_mod.view(app, dep) for dep in app[app_mod.DEPLOYER].all()]
        if resync:
            await resp.write(b"event: resync\ndata: " + orjson.dumps(views) + b"\n\n")
        for v in views:
            await resp.write(b"event: deployment\ndata: " + orjson.dumps(v) + b"\n\n")
    with bus.stream(ViewPublished) as queue:
        await all_views(False)  # the current views first
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), 15)
            except asyncio.TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if isinstance(event, Resync):
                await all_views(True)
            else:
                await resp.write(b"event: deployment\ndata: " + orjson.dumps(event.view) + b"\n\n")


async def audit(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    try:
        limit = min(1000, max(1, int(request.query.get("limit", "100"))))
        dep = request.query.get("deployment_id")
        dep_id = int(dep) if dep else None
        before_text = request.query.get("before")
        before = int(before_text) if before_text else None
    except ValueError:
        raise _field_error("limit", "limit, deployment_id and before are whole numbers") from None
    return _json(await app[app_mod.STORE].audit(dep_id, limit=limit, before=before))


async def deployment_events(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    return _json(await app[app_mod.STORE].events(_dep_id(request), limit=100))


# GET /api/deployments/{id}/logs: the default and the largest tail.
LOGS_TAIL = 100
LOGS_MAX_TAIL = 10000
# How often a follow looks whether a start waiting at the start-up gate has its engine yet.
LOGS_ENGINE_POLL_S = 0.1


def _logs_query(request: web.Request) -> tuple[int, bool]:
    raw_tail = request.query.get("tail", str(LOGS_TAIL))
    if not raw_tail.isdigit() or int(raw_tail) > LOGS_MAX_TAIL:
        raise _field_error("tail", f"whole lines, 0 to {LOGS_MAX_TAIL}")
    follow = request.query.get("follow", "0")
    if follow not in ("0", "1", "true", "false"):
        raise _field_error("follow", "1 or 0")
    return int(raw_tail), follow in ("1", "true")


async def _engine_or_not_starting(deployer: Deployer, dep_id: int) -> None:
    """Wait while the deployment is starting but its engine is not made yet (its start waits
    at the start-up gate): a follow then begins with that run instead of ending at once."""
    while True:
        dep = deployer.get(dep_id)
        if dep is None or dep.state is not State.STARTING or deployer.base_url(dep_id) is not None:
            return
        await asyncio.sleep(LOGS_ENGINE_POLL_S)


async def deployment_logs(request: web.Request) -> web.StreamResponse:
    """The engine's log as text/plain: the last ``tail`` lines, and with ``follow=1`` what
    the running engine writes until its log ends or the client hangs up."""
    app_mod, app = _app_parts(request)
    dep_id = _dep_id(request)
    tail, follow = _logs_query(request)
    deployer = app[app_mod.DEPLOYER]
    if follow:
        await _engine_or_not_starting(deployer, dep_id)
    dep = deployer.get(dep_id)
    if dep is None:
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8", "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff"})
    # Closed in every case, a hang-up (the handler's cancellation) included: the
    # backend's follower or Docker's stream goes with it, and no task is left.
    async with contextlib.aclosing(deployer.backend.logs(dep, tail=tail, follow=follow)) as stream:
        try:
            first = await anext(stream, b"")
        except BackendError as exc:
            raise OndemandError(503, "logs_unavailable", f"cannot read the log of {dep.name}: {exc}") from exc
        await resp.prepare(request)
        try:
            await resp.write(first)
            async for chunk in stream:
                await resp.write(chunk)
        except BackendError as exc:  # the answer has begun: say so in the text, then end it
            await resp.write(f"\n[ondemand: the log broke off: {exc}]\n".encode())
        except ConnectionResetError:
            return resp
    await resp.write_eof()
    return resp


async def sync_now(request: web.Request) -> web.Response:
    app_mod, app = _app_parts(request)
    sync = app[app_mod.SYNC]
    if not sync.enabled:
        raise OndemandError(409, "litellm_disabled", "LiteLLM is not configured (litellm.url, litellm.master_key_file)")
    return _json(await sync.sync_now())


async def litellm_names(request: web.Request) -> web.Response:
    """Each name ondemand registers in LiteLLM: which instances serve it, ready or cold."""
    app_mod, app = _app_parts(request)
    sync = app[app_mod.SYNC]
    if not sync.enabled:
        raise OndemandError(409, "litellm_disabled", "LiteLLM is not configured (litellm.url, litellm.master_key_file)")
    return _json({"instance": app[app_mod.CONFIG].instance, "names": await sync.names()})


# How long the state file may take to answer a liveness check (a transaction in
# progress is waited for, as any read waits).
HEALTH_TIMEOUT_S = 2.0


async def healthz(request: web.Request) -> web.Response:
    """Liveness for Docker's HEALTHCHECK, systemd and load balancers: no credentials
    (it says nothing but "up"), 200 while this loop and the state file answer."""
    try:
        await asyncio.wait_for(request.app[components.STORE].ping(), HEALTH_TIMEOUT_S)
    except Exception as exc:  # a closed, locked or broken state file: not healthy, whatever the cause
        reason = "the state file did not answer in time" if isinstance(exc, asyncio.TimeoutError) \
            else f"the state file does not answer: {exc}"
        log.warning("health check: %s", reason)
        return _json({"status": "unavailable", "reason": reason}, status=503)
    return _json({"status": "ok"})


async def metrics_route(request: web.Request) -> web.Response:
    """The Prometheus text format: the admin token over TCP (unless ``metrics_public``),
    nothing on the admin socket."""
    telemetry = request.app[components.TELEMETRY]
    return web.Response(body=telemetry.exposition(), headers={"Content-Type": CONTENT_TYPE})


_UI_DIR = pathlib.Path(__file__).parent / "ui"
# The page's files: a fixed list, so nothing else under the package can be fetched.
_UI_FILES = {"": ("index.html", "text/html"), "app.js": ("app.js", "text/javascript"),
             "app.css": ("app.css", "text/css")}
_UI_HEADERS = {"Cache-Control": "no-cache", "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer",
               "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                          "connect-src 'self'; img-src 'self'; frame-ancestors 'none'; "
                                          "base-uri 'none'; form-action 'none'"}


async def ui(request: web.Request) -> web.Response:
    """The admin page (no credentials needed to load it: it asks for the token, and
    everything it shows comes from the admin API, which checks it)."""
    name, content_type = _UI_FILES[request.match_info.get("file", "")]
    return web.Response(body=(_UI_DIR / name).read_bytes(), content_type=content_type, charset="utf-8",
                        headers=_UI_HEADERS)


def add_routes(app: web.Application, base_path: str) -> None:
    api = base_path + "/api"
    r = app.router
    r.add_get(base_path + "/ui/", ui)
    r.add_get(base_path + "/ui/{file:app\\.(?:js|css)}", ui)
    r.add_get(base_path + "/healthz", healthz)
    r.add_get(base_path + "/metrics", metrics_route)

    async def to_ui(request: web.Request) -> web.Response:
        raise web.HTTPFound(base_path + "/ui/")
    r.add_get(base_path + "/ui", to_ui)
    r.add_get(api + "/host", host)
    r.add_get(api + "/deployments", list_deployments)
    r.add_post(api + "/deployments", create_deployment)
    r.add_get(api + "/deployments/{id}", get_deployment)
    r.add_delete(api + "/deployments/{id}", delete_deployment)
    r.add_patch(api + "/deployments/{id}", edit_deployment)
    r.add_patch(api + "/deployments/{id}/mode", set_mode)
    r.add_get(api + "/deployments/{id}/events", deployment_events)
    r.add_get(api + "/deployments/{id}/logs", deployment_logs)
    r.add_post(api + "/deployments/{id}/{action:start|stop|sleep|wake}", action)
    r.add_get(api + "/events", events)
    r.add_get(api + "/audit", audit)
    r.add_post(api + "/sync", sync_now)
    r.add_get(api + "/litellm/names", litellm_names)
