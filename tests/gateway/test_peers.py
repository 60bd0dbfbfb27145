"""The peer policy, its refresh from the Docker API, and the peer guard (BEHAVIOUR.md, check 1 and
"Peer policy")."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest
from aiohttp import web

from ondemand.errors import ConfigError
from ondemand.gateway.peers import (
    AttachedNetwork,
    PeerGuard,
    PeerPolicy,
    PeerPolicySource,
    parse_allowed,
    peer_guard_middleware,
)

try:
    from docker_double import DockerDouble, networked
except ImportError:  # tests/ as a package
    from tests.docker_double import DockerDouble, networked

DGXMM = AttachedNetwork("dgxmm", ("172.18.0.0/16",), ("172.18.0.1",), id="n1")
LLM = AttachedNetwork("llm", ("172.20.0.0/24", "fd00:20::/64"), ("172.20.0.1", "fd00:20::1"), id="n2")
DECIDER = AttachedNetwork("decider", ("172.30.0.0/24",), ("172.30.0.1",), id="n3")


# -- the settings -----------------------------------------------------------------------------

def test_parse_allowed():
    assert parse_allowed("auto") == "auto"
    assert parse_allowed(" AUTO ") == "auto"
    assert [str(n) for n in parse_allowed(["10.0.0.0/8", "fd00::/8", "192.168.1.5"])] == [
        "10.0.0.0/8", "fd00::/8", "192.168.1.5/32"]
    assert [str(n) for n in parse_allowed("10.0.0.0/8, 172.16.0.0/12 192.168.0.0/16")] == [
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    assert parse_allowed([]) == ()


@pytest.mark.parametrize("bad", [["10.0.0.0/33"], ["nonsense"], ["10.0.0.1/8"], [10], 42, None,
                                 "10.0.0.0/8,bogus"])
def test_bad_cidrs_are_config_errors_naming_the_key(bad):
    with pytest.raises(ConfigError, match="ondemand_allowed_cidrs"):
        parse_allowed(bad)
    with pytest.raises(ConfigError, match="ondemand_allowed_cidrs"):
        PeerPolicySource(bad)


def test_guard_validates_its_prefix():
    with pytest.raises(ConfigError):
        PeerGuard(PeerPolicy(), "dgxmm/ondemand")
    with pytest.raises(ConfigError):
        PeerGuard(PeerPolicy(), "/dgxmm/ondemand/")


# -- the policy math --------------------------------------------------------------------------

def test_auto_allows_attached_subnets_minus_gateway_and_first_host():
    p = PeerPolicy.compute("auto", [DGXMM, LLM])
    assert p.allows("172.18.0.2")  # LiteLLM on dgxmm
    assert p.allows("172.18.255.254")
    assert p.allows("172.20.0.7")
    assert not p.allows("172.18.0.1")  # gateway: docker-proxy, hairpin NAT
    assert not p.allows("172.19.0.2")
    assert not p.allows("10.0.0.1")
    assert not p.allows("127.0.0.1")
    assert p.warnings == ()


def test_first_host_is_refused_even_when_the_gateway_is_elsewhere():
    net = AttachedNetwork("odd", ("10.9.0.0/24",), ("10.9.0.254",))
    p = PeerPolicy.compute("auto", [net])
    assert not p.allows("10.9.0.1") and not p.allows("10.9.0.254") and p.allows("10.9.0.2")


def test_auto_excludes_the_decider_network():
    p = PeerPolicy.compute("auto", [DGXMM, DECIDER], decider_network="decider")
    assert p.allows("172.18.0.5")
    assert not p.allows("172.30.0.5")
    # by id too
    p = PeerPolicy.compute("auto", [DGXMM, DECIDER], decider_network="n3")
    assert not p.allows("172.30.0.5")


def test_decider_subnets_refused_even_when_overlapping_an_allowed_network():
    # Not attached: its subnets come from inspecting it by name.
    p = PeerPolicy.compute("auto", [DGXMM], decider_network="decider", decider_subnets=["172.18.5.0/24"])
    assert p.allows("172.18.4.9")
    assert not p.allows("172.18.5.9")


def test_explicit_list_minus_the_same_exclusions():
    p = PeerPolicy.compute(["172.16.0.0/12", "10.1.0.0/16"], [DGXMM, DECIDER], decider_network="decider")
    assert p.allows("10.1.2.3")  # only in the list
    assert p.allows("172.18.0.2")
    assert p.allows("172.19.0.2")  # the list, not the attached networks, decides what is allowed
    assert not p.allows("172.18.0.1")  # gateway
    assert not p.allows("172.30.0.7")  # decider network, although the list covers it
    assert not p.allows("172.30.0.1")
    assert not p.allows("10.2.0.1")
    # It covers excluded addresses: one warning naming them.
    assert len(p.warnings) == 2
    assert "172.18.0.1 (gateway of dgxmm)" in p.warnings[0]
    assert "172.30.0.0/24" in p.warnings[1]


def test_explicit_list_not_covering_exclusions_has_no_warning():
    p = PeerPolicy.compute(["172.18.0.0/24"], [DGXMM, LLM])
    assert "172.18.0.1" in p.warnings[0]
    p = PeerPolicy.compute(["172.18.1.0/24"], [DGXMM, LLM])
    assert p.warnings == () and p.allows("172.18.1.1")


def test_ipv6_and_mapped_ipv4():
    p = PeerPolicy.compute("auto", [LLM])
    assert p.allows("fd00:20::5")
    assert not p.allows("fd00:20::1")  # gateway (and first host)
    assert not p.allows("fd00:21::5")
    assert p.allows("::ffff:172.20.0.9")  # a dual-stack listener reports IPv4 peers like this
    assert not p.allows("::ffff:172.20.0.1")
    assert not p.allows("::ffff:10.0.0.1")
    assert p.allows("fd00:20::5%eth0")  # a scope id does not matter
    v6 = PeerPolicy.compute(["fd00:20::/64"], [LLM])
    assert v6.allows("fd00:20::2") and not v6.allows("172.20.0.9")


def test_not_an_address_is_refused():
    p = PeerPolicy.compute("auto", [DGXMM])
    for bad in ("", "localhost", "172.18.0", "172.18.0.2:80", "::ffff:zzz", "unix"):
        assert not p.allows(bad)


def test_outside_docker():
    p = PeerPolicy.compute("auto", None)
    assert p.allows_nobody and not p.allows("172.18.0.2") and not p.allows("127.0.0.1")
    assert "allows nobody" in p.warnings[0]
    p = PeerPolicy.compute(["127.0.0.0/8"], None, decider_network="decider")
    assert p.allows("127.0.0.1")  # the explicit list still applies
    assert "without the gateway" in p.warnings[0]


def test_auto_with_only_the_decider_network_allows_nobody():
    p = PeerPolicy.compute("auto", [DECIDER], decider_network="decider")
    assert p.allows_nobody and "allows nobody" in p.warnings[0]
    p = PeerPolicy.compute("auto", [AttachedNetwork("host", (), ())])  # network_mode: host
    assert p.allows_nobody


def test_decider_not_found_is_a_warning():
    p = PeerPolicy.compute("auto", [DGXMM], decider_network="decider", decider_subnets=None)
    assert p.allows("172.18.0.2")
    assert "not found" in p.warnings[0]


def test_nobody_before_the_first_refresh():
    src = PeerPolicySource(["0.0.0.0/0"], container_id_hint="x")
    assert not src.allows("10.0.0.1") and not src.refreshed


def test_allows_cache_is_bounded_and_policies_compare_by_content():
    p = PeerPolicy.compute("auto", [DGXMM])
    for i in range(5000):
        p.allows(f"172.18.{i // 256}.{i % 256}")
    assert len(p._cache) <= 4096
    assert p == PeerPolicy.compute("auto", [DGXMM])
    assert p != PeerPolicy.compute("auto", [DGXMM, LLM])


# -- the refresher against the Docker API double ----------------------------------------------

async def test_refresh_reads_the_attached_networks():
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource("auto", container_id_hint=cid[:12], docker_url=f"unix://{sock}",
                               proc_dir=None)
        policy = await src.refresh()
    assert src.refreshed and src.policy is policy
    assert src.allows("172.18.0.2") and src.allows("fd00:18::2")
    assert not src.allows("172.18.0.1") and not src.allows("fd00:18::1")
    assert not src.allows("172.17.0.2")  # a network we are not attached to
    assert any(p.endswith(f"/containers/{cid[:12]}/json") for p in d.requests)
    assert any(p.startswith("/v1.45/networks/") for p in d.requests)


async def test_refresh_follows_network_changes_and_the_decider():
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource("auto", decider_network="decider", container_id_hint=cid,
                               docker_url=f"unix://{sock}", proc_dir=None)
        await src.refresh()
        assert not src.allows("172.30.0.5") and not src.allows("172.17.0.5")
        d.connect(cid, "decider", "172.30.0.3")
        d.connect(cid, "bridge", "172.17.0.3")
        await src.refresh()
        assert src.allows("172.17.0.5") and not src.allows("172.17.0.1")
        assert not src.allows("172.30.0.5")  # attached, but the decider's
        d.disconnect(cid, "bridge")
        await src.refresh()
        assert not src.allows("172.17.0.5")


async def test_refresh_explicit_list_refuses_decider_subnets_inspected_by_name(caplog):
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource(["172.16.0.0/12"], decider_network="decider", container_id_hint=cid,
                               docker_url=f"unix://{sock}", proc_dir=None)
        await src.refresh()
    assert src.allows("172.17.0.5") and src.allows("172.18.0.5")
    assert not src.allows("172.30.0.5") and not src.allows("172.18.0.1")
    assert "/v1.45/networks/decider" in d.requests


async def test_container_found_through_proc(tmp_path):
    d, cid = networked()
    (tmp_path / "cgroup").write_text("0::/\n")
    (tmp_path / "mountinfo").write_text(f"1 2 0:1 /docker/containers/{cid}/hostname /etc/hostname rw\n")
    async with d as sock:
        # The hint (a --hostname that is not an id) is unknown to Docker; /proc has the id.
        src = PeerPolicySource("auto", container_id_hint="my-host", docker_url=f"unix://{sock}",
                               proc_dir=str(tmp_path))
        await src.refresh()
    assert src.allows("172.18.0.9")


async def test_a_hint_naming_another_container_is_not_believed():
    d, cid = networked()
    d.add_container("dgx01", {"bridge": "172.17.0.9"}, hostname="f00d")  # not our hostname
    async with d as sock:
        src = PeerPolicySource("auto", container_id_hint="dgx01", docker_url=f"unix://{sock}",
                               proc_dir=None)
        assert (await src.refresh()).allows_nobody
        # The default: $HOSTNAME is the short id, which is also the container's hostname.
        src = PeerPolicySource("auto", container_id_hint=cid[:12], docker_url=f"unix://{sock}",
                               proc_dir=None)
        assert not (await src.refresh()).allows_nobody


async def test_network_gone_between_calls_falls_back_to_the_endpoint():
    d, cid = networked()
    d.remove_network("dgxmm")
    async with d as sock:
        src = PeerPolicySource("auto", container_id_hint=cid, docker_url=f"unix://{sock}", proc_dir=None)
        await src.refresh()
    assert src.allows("172.18.0.9") and src.allows("fd00:18::9")
    assert not src.allows("172.18.0.1") and not src.allows("fd00:18::1")


async def test_outside_docker_cases():
    d, cid = networked()
    async with d as sock:
        # No container id at all.
        src = PeerPolicySource("auto", docker_url=f"unix://{sock}", proc_dir=None)
        assert (await src.refresh()).allows_nobody and src.refreshed
        # A hostname Docker does not know.
        src = PeerPolicySource("auto", container_id_hint="laptop", docker_url=f"unix://{sock}", proc_dir=None)
        assert (await src.refresh()).allows_nobody
        src = PeerPolicySource(["127.0.0.0/8"], container_id_hint="laptop", docker_url=f"unix://{sock}",
                               proc_dir=None)
        await src.refresh()
        assert src.allows("127.0.0.1")
    # Docker unreachable at the first refresh.
    src = PeerPolicySource("auto", container_id_hint=cid, docker_url="unix:///nonexistent/docker.sock",
                           proc_dir=None)
    assert (await src.refresh()).allows_nobody


async def test_docker_failure_after_success_keeps_the_previous_policy(caplog):
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource("auto", container_id_hint=cid, docker_url=f"unix://{sock}", proc_dir=None)
        await src.refresh()
        good = src.policy
        d.fail_status = 500
        caplog.set_level(logging.WARNING, logger="ondemand.gateway.peers")
        for _ in range(3):
            assert await src.refresh() is good
        assert src.allows("172.18.0.2")
        assert len([r for r in caplog.records if "keeping the previous" in r.getMessage()]) == 1
        d.fail_status = None
        await src.refresh()
        assert src.policy is good  # same content: same object, cache kept


async def test_one_warning_per_distinct_policy(caplog):
    caplog.set_level(logging.INFO, logger="ondemand.gateway.peers")
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource(["172.18.0.0/16"], container_id_hint=cid, docker_url=f"unix://{sock}",
                               proc_dir=None)

        def warnings():
            return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

        for _ in range(5):
            await src.refresh()
        assert len(warnings()) == 1 and "172.18.0.1 (gateway of dgxmm)" in warnings()[0]
        # A different policy with a different warning: one more.
        d.add_network("extra", [("172.18.7.0/24", "172.18.7.1")])
        d.connect(cid, "extra", "172.18.7.3")
        for _ in range(3):
            await src.refresh()
        assert len(warnings()) == 2 and "172.18.7.1 (gateway of extra)" in warnings()[1]
        # Back to the first: already warned about.
        d.disconnect(cid, "extra")
        await src.refresh()
        assert len(warnings()) == 2


async def test_auto_outside_docker_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger="ondemand.gateway.peers")
    src = PeerPolicySource("auto", proc_dir=None)
    for _ in range(4):
        await src.refresh()
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "allows nobody" in msgs[0]


async def test_run_refreshes_periodically():
    d, cid = networked()
    async with d as sock:
        src = PeerPolicySource("auto", container_id_hint=cid, docker_url=f"unix://{sock}", proc_dir=None)
        task = asyncio.create_task(src.run(interval_s=0.05))
        try:
            for _ in range(100):
                if src.refreshed:
                    break
                await asyncio.sleep(0.01)
            assert src.allows("172.18.0.2")
            d.add_network("late", [("10.50.0.0/24", "10.50.0.1")])
            d.connect(cid, "late", "10.50.0.3")
            for _ in range(100):
                if src.allows("10.50.0.9"):
                    break
                await asyncio.sleep(0.01)
            assert src.allows("10.50.0.9")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


# -- the guard on a real server ---------------------------------------------------------------

PREFIX = "/dgxmm/ondemand"


@pytest.fixture
async def guarded_server():
    """A server on 127.0.0.1 with the guard over an explicit 127.0.0.0/29 and an attached network
    127.0.0.0/24 whose gateway is 127.0.0.1 (so 127.0.0.1 is both gateway and first host), and a
    decider network 127.0.0.4/30."""
    d = DockerDouble()
    d.add_network("dgxmm", [("127.0.0.0/24", "127.0.0.1")])
    d.add_network("decider", [("127.0.0.4/30", None)])
    cid = d.add_container("ondemand", {"dgxmm": "127.0.0.200"})
    async with d as sock:
        src = PeerPolicySource(["127.0.0.0/29"], decider_network="decider", container_id_hint=cid,
                               docker_url=f"unix://{sock}", proc_dir=None)
        seen = []

        async def handler(request):
            seen.append(request.raw_path)
            return web.json_response({"ok": True})

        app = web.Application(middlewares=[peer_guard_middleware(src, PREFIX)])
        app.router.add_route("*", PREFIX + "/{tail:.*}", handler)
        app.router.add_get("/dgxmm/api/host", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield src, f"http://127.0.0.1:{port}", seen
        finally:
            await runner.cleanup()


async def _get(base: str, path: str, local: str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = aiohttp.TCPConnector(local_addr=(local, 0), force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.get(base + path, headers=headers or {}) as r:
        return r.status, await r.read()


NOT_FOUND = {"error": {"message": "Not found", "type": "not_found_error", "code": "not_found"}}


async def test_guard_by_peer_address(guarded_server):
    src, base, seen = guarded_server
    path = PREFIX + "/1/v1/models"
    # Before the first refresh nobody passes.
    status, body = await _get(base, path, "127.0.0.2")
    assert status == 404 and orjson.loads(body) == NOT_FOUND
    await src.refresh()
    assert (await _get(base, path, "127.0.0.2"))[0] == 200
    assert (await _get(base, path, "127.0.0.3"))[0] == 200
    for refused in ("127.0.0.1", "127.0.0.5", "127.0.0.9", "127.0.1.2"):
        # gateway and first host / decider network / outside the list / outside everything
        status, body = await _get(base, path, refused)
        assert status == 404 and orjson.loads(body) == NOT_FOUND, refused
    assert seen == [path, path]


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP", "x-forwarded-for"])
async def test_guard_refuses_forwarding_headers_even_from_an_allowed_peer(guarded_server, header):
    src, base, seen = guarded_server
    await src.refresh()
    status, body = await _get(base, PREFIX + "/1/v1/models", "127.0.0.2", {header: "127.0.0.2"})
    assert status == 404 and orjson.loads(body) == NOT_FOUND
    assert seen == []


async def test_guard_only_covers_the_gateway_prefix(guarded_server):
    src, base, seen = guarded_server
    await src.refresh()
    assert (await _get(base, "/dgxmm/api/host", "127.0.0.9"))[0] == 200
    assert (await _get(base, "/dgxmm/api/host", "127.0.0.2", {"X-Forwarded-For": "1.2.3.4"}))[0] == 200


async def test_guard_covers_an_encoded_prefix(guarded_server):
    # aiohttp routes /dgxmm/%6Fndemand/... to the gateway's routes: the guard must see it too.
    from yarl import URL
    src, base, seen = guarded_server
    await src.refresh()
    raw = "/dgxmm/%6Fndemand/1/v1/models"
    for local, status in (("127.0.0.9", 404), ("127.0.0.2", 200)):
        conn = aiohttp.TCPConnector(local_addr=(local, 0), force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            async with s.get(URL(base + raw, encoded=True), headers={}) as r:
                assert r.status == status, local
    assert seen == [raw]  # it reached the gateway's route, with its raw path, only once allowed


async def test_guard_on_a_plain_policy_and_without_a_peer():
    guard = PeerGuard(PeerPolicy.compute("auto", [DGXMM]), PREFIX)

    class Transport:
        def __init__(self, peer):
            self.peer = peer

        def get_extra_info(self, name):
            return self.peer if name == "peername" else None

    from aiohttp.test_utils import make_mocked_request
    for peer, refused in ((("172.18.0.2", 5555), False), (("172.18.0.1", 5555), True), ("", True),
                          (None, True), (("::ffff:172.18.0.2", 1, 0, 0), False)):
        req = make_mocked_request("GET", PREFIX + "/1/v1/models", transport=Transport(peer))
        assert guard.refused(req) is refused, peer
