"""A Docker Engine API double, served by aiohttp on a Unix socket.

Answers the calls aiodocker 0.27 makes for the peer policy: ``GET /version`` (unversioned: its
``api_version="auto"`` probe), ``GET /v1.xx/containers/{id}/json`` (container inspect) and
``GET /v1.xx/networks/{id}`` (network inspect), with the shapes of the real API
(``NetworkSettings.Networks`` endpoints, ``IPAM.Config``). Containers and networks resolve like
Docker's: full id, name, or unique id prefix (``$HOSTNAME`` is the 12-digit prefix). The model is
mutable while the server runs; ``fail_status`` makes every inspect fail with that status;
``requests`` records the paths asked.

    double = DockerDouble()
    double.add_network("dgxmm", [("172.18.0.0/16", "172.18.0.1")])
    cid = double.add_container("ondemand", {"dgxmm": "172.18.0.2"})
    async with double as sock_path:
        async with aiodocker.Docker(url=f"unix://{sock_path}") as docker: ...
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import tempfile
from typing import Any, Callable, Sequence

from aiohttp import web

API_VERSION = "1.45"


def _id(kind: str, name: str) -> str:
    return hashlib.sha256(f"{kind}:{name}".encode()).hexdigest()


class DockerDouble:
    def __init__(self, api_version: str = API_VERSION):
        self.api_version = api_version
        self.networks: dict[str, dict[str, Any]] = {}    # id -> network inspect
        self.containers: dict[str, dict[str, Any]] = {}  # id -> container inspect
        self.requests: list[str] = []
        self.fail_status: int | None = None
        self.socket_path: str | None = None
        self._dir: str | None = None
        self._runner: web.AppRunner | None = None

    # -- the model ----------------------------------------------------------------------------

    def add_network(self, name: str, ipam: Sequence[tuple[str, str | None]] = (), *,
                    id: str | None = None, driver: str = "bridge") -> str:
        """A network with IPAM configs ``[(subnet, gateway or None)]``; returns its id."""
        nid = id or _id("network", name)
        config = [{"Subnet": s, **({"Gateway": g} if g else {})} for s, g in ipam]
        self.networks[nid] = {
            "Name": name, "Id": nid, "Created": "2025-01-01T00:00:00.000000000Z", "Scope": "local",
            "Driver": driver, "EnableIPv4": True,
            "EnableIPv6": any(ipaddress.ip_network(s).version == 6 for s, _ in ipam),
            "IPAM": {"Driver": "default", "Options": {}, "Config": config},
            "Internal": False, "Attachable": False, "Ingress": False,
            "ConfigFrom": {"Network": ""}, "ConfigOnly": False,
            "Containers": {}, "Options": {}, "Labels": {},
        }
        return nid

    def add_container(self, name: str, addresses: dict[str, str | list[str]] | None = None, *,
                      id: str | None = None, hostname: str | None = None) -> str:
        """A running container attached to the named networks with the given address(es)
        (at most one IPv4 and one IPv6 per network); returns its full id."""
        cid = id or _id("container", name)
        self.containers[cid] = {
            "Id": cid, "Name": "/" + name, "Created": "2025-01-01T00:00:00.000000000Z",
            "Path": "python3", "Args": ["ondemand.pyz", "serve"],
            "State": {"Status": "running", "Running": True, "Pid": 4242, "ExitCode": 0},
            "Image": "sha256:" + _id("image", name),
            "Config": {"Hostname": hostname or cid[:12], "Image": "ondemand:latest", "Labels": {}},
            "HostConfig": {"NetworkMode": next(iter(addresses or {}), "default")},
            "NetworkSettings": {"SandboxID": _id("sandbox", name), "Ports": {}, "Networks": {}},
        }
        for net, addrs in (addresses or {}).items():
            self.connect(cid, net, addrs)
        return cid

    def connect(self, container: str, network: str, addresses: str | Sequence[str] = ()) -> None:
        c = self._container(container)
        n = self._network(network)
        assert c is not None and n is not None, (container, network)
        if isinstance(addresses, str):
            addresses = [addresses]
        ep: dict[str, Any] = {
            "IPAMConfig": None, "Links": None, "Aliases": None, "MacAddress": "02:42:ac:12:00:02",
            "DriverOpts": None, "NetworkID": n["Id"], "EndpointID": _id("endpoint", c["Id"] + n["Id"]),
            "Gateway": "", "IPAddress": "", "IPPrefixLen": 0,
            "IPv6Gateway": "", "GlobalIPv6Address": "", "GlobalIPv6PrefixLen": 0,
            "DNSNames": [c["Name"][1:], c["Id"][:12]],
        }
        for a in addresses:
            ip = ipaddress.ip_address(a)
            for cfg in n["IPAM"]["Config"]:
                sub = ipaddress.ip_network(cfg["Subnet"])
                if ip in sub:
                    if ip.version == 4:
                        ep.update(IPAddress=a, IPPrefixLen=sub.prefixlen, Gateway=cfg.get("Gateway", ""))
                    else:
                        ep.update(GlobalIPv6Address=a, GlobalIPv6PrefixLen=sub.prefixlen,
                                  IPv6Gateway=cfg.get("Gateway", ""))
                    break
            else:
                raise AssertionError(f"{a} is in no subnet of {network}")
        c["NetworkSettings"]["Networks"][n["Name"]] = ep
        n["Containers"][c["Id"]] = {
            "Name": c["Name"][1:], "EndpointID": ep["EndpointID"], "MacAddress": ep["MacAddress"],
            "IPv4Address": f"{ep['IPAddress']}/{ep['IPPrefixLen']}" if ep["IPAddress"] else "",
            "IPv6Address": (f"{ep['GlobalIPv6Address']}/{ep['GlobalIPv6PrefixLen']}"
                            if ep["GlobalIPv6Address"] else ""),
        }

    def disconnect(self, container: str, network: str) -> None:
        c = self._container(container)
        n = self._network(network)
        c["NetworkSettings"]["Networks"].pop(n["Name"], None)
        n["Containers"].pop(c["Id"], None)

    def remove_network(self, network: str) -> None:
        """Removes the network only (endpoints that name it stay: the race the refresher handles)."""
        del self.networks[self._network(network)["Id"]]

    @staticmethod
    def _resolve(table: dict[str, dict], ref: str, name_of: Callable[[dict], str]) -> dict | None:
        if ref in table:
            return table[ref]
        for obj in table.values():
            if name_of(obj) == ref:
                return obj
        matches = [obj for oid, obj in table.items() if ref and oid.startswith(ref)]
        return matches[0] if len(matches) == 1 else None

    def _container(self, ref: str) -> dict | None:
        return self._resolve(self.containers, ref, lambda c: c["Name"][1:])

    def _network(self, ref: str) -> dict | None:
        return self._resolve(self.networks, ref, lambda n: n["Name"])

    # -- the API ------------------------------------------------------------------------------

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response({"message": message}, status=status)

    async def _version(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        return web.json_response({
            "Version": "27.0.0", "ApiVersion": self.api_version, "MinAPIVersion": "1.24",
            "Os": "linux", "Arch": "arm64", "KernelVersion": "6.8.0",
        })

    async def _container_inspect(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        if self.fail_status:
            return self._error(self.fail_status, "simulated failure")
        c = self._container(request.match_info["id"])
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        return web.json_response(c)

    async def _network_inspect(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        if self.fail_status:
            return self._error(self.fail_status, "simulated failure")
        n = self._network(request.match_info["id"])
        if n is None:
            return self._error(404, f"network {request.match_info['id']} not found")
        return web.json_response(n)

    async def _unknown(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        return self._error(404, "page not found")

    def app(self) -> web.Application:
        app = web.Application()
        v = r"/{version:v1\.\d+}"
        app.router.add_get("/version", self._version)
        app.router.add_get(v + "/version", self._version)
        app.router.add_get(v + "/containers/{id}/json", self._container_inspect)
        app.router.add_get(v + "/networks/{id}", self._network_inspect)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    @property
    def url(self) -> str:
        assert self.socket_path, "not started"
        return "unix://" + self.socket_path

    async def __aenter__(self) -> str:
        # A short directory: a Unix socket path must fit in 108 bytes.
        self._dir = tempfile.mkdtemp(prefix="dd-")
        self.socket_path = os.path.join(self._dir, "docker.sock")
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        await web.UnixSite(self._runner, self.socket_path).start()
        return self.socket_path

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
