"""Who may call the gateway: the peer policy, its refresh from Docker, and the peer guard.

Design doc, Gateway, check 1 and "Peer policy". The gateway answers only raw TCP peers on
ondemand's own Docker networks (or an explicit ``ondemand_allowed_cidrs`` list), never the
networks' gateway and first host addresses (where docker-proxy and hairpin NAT make connections
to a published port come from: the host and the LAN never pass), never the decider's network,
and never a request that carries a forwarding header (it came through a proxy). A refused request
gets 404 not_found, as if the route did not exist.

- :class:`PeerPolicy`: the policy math, immutable, with a fast cached ``allows(ip)``.
- :class:`PeerPolicySource`: reads the attached networks from the Docker API (aiodocker) at
  start and every 30 s and holds the current policy; nobody is allowed before the first refresh.
- :class:`PeerGuard`: the aiohttp middleware applying it to the gateway's routes.

Imports nothing of ours but the errors; settings come in as arguments.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, Union

from aiohttp import hdrs, web
from multidict import istr

from ondemand.errors import ConfigError, not_found

__all__ = [
    "AttachedNetwork", "PeerPolicy", "PeerPolicySource", "PeerGuard", "peer_guard_middleware",
    "parse_allowed", "container_ids_from_proc",
]

_log = logging.getLogger("ondemand.peers")

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

_KEY = "ondemand_allowed_cidrs"
# Per-policy cache of allows() answers; peers are few (LiteLLM, a handful of containers), the
# bound only stops a scan of many addresses from growing it without limit.
_CACHE_MAX = 4096


# -- settings ---------------------------------------------------------------------------------

def parse_allowed(value: Any) -> str | tuple[IPNetwork, ...]:
    """``"auto"`` or the CIDRs of an explicit list; else ``ConfigError`` naming the key.

    Accepts ``"auto"``, a list of strings, or one string of CIDRs separated by commas or white
    space (an environment variable). A bare address is its /32 (/128). Host bits set
    (``10.0.0.1/8``) are refused: such an entry is usually a typo and would allow a whole network.
    """
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        items: list[Any] = [v for v in re.split(r"[\s,]+", value) if v]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{_KEY}: expected \"auto\" or a list of CIDRs, got {value!r}")
    nets = []
    for item in items:
        if isinstance(item, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
            nets.append(item)  # already parsed (idempotent)
            continue
        if not isinstance(item, str):
            raise ConfigError(f"{_KEY}: expected a CIDR string, got {item!r}")
        try:
            nets.append(ipaddress.ip_network(item.strip(), strict=True))
        except ValueError as e:
            raise ConfigError(f"{_KEY}: {item!r} is not a valid CIDR ({e})") from None
    return tuple(nets)


# -- the policy -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttachedNetwork:
    """A Docker network ondemand's container is attached to: its subnets and gateway addresses."""

    name: str
    subnets: tuple[str, ...] = ()
    gateways: tuple[str, ...] = ()
    id: str = ""


