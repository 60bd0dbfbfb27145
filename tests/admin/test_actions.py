"""ondemand/admin/actions.py: start, stop, sleep and wake a deployment and switch its mode
through the admin API of the whole ondemand on loopback, with the engine simulator behind it:
the states each action leaves, its refusals (409 and the field a 400 names) and the audit
of a mode switch. Sleep levels and idle actions: test_warmth_admin.py."""
import pytest
from helpers import wait_for
from test_admin import api, new_dep
from test_warmth_admin import sim_state, sleeper


async def test_actions(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    i = v["id"]
    status, view = await api(server, "POST", f"/deployments/{i}/start?wait=1")
    assert status == 200 and view["state"] == "ready" and view["base_url"].startswith("http://127.0.0.1:")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep")
    assert view["state"] == "asleep"
    status, view = await api(server, "POST", f"/deployments/{i}/wake?wait=1")
    assert view["state"] == "ready"
    status, view = await api(server, "POST", f"/deployments/{i}/stop")
    assert view["state"] == "stopped"
    status, err = await api(server, "POST", f"/deployments/{i}/wake")
    assert status == 409
    _, big = await api(server, "POST", "/deployments", new_dep("big", memory_gib=20))
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, err = await api(server, "POST", f"/deployments/{big['id']}/start")
    assert status == 409 and err["error"]["code"] == "insufficient_memory"
    status, body = await api(server, "DELETE", f"/deployments/{i}")
    assert status == 200 and server.deployer.get(i) is None
    _, events = await api(server, "GET", f"/deployments/{big['id']}/events")
    assert events[-1]["text"].startswith("created")



async def test_mode_switch_is_audited_and_bounded(server):
    _, v = await api(server, "POST", "/deployments", new_dep("a"))
    status, err = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "on_demand", "idle_timeout_s": 5000000})
    assert status == 400 and err["error"]["message"] == "idle_timeout_s: must be 1 to 86400 seconds, or null"
    status, view = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "always_on"})
    assert status == 200 and view["pending_mode"] == "always_on" and view["mode"] == "on_demand"
    await wait_for(lambda: server.deployer.get(v["id"]).mode == "always_on", what="pending mode applied at ready")
    _, audit = await api(server, "GET", "/audit")
    row = [r for r in audit if r["action"] == "ondemand_mode"][0]
    assert row["detail"]["old"]["mode"] == "on_demand" and row["detail"]["new"]["pending_mode"] == "always_on"
    status, view = await api(server, "PATCH", f"/deployments/{v['id']}/mode", {"mode": "on_demand", "idle_timeout_s": 120})
    assert view["mode"] == "on_demand" and view["idle_timeout_s"] == 120


@pytest.mark.parametrize("body", [{"drain_s": -1}, {"drain_s": 3601}, {"drain_s": "5"}, {"drain_s": True},
                                  {"force": 1}, {"force": "yes"}, {"level": 1, "soon": True},
                                  {"level": 3}, {"level": 0}, {"level": "1"}, {"level": True}, {"level": 1.5},
                                  {"lvl": 1}])
async def test_a_sleeps_body_is_checked_before_anything_sleeps(server, body):
    _, view = await api(server, "POST", "/deployments", sleeper("a"))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, err = await api(server, "POST", f"/deployments/{i}/sleep", body)
    assert status == 400 and err["error"]["code"] == "invalid_field", err
    assert err["error"]["message"].startswith(sorted(body)[-1] + ":"), err
    assert server.state(i) == "ready" and (await sim_state(server, i))["sleeps"] == 0


async def test_an_asleep_deployment_is_woken_not_started_and_a_mode_has_two_values(server):
    _, view = await api(server, "POST", "/deployments", sleeper("a"))
    i = view["id"]
    await api(server, "POST", f"/deployments/{i}/start?wait=1")
    status, view = await api(server, "POST", f"/deployments/{i}/sleep", {"drain_s": 0, "force": True})
    assert status == 200 and view["state"] == "asleep"
    status, err = await api(server, "POST", f"/deployments/{i}/start")
    assert status == 409 and err["error"]["code"] == "invalid_state" and "use wake" in err["error"]["message"]
    status, err = await api(server, "POST", f"/deployments/{i}/nap")
    assert status == 404 and err["error"]["code"] == "not_found"
    for body, field in (({"mode": "sometimes"}, "mode"), ({"mode": "on_demand", "idle": 5}, "idle"),
                        ({"mode": "on_demand", "idle_timeout_s": "60"}, "idle_timeout_s")):
        status, err = await api(server, "PATCH", f"/deployments/{i}/mode", body)
        assert status == 400 and err["error"]["message"].startswith(field + ":"), (body, err)
    assert server.state(i) == "asleep" and server.deployer.get(i).mode == "on_demand"
