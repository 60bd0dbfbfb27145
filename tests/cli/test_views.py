"""ondemand/cli/views.py: how a deployment's view reads in ``status`` and ``deploy show``, on the
module's functions with views as the API gives them: its row (mode, in-flight of its limit, queue
place, memory, start ETA), its state with the sleep's tier, when a start is expected, why it is
kept awake or was put away early, its keep_warm plan and its command line; and, as an admin runs
``deploy add`` (a real process against a running server), the warning for an engine it cannot see idle."""
from test_cli import cli, write_config

from ondemand.cli import views
from ondemand.cli.views import _dep_rows, _expected, _kept_and_taken


async def test_adding_or_switching_llamacpp_without_metrics_warns(tmp_path, server):
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("deploy", "add", "blind", "--engine", "llamacpp", "--mode", "on_demand",
                             "--command", "llama-server --port {port}", config=cfg)
    assert rc == 0 and "created blind" in out
    assert err.startswith("warning: blind: llama.cpp without --metrics") and "never put to sleep" in err
    rc, out, err = await cli("deploy", "add", "seen", "--engine", "llamacpp", "--mode", "on_demand",
                             "--command", "llama-server --metrics --port {port}", config=cfg)
    assert rc == 0 and err == ""
    rc, out, err = await cli("deploy", "add", "later", "--engine", "llamacpp", "--no-start",
                             "--command", "llama-server --port {port}", config=cfg)
    assert rc == 0 and err == ""  # always on: nothing to put to sleep
    later = server.deployer.all()[-1].id
    rc, out, err = await cli("mode", "set", str(later), "on_demand", config=cfg)
    assert rc == 0 and "warning: later:" in err


def test_status_says_a_starting_models_phase_and_what_is_left():
    views = [{"name": "a", "state": "starting", "updated_at": 100.0, "start_eta_s": 12.0, "start_phase": "weights",
              "ondemand": {"phase": "idle"}},
             {"name": "b", "state": "starting", "updated_at": 100.0, "start_eta_s": 40.0, "start_phase": None,
              "ondemand": {"phase": "idle"}}]
    # With a phase, start_eta_s is what is left already; without one (a wake), counted from updated_at.
    assert _expected(views, now=110.0) == ["a: starting (weights), expected in about 12 s",
                                           "b: starting, expected in about 30 s"]


def test_status_says_when_a_starting_or_queued_model_is_expected():
    from ondemand.cli.views import _dep_rows
    views = [
        {"name": "a", "state": "starting", "updated_at": 100.0, "start_eta_s": 40.0, "ondemand": {"phase": "idle"}},
        {"name": "b", "state": "stopped", "updated_at": 0.0, "start_eta_s": 12.0, "ondemand": {"phase": "queued"}},
        {"name": "c", "state": "starting", "updated_at": 100.0, "start_eta_s": None, "ondemand": {"phase": "idle"}},
        {"name": "d", "state": "ready", "updated_at": 0.0, "start_eta_s": 5.0, "ondemand": {"phase": "idle"}},
    ]
    assert _expected(views, now=110.0) == ["a: starting, expected in about 30 s",
                                           "b: queued for GPU memory; once it starts, expected in about 12 s"]
    row = {"id": 1, "served_name": "A", "mode": "on_demand", "memory_gib": 1, **views[0]}
    assert _dep_rows([row])[0][-1] == "~40s"


def test_status_says_why_it_is_kept_awake_and_that_it_was_put_away_early():
    views = [{"name": "a", "ondemand": {"held_for": "slo", "put_away_early": None}},
             {"name": "b", "ondemand": {"held_for": None, "put_away_early": {
                 "for": "big", "rule": "cost", "idle_for_s": 42.0, "idle_after_s": 600.0, "wait_s": 558.0,
                 "loss_s": 3.1}}},
             {"name": "c", "ondemand": {"held_for": None, "put_away_early": None}}, {"name": "d", "ondemand": None}]
    assert _kept_and_taken(views) == [
        "a: kept awake: its wake would miss the SLO",
        "b: put away early for big by cost (42 s idle of its 600 s idle timeout: wait 558 s > expected loss 3.1 s)"]


def row(**kw):
    """A view as the API gives it, of the fields a row reads."""
    return {"id": 1, "name": "a", "served_name": "A", "mode": "on_demand", "state": "ready", "memory_gib": 8,
            "ondemand": {"phase": "idle", "inflight": 3, "queued": 0}, **kw}


def test_a_row_says_a_pending_mode_the_in_flight_limit_and_the_queue_place():
    (r,) = _dep_rows([row()])
    assert r == [1, "a", "A", "on_demand", "normal", "ready", "idle", 3, 0, "never", "8 GiB", "-", None]
    (r,) = _dep_rows([row(pending_mode="always_on", max_inflight=4, priority="high", gpus=[0, 2],
                          ondemand={"phase": "queued", "inflight": 3, "queued": 2, "queue_position": 5})])
    assert r[3:9] == ["on_demand → always_on", "high", "ready", "queued", "3/4", "2 (#5)"] and r[11] == "0,2"
    (r,) = _dep_rows([row(mode="always_on", pending_mode="always_on")])
    assert r[3] == "always_on (starting again)"


def test_the_state_says_the_sleeps_tier_and_the_memory_a_measurement_over_it():
    assert views._state(row()) == "ready"
    assert views._state(row(state="asleep")) == "asleep"
    assert views._state(row(state="asleep", sleep_level=1, host_gib=15.04)) == "asleep (level 1, 15.0 GiB host)"
    assert views._state(row(state="asleep", sleep_level=2)) == "asleep (level 2)"
    assert views._memory(row(memory_gib=20)) == "20 GiB"
    assert views._memory(row(memory_gib=20, measured_gib=21.0)) == "20 GiB (measured 21.0)"
    assert views._memory(row(memory_gib=20, measured_gib=30.0)) == "20 GiB (measured 30.0 !)"
    assert views._tier(0) == "is stopped" and views._tier(2) == "sleeps at level 2"


def test_keep_warm_says_its_plan_or_why_it_is_as_fixed():
    assert views._keep_warm({"keep_warm": "fixed", "adaptive": None}) == "fixed"
    assert views._keep_warm({"keep_warm": "adaptive"}) == "adaptive (as fixed: too few idle gaps learned yet)"
    assert views._keep_warm({"keep_warm": "adaptive", "adaptive": {"gaps": 9, "awake_for_s": None}}) == \
        "adaptive (as fixed: no pattern in its 9 idle gaps)"
    said = views._keep_warm({"keep_warm": "adaptive", "adaptive": {"gaps": 30, "awake_for_s": 90.0, "rest": "nowhere",
                                                                  "prewarm_in_s": 3500.0}})
    assert said == ("adaptive (30 gaps: awake 90 s idle, then its idle action's tier; "
                    "woken again 3500 s after its last request)")


def test_the_launch_lines_quote_the_command_and_say_why_there_is_none():
    assert views._launch_lines({"argv": ["sim", "--note", "two words"], "env": {"B": "x y", "A_KEY": "***"},
                                "env_names": ["A_KEY", "B"]}) == [
        "argv:            sim --note 'two words'", "env:             A_KEY='***' B='x y'", "env_names:       A_KEY, B"]
    assert views._launch_lines({"argv": None, "argv_error": "memory_gib: too large"}) == [
        "argv:            - (memory_gib: too large)"]
    assert views._launch_lines({"argv": None, "offline": True, "model": "org/m"})[0].startswith(
        "argv:            - (derived by the running server")
    assert views._launch_lines({"argv": None}) == []
