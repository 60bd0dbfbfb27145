"""ondemand/admin/components.py: the deployment's view the API and the events show, from the whole
ondemand on loopback with the engine simulator behind it: the view published while a request
starts it cold, and the launch fields (the command line as it will run, secrets masked, or why
it cannot be derived)."""
from helpers import sim_command, two_pools
from test_admin import api, new_dep


async def test_published_views_of_a_cold_start(server):
    """The view published with `starting` says starting_for_request; updated_at follows the file."""
    from ondemand.admin import components
    _, v = await api(server, "POST", "/deployments", new_dep("a", command=sim_command("a", "--startup-delay", "0.3")))
    i = v["id"]
    seen = []
    from ondemand.events import ViewPublished
    server.app[components.BUS].subscribe(ViewPublished, lambda e: e.view.get("id") == i and seen.append(
        (e.view["state"], e.view["ondemand"]["phase"], e.view["updated_at"])))
    async with two_pools() as s, s.post(server.gw(i, "chat/completions"), headers=server.auth(),
                      json={"model": "a", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
    phases = [(state, phase) for state, phase, _ in seen]
    assert ("starting", "starting_for_request") in phases, phases
    stored = await server.deployer.store.deployment(i)
    _, view = await api(server, "GET", f"/deployments/{i}")
    assert view["updated_at"] == stored["updated_at"] > v["created_at"]
    assert seen[-1][2] >= seen[0][2]


async def test_a_view_is_the_row_and_what_each_part_says_of_it_with_no_secret(server):
    status, view = await api(server, "POST", "/deployments", new_dep("a", env={"MY_API_KEY": "k-1", "NOTE": "n"}))
    assert status == 201 and "k-1" not in str(view) and "compile_key" not in view
    assert view["env"] == {"MY_API_KEY": "***", "NOTE": "n"} and view["env_names"] == ["MY_API_KEY", "NOTE"]
    assert view["argv"] == sim_command("a") and view["engine_image"] is None
    assert (view["memory_gib"], view["memory_source"], view["declared_gib"]) == (10.0, "declared", 10.0)
    assert view["base_url"] is None and view["engine_metrics"] is None and view["adaptive"] is None
    assert view["ondemand"]["phase"] == "sleeping" and view["litellm"]["code"] == "litellm_disabled"
    assert (view["last_start_s"], view["start_eta_s"], view["start_phases"]) == (None, None, [])
    status, view = await api(server, "POST", f"/deployments/{view['id']}/start?wait=1")
    assert view["state"] == "ready" and view["base_url"] == server.deployer.base_url(view["id"]) is not None
    assert view["last_start_s"] > 0 and view["env"]["MY_API_KEY"] == "***"
