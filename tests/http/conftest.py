"""The fixtures the tests of ondemand/http/ share (the helpers they share are modules beside
them: raw_http.py, the client's side of the wire; engine_double.py, an engine on loopback)."""
import pytest

from ondemand.app import GATEWAY
from ondemand.http.pool import Upstreams


@pytest.fixture
async def ready(server):
    """The whole server (tests/conftest.py's ``server``) and a deployment ``a`` whose engine
    simulator is ready: (server, its id)."""
    dep = await server.add("a")
    await server.deployer.restart(dep)
    return server, dep


@pytest.fixture
def gateway_calls(server, monkeypatch) -> list:
    """The requests that reached the gateway, by raw path."""
    seen: list = []
    gateway = server.app[GATEWAY]
    handle = gateway.handle

    async def spy(call):
        seen.append(call.raw_path)
        await handle(call)
    monkeypatch.setattr(gateway, "handle", spy)
    return seen


@pytest.fixture
async def ups():
    """The engines' connection pools, closed after the test."""
    u = Upstreams()
    yield u
    await u.close()
