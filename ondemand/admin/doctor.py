"""``ondemand doctor``: one function per check, each saying what is wrong and
what to do. A check is ``{"check", "ok", "detail"}`` with ``ok`` true, false
(something to fix) or None (skipped: not configured, not running).

The engine recipes' box (issue #21): the images the deployments run are on the
Docker host (ondemand never pulls), Docker can hand out GPUs (the NVIDIA runtime or
CDI devices), the model cache is writable, the token file is readable and private,
and each deployment's GPU count and memory share fit the box's GPUs."""
from __future__ import annotations

import asyncio
import os
import stat as stat_mod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..engines import recipes
from ..model import Deployment
from .client import NoServer, request, stored_deployments

if TYPE_CHECKING:
    from ..control.budget import Budget, Reading

Check = dict[str, Any]


def _check(check: str, ok: bool | None, detail: str) -> Check:
    return {"check": check, "ok": ok, "detail": detail}


async def check_docker(cfg: Config) -> Check:
    if cfg.deployer.backend != "docker":
        return _check("docker", None, "deployer.backend = process: engines run as child processes")
    from ..engines.dockerapi import DockerError, client
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
    from ..control.budget import Budget, BudgetError
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
    from ..gateway import keys
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
    from ..gateway import keys
    from ..litellm.client import LiteLLMClient, LiteLLMError
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
    from ..engines.metrics import BLIND_WARNING
    from ..engines.metrics import blind as is_blind
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


# --- the engine recipes' box -------------------------------------------------------------

def check_hf_token(cfg: Config) -> Check:
    """deployer.hf_token_file: readable, not empty, and private (its token is never shown)."""
    path = cfg.deployer.hf_token_file
    if path is None:
        return _check("hf-token", None, "deployer.hf_token_file is not set: gated models (Llama, Gemma ...) "
                                        "cannot be downloaded")
    try:
        recipes.read_token(path)
    except OSError as exc:
        return _check("hf-token", False, f"cannot read {path} ({exc.strerror or exc}): write the Hugging Face token "
                                         "there, readable by the user ondemand runs as, or unset "
                                         "deployer.hf_token_file")
    except ValueError:
        return _check("hf-token", False, f"{path} is empty: write the Hugging Face token there")
    mode = stat_mod.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        return _check("hf-token", False, f"{path} is mode {mode:o}, readable by others: chmod 600 it")
    return _check("hf-token", True, f"{path} holds a token (mode {mode:o})")


def _unwritable(name: str, path: Path, key: str, owner: str) -> Check | None:
    """The check that says what is wrong with ``path``, a directory the engines write to (an
    existing one): not a directory, or not writable here; None when it is fine."""
    if not path.is_dir():
        return _check(name, False, f"{path} is not a directory: set {key} to one")
    if not os.access(path, os.W_OK | os.X_OK):
        return _check(name, False, f"{path} is not writable here: chown it to {owner}, or chmod u+w it")
    return None


def check_model_cache(cfg: Config) -> Check:
    """deployer.model_cache: a directory the engines can write their downloads to."""
    path = cfg.deployer.model_cache
    if path is None:
        return _check("cache", None, "deployer.model_cache is not set: every cold start downloads the weights "
                                     "again (set it to a host directory with room for them)")
    if not path.exists():
        return _check("cache", False, f"{path} does not exist: mkdir -p {path} (or set deployer.model_cache)")
    wrong = _unwritable("cache", path, "deployer.model_cache", "the user the engines run as (root in the images)")
    return wrong or _check("cache", True, f"{path} is writable")


