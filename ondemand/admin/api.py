"""The admin API: ``{base_path}/api/...``, JSON in and out.

Behind the admin token on TCP (``Authorization: Bearer``, constant-time
compare; the on-demand key never opens it) and open on the Unix socket
``{state_dir}/admin.sock`` (mode 0600), which the command line uses.
Errors use the gateway's ``{"error": {"message", "type", "code"}}`` form;
validation errors name the field.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import pathlib
import socket
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .. import __version__
from ..config import Config
from ..control.budget import Budget
from ..engines.deployer import Deployer
from ..errors import BudgetError, OndemandError, StateFileError, internal_error, misdirected, upgrade_refused
from ..gateway import keys as keys_mod
from ..http.aio import ClientGone
from ..http.headers import bearer, token_bytes
from ..http.limits import Limits
from ..http.server import LIMITS
from ..model import State, parse_id
from . import actions, components, deployments, replays, streams
from .fields import field_error
from .telemetry import CONTENT_TYPE
from .wire import JSON, app_parts, http_error, is_unix, json_answer, refusal

# The admin API's logger: its name is the one its logs had before the API was split.
log = logging.getLogger("ondemand.admin.api")
# A request whose client went away before it could be answered (nginx's code, as the gateway's).
CLIENT_GONE = 499


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
            return refusal(upgrade_refused(), close=True)
        if request.raw_path.startswith(gateway + "/"):
            # This connection carries admin requests: the gateway serves only connections
            # that began with one of its own (RFC 9110's 421: retry on another connection).
            return refusal(misdirected("A gateway request on a connection that carries admin requests"))
        if request.path.startswith(gateway):
            return refusal(OndemandError(404, "not_found", "Not found"))  # ondemand%2F1, say
        if guarded(request.path) and not is_unix(request):
            token = keys_mod.read_key_file(cfg.token_file)
            presented = bearer(request.headers) or ""
            # The presented bytes as they came: .encode() raised on a non-UTF-8 byte (issue 23).
            if token is None or not hmac.compare_digest(token_bytes(presented), token.encode()):
                telemetry = request.app.get(components.TELEMETRY)
                if telemetry is not None:
                    telemetry.auth_failed()
                err = OndemandError(401, "invalid_admin_token",
                                    "The admin API needs the admin token (admin_token_file), or the admin socket")
                return web.Response(status=401, body=err.body(), content_type=JSON)
        try:
            return await handler(request)
        except StateFileError as exc:
            err = OndemandError(503, "state_file_unwritable", str(exc), headers={"Retry-After": "30"})
            return web.Response(status=err.status, body=err.body(), content_type=JSON, headers=err.headers)
        except OndemandError as err:
            return refusal(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return http_error(exc, (request.app.get(LIMITS) or Limits()).admin_max_body)
        except ClientGone:
            log.debug("%s %s: the client hung up before its body had arrived; nothing was done",
                      request.method, request.path)
            gone = web.Response(status=CLIENT_GONE)  # for no one: aiohttp drops it on the closed connection
            gone.force_close()
            return gone
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            if request.writer is None or request.writer.output_size:
                raise  # an answer (an event stream) is under way: aiohttp cuts the connection
            return web.Response(status=500, body=internal_error().body(), content_type=JSON)
    return admin_auth


# --- host -------------------------------------------------------------------------

async def host(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    cfg: Config = app[app_mod.CONFIG]
    deployer, gpus = app[app_mod.DEPLOYER], app[app_mod.BUDGET]
    try:
        snap = (await gpus.snapshot(deployer.as_read())).as_dict()  # as a start's fit check counts it
        budget: dict[str, Any] = {"source": gpus.source, **snap}
    except BudgetError as exc:
        budget = {"source": gpus.source, "error": str(exc)}
    key = app[app_mod.KEYS].current()
    sync = app[app_mod.SYNC]
    last = getattr(sync, "last_result", None) or {}
    return json_answer({
        "version": __version__,
        "hostname": socket.gethostname(),
        "instance": cfg.instance,
        "listen": cfg.listen,
        "backend": deployer.backend.kind,
        "budget": budget,
        "host_memory": host_memory(deployer, gpus),
        "ondemand": {
            "configured": key is not None,
            "key_fingerprint": keys_mod.fingerprint(key) if key else None,
            "litellm_enabled": sync.enabled,
            "litellm_ready": sync.last_ok,
            "litellm_error": last.get("error") if isinstance(last, dict) else None,
            "queued": app[app_mod.CONTROLLER].waiting(),
            "queue": app[app_mod.CONTROLLER].queue.ids(),
            "scheduler": cfg.scheduler,  # who waits and who holds the memory, and what it aims at
            "slo_s": cfg.slo_s,
        },
    })


def host_memory(deployer: Deployer, budget: Budget) -> dict[str, float | None]:
    """The host memory tiered warmth watches (GiB): the box's total and what is available
    (``MemAvailable`` of ``budget.meminfo_path``; null when unreadable), what the asleep
    engines were measured to hold, and the reserve a level-1 sleep must leave."""
    try:
        mem = budget.meminfo()
        total: float | None = round(mem.total, 3)
        available: float | None = round(mem.total - mem.used, 3)
    except BudgetError:
        total = available = None
    asleep = sum(d.host_gib or 0.0 for d in deployer.all() if d.state is State.ASLEEP)
    return {"total_gib": total, "available_gib": available, "asleep_gib": round(asleep, 3),
            "reserve_gib": budget.host_reserve_gib}


# GET /api/audit: the default and the largest page.
AUDIT_LIMIT = 100
AUDIT_MAX_LIMIT = 1000


async def audit(request: web.Request) -> web.Response:
    """The audit rows, newest first: ``limit`` of them, of deployment ``deployment_id``, older
    than row ``before``; each out of its range is 400 naming it (a limit out of range was
    clamped, and an id beyond SQLite's 64 bits a 500)."""
    app_mod, app = app_parts(request)
    raw_limit = request.query.get("limit", str(AUDIT_LIMIT))
    # ASCII digits, a few: "¹" passes isdigit() and 5,000 digits int() (as ?tail= of the logs).
    if not (raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 6) \
            or not 1 <= int(raw_limit) <= AUDIT_MAX_LIMIT:
        raise field_error("limit", f"whole rows, 1 to {AUDIT_MAX_LIMIT} (default {AUDIT_LIMIT})")
    dep_id = _query_id(request, "deployment_id", "a deployment's id")
    before = _query_id(request, "before", "an audit row's id (the next page: rows older than it)")
    return json_answer(await app[app_mod.STORE].audit(dep_id, limit=int(raw_limit), before=before))


def _query_id(request: web.Request, name: str, what: str) -> int | None:
    """An id of the query, canonical decimal as in a path (at most 18 digits: SQLite's integers
    are 64-bit); absent or empty: None."""
    raw = request.query.get(name)
    if not raw:
        return None
    value = parse_id(raw)
    if value is None:
        raise field_error(name, f"{what}: a whole number, at most 18 digits")
    return value


async def sync_now(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    sync = app[app_mod.SYNC]
    if not sync.enabled:
        raise OndemandError(409, "litellm_disabled", "LiteLLM is not configured (litellm.url, litellm.master_key_file)")
    return json_answer(await sync.sync_now())


async def litellm_names(request: web.Request) -> web.Response:
    """Each name ondemand registers in LiteLLM: which instances serve it, ready or cold."""
    app_mod, app = app_parts(request)
    sync = app[app_mod.SYNC]
    if not sync.enabled:
        raise OndemandError(409, "litellm_disabled", "LiteLLM is not configured (litellm.url, litellm.master_key_file)")
    return json_answer({"instance": app[app_mod.CONFIG].instance, "names": await sync.names()})


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
        return json_answer({"status": "unavailable", "reason": reason}, status=503)
    return json_answer({"status": "ok"})


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
    r.add_get(api + "/deployments", deployments.list_deployments)
    r.add_post(api + "/deployments", deployments.create_deployment)
    r.add_get(api + "/deployments/{id}", deployments.get_deployment)
    r.add_delete(api + "/deployments/{id}", deployments.delete_deployment)
    r.add_patch(api + "/deployments/{id}", deployments.edit_deployment)
    r.add_patch(api + "/deployments/{id}/mode", actions.set_mode)
    r.add_get(api + "/deployments/{id}/events", deployments.deployment_events)
    r.add_get(api + "/deployments/{id}/logs", streams.deployment_logs)
    r.add_post(api + "/deployments/{id}/{action:start|stop|sleep|wake}", actions.action)
    r.add_get(api + "/events", streams.events)
    r.add_get(api + "/audit", audit)
    r.add_post(api + "/sync", sync_now)
    r.add_get(api + "/litellm/names", litellm_names)
    r.add_get(api + "/replays", replays.list_replays)
    r.add_get(api + "/replays/{name}", replays.get_replay)
