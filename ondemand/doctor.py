"""``ondemand doctor``: one function per check, each saying what is wrong and
what to do. A check is ``{"check", "ok", "detail"}`` with ``ok`` true, false
(something to fix) or None (skipped: not configured, not running)."""
from __future__ import annotations

import asyncio
import os
import stat as stat_mod
from typing import Any

from .adminclient import NoServer, request, stored_deployments
from .config import Config
from .model import Deployment

Check = dict[str, Any]


def _check(check: str, ok: bool | None, detail: str) -> Check:
    return {"check": check, "ok": ok, "detail": detail}


async def check_docker(cfg: Config) -> Check:
    if cfg.deployer.backend != "docker":
        return _check("docker", None, "deployer.backend = process: engines run as child processes")
    from .dockerapi import DockerError, client
    try:
        docker = client(cfg.deployer.docker_url)
        try:
            version = await docker.version()
            try:
                await docker.networks.get(cfg.deployer.network)
                return _check("docker", True,
                              f"Docker {version.get('Version')} answers; network {cfg.deployer.network} exists")
            except DockerError:
                return _check("docker", False,
                              f"network {cfg.deployer.network!r} is missing: create it "
                              f"(docker network create {cfg.deployer.network}) or set deployer.network")
        finally:
            await docker.close()
    except Exception as exc:
        return _check("docker", False, f"the Docker API does not answer ({exc or type(exc).__name__}): start dockerd, "
                                       "mount /var/run/docker.sock, or set deployer.docker_url")


async def check_budget(cfg: Config) -> Check:
    """nvidia-smi, /proc/meminfo or the declared capacity."""
    from .budget import Budget, BudgetError
    budget = Budget.from_config(cfg)
    try:
        measured = await budget.measure()
    except BudgetError as exc:
        return _check("budget", False, str(exc))
    if measured is None:
        sizes = cfg.budget.gpu_capacity_gib or (cfg.budget.capacity_gib or 0,)
        per = f" ({len(sizes)} GPUs)" if cfg.budget.gpu_capacity_gib else ""
        return _check("budget", True, f"static: {sum(sizes):g} GiB declared{per}")
    used, total = sum(g.used for g in measured), sum(g.total for g in measured)
    gpus = f" on {len(measured)} GPUs" if cfg.budget.source == "nvidia-smi" else ""
    return _check("budget", True, f"{cfg.budget.source}: {used:.1f} of {total:.1f} GiB in use{gpus}")


def check_key(cfg: Config) -> Check:
    from . import keys
    key = keys.read_key_file(cfg.key_file)
    if key is None:
        return _check("key", False,
                      f"no key in {cfg.key_file}: run `ondemand key init` (the gateway answers 503 until then)")
    mode = stat_mod.S_IMODE(os.stat(cfg.key_file).st_mode)
    if mode & 0o077:
        return _check("key", False, f"{cfg.key_file} is readable by others (mode {mode:o}): chmod 600 it")
    return _check("key", True, f"{cfg.key_file}, fingerprint {keys.fingerprint(key)}")


def check_modes(cfg: Config) -> Check:
    """The files with secrets: the state directory 0700; the key, the admin token and the
    admin socket 0600 (none of them readable or writable by others)."""
    wanted = [(cfg.state_dir, "chmod 700"), (cfg.key_file, "chmod 600"), (cfg.token_file, "chmod 600"),
              (cfg.admin_socket, "chmod 600")]
    wrong = []
    for path, fix in wanted:
        try:
            have = stat_mod.S_IMODE(os.stat(path).st_mode)
        except OSError:
            continue  # not made yet: serve makes it with the right mode
        if have & 0o077:
            wrong.append(f"{path} is mode {have:o}, open to others: {fix} it")
    if wrong:
        return _check("files", False, "; ".join(wrong))
    return _check("files", True, "the state directory, the key, the admin token and the socket are private")


