"""``keep_warm`` through the admin API: ``fixed`` on every deployment unless told, ``adaptive``
taken at creation and while its engine runs (a live field: no engine reads it), any other value
refused and nothing changed by a refusal; the view's ``adaptive`` is null until a plan is made."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.server(reap_interval_s=3600)


async def patch(http, server, dep_id: int, body: dict):
    async with http.patch(f"{server.url}/api/deployments/{dep_id}", json=body, headers=server.admin_headers()) as r:
        return r.status, await r.json()


async def test_keep_warm_is_fixed_unless_told_and_adaptive_is_a_live_field(server, http):
    dep = await server.add("warm", 4)
    async with http.get(f"{server.url}/api/deployments/{dep}", headers=server.admin_headers()) as r:
        view = await r.json()
        assert view["keep_warm"] == "fixed" and view["adaptive"] is None
    await server.deployer.restart(dep)
    for value in ("sometimes", None, 1):
        status, body = await patch(http, server, dep, {"keep_warm": value})
        assert status == 400 and body["error"]["code"] == "invalid_field", body
        assert body["error"]["message"].startswith("keep_warm: fixed or adaptive"), body
    assert server.deployer.get(dep).keep_warm == "fixed"
    status, body = await patch(http, server, dep, {"keep_warm": "adaptive"})
    assert status == 200 and body["keep_warm"] == "adaptive" and body["state"] == "ready", body
    assert body["adaptive"] is None  # nothing learned yet: it behaves as fixed
    assert server.deployer.get(dep).state == "ready"  # the engine runs on: nothing restarted it
    async with http.post(f"{server.url}/api/deployments", headers=server.admin_headers(),
                         json={"name": "b", "command": ["true", "{port}"], "keep_warm": "adaptive",
                               "mode": "on_demand"}) as r:
        assert r.status == 201, await r.text()
        assert (await r.json())["keep_warm"] == "adaptive"
    status, body = await patch(http, server, dep, {"keep_warm": "fixed"})
    assert status == 200 and body["keep_warm"] == "fixed"


async def test_idle_gaps_are_learned_from_requests_kept_in_the_state_file_and_back_after_a_restart(tmp_path):
    """Two requests 1.5 s apart through the gateway: one gap, in the controller and in the state
    file; a restart on the same state file learns it back."""
    import asyncio

    import aiohttp
    from helpers import run_app, wait_for

    chat = {"model": "G", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with run_app(tmp_path, reap_interval_s=3600) as srv, aiohttp.ClientSession() as http:
        dep = await srv.add("g", 4)
        for pause in (0, 1.5):
            await asyncio.sleep(pause)
            async with http.post(srv.gw(dep, "chat/completions"), json=chat, headers=srv.auth()) as r:
                assert r.status == 200, await r.text()
        (gap,) = srv.controller.rhythm(dep).gaps
        assert 1.5 <= gap < 5

        async def kept():  # written by a task of the controller's effects, not by the request
            return await srv.deployer.store.idle_gaps() == {dep: [gap]}
        await wait_for(kept, what="the gap in the state file")
    async with run_app(tmp_path, reap_interval_s=3600) as srv:
        assert srv.controller.rhythm(dep).gaps == [gap]
