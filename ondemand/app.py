"""The one composition module: builds every object, wires them, runs the server.

Every long-lived resource is a typed ``web.AppKey`` started and stopped
through ``app.cleanup_ctx``, so the start-up order is the list in
``build_app`` and shutdown is its reverse (aiohttp's habit). Nothing else
wires components together or reads the environment (the command line's
``cli`` builds the few it uses without a server, ``http.server`` its
connections; ``config`` reads the environment once).
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from . import __version__, events
from .admin.components import (
    ACCESS_LOG,
    ADMISSION,
    BUDGET,
    BUS,
    CLOCK,
    CONFIG,
    CONTROLLER,
    DEPLOYER,
    EFFECTS,
    FOOTPRINTS,
    GATEWAY,
    KEYS,
    PEERS,
    POLICY,
    SAMPLER,
    STARTED_AT,
    STARTS,
    STORE,
    SYNC,
    TASKS,
    TELEMETRY,
    WATCH,
    view,
)
from .admin.gpu_memory import GpuMemory
from .admin.telemetry import Telemetry
from .config import Config
from .control.admission import Admission
from .control.budget import Budget
from .control.controller import Controller
from .control.effects import DeployerEffects
from .control.footprint import FootprintSampler
from .control.reaper import Reaper
from .control.scheduler import scheduler
from .control.starts import StartHistory
from .engines.backends import Backend
from .engines.backends.process import ProcessBackend
from .engines.deployer import Deployer
from .engines.metrics import MetricsSampler
from .engines.recipes import Box
from .engines.startwatch import StartWatch
from .errors import StartupError
from .events import CountersChanged, DeploymentChanged, EventBus, KeyRotated, Slept, ViewPublished, Woken
from .gateway import keys as keys_mod
from .gateway.accesslog import AccessLog
from .gateway.exchange import Exchange
from .gateway.peers import PeerGuard, PeerPolicySource
from .gateway.ratelimit import FailureLimiter
from .gateway.routes import Gateway
from .http.cycle import Call
from .http.limits import Limits
from .http.pool import Upstreams
from .http.server import LIMITS, ROUTE, HttpServer, Route, raise_open_files
from .litellm.client import LiteLLMClient
from .litellm.sync import LiteLLMSync
from .model import State
from .state.lock import lock_state_dir, make_state_dir, not_a_directory
from .state.retention import prune_old_rows
from .state.store import Store
from .tasks import TaskGroup

log = logging.getLogger("ondemand.app")

def make_backend(cfg: Config) -> Backend:
    if cfg.deployer.backend == "process":
        return ProcessBackend(cfg.state_dir)
    from .engines.backends.docker import DockerBackend
    return DockerBackend(docker_url=cfg.deployer.docker_url, network=cfg.deployer.network,
                         own_container_id=socket.gethostname(), gpus=cfg.deployer.gpus,
                         shm_size_gib=cfg.deployer.shm_size_gib, publish_host=cfg.deployer.publish_host)


def ensure_token(path: Path) -> str:
    """The admin token in ``path``, written there first (a new one) when there is none."""
    token = keys_mod.read_key_file(path)
    if token is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # one line, as for the state directory
            raise StartupError(f"admin_token_file {path}: {path.parent} {not_a_directory(path.parent)}") from None
        token = keys_mod.generate_key().replace("odk-", "oda-", 1)
        keys_mod.write_key_file(path, token)
        log.info("wrote a new admin token to %s", path)
    return token


def build_app(cfg: Config, *, backend: Backend | None = None,
              clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The application: routes and middlewares now (aiohttp freezes them), the
    components in the cleanup contexts below, in start-up order. ``clock``: the controller's."""
    from .admin import api as admin  # the admin API's routes

    # Built here, once, for both stacks; the connection caps are configuration keys.
    limits = Limits.of(cfg)
    app = web.Application(client_max_size=limits.client_max_size())
    app[CONFIG] = cfg
    app[LIMITS] = limits
    app[BUS] = EventBus()
    app[STARTED_AT] = time.time()
    app[CLOCK] = clock
    holder = _PolicyHolder()
    app[POLICY] = holder
    guard = PeerGuard(holder, cfg.base_path + "/ondemand")
    app.middlewares.append(guard)
    app.middlewares.append(admin.auth_middleware(cfg))

    app[ROUTE] = _gateway_route(app, guard, cfg.base_path + "/ondemand")
    admin.add_routes(app, cfg.base_path)

    async def engines(app: web.Application) -> AsyncIterator[None]:
        async for _ in _engines(app, backend):
            yield

    app.on_shutdown.append(_shutting_down)
    app.cleanup_ctx.extend([_state, _starts, engines, _control, _observe, _gateway, _litellm, _views, _background,
                            _restarts])
    return app


