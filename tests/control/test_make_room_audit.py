"""Make-room's account of its victims (control/attempts.py): each victim put away is counted by
the rule that allowed it (``ondemand_make_room_total{rule}``: ``idle_timeout``, idle for its whole
timeout; ``cost``, before it); one taken before its timeout is audited ``ondemand_make_room`` on the
requester's deployment, with the victim and the scheduler's reason (``TakeRule.reason``), and its
view says so (``ondemand.put_away_early``) until it is ready again. First on test_controller's fake
clock and recording effects (test_cost's lull: the requester starts cold in 60 s, min_idle_timeout_s
1 s, SLO 5 s, the victim sleeps and wakes in 4 s, dear enough that warmth by value keeps its idle
timeout: its loss is 61 + 4 - 5 = 60 s); then through a
real ondemand: the audit row in the state file, the metric in a scrape, the view over HTTP and
``ondemand status``."""
from __future__ import annotations

from typing import Any

import pytest
from helpers import wait_for
from test_controller import Clock, Req, make
from test_controller import Effects as RecordingEffects

from ondemand import app as app_mod
from ondemand.control import scheduler as schedulers
from ondemand.errors import InsufficientMemory
from ondemand.model import State

SLO_S = 5.0


class Effects(RecordingEffects):
    """test_controller's recording effects, keeping each audit row's detail too."""

    def __init__(self, clock: Clock):
        super().__init__(clock)
        self.audits: list[tuple[str, int, str, dict[str, Any]]] = []

    def audit(self, action: str, dep_id: int, text: str, detail: dict[str, Any]) -> None:
        self.audits.append((action, dep_id, text, detail))


@pytest.fixture
def world():
    clock = Clock()
    return clock, Effects(clock)


def lull(world, scheduler: str, *, idle: float):
    """2 (10 GiB, idle timeout 600 s, sleeps when idle) was used ``idle`` s ago; 1 (10 GiB) is
    refused for 6 GiB and asks make-room."""
    c, fx, clock = make(world, scheduler=schedulers.scheduler(scheduler, SLO_S))
    fx.rest_costs = {"asleep_1": 4.0, "asleep_2": 6.0, "stopped": 60.0}
    fx.add(1, 10)
    fx.add(2, 10, idle_timeout_s=600, idle_action="sleep")
    fx.set(2, state=State.READY)
    clock.advance(601)
    c.try_take(2).release()
    clock.advance(idle)
    r = Req(c, 1)
    c.on_refused(1, InsufficientMemory(10, 4, 24))
    return c, fx, r


def put_to_sleep(c, fx, victim: int, for_dep: int, approved: bool = True) -> None:
    """Play the deployer: the sleep make-room asked for is done (or its precheck kept it)."""
    assert [s[1:3] for s in fx.taken("sleep")] == [(victim, for_dep)]
    if approved:
        fx.set(victim, state=State.ASLEEP, sleep_level=1)
    c.on_stopped(victim, approved, for_dep)


def test_a_victim_taken_before_its_timeout_by_cost_is_audited_counted_and_shown(world):
    c, fx, r = lull(world, "cost", idle=42)
    assert fx.audits == []  # nothing is said before the sleep is done
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"cost": 1}
    [(action, dep_id, text, detail)] = fx.audits
    assert action == "ondemand_make_room" and dep_id == 1  # the requester's row
    assert text == ("Put d2 to sleep for d1 after 42 s idle of its 600 s idle timeout "
                    "(cost: wait 558 s > expected loss 60 s)")
    assert detail == {"victim_id": 2, "victim": "d2", "for": "d1",
                      "reason": {"rule": "cost", "wait_s": 558.0, "loss_s": 60.0, "hold_s": 61.0, "come_back_s": 4.0,
                                 "slo_s": SLO_S, "idle_for_s": 42.0, "idle_after_s": 600.0}}
    early = c.status(2)["put_away_early"]
    assert early["for"] == "d1" and early["for_id"] == 1 and early["rule"] == "cost" and early["loss_s"] == 60.0
    assert early["at"] == 1.7e9 + c.clock()
    assert ("counters", 2, c.clock()) in fx.calls  # its view is published again with it
    assert c.status(1)["put_away_early"] is None and c.status(1)["held_for"] is None
    fx.set(2, state=State.STARTING)
    assert c.status(2)["put_away_early"] is not None  # still resting until its wake is done
    fx.set(2, state=State.READY)
    assert c.status(2)["put_away_early"] is None


def test_a_victim_the_precheck_kept_is_neither_counted_nor_audited(world):
    c, fx, r = lull(world, "cost", idle=42)
    put_to_sleep(c, fx, 2, 1, approved=False)
    assert c.make_rooms() == {} and fx.audits == []
    assert c.status(2)["put_away_early"] is None