def check_compile_cache(cfg: Config) -> Check:
    """deployer.compile_cache: a directory ondemand (and the engines) can write the per-configuration
    caches to, or make (it is made at the first start that uses it)."""
    path = cfg.deployer.compile_cache
    if path is None:
        return _check("compile cache", None, "deployer.compile_cache is not set: every vLLM cold start compiles "
                                             "again (set it to a host directory: one cache per configuration)")
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and os.access(parent, os.W_OK | os.X_OK):
            return _check("compile cache", True, f"{path} does not exist yet: it is made at the first start")
        return _check("compile cache", False, f"{path} does not exist and cannot be made here: mkdir -p {path}")
    wrong = _unwritable("compile cache", path, "deployer.compile_cache", "the user ondemand and the engines run as")
    if wrong is not None:
        return wrong
    keys = sum(1 for p in path.iterdir() if p.is_dir())
    return _check("compile cache", True, f"{path} is writable ({keys} configuration(s) cached)")


def check_fits(rows: list[dict[str, Any]] | None, sizes: tuple[float, ...] | None, per_gpu: bool,
               budget: Budget | None = None, reading: Reading | None = None) -> Check | None:
    """Each deployment's GPU count, pin and memory share against the box's GPUs (``sizes``:
    each GPU's total, or the one pool's), then whether it can ever fit beside the always-on and
    system deployments, as the controller asks before it answers 503 ``does_not_fit`` (a deployment
    without a recipe has no share to check: 30 GiB on a 24 GiB GPU was said to fit). ``budget`` and
    ``reading``: the box's (its reserve, its cap); without them, ``sizes`` declared. None when
    the deployments or the sizes are unknown."""
    from ..control import verdicts
    from ..control.budget import Budget, Reading
    if not rows or not sizes:
        return None
    if budget is None or reading is None:
        budget = Budget("static", None if per_gpu else sizes[0], gpu_capacity_gib=sizes if per_gpu else None)
        reading = Reading(None)
    deps = [Deployment.from_row(row) for row in rows]
    # A recipe with no memory_gib is booked by the server from its checkpoint: a state file's row
    # read with no server running has no size, and never_fits would count it as nothing.
    unsized = [d.name for d in deps if d.footprint_gib <= 0 and d.model is not None]
    wrong = []
    for dep in deps:
        try:
            recipes.check_fits_box(dep.memory_gib, dep.gpu_count, sizes, per_gpu, dep.model is not None)
        except recipes.FieldError as exc:
            wrong.append(f"{dep.name}: {exc.message} (deploy set {dep.id} --{exc.field.replace('_', '-')} ...)")
            continue
        if per_gpu and dep.gpu_ids and max(dep.gpu_ids) >= len(sizes):
            wrong.append(f"{dep.name}: pinned to GPU {max(dep.gpu_ids)}, but this box has GPUs 0 to "
                         f"{len(sizes) - 1} (deploy set {dep.id} --gpu-ids ...)")
            continue
        fit = None if unsized else budget.never_fits(dep, deps, reading)
        if fit is not None:
            verdict = verdicts.does_not_fit(dep, fit, sum(fit.ondemand))
            gets = "a request for it gets 503 does_not_fit" if dep.on_demand else "its start is refused"
            wrong.append(f"{dep.name}: can never fit, {gets}: "
                         f"{verdict.message} (deploy set {dep.id} --memory-gib ... or --gpu-count ...)")
    if wrong:
        return _check("fits", False, "; ".join(wrong))
    box = f"{len(sizes)} GPUs of {min(sizes):g} GiB" if per_gpu else f"one pool of {sizes[0]:g} GiB"
    unknown = f"; not checked beside each other: {', '.join(unsized)} have no size until ondemand books them" \
        if unsized else ""
    return _check("fits", True, f"{len(rows)} deployments fit the box ({box}){unknown}")


async def _box(cfg: Config) -> tuple[tuple[float, ...] | None, bool, Budget, Reading | None]:
    """The box's GPU sizes, whether it tells GPUs apart, its budget and a reading of it."""
    from ..control.budget import Budget, BudgetError
    budget = Budget.from_config(cfg)
    try:
        return await budget.box_sizes(), budget.per_gpu, budget, await budget.read(())
    except BudgetError:  # the budget check says why
        return None, budget.per_gpu, budget, None


