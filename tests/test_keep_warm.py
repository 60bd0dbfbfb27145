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