def _net(s: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(s, strict=False)
    except ValueError:
        return None


def _addr(s: str) -> IPAddress | None:
    try:
        a = ipaddress.ip_address(s.split("%", 1)[0])
    except ValueError:
        return None
    if a.version == 6 and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def _first_host(net: IPNetwork) -> IPAddress | None:
    if net.num_addresses < 2:
        return None
    return net.network_address + 1


class PeerPolicy:
    """Allowed networks minus refused networks and addresses. Immutable; ``allows`` is cached.

    Build it with :meth:`compute` (the design's rules) or :meth:`nobody`.
    """

    __slots__ = ("allowed", "refused_networks", "refused_addresses", "summary", "warnings",
                 "signature", "_allow4", "_allow6", "_deny_nets", "_cache")

    def __init__(self, allowed: Iterable[IPNetwork] = (), refused_networks: Iterable[IPNetwork] = (),
                 refused_addresses: Iterable[IPAddress] = (), *, summary: str = "",
                 warnings: Sequence[str] = ()):
        self.allowed: tuple[IPNetwork, ...] = tuple(sorted(set(allowed), key=_sort_key))
        self.refused_networks: tuple[IPNetwork, ...] = tuple(sorted(set(refused_networks), key=_sort_key))
        self.refused_addresses: frozenset[IPAddress] = frozenset(refused_addresses)
        self.summary = summary
        self.warnings: tuple[str, ...] = tuple(warnings)
        self.signature = (self.allowed, self.refused_networks,
                          tuple(sorted(self.refused_addresses, key=_sort_key)), self.warnings)
        self._allow4 = tuple(n for n in self.allowed if n.version == 4)
        self._allow6 = tuple(n for n in self.allowed if n.version == 6)
        self._deny_nets = self.refused_networks
        self._cache: dict[str, bool] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerPolicy) and other.signature == self.signature

    def __hash__(self) -> int:
        return hash(self.signature)

    def __repr__(self) -> str:
        return f"PeerPolicy({self.summary or 'allows ' + ', '.join(map(str, self.allowed)) or 'nobody'})"

    @property
    def allows_nobody(self) -> bool:
        return not self.allowed

    def allows(self, ip: str) -> bool:
        """Whether the raw TCP peer address ``ip`` may call the gateway (IPv4-mapped IPv6 is
        its IPv4; a scope id is ignored; anything that is not an address is refused)."""
        r = self._cache.get(ip)
        if r is None:
            r = self._decide(ip)
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[ip] = r
        return r

    def _decide(self, ip: str) -> bool:
        a = _addr(ip)
        if a is None or a in self.refused_addresses:
            return False
        if not any(a in n for n in (self._allow4 if a.version == 4 else self._allow6)):
            return False
        return not any(a in n for n in self._deny_nets)

    @classmethod
    def nobody(cls, reason: str, *, warnings: Sequence[str] = ()) -> PeerPolicy:
        return cls(summary=f"allows nobody ({reason})", warnings=warnings)

    @classmethod
    def compute(cls, allowed: Any, attached: Sequence[AttachedNetwork] | None,
                decider_network: str | None = None,
                decider_subnets: Sequence[str] | None = None) -> PeerPolicy:
        """The design's rules.

        ``allowed``: ``"auto"`` or CIDRs (validated by :func:`parse_allowed`). ``attached``: the
        networks ondemand's container is attached to, ``None`` outside Docker (no container, or
        Docker unreachable). ``decider_network``: its name; when ondemand is attached to it its
        subnets come from ``attached``, else from ``decider_subnets`` (``None``: not found).
        """
        setting = parse_allowed(allowed)
        if attached is None:
            if setting == "auto":
                return cls.nobody("auto outside Docker", warnings=(
                    f"{_KEY} = auto allows nobody: ondemand is not running in a Docker container "
                    "or cannot read its networks from the Docker API",))
            return cls(setting, summary="explicit list, outside Docker", warnings=(
                f"{_KEY}: the attached Docker networks could not be read (not in a container, or "
                "Docker unreachable): the explicit list applies without the gateway, first-host "
                "and decider-network exclusions",))

        warnings: list[str] = []
        decider_nets: list[IPNetwork] = []
        others: list[AttachedNetwork] = []
        decider_attached = False
        for an in attached:
            if decider_network and decider_network in (an.name, an.id):
                decider_attached = True
                decider_nets.extend(n for n in map(_net, an.subnets) if n is not None)
            else:
                others.append(an)
        if decider_network and not decider_attached:
            if decider_subnets is None:
                warnings.append(f"decider network {decider_network!r} not found: its peers cannot "
                                "be refused by subnet")
            else:
                decider_nets.extend(n for n in map(_net, decider_subnets) if n is not None)

        # Connections to a published host port arrive from the gateway or the first host address
        # of a network (docker-proxy, hairpin NAT): refused on every attached network.
        refused: dict[IPAddress, str] = {}
        for an in attached:
            for g in an.gateways:
                a = _addr(g) if g else None
                if a is not None:
                    refused.setdefault(a, f"gateway of {an.name}")
            for s in an.subnets:
                n = _net(s)
                h = _first_host(n) if n is not None else None
                if h is not None:
                    refused.setdefault(h, f"first host of {an.name}")

        if setting == "auto":
            allow = [n for an in others for n in map(_net, an.subnets) if n is not None]
            if not allow:
                warnings.append(f"{_KEY} = auto allows nobody: ondemand's container is attached to "
                                "no network with a subnet other than the decider's")
            summary = "auto"
        else:
            allow = list(setting)
            covered = sorted((a for a in refused if any(a in n for n in allow)), key=_sort_key)
            if covered:
                warnings.append(f"{_KEY} covers addresses that are refused anyway: " + ", ".join(
                    f"{a} ({refused[a]})" for a in covered))
            overlap = [d for d in decider_nets if any(d.overlaps(n) for n in allow
                                                      if d.version == n.version)]
            if overlap:
                warnings.append(f"{_KEY} overlaps the decider network {decider_network!r}, whose "
                                "peers are refused anyway: " + ", ".join(map(str, overlap)))
            if not allow:
                warnings.append(f"{_KEY} is an empty list: the gateway allows nobody")
            summary = "explicit list"
        return cls(allow, decider_nets, refused, summary=summary, warnings=warnings)

    def describe(self) -> str:
        if not self.allowed:
            return self.summary or "allows nobody"
        s = f"{self.summary}: allows {', '.join(map(str, self.allowed))}"
        if self.refused_networks:
            s += f"; refuses networks {', '.join(map(str, self.refused_networks))}"
        if self.refused_addresses:
            s += f"; refuses {', '.join(str(a) for a in sorted(self.refused_addresses, key=_sort_key))}"
        return s


