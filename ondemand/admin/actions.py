"""The actions on a deployment: start, stop, sleep (its drain first) and wake, and its mode
(``PATCH .../mode``)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..engines import tiers
from ..engines.deployer import Deployer, StartFailed, StartInterrupted
from ..errors import BudgetError, DeployerError, InsufficientMemory, OndemandError
from ..model import State
from .fields import field_error
from .wire import app_parts, caller, deployment_id, json_answer, read_json


async def admit(deployer: Deployer, dep_id: int, request: web.Request) -> None:
    """A start (or a wake) by an administrator: the deployer's refusals in the API's codes."""
    try:
        await deployer.admit_start(dep_id, actor="admin", user=caller(request), text="started by an administrator")
    except InsufficientMemory as exc:
        raise OndemandError(409, "insufficient_memory", f"it does not fit now: {exc}") from exc
    except BudgetError as exc:
        raise OndemandError(503, "budget_unavailable", f"the GPU memory budget cannot be read: {exc}",
                            headers={"Retry-After": "10"}) from exc
    except DeployerError as exc:
        raise OndemandError(409, "invalid_state", str(exc)) from exc


async def set_mode(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    data = await read_json(request)
    unknown = sorted(set(data) - {"mode", "idle_timeout_s"})
    if unknown:
        raise field_error(unknown[0], "unknown field; known: mode, idle_timeout_s")
    mode = data.get("mode")
    if mode not in ("on_demand", "always_on"):
        raise field_error("mode", "on_demand or always_on")
    idle = data.get("idle_timeout_s")
    if "idle_timeout_s" in data and idle is not None and (not isinstance(idle, int) or isinstance(idle, bool)):
        raise field_error("idle_timeout_s", "null or whole seconds")
    try:
        await app[app_mod.ADMISSION].set_mode(dep_id, mode, idle_timeout_s=idle,
                                               set_idle_timeout="idle_timeout_s" in data, user=caller(request))
    except OndemandError as err:
        if err.code == "invalid_idle_timeout":
            raise field_error("idle_timeout_s", err.message.removeprefix("idle_timeout_s ")) from None
        if err.code == "invalid_mode":
            raise field_error("mode", err.message) from None
        raise
    return json_answer(app_mod.view(app, app[app_mod.DEPLOYER].get(dep_id)))


async def action(request: web.Request) -> web.Response:
    app_mod, app = app_parts(request)
    dep_id = deployment_id(request)
    deployer = app[app_mod.DEPLOYER]
    verb = request.match_info["action"]
    user = caller(request)
    try:
        if verb == "start":
            if deployer.get(dep_id).state is State.ASLEEP:
                raise OndemandError(409, "invalid_state", "it is asleep: use wake")
            await admit(deployer, dep_id, request)
        elif verb == "wake":
            if deployer.get(dep_id).state is not State.ASLEEP:
                raise OndemandError(409, "invalid_state", "it is not asleep")
            await admit(deployer, dep_id, request)
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
    return json_answer(app_mod.view(app, deployer.get(dep_id)))


DRAIN_S = 30.0  # how long a sleep waits for the requests in flight, unless its body says
MAX_DRAIN_S = 3600.0


async def _sleep_body(request: web.Request) -> tuple[int | None, float, bool]:
    """The sleep's optional body, ``{"level": 1|2, "drain_s": S, "force": false}``: the level
    asked for (None: the deployment's idle level, else 1), how long to wait for the requests
    in flight, and whether to sleep at once."""
    data = await read_json(request)
    unknown = sorted(set(data) - {"level", "drain_s", "force"})
    if unknown:
        raise field_error(unknown[0], "unknown field; known: level, drain_s, force")
    level = data.get("level")
    if level is not None and (not isinstance(level, int) or isinstance(level, bool) or level not in tiers.LEVELS):
        raise field_error("level", "1 (weights kept in host memory) or 2 (weights dropped), or null "
                                    "(its idle_action's level)")
    drain = data.get("drain_s", DRAIN_S)
    if drain is None:
        drain = DRAIN_S
    if not isinstance(drain, (int, float)) or isinstance(drain, bool) or not 0 <= drain <= MAX_DRAIN_S:
        raise field_error("drain_s", f"seconds to wait for the requests in flight, 0 to {MAX_DRAIN_S:g} "
                                      f"(default {DRAIN_S:g})")
    force = data.get("force", False)
    if not isinstance(force, bool):
        raise field_error("force", "true (sleep at once: the engine aborts what it runs) or false")
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
