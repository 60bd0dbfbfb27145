"""``held_for`` end to end: why a warmth policy keeps an idle deployment awake past where the seed's
rule would rest it (``WarmthPolicy.held_for``, read through ``Controller.held_for``) shows in the
view's ``ondemand`` object over the admin API, in the event stream's views and in ``ondemand
status`` (its lines: tests/cli/test_views.py); the reaper's step publishes a view again when its hold begins or ends. ``fixed`` and
``adaptive`` hold nothing for the SLO: the policy that says ``slo`` is the test's own, put where the
controller picks a deployment's warmth (``Controller.fixed``, as the replay's clairvoyant reference
puts its own)."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import orjson
import pytest
from core_doubles import Clock, Effects, make
from helpers import ROOT, two_pools, wait_for
from test_cli import cli, write_config

from ondemand.model import State


class HoldsForTheSlo:
    """The box's policy in every answer but one: a ready deployment is held awake for the SLO."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def held_for(self, dep, rec, now):
        return "slo" if dep.state is State.READY else None


@pytest.mark.server(reap_interval_s=3600)
async def test_held_for_shows_in_the_view_the_event_stream_and_status(tmp_path, server, http):
    dep = await server.add("warm", 4)
    await server.deployer.restart(dep)

    async def ondemand() -> dict:
        async with http.get(f"{server.url}/api/deployments/{dep}", headers=server.admin_headers()) as r:
            assert r.status == 200
            return (await r.json())["ondemand"]
    assert (await ondemand())["held_for"] is None  # fixed keeps nothing awake past its timeout
    server.controller.fixed = HoldsForTheSlo(server.controller.fixed)
    seen = await ondemand()
    assert seen["held_for"] == "slo" and seen["put_away_early"] is None

    views: list[dict] = []

    async def reader() -> None:
        async with two_pools() as s, s.get(f"{server.url}/api/events", headers=server.admin_headers()) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    views.append(orjson.loads(line[6:]))
    task = asyncio.ensure_future(reader())
    try:
        await wait_for(lambda: any(v.get("id") == dep for v in views), what="the stream's first view")
    finally:
        task.cancel()
    [view] = [v for v in views if v.get("id") == dep]
    assert view["ondemand"]["held_for"] == "slo"

    rc, out, err = await cli("status", config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert "warm: kept awake: its wake would miss the SLO" in out.splitlines()
    rc, out, err = await cli("deploy", "show", str(dep), config=write_config(tmp_path / "c.toml", server.cfg.state_dir))
    assert rc == 0, err
    assert "warm: kept awake: its wake would miss the SLO" in out.splitlines()  # and one deployment's view says it


def test_the_reapers_step_publishes_a_hold_once_as_it_begins_and_as_it_ends():
    """(Views are published at most once a second: the clock moves on between the steps.)"""
    clock = Clock()
    c, fx, clock = make((clock, Effects(clock)))
    fx.add(1, state=State.READY)
    c.reap()
    clock.advance(5)
    fx.taken("counters")
    c.fixed = HoldsForTheSlo(c.fixed)
    assert c.held_for(1) == "slo" and c.status(1)["held_for"] == "slo"
    c.reap()
    assert [call[1] for call in fx.taken("counters")] == [1]  # its view again: the hold began
    clock.advance(5)
    c.reap()
    assert fx.taken("counters") == []  # nothing changed
    c.fixed = c.fixed.inner  # the hold ends as time passes (here: the policy says so)
    c.reap()
    assert [call[1] for call in fx.taken("counters")] == [1] and c.status(1)["held_for"] is None


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to run the page's script")
def test_the_page_says_why_it_is_kept_awake_and_that_it_was_put_away_early():
    """app.js's rows, rendered by node over a fake DOM (tests/clients/page_rows.js): the state
    cell says why the deployment is kept awake, and that make-room put it away early, for whom and
    by which rule (the figures in its title)."""
    base = {"served_name": "S", "engine": "vllm", "model": None, "role": "model", "mode": "on_demand",
            "updated_at": 0, "gpus": [], "memory_gib": 4, "measured_gib": None, "litellm": None}
    views = [{**base, "id": 1, "name": "a", "state": "ready", "ondemand": {"held_for": "slo"}},
             {**base, "id": 2, "name": "b", "state": "asleep", "sleep_level": 1, "ondemand": {"put_away_early": {
                 "for": "big", "rule": "cost", "idle_for_s": 42.0, "idle_after_s": 600.0, "wait_s": 558.0,
                 "loss_s": 3.1}}},
             {**base, "id": 3, "name": "c", "state": "ready", "ondemand": {"held_for": None, "put_away_early": None}}]
    done = subprocess.run(["node", str(ROOT / "tests" / "clients" / "page_rows.js"),
                           str(ROOT / "ondemand" / "admin" / "ui" / "app.js")],
                          input=json.dumps(views), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    a, b, c = (row["State"] for row in json.loads(done.stdout))
    assert "kept awake: its wake would miss the SLO" in a["text"]
    assert "put away early for big by cost" in b["text"]
    assert "42 s idle of its 10 min idle timeout · big would have waited 9 min 18 s, more than its expected loss " \
           "of 3.1 s" in b["titles"]
    assert "kept awake" not in c["text"] and "put away early" not in c["text"]