def test_under_seed_a_victim_idle_for_its_whole_timeout_counts_idle_timeout_and_is_not_audited(world):
    c, fx, r = lull(world, "seed", idle=601)
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"idle_timeout": 1}
    assert fx.audits == [] and c.status(2)["put_away_early"] is None


def test_under_cost_a_victim_idle_for_its_whole_timeout_counts_idle_timeout_too(world):
    c, fx, r = lull(world, "cost", idle=601)
    put_to_sleep(c, fx, 2, 1)
    assert c.make_rooms() == {"idle_timeout": 1} and fx.audits == []


def test_the_rules_say_why_they_took():
    """Each take rule's reason: ``idle_timeout`` once idle for the whole timeout, whatever the rule;
    before it, the rule's own name (the cost rule with its figures: test above)."""
    from ondemand.model import Deployment
    a, b = Deployment(id=1, name="a", served_name="A"), Deployment(id=2, name="b", served_name="B")
    assert schedulers.SeedScheduler().reason(a, b, 600, 600) == {"rule": "idle_timeout"}
    assert schedulers.SeedScheduler(schedulers.any_quiet).reason(a, b, 5, 600) == {"rule": "any_quiet"}
    assert schedulers.SeedScheduler(schedulers.any_quiet).reason(a, b, 700, 600) == {"rule": "idle_timeout"}
    assert schedulers.scheduler("cost").reason(a, b, 600, 600) == {"rule": "idle_timeout"}
    # The take rules decide only early takes: the seed's takes none, Ollama's any quiet one.
    assert not schedulers.after_idle_timeout(a, b, 5, 600) and schedulers.any_quiet(a, b, 5, 600)
    assert schedulers.SeedScheduler().takes(a, b, 600, 600) and not schedulers.SeedScheduler().takes(a, b, 5, 600)


# --- through a real ondemand ----------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.mark.server(reap_interval_s=3600, scheduler="cost", slo_s=0.5)
async def test_a_real_make_room_by_cost_is_in_the_audit_the_metrics_the_view_and_status(tmp_path, server, http):
    """big (15 GiB) served a request a moment ago, of its 600 s idle timeout; x (12 GiB) does not fit
    beside it (24 GiB): the request for x would wait 600 s without big, and big's loss is what x's
    cold start (60 s, nothing measured) and its 1 s minimum hold cost big's next request, with big's
    own cold start, less the 0.5 s SLO: big is stopped for x at once. (Its start, half a second, is
    dear against that SLO: warmth by value keeps its idle timeout, so the take is cost's.)"""
    from test_cli import cli, write_config
    from test_telemetry import scrape, v
    big = await server.add("big", 15, "--startup-delay", "0.5", idle_timeout_s=600)
    x = await server.add("x", 12)
    async with http.post(server.gw(big, "chat/completions"), json={**CHAT, "model": "BIG"},
                         headers=server.auth()) as r:
        assert r.status == 200, await r.text()
    await server.app[app_mod.SAMPLER].sample_once()  # its engine's metrics say idle
    async with http.post(server.gw(x, "chat/completions"), json={**CHAT, "model": "X"}, headers=server.auth()) as r:
        assert r.status == 200, await r.text()
    assert server.state(big) == "stopped"

    rows: list[dict] = []

    async def audited() -> bool:  # written by a task of the effects, just after the stop's report
        async with http.get(f"{server.url}/api/audit", headers=server.admin_headers()) as r:
            rows[:] = [row for row in await r.json() if row["action"] == "ondemand_make_room"]
        return bool(rows)
    await wait_for(audited, what="the ondemand_make_room row")
    [row] = rows
    assert row["deployment_id"] == x and row["actor"] == "ondemand"
    assert row["text"].startswith("Stopped big for x after ") and "(cost: wait " in row["text"]
    reason = row["detail"]["reason"]
    assert row["detail"]["victim_id"] == big and reason["rule"] == "cost" and reason["idle_after_s"] == 600
    assert reason["wait_s"] > reason["loss_s"], row
    m = await scrape(server, http)
    assert v(m, "ondemand_make_room_total", rule="cost") == 1
    assert v(m, "ondemand_make_room_total", rule="idle_timeout") == 0
    assert ("ondemand_make_room_total", (("rule", "idle_timeout"),)) in m  # both series, from 0
    async with http.get(f"{server.url}/api/deployments/{big}", headers=server.admin_headers()) as r:
        early = (await r.json())["ondemand"]["put_away_early"]
    assert early["for"] == "x" and early["rule"] == "cost"
    rc, out, err = await cli("status", config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert any(line.startswith("big: put away early for x by cost (") for line in out.splitlines()), out
    rc, out, err = await cli("deploy", "show", str(big), config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert any(line.startswith("big: put away early for x by cost (") for line in out.splitlines()), out
