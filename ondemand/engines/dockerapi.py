"""Every use of the Docker API (aiodocker) in the package, and nothing else.

- ``client(url)``: the one client factory (``url`` None: aiodocker's discovery, i.e.
  the Docker context, ``DOCKER_HOST`` or the local socket); ``Docker`` and
  ``DockerError`` are aiodocker's own, for the callers' annotations and ``except``.
- ``own_networks``: which Docker networks the container ondemand runs in is
  attached to (the peer policy's input), and the decider network's subnets.
- ``container_ids_from_proc``: candidate ids of that container, from ``/proc``.
- ``image_present`` and ``info``: what ``ondemand doctor`` asks of the Docker host (an
  image inspected, never pulled; ``docker info``'s runtimes and CDI devices).

A leaf: it imports nothing of ours. The docker backend, the peer policy and
``ondemand doctor`` use it.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import aiodocker
import aiohttp
from aiodocker.containers import DockerContainer
from aiodocker.exceptions import DockerError
from aiodocker.networks import DockerNetwork

__all__ = ["Docker", "DockerContainer", "DockerError", "client", "AttachedNetwork", "OutsideDocker", "own_networks",
           "container_ids_from_proc", "read_proc_ids", "image_present", "info"]

Docker = aiodocker.Docker


def client(url: str | None, *, timeout: aiohttp.ClientTimeout | None = None) -> Docker:
    """A Docker API client. Raises AssertionError or ValueError when there is no usable
    address (no socket found, a bad URL), as aiodocker does."""
    if timeout is None:
        return aiodocker.Docker(url=url)
    return aiodocker.Docker(url=url, timeout=timeout)


async def image_present(docker: Docker, ref: str) -> bool:
    """Whether the image is on the Docker host: inspected, never pulled. Raises DockerError
    for anything but "no such image"."""
    try:
        await docker.images.inspect(ref)
    except DockerError as e:
        if e.status == 404:
            return False
        raise
    return True


async def info(docker: Docker) -> dict[str, Any]:
    """``docker info``: the host's runtimes (``Runtimes``), CDI spec directories
    (``CDISpecDirs``) and the devices it discovered (``DiscoveredDevices``, API 1.50+)."""
    return dict(await docker.system.info())


# -- the container we run in ------------------------------------------------------------------

@dataclass(frozen=True)
class AttachedNetwork:
    """A Docker network ondemand's container is attached to: its subnets and gateway addresses."""

    name: str
    subnets: tuple[str, ...] = ()
    gateways: tuple[str, ...] = ()
    id: str = ""


class OutsideDocker(Exception):
    """Not in a container this Docker knows (a definite answer, unlike an unreachable Docker)."""


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


def read_proc_ids(proc_dir: str | None) -> list[str]:
    """``container_ids_from_proc`` of ``proc_dir``'s cgroup and mountinfo files."""
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


async def own_networks(docker_url: str | None, proc_dir: str | None, hint: str | None,
                       decider_network: str | None) -> tuple[list[AttachedNetwork], list[str] | None]:
    """The networks of the container we run in, and the decider network's subnets when we
    are not attached to it (None: not found). Raises OutsideDocker, or anything the
    Docker API raises (unreachable)."""
    # The full ids from /proc first: exact. The hint last, and only believed when the
    # container Docker resolves it to (by name or id prefix) has that hostname or id, so a
    # host whose name happens to name a container, or prefix an id, is not mistaken for it.
    candidates = read_proc_ids(proc_dir)
    if hint and hint not in candidates:
        candidates.append(hint)
    if not candidates:
        raise OutsideDocker("no container id (no hint, nothing in /proc)")
    async with client(docker_url) as docker:
        container = await _own_container(docker, candidates, hint)
        # A DockerContainer has __contains__ and __getitem__ but no get().
        settings = (container["NetworkSettings"] if "NetworkSettings" in container else None) or {}  # noqa: SIM401
        endpoints = settings.get("Networks") or {}
        attached = [await _attached(docker, name, ep or {}) for name, ep in endpoints.items()]
        decider_subnets: list[str] | None = None
        d = decider_network
        if d and not any(d in (an.name, an.id) for an in attached):
            try:
                info = await DockerNetwork(docker, d).show()
                decider_subnets = [c["Subnet"] for c in ((info.get("IPAM") or {}).get("Config") or [])
                                   if c.get("Subnet")]
            except DockerError as e:
                if e.status != 404:
                    raise
        return attached, decider_subnets


async def _own_container(docker: Docker, candidates: list[str], hint: str | None) -> DockerContainer:
    for cid in candidates:
        try:
            found = await docker.containers.get(cid)
        except DockerError as e:
            if e.status != 404:
                raise
            continue
        config = (found["Config"] if "Config" in found else None) or {}  # noqa: SIM401 (no DockerContainer.get)
        if found.id == cid or (cid == hint and config.get("Hostname") == hint):
            return found
    raise OutsideDocker(f"no container {', '.join(candidates)} in this Docker")


async def _attached(docker: Docker, name: str, ep: dict[str, Any]) -> AttachedNetwork:
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
    return AttachedNetwork(name, tuple(subnets), tuple(dict.fromkeys(gateways)), net_id)
