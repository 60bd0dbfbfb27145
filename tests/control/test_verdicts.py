"""The controller's refusals (ondemand/control/verdicts.py): ``screen``'s order of checks, on
real deployment rows, and what each refusal says (status, code, the deployment it names, the
headers a client retries by). The same refusals through the whole server: test_gateway.py."""
from __future__ import annotations

import pytest

from ondemand.control import verdicts
from ondemand.control.placement import Fit
from ondemand.control.ticket import Want
from ondemand.errors import OndemandError
from ondemand.model import Deployment, Mode, Role, State


def dep(**kw) -> Deployment:
    return Deployment(id=1, name="a", served_name="A", memory_gib=10, mode=Mode.ON_DEMAND,
                      state=State.STOPPED).replace(**kw)


def refused(d: Deployment | None, want: Want) -> tuple[int, str, bool] | None:
    """(status, code, before_body) of screen's refusal, None when it lets the request on."""
    try:
        assert verdicts.screen(d, want) is d
    except verdicts.Refusal as err:
        return err.status, err.code, err.before_body
    return None


@pytest.mark.parametrize("want", list(Want))
def test_an_unknown_deployment_is_404_for_every_route(want):
    assert refused(None, want) == (404, "not_found", True)


@pytest.mark.parametrize("want", list(Want))
def test_the_decision_model_is_refused_before_anything_else(want):
    # Even while ready and on demand, and for the listing that answers every other state.
    assert refused(dep(role=Role.DECISION, state=State.READY), want) == (503, "not_on_demand", True)


@pytest.mark.parametrize("state", list(State))
def test_the_listing_is_answered_in_every_state(state):
    assert refused(dep(state=state), Want.LIST) is None


@pytest.mark.parametrize("want", [Want.MODEL, Want.HEALTH, Want.TRAFFIC])
def test_planned_is_refused_for_every_route_but_the_listing(want):
    assert refused(dep(state=State.PLANNED), want) == (503, "ondemand_planned", True)


@pytest.mark.parametrize("state", sorted(set(State) - {State.PLANNED}, key=str))
def test_a_health_check_is_answered_in_every_state_but_planned(state):
    assert refused(dep(state=state, mode=Mode.ALWAYS_ON), Want.HEALTH) is None


@pytest.mark.parametrize("state", [State.STOPPED, State.ASLEEP, State.STARTING, State.FAILED])
def test_a_models_route_needs_it_ready_and_a_request_waits_for_it_on_demand(state):
    assert refused(dep(state=state), Want.MODEL) == (503, "ondemand_not_ready", True)
    assert refused(dep(state=state), Want.TRAFFIC) is None  # it waits for a start or a wake
    assert refused(dep(state=State.READY), Want.MODEL) is None


def test_an_always_on_deployment_not_ready_is_refused_unless_a_switch_to_on_demand_is_pending():
    assert refused(dep(mode=Mode.ALWAYS_ON), Want.TRAFFIC) == (503, "not_on_demand", True)
    assert refused(dep(mode=Mode.ALWAYS_ON, state=State.READY), Want.TRAFFIC) is None
    # A pending switch (either way) is waited for as an on-demand start.
    assert refused(dep(mode=Mode.ALWAYS_ON, pending_mode=Mode.ON_DEMAND), Want.TRAFFIC) is None


def test_a_refusal_names_its_deployment_for_the_metrics_label():
    with pytest.raises(verdicts.Refusal) as err:
        verdicts.screen(dep(state=State.PLANNED), Want.TRAFFIC)
    assert err.value.deployment == "a" and "A is planned" in err.value.message
    assert verdicts.unknown(7).deployment == "" and "7 does not exist" in verdicts.unknown(7).message
    assert verdicts.removed(7).code == "not_found" and "removed" in verdicts.removed(7).message
    assert not verdicts.planned(dep()).before_body  # given after the wait: not one of screen's


def test_the_retryable_refusals_tell_the_client_when_to_come_back():
    busy = verdicts.busy(dep(max_inflight=2))
    assert (busy.status, busy.code, busy.deployment) == (429, "ondemand_busy", "a")
    assert busy.headers == {"Retry-After": "1", "x-should-retry": "true"} and "limit of 2" in busy.message
    failed = verdicts.start_failed(dep(), "exit code 1", 42)
    assert (failed.status, failed.code, failed.headers) == (503, "start_failed", {"Retry-After": "42"})
    assert "exit code 1" in failed.message and "42 s" in failed.message
    assert verdicts.queue_full(256).headers == {"Retry-After": "60"} and "256" in verdicts.queue_full(256).message
    timeout = verdicts.queue_timeout(dep(), 30.0)
    assert (timeout.code, timeout.headers) == ("ondemand_queue_timeout", {"Retry-After": "60"})
    assert "within 30 s" in timeout.message
    assert verdicts.shutting_down().headers == {"Retry-After": "10"}
    unreadable = verdicts.budget_unavailable("A", "nvidia-smi not found")
    assert (unreadable.code, unreadable.headers) == ("budget_unavailable", {"Retry-After": "10"})


def test_the_refusals_for_a_request_cut_short_have_no_retry_after():
    for err in (verdicts.stopped("A"), verdicts.switched_to_always_on(dep(state=State.STOPPING))):
        assert isinstance(err, OndemandError) and err.status == 503 and err.headers == {}
    assert verdicts.switched_to_always_on(dep(state=State.STOPPING)).code == "not_on_demand"


def fit(**kw) -> Fit:
    fields = dict(need=40.0, free=(80.0,), ondemand=(30.0,), count=1, allowed=None, per_gpu=True)
    fields.update(kw)
    return Fit(**fields)


def test_does_not_fit_says_what_it_needs_and_what_this_box_can_ever_give():
    one_pool = verdicts.does_not_fit(dep(), fit(per_gpu=False), 30)
    assert one_pool.code == "does_not_fit"
    assert one_pool.message == "A needs 40 GiB, more than the 30 GiB that on-demand models can ever use here"
    per_gpu = verdicts.does_not_fit(dep(), fit(ondemand=(30.0, 20.0)), 50)
    assert per_gpu.message == ("A needs 40 GiB on one GPU, more than what on-demand models can ever use on "
                               "this box's 2 GPUs (at most 30 GiB on one GPU)")
    spread = verdicts.does_not_fit(dep(), fit(need=80.0, count=2, ondemand=(30.0, 30.0)), 60)
    assert "2 GPUs with 40 GiB each" in spread.message
    too_many = verdicts.does_not_fit(dep(), fit(count=4, ondemand=(80.0, 80.0)), 160)
    assert too_many.message == "A needs 4 GPUs (gpu_count), but this box has 2"
