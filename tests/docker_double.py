"""A Docker Engine API double, served by aiohttp on a Unix socket.

Answers the calls aiodocker 0.27 makes for the peer policy: ``GET /version`` (unversioned: its
``api_version="auto"`` probe), ``GET /v1.xx/containers/{id}/json`` (container inspect) and
``GET /v1.xx/networks/{id}`` (network inspect), with the shapes of the real API
(``NetworkSettings.Networks`` endpoints, ``IPAM.Config``).

And the container life cycle the docker backend drives (create, start, wait, stop, delete,
logs): an image registered with ``add_image(name, entrypoint)`` runs as a host process,
``entrypoint + Cmd`` (``python3`` is the test's interpreter), in a session of its own, its output the container's log (framed as
Docker's multiplexed stream, every line as stderr; ``follow`` streams new lines until the container stops). A port published on 127.0.0.1 with no host port gets a free one,
and since a host process cannot listen on the container's port the double rewrites the value
of ``--port`` in the command from the container port to that host port (so the engine must
take ``--port``, as the engine simulator does). Stop is SIGTERM, SIGKILL after ``t``. Containers and networks resolve like
Docker's: full id, name, or unique id prefix (``$HOSTNAME`` is the 12-digit prefix). The model is
mutable while the server runs; ``fail_status`` makes every inspect fail with that status;
``requests`` records the paths asked. ``GET /info`` answers ``info`` (mutable) and
``GET /images/{name}/json`` the images added.

    double = DockerDouble()
    double.add_network("dgxmm", [("172.18.0.0/16", "172.18.0.1")])
    cid = double.add_container("ondemand", {"dgxmm": "172.18.0.2"})
    async with double as sock_path:
        async with aiodocker.Docker(url=f"unix://{sock_path}") as docker: ...
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

API_VERSION = "1.45"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.images: dict[str, list[str]] = {}           # name -> entrypoint (host argv)
        # The image's programs as found on the host: its python3 is the test's interpreter.
        self.programs: dict[str, str] = {"python3": sys.executable, "python": sys.executable}
        self._procs: dict[str, asyncio.subprocess.Process] = {}  # container id -> its process
        self._exited: dict[str, asyncio.Event] = {}
        self._watchers: set[asyncio.Task] = set()
        # ``GET /info`` (docker info): a Docker without the NVIDIA toolkit, unless a test says.
        self.info: dict[str, Any] = {"ServerVersion": "27.0.0", "Runtimes": {"runc": {"path": "runc"}},
                                     "DefaultRuntime": "runc", "CDISpecDirs": []}

    def add_image(self, name: str, entrypoint: Sequence[str]) -> None:
        """An image whose containers run ``entrypoint + Cmd`` on the host."""
        self.images[name] = list(entrypoint)

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

    async def _info(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        return web.json_response(self.info)

    async def _image_inspect(self, request: web.Request) -> web.Response:
        """An image added with ``add_image``; a name without a tag is ``:latest``, as Docker's."""
        self.requests.append(request.path)
        name = request.match_info["name"]
        for ref in (name, name + ":latest"):
            if ref in self.images:
                return web.json_response({"Id": "sha256:" + _id("image", ref), "RepoTags": [ref],
                                          "Config": {"Entrypoint": self.images[ref]}})
        return self._error(404, f"No such image: {name}")

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

    # -- the container life cycle ----------------------------------------------------------

    def _log_path(self, cid: str) -> str:
        assert self._dir
        return os.path.join(self._dir, cid[:12] + ".log")

    async def _container_create(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        config = await request.json()
        name = request.query.get("name") or uuid.uuid4().hex[:12]
        if config.get("Image") not in self.images:
            return self._error(404, f"No such image: {config.get('Image')}")
        if self._container(name) is not None:
            return self._error(409, f'Conflict. The container name "/{name}" is already in use')
        host_config = config.get("HostConfig") or {}
        mode = host_config.get("NetworkMode") or "default"
        if mode not in ("default", "bridge", "host", "none") and self._network(mode) is None:
            return self._error(404, f"network {mode} not found")
        cid = _id("container", name + uuid.uuid4().hex)
        self.containers[cid] = {
            "Id": cid, "Name": "/" + name, "Created": "2025-01-01T00:00:00.000000000Z",
            "Path": (self.images[config["Image"]] or [""])[0], "Args": config.get("Cmd") or [],
            "State": {"Status": "created", "Running": False, "Pid": 0, "ExitCode": 0},
            "Image": "sha256:" + _id("image", config["Image"]),
            "Config": {"Hostname": cid[:12], "Image": config["Image"], "Labels": config.get("Labels") or {},
                       "Cmd": config.get("Cmd"), "Env": config.get("Env"),
                       "ExposedPorts": config.get("ExposedPorts") or {}, "Tty": False},
            "HostConfig": host_config,
            "NetworkSettings": {"SandboxID": "", "Ports": {}, "Networks": {}},
        }
        self._exited[cid] = asyncio.Event()
        open(self._log_path(cid), "wb").close()
        return web.json_response({"Id": cid, "Warnings": []}, status=201)

    def _found(self, request: web.Request) -> dict | None:
        self.requests.append(request.path)
        return self._container(request.match_info["id"])

    async def _container_start(self, request: web.Request) -> web.Response:
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        if c["State"]["Running"]:
            return web.Response(status=304)
        argv = self.images[c["Config"]["Image"]] + [str(a) for a in c["Config"].get("Cmd") or []]
        if not argv:
            return self._error(400, "no command specified")
        argv[0] = self.programs.get(argv[0], argv[0])
        ports: dict[str, list[dict[str, str]]] = {}
        for spec, bindings in (c["HostConfig"].get("PortBindings") or {}).items():
            container_port = spec.split("/")[0]
            ports[spec] = []
            for b in bindings:
                host_port = b.get("HostPort") or str(_free_port())
                ports[spec].append({"HostIp": b.get("HostIp") or "0.0.0.0", "HostPort": host_port})
                for i in range(len(argv) - 1):
                    if argv[i] == "--port" and argv[i + 1] == container_port:
                        argv[i + 1] = host_port
        env = dict(os.environ)
        for item in c["Config"].get("Env") or []:
            key, _, value = item.partition("=")
            env[key] = value
        # The container sees only the GPUs of its device request; as a host process, the
        # engine is told their host indices (so the engine simulator claims memory there).
        requests = c["HostConfig"].get("DeviceRequests") or []
        ids = [i for r in requests for i in (r.get("DeviceIDs") or [])]
        if ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        elif not requests:
            env["CUDA_VISIBLE_DEVICES"] = ""  # no device request: no GPU
        with open(self._log_path(c["Id"]), "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                env=env)
        self._procs[c["Id"]] = proc
        self._exited[c["Id"]].clear()
        c["State"].update(Status="running", Running=True, Pid=proc.pid, ExitCode=0)
        c["NetworkSettings"]["Ports"] = ports
        task = asyncio.get_running_loop().create_task(self._watch(c, proc))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return web.Response(status=204)

    async def _watch(self, c: dict, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        c["State"].update(Status="exited", Running=False, Pid=0, ExitCode=code if code >= 0 else 128 - code)
        c["NetworkSettings"]["Ports"] = {}
        self._exited[c["Id"]].set()

    async def _container_wait(self, request: web.Request) -> web.Response:
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        if c["State"]["Running"]:  # Docker's default condition, "not-running"
            await self._exited.setdefault(c["Id"], asyncio.Event()).wait()
        return web.json_response({"StatusCode": c["State"]["ExitCode"], "Error": None})

    async def _kill(self, c: dict, grace: float) -> None:
        proc = self._procs.get(c["Id"])
        if proc is None or not c["State"]["Running"]:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
            if grace <= 0 and sig == signal.SIGTERM:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(self._exited[c["Id"]].wait(), wait)
                return
            except asyncio.TimeoutError:
                pass

    async def _container_stop(self, request: web.Request) -> web.Response:
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        if not c["State"]["Running"]:
            return web.Response(status=304)
        await self._kill(c, float(request.query.get("t", "10")))
        return web.Response(status=204)

    async def _container_delete(self, request: web.Request) -> web.Response:
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        if c["State"]["Running"]:
            if request.query.get("force") not in ("1", "true", "True"):
                return self._error(409, "You cannot remove a running container: stop it or force")
            await self._kill(c, 0)
        del self.containers[c["Id"]]
        self._procs.pop(c["Id"], None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._log_path(c["Id"]))
        return web.Response(status=204)

    async def _container_top(self, request: web.Request) -> web.Response:
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        if not c["State"]["Running"]:
            return self._error(409, f"Container {c['Id']} is not running")
        pid = c["State"]["Pid"]
        return web.json_response({"Titles": ["UID", "PID", "PPID", "C", "STIME", "TTY", "TIME", "CMD"],
                                  "Processes": [["root", str(pid), "1", "0", "00:00", "?", "00:00:00", "engine"]]})

    async def _container_logs(self, request: web.Request) -> web.StreamResponse:
        """Docker's logs call: the multiplexed stream (every line as stderr), ``tail`` lines
        (or ``all``); with ``follow``, then every line the container writes until it stops."""
        c = self._found(request)
        if c is None:
            return self._error(404, f"No such container: {request.match_info['id']}")
        with open(self._log_path(c["Id"]), "rb") as fh:
            data = fh.read()
        lines = data.splitlines(keepends=True)
        tail = request.query.get("tail", "all")
        if tail != "all":
            lines = lines[-int(tail):] if int(tail) else []
        body = b"".join(self._frame(line) for line in lines)
        if request.query.get("follow") not in ("1", "true", "True"):
            return web.Response(body=body, content_type="application/vnd.docker.multiplexed-stream")
        out = web.StreamResponse(headers={"Content-Type": "application/vnd.docker.multiplexed-stream"})
        await out.prepare(request)
        await out.write(body)
        await self._follow(c, len(data), out)
        await out.write_eof()
        return out

    @staticmethod
    def _frame(line: bytes) -> bytes:
        return struct.pack(">BxxxL", 2, len(line)) + line

    async def _follow(self, c: dict, pos: int, out: web.StreamResponse) -> None:
        """Send what the log file gains from ``pos`` on, line by line, until the container
        is not running and everything it wrote was sent (Docker's follow ends there)."""
        partial = b""
        while True:
            running = c["State"]["Running"]
            try:
                with open(self._log_path(c["Id"]), "rb") as fh:
                    fh.seek(pos)
                    new = fh.read()
            except FileNotFoundError:  # removed
                return
            pos += len(new)
            partial += new
            *whole, partial = partial.split(b"\n")
            for line in whole:
                await out.write(self._frame(line + b"\n"))
            if not running and not new:
                if partial:
                    await out.write(self._frame(partial))
                return
            await asyncio.sleep(0.02)

    async def _unknown(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        return self._error(404, "page not found")

    def app(self) -> web.Application:
        app = web.Application()
        v = r"/{version:v1\.\d+}"
        app.router.add_get("/version", self._version)
        app.router.add_get(v + "/version", self._version)
        app.router.add_get(v + "/containers/{id}/json", self._container_inspect)
        app.router.add_post(v + "/containers/create", self._container_create)
        app.router.add_post(v + "/containers/{id}/start", self._container_start)
        app.router.add_post(v + "/containers/{id}/wait", self._container_wait)
        app.router.add_post(v + "/containers/{id}/stop", self._container_stop)
        app.router.add_delete(v + "/containers/{id}", self._container_delete)
        app.router.add_get(v + "/containers/{id}/logs", self._container_logs)
        app.router.add_get(v + "/containers/{id}/top", self._container_top)
        app.router.add_get(v + "/networks/{id}", self._network_inspect)
        app.router.add_get(v + "/info", self._info)
        app.router.add_get(v + "/images/{name:.+}/json", self._image_inspect)
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
        for c in list(self.containers.values()):  # nothing outlives the double
            await self._kill(c, 0)
        for task in list(self._watchers):
            await task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def networked() -> tuple[DockerDouble, str]:
    """A double with ondemand's container on ``dgxmm`` (IPv4 and IPv6), a ``decider`` network
    it is not attached to, and the default ``bridge``: what the peer policy reads of Docker
    (``engines/dockerapi.own_networks``). Its container's id is the second value."""
    d = DockerDouble()
    d.add_network("dgxmm", [("172.18.0.0/16", "172.18.0.1"), ("fd00:18::/64", "fd00:18::1")])
    d.add_network("decider", [("172.30.0.0/24", "172.30.0.1")])
    d.add_network("bridge", [("172.17.0.0/16", "172.17.0.1")])
    cid = d.add_container("ondemand", {"dgxmm": ["172.18.0.3", "fd00:18::3"]})
    return d, cid