async def check_litellm(cfg: Config) -> Check:
    if not cfg.litellm.url:
        return _check("litellm", None, "litellm.url is not set: models are not registered in LiteLLM")
    from . import keys
    from .litellm import LiteLLMClient, LiteLLMError
    master = keys.read_key_file(cfg.litellm.master_key_file) if cfg.litellm.master_key_file else None
    if master is None:
        return _check("litellm", False,
                      "litellm.master_key_file holds no key: set it to a file with LiteLLM's master key")
    client = LiteLLMClient(cfg.litellm.url, master)
    try:
        models = await client.list_models()
        return _check("litellm", True, f"{cfg.litellm.url} answers; {len(models)} models listed")
    except LiteLLMError as exc:
        hint = (" — LiteLLM's model routes need its database: set DATABASE_URL and STORE_MODEL_IN_DB=True"
                if exc.code == "litellm_no_db" else "")
        return _check("litellm", False, f"{exc.message} ({exc.code}){hint}")
    finally:
        await client.close()


async def _deployments(cfg: Config) -> list[dict[str, Any]] | None:
    try:
        _status, rows = await request(cfg, "GET", "/deployments")
    except NoServer:
        return await stored_deployments(cfg)
    return rows if isinstance(rows, list) else None


def check_engines(rows: list[dict[str, Any]] | None) -> Check | None:
    """Engines whose idleness cannot be seen; None when no deployment can be read."""
    from .metrics import BLIND_WARNING
    from .metrics import blind as is_blind
    blind = [d["name"] for d in rows or () if is_blind(Deployment.from_row(d))]
    if blind:
        return _check("engines", False, f"{', '.join(blind)}: {BLIND_WARNING}")
    if rows is not None:
        return _check("engines", True, f"{len(rows)} deployments; every on-demand engine can report its load")
    return None


def check_footprints(rows: list[dict[str, Any]] | None) -> Check | None:
    """Deployments whose engines were measured more than 10 % over what they declared."""
    deps = [Deployment.from_row(d) for d in rows or ()]
    over = [f"{d.name} (declared {d.memory_gib:g} GiB, measured {d.measured_gib:.1f})"
            for d in deps if d.over_declared]
    if over:
        return _check("footprints", False, f"{'; '.join(over)}: raise memory_gib (deploy set ID --memory-gib N); "
                                           "until then fit checks count the measured size")
    measured = [d for d in deps if d.measured_gib is not None]
    if measured:
        return _check("footprints", True, f"{len(measured)} engines measured, none over its declared memory_gib")
    return None


async def check_server(cfg: Config) -> Check:
    """The admin socket: ok True when a server answers, None when none runs."""
    try:
        _status, data = await request(cfg, "GET", "/host")
    except NoServer:
        return _check("server", None, "no server runs (ondemand serve)")
    return _check("server", True, f"answers on {cfg.admin_socket} (version {data.get('version') if data else '?'})")


async def check_listener(cfg: Config, server_runs: bool) -> Check:
    """With a server: does the listener accept connections? Without: is it free?"""
    host, port = cfg.listen_host_port
    if server_runs:
        probe = "127.0.0.1" if host in ("0.0.0.0", "") else host
        try:
            _r, w = await asyncio.wait_for(asyncio.open_connection(probe, port), 5)
            w.close()
            return _check("listener", True, f"{cfg.listen} accepts connections")
        except (OSError, asyncio.TimeoutError) as exc:
            return _check("listener", False, f"{cfg.listen} refuses connections: {exc}")
    try:
        import socket as socket_mod
        with socket_mod.socket(socket_mod.AF_INET6 if ":" in host else socket_mod.AF_INET) as s:
            s.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_REUSEADDR, 1)
            s.bind((host, port))
        return _check("listener", True, f"{cfg.listen} is free to listen on")
    except OSError as exc:
        return _check("listener", False,
                      f"cannot listen on {cfg.listen}: {exc.strerror} (another process? change listen)")


async def run(cfg: Config) -> list[Check]:
    """Every check, in the order they are printed."""
    out = [await check_docker(cfg), await check_budget(cfg), check_key(cfg), check_modes(cfg),
           await check_litellm(cfg)]
    rows = await _deployments(cfg)
    out.extend(c for c in (check_engines(rows), check_footprints(rows)) if c is not None)
    server = await check_server(cfg)
    out.append(server)
    out.append(await check_listener(cfg, server["ok"] is True))
    return out
