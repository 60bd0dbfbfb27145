"""Every refusal the controller gives a request, in one place: their codes, statuses,
texts and headers (the README's error table). Each is made when it is given."""
from __future__ import annotations

from ..errors import OndemandError
from ..model import Deployment
from .placement import Fit


def unknown(dep_id: int) -> OndemandError:
    return OndemandError(404, "not_found", f"deployment {dep_id} does not exist")


def removed(dep_id: int) -> OndemandError:
    return OndemandError(404, "not_found", f"deployment {dep_id} was removed")


def planned(dep: Deployment) -> OndemandError:
    return OndemandError(503, "ondemand_planned",
                         f"{dep.served_name} is planned: an administrator has to start it first")


def shutting_down() -> OndemandError:
    return OndemandError(503, "ondemand_shutting_down", "ondemand is shutting down; send the request again",
                         headers={"Retry-After": "10"})


def busy(dep: Deployment) -> OndemandError:
    # 429 with x-should-retry: LiteLLM cools the entry down and the OpenAI SDKs send it again
    # after Retry-After, so the next try may land on another box (docs/several-boxes.md).
    return OndemandError(429, "ondemand_busy",
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
