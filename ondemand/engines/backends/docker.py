"""The docker backend: each engine is a container, made and driven through the Docker API
(``dockerapi``, which holds every aiodocker call of the package).

The container is ``ondemand-{name}``: the deployment's ``image`` with ``Cmd`` = its ``args``
(the image's entrypoint stays; vLLM images take the engine arguments), on the configured Docker
network (the admin's: it must exist, it is never created here). With ``gpus``, it gets the GPUs
its start was given (an nvidia device request with those device IDs; every GPU for a deployment
with ``gpu_count`` NULL; none for 0, with ``NVIDIA_VISIBLE_DEVICES=void`` so that a host whose
default runtime is nvidia does not hand it every GPU anyway).
Labels mark it ours (``ondemand.managed``), name its deployment (id and name) and fingerprint
what it was made from (``ondemand.config_hash``), so that after an ondemand restart ``adopt``
takes back only a running container made for this deployment from its current configuration;
an older one is stopped and removed instead of being served or left holding GPU memory.

Address: when ondemand runs in a container on that network, ``http://ondemand-{name}:{port}``
(Docker's DNS). Otherwise the engine port is published on ``deployer.publish_host`` only
(127.0.0.1 unless set), on a host port Docker picks, read back from the inspect:
``http://127.0.0.1:{hostport}``. Never on every address: the engine has no key of its own.
A recipe (``recipes.launch``) gives the entrypoint, the arguments, the environment and the
mounts (the model cache, the deployment's volumes).

Images are never pulled (an appliance may reach no registry): a missing image is an error that
says to load it locally. Every Docker error becomes a ``BackendError`` carrying Docker's message.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import aiohttp

from ...model import Deployment
from .. import dockerapi
from ..dockerapi import Docker, DockerContainer, DockerError
from ..recipes import Launch, is_secret
from . import Backend, BackendError, Engine, visible_gpus

log = logging.getLogger("ondemand.engines.backends.docker")

LABEL_MANAGED = "ondemand.managed"
LABEL_ID = "ondemand.deployment_id"
LABEL_NAME = "ondemand.deployment_name"
LABEL_HASH = "ondemand.config_hash"
PREFIX = "ondemand-"
# Grace period when a stale container of ours (older configuration) is replaced.
STALE_STOP_S = 30
# Ordinary API calls (inspect, create, start, delete); waits, stops and logs have no total.
API_TIMEOUT = aiohttp.ClientTimeout(total=120, connect=10)
GPU_REQUEST = {"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]]}


def gpu_request(gpus: tuple[int, ...]) -> dict[str, Any]:
    """An nvidia device request for exactly these GPUs (nvidia-smi's indices)."""
    return {"Driver": "nvidia", "DeviceIDs": [str(g) for g in gpus], "Capabilities": [["gpu"]]}


def container_name(dep: Deployment) -> str:
    return PREFIX + dep.name


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _port(dep: Deployment) -> int:
    return int(dep.port or 8000)


def _error(what: str, exc: Exception) -> BackendError:
    """A Docker (or transport) failure as a BackendError with Docker's own message."""
    if isinstance(exc, DockerError):
        if exc.status == 900:  # aiodocker: cannot connect
            return BackendError(f"{what}: Docker is unreachable: {exc.message}")
        return BackendError(f"{what}: {exc.message}")
    if isinstance(exc, asyncio.TimeoutError):
        return BackendError(f"{what}: the Docker API did not answer in time")
    return BackendError(f"{what}: lost the Docker API connection: {exc or type(exc).__name__}")


_TRANSPORT = (DockerError, aiohttp.ClientError, asyncio.TimeoutError)


def _status(exc: Exception) -> int | None:
    """Docker's status for a failed call (404: no such object ...); None when Docker did not answer."""
    return exc.status if isinstance(exc, DockerError) else None


class DockerBackend(Backend):
    kind = "docker"

    def __init__(self, *, docker_url: str | None, network: str, in_container: bool | None = None,
                 own_container_id: str | None = None, gpus: bool = True, shm_size_gib: float = 16.0,
                 publish_host: str = "127.0.0.1"):
        """``docker_url``: the Docker API address (None: aiodocker's discovery, i.e. the Docker
        context, ``DOCKER_HOST`` or the local socket). ``network``: the network engines join.
        ``in_container``: whether ondemand runs in a container on ``network`` (engines are then
        reached by container name); None: find out by inspecting ``own_container_id``.
        ``gpus``: request every GPU (nvidia device request); off for machines without one.
        ``shm_size_gib``: size of the container's /dev/shm (0: Docker's default of 64 MiB, which
        vLLM's tensor-parallel workers and PyTorch data loaders outgrow: NCCL fails with a bus
        error). A tmpfs: it takes memory only as it is used. ``publish_host``: beside Docker on
        the host, the address engine ports are published on (and reached at)."""
        self.docker_url = docker_url
        self.publish_host = publish_host
        self.network = network
        self.gpus = gpus
        self.shm_size = int(shm_size_gib * 2**30)
        self.own_container_id = own_container_id
        self._in_container = in_container
        self._docker: Docker | None = None
        self._docker_lock = asyncio.Lock()

    # --- the client -------------------------------------------------------------------------

    async def _client(self) -> Docker:
        async with self._docker_lock:
            if self._docker is None:
                try:
                    self._docker = dockerapi.client(self.docker_url, timeout=API_TIMEOUT)
                except (AssertionError, ValueError) as exc:  # no socket found, bad URL
                    raise BackendError(f"no usable Docker API address ({self.docker_url or 'default'}): "
                                       f"{str(exc) or 'no Docker socket found'}") from exc
            return self._docker

    async def close(self) -> None:
        if self._docker is not None:
            docker, self._docker = self._docker, None
            await docker.close()

    async def in_container(self) -> bool:
        """Whether engines are reached by container name on the network (decided once)."""
        if self._in_container is None:
            self._in_container = await self._detect_in_container()
        return self._in_container

    async def _detect_in_container(self) -> bool:
        if not self.own_container_id:
            return False
        docker = await self._client()
        try:
            info = await docker.containers.get(self.own_container_id)
        except _TRANSPORT as exc:
            if _status(exc) == 404:
                return False  # a container, but of another Docker (or none at all)
            raise _error("inspecting our own container", exc) from exc
        networks = (info._container.get("NetworkSettings") or {}).get("Networks") or {}
        if self.network not in networks:
            log.warning("ondemand runs in container %s, which is not attached to network %s: "
                        "engines will not be reachable by name (docker network connect %s %s)",
                        self.own_container_id, self.network, self.network, self.own_container_id)
        return True

    # --- helpers ------------------------------------------------------------------------------

    def config_hash(self, dep: Deployment, launch: Launch) -> str:
        """Fingerprint of what the container is made from; a change means "replace it".
        A secret's value is not in it (a rotated token does not replace a running engine)."""
        spec: dict[str, Any] = {"image": launch.image, "args": [str(a) for a in launch.args],
                "port": _port(dep), "engine": dep.engine, "network": self.network,
                "gpus": self.gpus}
        devices = visible_gpus(dep)
        if devices is not None:  # absent for every GPU: containers made before placement still match
            spec["devices"] = list(devices)
        # Absent when unused, so that containers made before recipes still match.
        if launch.entrypoint is not None:
            spec["entrypoint"] = list(launch.entrypoint)
        if launch.env:
            spec["env"] = [[k, "" if is_secret(k) else v] for k, v in launch.env]
        if launch.mounts:
            spec["mounts"] = [str(m) for m in launch.mounts]
        if self.publish_host != "127.0.0.1":
            spec["publish_host"] = self.publish_host
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def _labels(self, dep: Deployment, launch: Launch) -> dict[str, str]:
        return {LABEL_MANAGED: "true", LABEL_ID: str(dep.id), LABEL_NAME: dep.name,
                LABEL_HASH: self.config_hash(dep, launch)}

    async def _inspect(self, ref: str, what: str) -> dict[str, Any] | None:
        """The container's inspect, or None when there is none by that name or id."""
        docker = await self._client()
        try:
            container = await docker.containers.get(ref)
        except _TRANSPORT as exc:
            if _status(exc) == 404:
                return None
            raise _error(what, exc) from exc
        return container._container

    @staticmethod
    def _ours(info: dict[str, Any]) -> bool:
        labels = (info.get("Config") or {}).get("Labels") or {}
        return labels.get(LABEL_MANAGED) == "true"

    def _matches(self, info: dict[str, Any], dep: Deployment, launch: Launch | None) -> str | None:
        """None when ``info`` is a container made for ``dep`` as configured now, else why not
        (``launch`` None: how it runs now cannot be told, so only the deployment is compared)."""
        labels = (info.get("Config") or {}).get("Labels") or {}
        if labels.get(LABEL_ID) != str(dep.id):
            return f"it belongs to deployment id {labels.get(LABEL_ID)}"
        if launch is not None and labels.get(LABEL_HASH) != self.config_hash(dep, launch):
            return "it was made from an older configuration"
        return None

    @staticmethod
    def _running(info: dict[str, Any]) -> bool:
        return bool((info.get("State") or {}).get("Running"))

    async def _base_url(self, info: dict[str, Any], dep: Deployment) -> str | None:
        """The engine's address, or None when it has none we can reach (no published port)."""
        port = _port(dep)
        if await self.in_container():
            return f"http://{container_name(dep)}:{port}"
        ports = (info.get("NetworkSettings") or {}).get("Ports") or {}
        for binding in ports.get(f"{port}/tcp") or ():
            if binding.get("HostIp") in (self.publish_host, "") and binding.get("HostPort"):
                return f"http://{_host(self.publish_host)}:{binding['HostPort']}"
        return None

    async def _discard(self, info: dict[str, Any], why: str) -> None:
        """Stop (gracefully) and remove a container of ours that must not be used."""
        docker = await self._client()
        container = docker.containers.container(info["Id"])
        name = info.get("Name", "").lstrip("/")
        log.warning("replacing container %s: %s", name, why)
        try:
            if self._running(info):
                await container.stop(t=STALE_STOP_S)
            await container.delete(force=True)
        except _TRANSPORT as exc:
            if _status(exc) != 404:
                raise _error(f"removing the old container {name}", exc) from exc

    # --- the Backend API ----------------------------------------------------------------------

    async def start(self, dep: Deployment, launch: Launch | None = None) -> Engine:
        launch = launch or self.as_given(dep)
        name = container_name(dep)
        image = launch.image
        if not image:
            raise BackendError(f"deployment {dep.name} has no image (the docker backend runs `image`)")
        docker = await self._client()
        running = await self._reuse_or_discard(name, dep, launch)
        if running is not None:
            return running
        await self._check_network(docker)
        container = await self._create(docker, await self.create_request(dep, launch), name, image)
        try:
            await container.start()
            info = await container.show()
        except _TRANSPORT as exc:
            err = _error(f"starting container {name}", exc)
            if self.gpus and "device driver" in str(exc):
                err = BackendError(f"{err}: this Docker host cannot give containers GPUs "
                                   f"(is the NVIDIA Container Toolkit installed and configured?)")
            with contextlib.suppress(*_TRANSPORT):
                await container.delete(force=True)
            raise err from exc
        url = await self._base_url(info, dep)
        if url is None:
            # Exited before Docker published the port (it fails at start): wait_exit tells.
            log.warning("container %s has no published port (state %s)", name,
                        (info.get("State") or {}).get("Status"))
            url = "http://127.0.0.1:0"
        log.info("started %s: container %s at %s", dep.name, container.id[:12], url)
        return Engine(dep.id, dep.name, url, ref=container.id)

    async def _reuse_or_discard(self, name: str, dep: Deployment, launch: Launch) -> Engine | None:
        """A container by that name already: adopt it when it is ours, made from the current
        configuration and serving; otherwise remove it (refuse one that is not ours)."""
        info = await self._inspect(name, f"inspecting container {name}")
        if info is None:
            return None
        if not self._ours(info):
            raise BackendError(f"a container named {name} exists and was not made by ondemand "
                               f"(no {LABEL_MANAGED} label): remove or rename it")
        why = self._matches(info, dep, launch)
        if why is None and self._running(info):
            url = await self._base_url(info, dep)
            if url is not None:
                log.info("container %s is running already: adopting it (%s)", name, url)
                return Engine(dep.id, dep.name, url, ref=info["Id"], adopted=True)
            why = f"its engine port is not published on {self.publish_host}"
        await self._discard(info, why or "it is not running")
        return None

    async def create_request(self, dep: Deployment, launch: Launch) -> dict[str, Any]:
        """What a start asks Docker to create for ``dep`` run as ``launch``: image, labels, port,
        network, GPUs, /dev/shm, mounts, environment, entrypoint and engine arguments."""
        image = launch.image
        port = _port(dep)
        host_config: dict[str, Any] = {"NetworkMode": self.network, "RestartPolicy": {"Name": "no"}}
        env: list[str] = [f"{k}={v}" for k, v in launch.env]  # before the GPU's: those win
        devices = visible_gpus(dep)
        if self.gpus and devices is None:
            host_config["DeviceRequests"] = [GPU_REQUEST]
        elif self.gpus and devices:
            host_config["DeviceRequests"] = [gpu_request(devices)]
            env.append("NVIDIA_VISIBLE_DEVICES=" + ",".join(str(g) for g in devices))
        elif self.gpus:
            env.append("NVIDIA_VISIBLE_DEVICES=void")  # gpu_count 0: no GPU, whatever the image says
        if self.shm_size:
            host_config["ShmSize"] = self.shm_size
        if launch.mounts:
            host_config["Binds"] = [str(m) for m in launch.mounts]
        if not await self.in_container():
            host_config["PortBindings"] = {f"{port}/tcp": [{"HostIp": self.publish_host, "HostPort": ""}]}
        config: dict[str, Any] = {
            "Image": image,
            "Labels": self._labels(dep, launch),
            "ExposedPorts": {f"{port}/tcp": {}},
            "HostConfig": host_config,
        }
        if env:
            config["Env"] = env
        if launch.entrypoint is not None:
            config["Entrypoint"] = list(launch.entrypoint)
        args = [str(a) for a in launch.args]
        if args:
            config["Cmd"] = args
        return config

    @staticmethod
    async def _create(docker: Docker, config: dict[str, Any], name: str, image: str) -> DockerContainer:
        try:
            return await docker.containers.create(config, name=name)
        except _TRANSPORT as exc:
            if isinstance(exc, DockerError) and exc.status == 404 and "image" in exc.message.lower():
                raise BackendError(
                    f"image {image} is not on this Docker host ({exc.message}); ondemand never pulls "
                    f"(no registry may be reachable): load it locally first (docker load / docker pull)"
                ) from exc
            raise _error(f"creating container {name}", exc) from exc

    async def _check_network(self, docker: Docker) -> None:
        try:
            await docker.networks.get(self.network)
        except _TRANSPORT as exc:
            if _status(exc) == 404:
                raise BackendError(
                    f"Docker network {self.network} does not exist: create it (docker network create "
                    f"{self.network}) or set deployer.network to the network ondemand and LiteLLM use"
                ) from exc
            raise _error(f"inspecting network {self.network}", exc) from exc

    async def wait_exit(self, engine: Engine) -> int | None:
        docker = await self._client()
        container = docker.containers.container(engine.ref)
        try:
            result = await container.wait()
        except _TRANSPORT as exc:
            if _status(exc) == 404:
                return None  # removed: its exit code went with it
            raise _error(f"waiting for container {PREFIX}{engine.name}", exc) from exc
        code = result.get("StatusCode")
        return int(code) if code is not None else None

    async def stop(self, engine: Engine, timeout: float) -> None:
        docker = await self._client()
        container = docker.containers.container(engine.ref)
        try:
            await container.stop(t=max(0, math.ceil(timeout)))
        except _TRANSPORT as exc:
            if _status(exc) in (304, 404):
                return  # stopped already, or gone
            raise _error(f"stopping container {PREFIX}{engine.name}", exc) from exc

    async def pids(self, engine: Engine) -> list[int]:
        """The container's processes as the host numbers them (Docker's ``top``)."""
        docker = await self._client()
        try:
            top = await docker.containers.container(engine.ref).top()
        except _TRANSPORT as exc:
            log.debug("cannot list the processes of %s%s: %s", PREFIX, engine.name, exc)
            return []
        titles = top.get("Titles") or []
        if "PID" not in titles:
            return []
        col = titles.index("PID")
        out = []
        for row in top.get("Processes") or []:
            with contextlib.suppress(ValueError, IndexError, TypeError):
                out.append(int(row[col]))
        return out

    async def host_memory(self, engine: Engine) -> float | None:
        """The resident memory of the container's processes (their host pids, from ``top``);
        when those cannot be read (ondemand in a container of its own pid namespace), the
        container's usage as ``docker stats`` counts it: usage less the page cache it may drop
        (cgroup v2 ``inactive_file``, v1 ``total_inactive_file``)."""
        rss = await super().host_memory(engine)
        if rss is not None:
            return rss
        docker = await self._client()
        try:
            stats = await docker.containers.container(engine.ref).stats(stream=False)
            mem = (stats[0] if stats else {}).get("memory_stats") or {}
            usage = mem.get("usage")
            if isinstance(usage, int) and usage > 0:
                inner = mem.get("stats") or {}
                cache = inner.get("inactive_file", inner.get("total_inactive_file", 0))
                return max(0, usage - (cache if isinstance(cache, int) else 0)) / 1024 ** 3
        except (*_TRANSPORT, AttributeError, TypeError, IndexError) as exc:
            log.debug("cannot read the memory of %s%s: %s", PREFIX, engine.name, exc)
        return None

    async def remove(self, dep: Deployment) -> None:
        name = container_name(dep)
        info = await self._inspect(name, f"inspecting container {name}")
        if info is None:
            return
        if not self._ours(info):
            log.warning("not removing container %s: it was not made by ondemand", name)
            return
        docker = await self._client()
        try:
            await docker.containers.container(info["Id"]).delete(force=True)
        except _TRANSPORT as exc:
            if _status(exc) != 404:
                raise _error(f"removing container {name}", exc) from exc

    async def adopt(self, dep: Deployment, launch: Launch | None = None, *, compare: bool = True) -> Engine | None:
        name = container_name(dep)
        info = await self._inspect(name, f"inspecting container {name}")
        if info is None or not self._ours(info) or not self._running(info):
            return None  # an exited one stays for its log tail; start() replaces it
        why = self._matches(info, dep, (launch or self.as_given(dep)) if compare else None)
        url = await self._base_url(info, dep) if why is None else None
        if why is None and url is None:
            why = f"its engine port is not published on {self.publish_host}"
        if why is not None:
            # Not served, and not left running either: it would hold GPU memory nobody counts.
            await self._discard(info, why)
            return None
        assert url is not None  # why is None only with a url
        return Engine(dep.id, dep.name, url, ref=info["Id"], adopted=True)

    async def log_tail(self, engine: Engine | None, dep: Deployment, lines: int = 40) -> str:
        ref = engine.ref if engine is not None else container_name(dep)
        docker = await self._client()
        try:
            chunks = await docker.containers.container(ref).log(stdout=True, stderr=True, tail=lines)
        except _TRANSPORT as exc:
            if _status(exc) == 404:
                return ""
            raise _error(f"reading the log of {container_name(dep)}", exc) from exc
        return "\n".join("".join(chunks).splitlines()[-lines:])

    async def logs(self, dep: Deployment, *, tail: int, follow: bool) -> AsyncIterator[bytes]:
        """The container's log (stdout and stderr) through Docker's logs call; a follow ends
        when the container stops (Docker closes the stream). Only a container of ours."""
        name = container_name(dep)
        info = await self._inspect(name, f"inspecting container {name}")
        if info is None or not self._ours(info):
            return
        docker = await self._client()
        container = docker.containers.container(info["Id"])
        what = f"reading the log of {name}"
        try:
            if not follow:
                chunks = await container.log(stdout=True, stderr=True, tail=tail)
                if chunks:
                    yield "".join(chunks).encode()
                return
            # aiodocker reads the stream with no total timeout (a log call is long-running). Its
            # follow is an async generator (typed as an iterator): closed, it closes the response.
            stream = cast(AsyncGenerator[str, None], container.log(stdout=True, stderr=True, follow=True, tail=tail))
            async with contextlib.aclosing(stream):
                async for piece in stream:
                    yield piece.encode()
        except _TRANSPORT as exc:
            if _status(exc) != 404:  # removed meanwhile: its log went with it
                raise _error(what, exc) from exc
