"""Who may call the gateway: the peer policy, its refresh from Docker, and the peer guard.

BEHAVIOUR.md, "Checks, in order", check 1, and "Peer policy". The gateway answers only raw TCP peers on
ondemand's own Docker networks (or an explicit ``ondemand_allowed_cidrs`` list), never the
networks' gateway and first host addresses (where docker-proxy and hairpin NAT make connections
to a published port come from: the host and the LAN never pass), never the decider's network,
and never a request that carries a forwarding header (it came through a proxy). A refused request
gets 404 not_found, as if the route did not exist.

- :class:`PeerPolicy`: the policy math, immutable, with a fast cached ``allows(ip)``.
- :class:`PeerPolicySource`: reads the attached networks from the Docker API (``dockerapi``)
  at start and every 30 s and holds the current policy; nobody is allowed before the first
  refresh.
- :class:`PeerGuard`: the aiohttp middleware applying it to the gateway's routes.

Imports nothing of ours but the errors and ``dockerapi`` (which holds every Docker call;
``AttachedNetwork`` and ``container_ids_from_proc`` are its own, importable from here too);
settings come in as arguments.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

from aiohttp import hdrs, web
from multidict import istr

from ondemand.engines import dockerapi
from ondemand.engines.dockerapi import AttachedNetwork, container_ids_from_proc
from ondemand.errors import ConfigError, not_found

__all__ = [
    "AttachedNetwork", "PeerPolicy", "PeerPolicySource", "PeerGuard", "peer_guard_middleware",
    "parse_allowed", "container_ids_from_proc",
]

_log = logging.getLogger("ondemand.gateway.peers")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_KEY = "ondemand_allowed_cidrs"
# Per-policy cache of allows() answers; peers are few (LiteLLM, a handful of containers), the
# bound only stops a scan of many addresses from growing it without limit.
_CACHE_MAX = 4096


# -- settings ---------------------------------------------------------------------------------

def parse_allowed(value: Any) -> Literal["auto"] | tuple[IPNetwork, ...]:
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

    Build it with :meth:`compute` (the rules of BEHAVIOUR.md, "Peer policy") or :meth:`nobody`.
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
        decider_nets, others = _split_decider(attached, decider_network, decider_subnets, warnings)
        refused = _refused_addresses(attached)
        if setting == "auto":
            allow = [n for an in others for n in map(_net, an.subnets) if n is not None]
            if not allow:
                warnings.append(f"{_KEY} = auto allows nobody: ondemand's container is attached to "
                                "no network with a subnet other than the decider's")
            summary = "auto"
        else:
            allow = list(setting)
            warnings.extend(_explicit_list_warnings(allow, refused, decider_nets, decider_network))
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


def _split_decider(attached: Sequence[AttachedNetwork], decider_network: str | None,
                   decider_subnets: Sequence[str] | None,
                   warnings: list[str]) -> tuple[list[IPNetwork], list[AttachedNetwork]]:
    """The decider network's subnets (from ``attached`` when ondemand is on it, else from
    ``decider_subnets``), and the other attached networks."""
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
    return decider_nets, others


def _refused_addresses(attached: Sequence[AttachedNetwork]) -> dict[IPAddress, str]:
    """Connections to a published host port arrive from the gateway or the first host address
    of a network (docker-proxy, hairpin NAT): refused on every attached network (address ->
    why)."""
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
    return refused


def _explicit_list_warnings(allow: list[IPNetwork], refused: dict[IPAddress, str],
                            decider_nets: list[IPNetwork], decider_network: str | None) -> list[str]:
    """What an explicit ``ondemand_allowed_cidrs`` list allows that is refused anyway."""
    warnings = []
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
    return warnings


def _sort_key(x: Any) -> tuple[Any, ...]:
    return (x.version, str(x))


# -- the policy from Docker ------------------------------------------------------------------

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
        # Until the first refresh nobody is allowed (BEHAVIOUR.md, "Peer policy").
        self.policy: PeerPolicy = PeerPolicy.nobody("not refreshed yet")
        self.refreshed = False
        self._docker_seen = False
        self._failing = False
        self._warned: dict[tuple[Any, ...], None] = {}  # signatures already warned about (bounded, ordered)

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
        except dockerapi.OutsideDocker as e:
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
        return await dockerapi.own_networks(self.docker_url, self.proc_dir, self.container_id_hint,
                                            self.decider_network)


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

    @property
    def refused_body(self) -> bytes:
        """The body of a refusal: the gateway's 404 not_found."""
        return self._body

    def refused(self, request: web.BaseRequest) -> bool:
        transport = request.transport
        if transport is None:
            return True
        peer = transport.get_extra_info("peername")
        if not peer or not isinstance(peer, tuple):
            return True  # a Unix socket or an unknown transport is not a network peer
        return self.refuses(request.headers, peer[0])

    def refuses(self, headers: Mapping[str, str], peer: str) -> bool:
        """A request with these headers from this TCP peer (``""``: not a network peer) is refused."""
        for h in _FORWARDING:
            if h in headers:
                return True
        return not peer or not self.policy.allows(peer)

    async def __call__(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.applies(request) and self.refused(request):
            refusal = web.Response(status=404, body=self._body, content_type="application/json")
            refusal.force_close()  # a refused request ends its connection (issue 40)
            return refusal
        response: web.StreamResponse = await handler(request)
        return response


def peer_guard_middleware(policy: _Policy, path_prefix: str) -> PeerGuard:
    """The middleware to put in ``web.Application(middlewares=[...])``."""
    return PeerGuard(policy, path_prefix)
