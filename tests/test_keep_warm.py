"""``keep_warm`` through the admin API: ``fixed`` on every deployment unless told; ``adaptive``
refused by name until the reaper acts on the learned rhythm (engines/rhythm.py), any other value
refused, and nothing changed by a refusal, while its engine runs too."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.server(reap_interval_s=3600)


async def patch(http, server, dep_id: int, body: dict):
    async with http.patch(f"{server.url}/api/deployments/{dep_id}", json=body, headers=server.admin_headers()) as r:
        return r.status, await r.json()


async def test_keep_warm_is_fixed_and_adaptive_is_refused_by_name(server, http):
    dep = await server.add("warm", 4)
    async with http.get(f"{server.url}/api/deployments/{dep}", headers=server.admin_headers()) as r:
        assert (await r.json())["keep_warm"] == "fixed"
    await server.deployer.restart(dep)
    for value, says in (("adaptive", "keep_warm: adaptive is not available"), ("sometimes", "keep_warm: fixed or adaptive"),
                        (None, "keep_warm: fixed or adaptive")):
        status, body = await patch(http, server, dep, {"keep_warm": value})
        assert status == 400 and body["error"]["code"] == "invalid_field", body
        assert body["error"]["message"].startswith(says), body
    assert server.deployer.get(dep).keep_warm == "fixed" and server.deployer.get(dep).state == "ready"
    async with http.post(f"{server.url}/api/deployments", headers=server.admin_headers(),
                         json={"name": "b", "command": ["true", "{port}"], "keep_warm": "adaptive"}) as r:
        assert r.status == 400 and (await r.json())["error"]["message"].startswith("keep_warm:")


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