def _images(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each image the deployments run (a view's ``engine_image``; a row read from the state
    file gets it from its recipe) and the deployments that run it."""
    box = recipes.Box.from_config(cfg)
    out: dict[str, list[str]] = {}
    for row in rows:
        image = row["engine_image"] if "engine_image" in row else recipes.launch(Deployment.from_row(row), box).image
        if image:
            out.setdefault(image, []).append(row["name"])
    return out


async def check_images(docker: Any, images: dict[str, list[str]]) -> Check | None:
    """The images are on the Docker host: ondemand never pulls (an appliance may reach no
    registry), so a missing one fails every start of its deployments."""
    from ..engines.dockerapi import image_present
    if not images:
        return None
    missing = [f"{image} (for {', '.join(names)}): docker pull {image}"
               for image, names in images.items() if not await image_present(docker, image)]
    if missing:
        return _check("images", False, "not on the Docker host, and ondemand never pulls: " + "; ".join(missing))
    return _check("images", True, f"on the Docker host: {', '.join(images)}")


def gpu_runtime(info: dict[str, Any]) -> Check:
    """From ``docker info``: can Docker hand GPUs to containers (the NVIDIA runtime, or CDI)?"""
    if "nvidia" in (info.get("Runtimes") or {}):
        return _check("runtime", True, "Docker has the nvidia runtime")
    devices = [d.get("ID", "") for d in info.get("DiscoveredDevices") or () if isinstance(d, dict)]
    gpus = [d for d in devices if d.startswith("nvidia.com/gpu")]
    if gpus:
        return _check("runtime", True, f"Docker's CDI devices: {', '.join(gpus)}")
    if info.get("CDISpecDirs") and "DiscoveredDevices" not in info:
        # Docker before API 1.50 lists no CDI devices, only where it reads their specs.
        return _check("runtime", True, f"Docker reads CDI specs from {', '.join(info['CDISpecDirs'])} "
                                       "(this Docker does not list the devices: nvidia-ctk cdi list shows them)")
    return _check("runtime", False, "Docker has no nvidia runtime and no CDI GPU devices, so engines get no GPU: "
                                    "install the NVIDIA Container Toolkit, then nvidia-ctk runtime configure "
                                    "--runtime=docker and restart dockerd (or nvidia-ctk cdi generate); on a box "
                                    "without GPUs set deployer.gpus = false")


async def check_docker_host(cfg: Config, rows: list[dict[str, Any]] | None) -> list[Check]:
    """The images and the GPU runtime, over one Docker client (docker backend only)."""
    if cfg.deployer.backend != "docker":
        return []
    from ..engines.dockerapi import DockerError, client, info
    images = _images(cfg, rows or [])
    try:
        docker = client(cfg.deployer.docker_url)
        try:
            out = [await check_images(docker, images)]
            if cfg.deployer.gpus:
                out.append(gpu_runtime(await info(docker)))
        finally:
            await docker.close()
    except (DockerError, OSError, AssertionError, ValueError, asyncio.TimeoutError) as exc:
        why = f"the Docker API does not answer ({exc or type(exc).__name__}): see the docker check"
        out = [_check("images", None, why)] if images else []
        if cfg.deployer.gpus:
            out.append(_check("runtime", None, why))
    return [c for c in out if c is not None]


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
           check_hf_token(cfg), check_model_cache(cfg), check_compile_cache(cfg), await check_litellm(cfg)]
    rows = await _deployments(cfg)
    out.extend(await check_docker_host(cfg, rows))
    out.extend(c for c in (check_engines(rows), check_footprints(rows), check_fits(rows, *await _box(cfg)))
               if c is not None)
    server = await check_server(cfg)
    out.append(server)
    out.append(await check_listener(cfg, server["ok"] is True))
    return out
