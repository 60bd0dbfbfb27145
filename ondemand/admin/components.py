"""The typed keys of the long-lived components on the aiohttp application, and
the deployment view built from them. ``app`` fills them in; the admin API and
the publishers read them. Imports only the component types."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from ..config import Config
from ..control.admission import Admission
from ..control.budget import Budget
from ..control.controller import Controller
from ..control.effects import DeployerEffects
from ..control.footprint import FootprintSampler
from ..control.starts import StartHistory
from ..engines import warmth
from ..engines.deployer import Deployer
from ..engines.metrics import MetricsSampler
from ..engines.recipes import MASK, FieldError, is_secret
from ..engines.startwatch import StartWatch
from ..events import EventBus
from ..gateway.accesslog import AccessLog
from ..gateway.keys import KeyWatcher
from ..gateway.peers import PeerPolicySource
from ..gateway.routes import Gateway
from ..litellm.sync import LiteLLMSync
from ..model import Deployment, State
from ..state.store import Store
from ..tasks import TaskGroup
from .telemetry import Telemetry

STORE = web.AppKey("store", Store)
BUS = web.AppKey("bus", EventBus)
DEPLOYER = web.AppKey("deployer", Deployer)
BUDGET = web.AppKey("budget", Budget)  # the deployer's too (its fit checks), as engines.memory.Memory
CONTROLLER = web.AppKey("controller", Controller)
ADMISSION = web.AppKey("admission", Admission)
EFFECTS = web.AppKey("effects", DeployerEffects)
SAMPLER = web.AppKey("sampler", MetricsSampler)
FOOTPRINTS = web.AppKey("footprints", FootprintSampler)
KEYS = web.AppKey("keys", KeyWatcher)
SYNC = web.AppKey("sync", LiteLLMSync)
PEERS = web.AppKey("peers", PeerPolicySource)
GATEWAY = web.AppKey("gateway", Gateway)
CONFIG = web.AppKey("config", Config)
STARTED_AT = web.AppKey("started_at", float)
# The controller's clock (a test moves it on instead of waiting out an idle timeout).
CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("clock")
TASKS = web.AppKey("tasks", TaskGroup)
TELEMETRY = web.AppKey("telemetry", Telemetry)
ACCESS_LOG = web.AppKey("access_log", AccessLog)  # only when access_log is text or json
STARTS = web.AppKey("starts", StartHistory)
WATCH = web.AppKey("start_watch", StartWatch)


class PolicyHolder(Protocol):
    """What the peer guard asks: set to the live policy source once it has read one."""
    source: PeerPolicySource | None

    def allows(self, ip: str) -> bool: ...


POLICY = web.AppKey("policy", PolicyHolder)


def launch_fields(deployer: Deployer, dep: Deployment) -> dict[str, Any]:
    """``argv`` (the command line as it will run, no secret in it), ``env`` with secrets'
    values masked, and the names of the variables the engine gets (``env_names``)."""
    try:
        how = deployer.launch(dep)
    except (FieldError, ValueError) as exc:
        return {"argv": None, "argv_error": str(exc), "env": {k: MASK if is_secret(k) else v for k, v in dep.env},
                "env_names": [k for k, _ in dep.env]}
    shown = how.shown_env()
    return {"argv": how.argv, "env": {k: MASK if is_secret(k) else v for k, v in dep.env}, "env_names": sorted(shown),
            "engine_image": how.image, "compile_key": how.compile_key}


def memory_fields(dep: Deployment) -> dict[str, Any]:
    """``memory_gib``: what it is booked (declared, else derived: ``recipes.booking``);
    ``memory_source``: ``declared``, ``checkpoint``, ``engine_default``, or ``measured`` when
    its engine was measured to use more (fit checks count that); ``declared_gib``: as given."""
    return {"memory_gib": dep.booked_gib, "memory_source": dep.memory_source, "declared_gib": dep.memory_gib}


def view(app: web.Application, dep: Deployment) -> dict[str, Any]:
    """A deployment view: the row plus its on-demand status, its LiteLLM entry's status,
    its engine's load and how long its starts take."""
    out = dep.as_dict()
    dep_id = dep.id
    out.update(launch_fields(app[DEPLOYER], dep))
    out.update(memory_fields(dep))
    out["base_url"] = app[DEPLOYER].base_url(dep_id)
    out["idle_level"] = warmth.idle_level(dep, app[BUDGET].per_gpu)  # 0: an idle engine is stopped
    out["ondemand"] = app[CONTROLLER].status(dep_id)
    out["adaptive"] = app[CONTROLLER].adaptive(dep_id)  # keep_warm adaptive's plan, or None (as fixed)
    sync = app.get(SYNC)
    out["litellm"] = sync.status_of(dep_id) if sync is not None else None
    sample = app[SAMPLER].as_dict(dep_id)
    out["engine_metrics"] = sample
    starts = app.get(STARTS)
    out.update(starts.fields(dep_id, dep.state is State.ASLEEP) if starts is not None
               else {"last_start_s": None, "start_eta_s": None})
    compile_key, watch = out.pop("compile_key", None), app.get(WATCH)
    if watch is not None:  # the start's phases (and, while it starts, what is left of it), its caches
        out.update(watch.fields(dep_id, compile_key))
    return out
