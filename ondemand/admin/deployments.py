"""The deployment routes: list, read, create (and its dry run), edit, remove, and a
deployment's stored events."""
from __future__ import annotations

import logging

from aiohttp import web

from ..engines import metrics, warmth
from ..engines.deployer import Deployer
from ..errors import BudgetError, DeployerError, DeploymentBusy, NameTaken, OndemandError
from ..model import Deployment
from . import components
from .actions import admit
from .fields import validate_changes, validate_new
from .wire import app_parts, caller, deployment_id, json_answer, read_json

# The admin API's logger: its name is the one its logs had before the API was split.
log = logging.getLogger("ondemand.admin.api")


async def list_deployments(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    return json_answer([app_mod.view(app, d) for d in app[app_mod.DEPLOYER].all()])


async def get_deployment(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    return json_answer(app_mod.view(app, app[app_mod.DEPLOYER].get(dep_id)))


async def edit_deployment(request: web.Request) -> web.Response:
    """Edit a stopped, failed or planned deployment in place; the id stays."""
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    deployer = app[app_mod.DEPLOYER]
    data = await read_json(request)
    dep = deployer.get(dep_id)
    if dep is None:  # removed while the body was read
        raise OndemandError(404, "not_found", f"no deployment {dep_id}")
    changes = validate_changes(data, app[app_mod.CONFIG], dep, deployer.all(), *await _box_sizes(deployer))
    try:
        dep = await deployer.edit(dep_id, changes, actor="admin", user=caller(request))
    except DeploymentBusy as exc:
        raise OndemandError(409, "deployment_busy", str(exc)) from exc
    except NameTaken as exc:
        raise OndemandError(409, "name_taken", str(exc)) from exc
    except DeployerError as exc:  # removed while the edit waited for the deployer
        raise OndemandError(404, "not_found", str(exc)) from exc
    # (the LiteLLM sync follows the change on its own: litellm.sync.sync_needed)
    if changes and metrics.blind(dep):
        log.warning("%s: %s", dep.name, metrics.BLIND_WARNING)
    return json_answer(app_mod.view(app, dep))


async def create_deployment(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    deployer = app[app_mod.DEPLOYER]
    data = await read_json(request)
    fields, start_now = validate_new(data, app[app_mod.CONFIG], deployer.all(), *await _box_sizes(deployer))
    if request.query.get("dry_run") not in (None, "0", "false"):
        # What it would be and run, with nothing written (deploy add --dry-run).
        dep = await deployer.book(Deployment.from_row({**fields, "id": 0}))  # its checkpoint read in a thread
        return json_answer({**dep.as_dict(), **components.launch_fields(deployer, dep), **components.memory_fields(dep),
                      "idle_level": warmth.idle_level(dep, deployer.budget.per_gpu), "dry_run": True})
    dep = await deployer.create(fields, actor="admin", user=caller(request))
    if metrics.blind(dep):
        log.warning("%s: %s", dep.name, metrics.BLIND_WARNING)
    if start_now:
        await admit(deployer, dep.id, request)
    return json_answer(app_mod.view(app, deployer.get(dep.id) or dep), status=201)


async def _box_sizes(deployer: Deployer) -> tuple[tuple[float, ...] | None, bool]:
    """The GPUs' sizes for the checks against the box, or None when they cannot be read now."""
    try:
        return await deployer.budget.box_sizes(), deployer.budget.per_gpu
    except BudgetError as exc:
        log.warning("the GPUs cannot be read (%s): a new deployment is not checked against the box", exc)
        return None, deployer.budget.per_gpu


async def delete_deployment(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    await app[app_mod.DEPLOYER].remove(dep_id, actor="admin", user=caller(request))
    return json_answer({"id": dep_id, "removed": True})


async def deployment_events(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    return json_answer(await app[app_mod.STORE].events(deployment_id(request), limit=100))