def _gateway_route(app: web.Application, guard: PeerGuard, prefix: str) -> Route:
    """The gateway's routes, the lean front's alone: the peer guard (check 1), then the gateway."""
    refused = guard.refused_body

    async def handle(call: Call) -> None:
        if guard.refuses(call.headers, call.peer):  # a refused request ends its connection (issue 40)
            return await call.send(404, {"Content-Type": "application/json"}, refused, close=True)
        await app[GATEWAY].handle(call)
    # A listener of the gateway's alone (admin_listen) closes a peer the policy refuses at the accept.
    return Route(prefix, handle, lambda: app[GATEWAY].max_body, allows=guard.policy.allows)


async def _shutting_down(app: web.Application) -> None:
    """aiohttp's shutdown signal: it comes after the listeners close and before aiohttp
    waits for open requests, so waiters end at once and nothing starts or stops for them."""
    controller = app.get(CONTROLLER)
    if controller is not None:
        controller.shutdown()


async def _state(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    lock = lock_state_dir(cfg.state_dir)  # first: before anything touches engines or the file
    try:
        app[STORE] = await Store.open(cfg.db_path)
        yield
        await app[STORE].close()
    finally:
        os.close(lock)


async def _starts(app: web.Application) -> AsyncIterator[None]:
    """The start history, listening before the deployer loads: a start taken back is timed too."""
    history = app[STARTS] = StartHistory(app[STORE])
    await history.load()
    app[BUS].subscribe(events.StartEnded, history.on_start_ended)
    app[BUS].subscribe(events.Slept, history.on_slept)
    app[BUS].subscribe(DeploymentChanged, lambda e: history.forget(e.dep_id) if e.removed else None)
    yield
    await history.close()


async def _engines(app: web.Application, backend: Backend | None) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    backend = backend or make_backend(cfg)
    box = dataclasses.replace(Box.from_config(cfg), backend=backend.kind)  # a test's backend may be another kind
    # The engines' pools: the gateway forwards on them, and every call of ondemand's own to an
    # engine (the deployer's, the sampler's) is made by them too, on connections of its own.
    upstreams = Upstreams()

    def forget_removed(e: DeploymentChanged) -> None:
        # Removed, or put to sleep: its idle connections to the engine are closed (asleep it may
        # sleep for hours; the wake's first request opens new ones).
        if e.removed or e.new_state is State.ASLEEP:
            upstreams.forget(e.dep_id)
    app[BUS].subscribe(DeploymentChanged, forget_removed)
    budget = app[BUDGET] = Budget.from_config(cfg)  # control's: the deployer's fit checks read it
    deployer = Deployer(app[STORE], backend, budget, publish=app[BUS].publish,
                        start_timeout_s=cfg.deployer.start_timeout_s, stop_timeout_s=cfg.deployer.stop_timeout_s,
                        wake_timeout_s=cfg.deployer.wake_timeout_s, box=box, upstreams=upstreams)
    app[DEPLOYER] = deployer
    app[SAMPLER] = MetricsSampler(lambda: deployer.engines_in((State.READY, State.ASLEEP)),
                                  interval_s=cfg.metrics_interval_s, client=deployer.client)
    footprints = app[FOOTPRINTS] = FootprintSampler(deployer, budget, interval_s=cfg.metrics_interval_s)

    def measure_when_ready(e: DeploymentChanged) -> None:
        if e.dep is not None and e.dep.state is State.READY and (e.old is None or e.old.state is not State.READY):
            # A second later: the requests that waited for it are forwarded first, not beside a
            # fork of nvidia-smi (the wake path's benchmark saw 10 to 20 ms of it).
            asyncio.get_running_loop().call_later(1.0, footprints.engine_ready)
    app[BUS].subscribe(DeploymentChanged, measure_when_ready)
    # Around each cold start: the compile cache, the weights read ahead, the phases in its log.
    watch = deployer.start_hooks = app[WATCH] = StartWatch.of(cfg, backend, deployer.budget.host_available_gib,
                                                             publish=app[BUS].publish, estimates=app[STARTS],
                                                             units=deployer.unit)
    app[BUS].subscribe(events.StartBegan, watch.on_start_began)
    app[BUS].subscribe(events.StartEnded, watch.on_start_ended)
    app[BUS].subscribe(DeploymentChanged, lambda e: watch.forget(e.dep_id) if e.removed else None)
    await deployer.load()
    yield
    await deployer.close(stop_engines=deployer.backend.kind == "process")
    await watch.close()
    await app[SAMPLER].close()
    await upstreams.close()


async def _control(app: web.Application) -> AsyncIterator[None]:
    cfg, bus, deployer = app[CONFIG], app[BUS], app[DEPLOYER]
    effects = app[EFFECTS] = DeployerEffects(deployer, app[BUDGET], app[SAMPLER], publish=bus.publish,
                                             starts=app[STARTS])
    controller = app[CONTROLLER] = Controller(
        effects, clock=app[CLOCK], wall=time.time, queue_timeout_s=cfg.ondemand_queue_timeout_s,
        max_queued=cfg.ondemand_max_queued, idle_timeout_s=cfg.ondemand_idle_timeout_s,
        min_idle_timeout_s=cfg.min_idle_timeout_s, sleep_timeout_s=cfg.sleep_timeout_s,
        scheduler=scheduler(cfg.scheduler, cfg.slo_s))
    effects.bind(controller)
    controller.learn(await deployer.store.idle_gaps())  # adaptive warmth: a restart keeps what was learned
    app[ADMISSION] = Admission(controller, deployer)
    bus.subscribe(DeploymentChanged, lambda e: controller.on_deployment(e.dep_id, e.dep, e.old))
    bus.subscribe(Slept, lambda e: controller.on_slept(e.dep_id))  # its memory is free: the queue looks
    yield
    controller.close()
    await effects.close()


async def _observe(app: web.Application) -> AsyncIterator[None]:
    """The metrics (``/metrics``) and the access log."""
    cfg, deployer, controller = app[CONFIG], app[DEPLOYER], app[CONTROLLER]
    gpu = GpuMemory(deployer, app[BUDGET])
    gpu()  # the first reading, so that the first scrape has one
    telemetry = app[TELEMETRY] = Telemetry(deployments=deployer.all, inflight=controller.inflight,
                                           queued=controller.waiting, gpu_memory=gpu, busy=controller.busy_total,
                                           prewarms=controller.prewarms, make_rooms=controller.make_rooms)
    app[BUS].subscribe(DeploymentChanged, telemetry.on_deployment)
    app[BUS].subscribe(events.StartEnded, telemetry.on_start_ended)
    app[BUS].subscribe(Slept, telemetry.on_slept)
    app[BUS].subscribe(Woken, telemetry.on_woken)
    app[BUS].subscribe(events.StartTimed, telemetry.on_start_timed)
    access = None
    if cfg.access_log != "off":
        access = app[ACCESS_LOG] = AccessLog(cfg.access_log, sys.stderr)
    try:
        yield
    finally:
        if access is not None:
            access.close()
        await gpu.close()


def _finished(app: web.Application) -> Callable[[Exchange], None]:
    """What the gateway does with a finished request: count it, and log it when asked."""
    count, access = app[TELEMETRY].exchange, app.get(ACCESS_LOG)
    if access is None:
        return count

    def count_and_log(ex: Exchange) -> None:
        count(ex)
        access.write(ex, time.time())
    return count_and_log


async def _gateway(app: web.Application) -> AsyncIterator[None]:
    cfg, bus = app[CONFIG], app[BUS]
    watcher = app[KEYS] = keys_mod.KeyWatcher(cfg.key_file, publish=bus.publish)
    limiter = FailureLimiter()
    bus.subscribe(KeyRotated, lambda e: limiter.clear())  # failed-attempt counts cleared at rotation
    watcher.current()
    app[GATEWAY] = Gateway(controller=app[ADMISSION], keys=watcher,
                           limiter=limiter, upstreams=app[DEPLOYER].client.upstreams, base_path=cfg.base_path,
                           finished=_finished(app),
                           start_eta=app[WATCH].notice_eta_s, start_phase=app[WATCH].notice_phase,
                           queue_place=app[CONTROLLER].queue_place,
                           max_body=app[LIMITS].gateway_max_body, body_timeout_s=app[LIMITS].body_timeout_s)
    yield


def _litellm_client(cfg: Config) -> LiteLLMClient | None:
    if not cfg.litellm.url:
        return None
    master = keys_mod.read_key_file(cfg.litellm.master_key_file) if cfg.litellm.master_key_file else None
    if master is None:
        log.warning("litellm.url is set but litellm.master_key_file holds no key: the sync is disabled")
        return None
    return LiteLLMClient(cfg.litellm.url, master)


async def _litellm(app: web.Application) -> AsyncIterator[None]:
    cfg, bus, deployer = app[CONFIG], app[BUS], app[DEPLOYER]

    async def deployments() -> list[dict[str, Any]]:
        return [d.as_dict() for d in deployer.all()]

    sync = app[SYNC] = LiteLLMSync(
        client=_litellm_client(cfg), internal_url=cfg.internal_url.rstrip("/"),
        queue_timeout_s=cfg.ondemand_queue_timeout_s, list_deployments=deployments,
        current_key=app[KEYS].current, engine_base_url=lambda d: deployer.base_url(d["id"]),
        instance=cfg.instance, on_result=app[TELEMETRY].litellm_synced)

    bus.subscribe(DeploymentChanged, sync.on_deployment)
    bus.subscribe(events.StartEnded, sync.on_start_ended)
    bus.subscribe(KeyRotated, lambda e: sync.trigger())
    yield
    await sync.close()


async def _views(app: web.Application) -> AsyncIterator[None]:
    """Deployment views for the admin API's event stream: on every change of a
    deployment, and on the controller's (throttled) counter changes."""
    bus, deployer = app[BUS], app[DEPLOYER]

    def publish(dep_id: int) -> None:
        dep = deployer.get(dep_id)
        bus.publish(ViewPublished(view(app, dep) if dep is not None else {"id": dep_id, "removed": True}))

    bus.subscribe(DeploymentChanged, lambda e: publish(e.dep_id))
    bus.subscribe(CountersChanged, lambda e: publish(e.dep_id))
    bus.subscribe(events.StartPhase, lambda e: publish(e.dep_id))  # a start's phase: its bar on the page
    yield


async def _background(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    tasks = app[TASKS] = TaskGroup("app")
    peers = app[PEERS] = PeerPolicySource(cfg.ondemand_allowed_cidrs, decider_network=cfg.decider_network,
                                          container_id_hint=socket.gethostname(),
                                          docker_url=cfg.deployer.docker_url)
    app[POLICY].source = peers
    await peers.refresh()
    tasks.spawn(peers.run(30.0, refresh_first=False), "peer policy")  # refreshed just above
    tasks.spawn(app[SAMPLER].run(), "metrics sampler")
    tasks.spawn(app[FOOTPRINTS].run(), "footprint sampler")
    tasks.spawn(Reaper(app[CONTROLLER], cfg.reap_interval_s).run(), "reaper")
    tasks.spawn(app[SYNC].run(), "litellm sync")
    tasks.spawn(_watch_key(app[KEYS]), "key watcher")
    tasks.spawn(prune_old_rows(app[STORE], cfg.retention_days), "retention")
    yield
    await tasks.close()


async def _restarts(app: web.Application) -> AsyncIterator[None]:
    """The always-on deployments that lost their engine while ondemand was down start again
    (issue 21, "After a reboot"), last: everything that hears of a start listens by now (the
    controller, the LiteLLM sync, the views). The deployer decides and owns the tasks."""
    app[DEPLOYER].restart_lost(held_for_others=app[CONTROLLER].held_for_others)
    yield


class _PolicyHolder:
    """The peer guard's policy before and after the first refresh: nobody until then."""
    source: PeerPolicySource | None = None

    def allows(self, ip: str) -> bool:
        return self.source is not None and self.source.allows(ip)


async def _watch_key(watcher: keys_mod.KeyWatcher) -> None:
    """Look at the key file about once a second even without traffic, so that a
    rotation re-registers LiteLLM's entries promptly."""
    while True:
        watcher.current()
        await asyncio.sleep(1.0)


# --- running -------------------------------------------------------------------

def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=None,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _tune_gc() -> None:
    """Start-up's objects leave the cyclic collector's scans, and its youngest generation is
    collected every 10,000 allocations, not 700: a request allocates a few hundred short-lived
    objects, almost none in cycles; with the defaults the collector took a tenth of its CPU."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


async def serve(cfg: Config, *, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM or SIGINT: stop accepting, let streams end within the
    grace period, then cancel what is left (uvicorn's order)."""
    setup_logging(cfg.log_level)
    raise_open_files(cfg.max_connections)
    make_state_dir(cfg.state_dir)  # a file in its place is one line, before the token is written there
    ensure_token(cfg.token_file)
    app = build_app(cfg)
    server = HttpServer(app, shutdown_timeout=cfg.shutdown_grace_s)
    try:
        await server.start()
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(f"cannot start: {exc}") from exc
    host, port = cfg.listen_host_port
    sock_path = cfg.admin_socket
    try:
        # A deep backlog: LiteLLM may open hundreds of connections at once, and a full
        # default queue (128) drops handshakes that then retry after 1, 3, 7 s.
        admin = cfg.admin_listen_host_port
        await server.listen_tcp(host or None, port, backlog=4096, serves="gateway" if admin else "all")
        if admin is not None:
            await server.listen_tcp(admin[0] or None, admin[1], serves="admin")
        if sock_path.exists() or sock_path.is_symlink():
            sock_path.unlink()
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            await server.listen_unix(str(sock_path))
        finally:
            os.umask(old_umask)
        os.chmod(sock_path, stat.S_IRUSR | stat.S_IWUSR)
    except OSError as exc:
        await server.stop()
        raise StartupError(f"cannot listen on {cfg.listen}{' / ' + cfg.admin_listen if cfg.admin_listen else ''} / "
                           f"{sock_path}: {exc.strerror or exc}") from exc
    _tune_gc()
    log.info("ondemand %s listening on %s (gateway %s/ondemand, admin %s/api%s, socket %s)",
             __version__, cfg.listen, cfg.base_path, cfg.base_path,
             f" on {cfg.admin_listen}" if cfg.admin_listen else "", sock_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("shutting down: no new connections; streams get %gs to end", cfg.shutdown_grace_s)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
        sock_path.unlink(missing_ok=True)
        log.info("stopped")