def _sort_key(x: Any) -> tuple:
    return (x.version, str(x))


# -- reading Docker ---------------------------------------------------------------------------

_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_MOUNTINFO_ID = re.compile(r"/containers/([0-9a-f]{64})/")


def container_ids_from_proc(cgroup: str | None = None, mountinfo: str | None = None) -> list[str]:
    """Candidate ids of the container we run in, from the texts of ``/proc/self/mountinfo``
    (``/var/lib/docker/containers/<id>/hostname`` mounts: works with cgroup v2) and
    ``/proc/self/cgroup`` (cgroup v1 ``/docker/<id>``, systemd ``docker-<id>.scope``)."""
    ids: list[str] = []
    for m in _MOUNTINFO_ID.finditer(mountinfo or ""):
        if m.group(1) not in ids:
            ids.append(m.group(1))
    for line in (cgroup or "").splitlines():
        if "docker" in line or "containerd" in line or "libpod" in line:
            for m in _CONTAINER_ID.finditer(line):
                if m.group() not in ids:
                    ids.append(m.group())
    return ids


def _read_proc(proc_dir: str | None) -> list[str]:
    if not proc_dir:
        return []
    texts = []
    for name in ("cgroup", "mountinfo"):
        try:
            with open(f"{proc_dir}/{name}", encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError:
            texts.append("")
    return container_ids_from_proc(texts[0], texts[1])


class _OutsideDocker(Exception):
    """Not in a container this Docker knows (a definite answer, unlike an unreachable Docker)."""


class PeerPolicySource:
    """Holds the current :class:`PeerPolicy` and refreshes it from the Docker API.

    ``allowed`` is validated here (``ConfigError`` naming ``ondemand_allowed_cidrs``).
    ``container_id_hint`` is the caller's guess of our container (``$HOSTNAME``: Docker resolves
    the short id), tried after the ids found in ``proc_dir``'s mountinfo and cgroup.
    ``docker_url``: the Docker API address (``None``: aiodocker's default discovery).

    Outside Docker (no candidate id, no such container, or Docker unreachable at the first
    refresh) the policy is computed with no attached networks. A refresh that fails after one that
    succeeded keeps the previous policy: a Docker hiccup must not lock LiteLLM out, and the
    networks it describes are still the ones connections can come from.
    """

    def __init__(self, allowed: Any = "auto", *, decider_network: str | None = None,
                 container_id_hint: str | None = None, docker_url: str | None = None,
                 proc_dir: str | None = "/proc/self", docker_timeout_s: float = 10.0,
                 logger: logging.Logger | None = None):
        self.allowed = parse_allowed(allowed)
        self.decider_network = decider_network or None
        self.container_id_hint = container_id_hint or None
        self.docker_url = docker_url
        self.proc_dir = proc_dir
        self.docker_timeout_s = docker_timeout_s
        self._log = logger or _log
        # Design doc: "Until the first refresh nobody is allowed."
        self.policy: PeerPolicy = PeerPolicy.nobody("not refreshed yet")
        self.refreshed = False
        self._docker_seen = False
        self._failing = False
        self._warned: dict[tuple, None] = {}  # signatures already warned about (bounded, ordered)

    def allows(self, ip: str) -> bool:
        return self.policy.allows(ip)

    async def refresh(self) -> PeerPolicy:
        """Read the attached networks and install the resulting policy; returns it."""
        try:
            attached, decider_subnets = await asyncio.wait_for(self._read(), self.docker_timeout_s)
            self._docker_seen = True
            if self._failing:
                self._log.info("Docker API reachable again; peer policy refreshed")
            self._failing = False
        except _OutsideDocker as e:
            self._log.debug("peer policy: outside Docker (%s)", e)
            attached, decider_subnets = None, None
        except Exception as e:  # noqa: BLE001 - any failure to read Docker is "unreachable"
            if self._docker_seen:
                if not self._failing:
                    self._log.warning("cannot read the Docker networks (%s: %s); keeping the "
                                      "previous peer policy", type(e).__name__, e)
                self._failing = True
                return self.policy
            self._log.debug("peer policy: Docker unreachable (%s: %s)", type(e).__name__, e)
            attached, decider_subnets = None, None
        policy = PeerPolicy.compute(self.allowed, attached, self.decider_network, decider_subnets)
        self._install(policy)
        return self.policy

    def _install(self, policy: PeerPolicy) -> None:
        self.refreshed = True
        if policy == self.policy:
            return  # keep the old object and its cache
        self.policy = policy
        self._log.info("peer policy: %s", policy.describe())
        sig = policy.signature
        if policy.warnings and sig not in self._warned:
            # One warning per distinct policy, not one per 30 s refresh.
            self._warned[sig] = None
            if len(self._warned) > 64:
                self._warned.pop(next(iter(self._warned)))
            self._log.warning("peer policy: %s", "; ".join(policy.warnings))

    async def run(self, interval_s: float = 30.0, *, refresh_first: bool = True) -> None:
        """Refresh now (unless ``refresh_first`` is false) and every ``interval_s`` until cancelled."""
        if not refresh_first:
            await asyncio.sleep(interval_s)
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception("peer policy refresh failed")
            await asyncio.sleep(interval_s)

    async def _read(self) -> tuple[list[AttachedNetwork], list[str] | None]:
        # The full ids from /proc first: exact. The hint last, and only believed when the
        # container Docker resolves it to (by name or id prefix) has that hostname or id, so a
        # host whose name happens to name a container, or prefix an id, is not mistaken for it.
        candidates = _read_proc(self.proc_dir)
        hint = self.container_id_hint
        if hint and hint not in candidates:
            candidates.append(hint)
        if not candidates:
            raise _OutsideDocker("no container id (no hint, nothing in /proc)")
        import aiodocker  # only here: the policy math and the guard need no Docker client
        from aiodocker.exceptions import DockerError
        from aiodocker.networks import DockerNetwork

        async with aiodocker.Docker(url=self.docker_url) as docker:
            container = None
            for cid in candidates:
                try:
                    found = await docker.containers.get(cid)
                except DockerError as e:
                    if e.status != 404:
                        raise
                    continue
                config = (found["Config"] if "Config" in found else None) or {}
                if found.id == cid or (cid == hint and config.get("Hostname") == hint):
                    container = found
                    break
            if container is None:
                raise _OutsideDocker(f"no container {', '.join(candidates)} in this Docker")
            settings = (container["NetworkSettings"] if "NetworkSettings" in container else None) or {}
            endpoints = settings.get("Networks") or {}
            attached = []
            for name, ep in endpoints.items():
                ep = ep or {}
                gateways = [g for g in (ep.get("Gateway"), ep.get("IPv6Gateway")) if g]
                subnets: list[str] = []
                net_id = ep.get("NetworkID") or ""
                try:
                    # One call (networks.get() would inspect it twice).
                    info = await DockerNetwork(docker, net_id or name).show()
                    for cfg in ((info.get("IPAM") or {}).get("Config") or []):
                        if cfg.get("Subnet"):
                            subnets.append(cfg["Subnet"])
                        if cfg.get("Gateway"):
                            gateways.append(cfg["Gateway"])
                except DockerError as e:
                    if e.status != 404:
                        raise
                    # Gone between the two calls: the endpoint's own address and prefix.
                    for a, p in (("IPAddress", "IPPrefixLen"), ("GlobalIPv6Address", "GlobalIPv6PrefixLen")):
                        if ep.get(a) and ep.get(p):
                            subnets.append(str(ipaddress.ip_interface(f"{ep[a]}/{ep[p]}").network))
                attached.append(AttachedNetwork(name, tuple(subnets), tuple(dict.fromkeys(gateways)), net_id))
            decider_subnets: list[str] | None = None
            d = self.decider_network
            if d and not any(d in (an.name, an.id) for an in attached):
                try:
                    info = await DockerNetwork(docker, d).show()
                    decider_subnets = [c["Subnet"] for c in ((info.get("IPAM") or {}).get("Config") or [])
                                       if c.get("Subnet")]
                except DockerError as e:
                    if e.status != 404:
                        raise
            return attached, decider_subnets


# -- the middleware ---------------------------------------------------------------------------

class _Policy(Protocol):
    def allows(self, ip: str) -> bool: ...


_FORWARDING = (hdrs.X_FORWARDED_FOR, hdrs.FORWARDED, istr("X-Real-IP"))


class PeerGuard:
    """aiohttp middleware: check 1 of the design for every request under ``path_prefix``.

    Refuses with the gateway's 404 not_found when the raw TCP peer (the transport's
    ``peername``, never a header) is not allowed by ``policy`` (a :class:`PeerPolicySource` or a
    :class:`PeerPolicy`), or when the request carries X-Forwarded-For, Forwarded or X-Real-IP.
    The answer is rendered here, so the guard works wherever it sits in the middleware chain.

    A request is under the prefix when its raw path is, or its decoded path is: aiohttp routes on
    the decoded path, so ``/dgxmm/%6Fndemand/...`` or an absolute-form target reach the gateway's
    routes and must not slip past the guard.
    """

    __middleware_version__ = 1  # a new-style middleware (what @web.middleware marks)

    def __init__(self, policy: _Policy, path_prefix: str):
        if not isinstance(path_prefix, str) or not path_prefix.startswith("/") or path_prefix.endswith("/"):
            raise ConfigError(f"base_path: the gateway prefix must start with '/' and not end with "
                              f"one, got {path_prefix!r}")
        if not callable(getattr(policy, "allows", None)):
            raise TypeError("policy must have allows(ip)")
        self.policy = policy
        self.prefix = path_prefix
        self._n = len(path_prefix)
        self._body = not_found().body()

    def _under(self, path: str) -> bool:
        n = self._n
        return path.startswith(self.prefix) and (len(path) == n or path[n] in "/?#")

    def applies(self, request: web.BaseRequest) -> bool:
        return self._under(request.raw_path) or self._under(request.path)

    def refused(self, request: web.BaseRequest) -> bool:
        headers = request.headers
        for h in _FORWARDING:
            if h in headers:
                return True
        transport = request.transport
        if transport is None:
            return True
        peer = transport.get_extra_info("peername")
        if not peer or not isinstance(peer, tuple):
            return True  # a Unix socket or an unknown transport is not a network peer
        return not self.policy.allows(peer[0])

    async def __call__(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.applies(request) and self.refused(request):
            return web.Response(status=404, body=self._body, content_type="application/json")
        return await handler(request)


def peer_guard_middleware(policy: _Policy, path_prefix: str) -> PeerGuard:
    """The middleware to put in ``web.Application(middlewares=[...])``."""
    return PeerGuard(policy, path_prefix)
