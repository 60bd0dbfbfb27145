"""Every refusal the controller gives a request, in one place: their codes, statuses,
texts and headers (the README's error table), and ``screen``, the refusals that need no
wait, in the order of the gateway's checks. Each is made when it is given."""
from __future__ import annotations

from typing import Any

from ..errors import OndemandError
from ..model import Deployment, Role, State
from .placement import Fit
from .ticket import Want


class Refusal(OndemandError):
    """A refusal of the controller's. ``deployment``: the name of the deployment it refuses
    ("" for none), which the gateway's records of the request carry (the metrics' label);
    ``before_body``: one of ``screen``'s, which a request meets before its body is read."""

    def __init__(self, dep: Deployment | None, status: int, code: str, message: str, *,
                 before_body: bool = False, **kw: Any):
        super().__init__(status, code, message, **kw)
        self.deployment = dep.name if dep is not None else ""
        self.before_body = before_body


def screen(dep: Deployment | None, want: Want) -> Deployment:
    """The refusals a request meets before anything waits, on the deployment as read in the
    step of the verdict, in the order of the gateway's checks (BEHAVIOUR.md, "Checks, in
    order", 7 to 9): unknown, the decision model, planned, a model's route while not ready,
    an always-on deployment not ready (a health check is answered in every state, and a
    pending switch to always on is waited for as an on-demand start). Returns ``dep``."""
    if dep is None:
        raise Refusal(None, 404, "not_found", "Not found", before_body=True)
    if dep.role is Role.DECISION:
        raise Refusal(dep, 503, "not_on_demand", f"{dep.served_name} is not served through the on-demand gateway",
                      before_body=True)
    if want is Want.LIST:
        return dep
    if dep.state is State.PLANNED:  # not registered in LiteLLM: nothing to wait for
        raise planned(dep, before_body=True)
    if dep.state is State.READY or want is Want.HEALTH:
        return dep
    if want is Want.MODEL:
        raise Refusal(dep, 503, "ondemand_not_ready", f"{dep.served_name} is {dep.state}", before_body=True)
    if not dep.on_demand and dep.pending_mode is None:
        raise Refusal(dep, 503, "not_on_demand", f"{dep.served_name} is always on and is {dep.state}",
                      before_body=True)
    return dep


def unknown(dep_id: int) -> OndemandError:
    return Refusal(None, 404, "not_found", f"deployment {dep_id} does not exist")


def removed(dep_id: int) -> OndemandError:
    return Refusal(None, 404, "not_found", f"deployment {dep_id} was removed")


def planned(dep: Deployment, *, before_body: bool = False) -> OndemandError:
    return Refusal(dep, 503, "ondemand_planned",
                   f"{dep.served_name} is planned: an administrator has to start it first", before_body=before_body)


def shutting_down() -> OndemandError:
    return OndemandError(503, "ondemand_shutting_down", "ondemand is shutting down; send the request again",
                         headers={"Retry-After": "10"})


def busy(dep: Deployment) -> OndemandError:
    # 429 with x-should-retry: LiteLLM cools the entry down and the OpenAI SDKs send it again
    # after Retry-After, so the next try may land on another box (docs/several-boxes.md).
    return Refusal(dep, 429, "ondemand_busy",
                   f"{dep.served_name} is answering its limit of {dep.max_inflight} requests at once "
                   "(max_inflight); send the request again in a moment",
                   headers={"Retry-After": "1", "x-should-retry": "true"})


def stopped(name: str) -> OndemandError:
    return OndemandError(503, "ondemand_stopped",
                         f"{name} was stopped while it was starting for this request; send it again to start it")


def switched_to_always_on(dep: Deployment) -> OndemandError:
    return OndemandError(503, "not_on_demand", f"{dep.served_name} was switched to always on and is {dep.state}")


def start_failed(dep: Deployment, reason: str, left: int) -> OndemandError:
    return OndemandError(503, "start_failed",
                         f"{dep.served_name} failed to start: {reason}; new starts are refused for {left} s",
                         headers={"Retry-After": str(left)})


def queue_full(waiting: int) -> OndemandError:
    return OndemandError(503, "ondemand_queue_full",
                         f"{waiting} requests are waiting already (ondemand_max_queued)",
                         headers={"Retry-After": "60"})


def queue_timeout(dep: Deployment, queue_timeout_s: float) -> OndemandError:
    return OndemandError(503, "ondemand_queue_timeout",
                         f"{dep.served_name} was not ready within {queue_timeout_s:g} s; try again later",
                         headers={"Retry-After": "60"})


def budget_unavailable(name: str, reason: str) -> OndemandError:
    return OndemandError(503, "budget_unavailable",
                         f"cannot start {name} now: the GPU memory budget cannot be read ({reason})",
                         headers={"Retry-After": "10"})


def does_not_fit(dep: Deployment, fit: Fit, capacity: float) -> OndemandError:
    if fit.per_gpu and fit.count > len(fit.ondemand):
        return OndemandError(503, "does_not_fit", f"{dep.served_name} needs {fit.count} GPUs (gpu_count), "
                                                  f"but this box has {len(fit.ondemand)}")
    if not fit.per_gpu:
        where = f"the {capacity:g} GiB that on-demand models can ever use here"
    else:
        best = max(fit.ondemand, default=0.0)
        where = (f"what on-demand models can ever use on this box's {len(fit.ondemand)} GPUs "
                 f"(at most {best:g} GiB on one GPU)")
    return OndemandError(503, "does_not_fit", f"{dep.served_name} needs {fit.describe()}, more than {where}")
