"""Configuration: read once at the command-line edge, validated, passed down.

One TOML file (``--config``, else ``$ONDEMAND_CONFIG``, else built-in defaults); every key can be overridden by
``ONDEMAND_<KEY>`` in upper case, with the dot of a table key written as ``_`` (``budget.source`` is
``ONDEMAND_BUDGET_SOURCE``). An unknown key or a value out of range raises ``ConfigError`` whose one-line
message names the key and what it allows. No other module reads ``os.environ``: configuration is read and
validated once. Imports nothing of ours but ``errors``.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shlex
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (DGX OS 22.04)
    import tomli as tomllib

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
    source: str = "nvidia-smi"
    capacity_gib: float | None = None
    gpu_capacity_gib: tuple[float, ...] | None = None  # static: one usable size per GPU
    reserve_gib: float = 0.0  # kept free on every GPU
    nvidia_smi: str = "nvidia-smi"
    meminfo_path: str = "/proc/meminfo"
    # Host memory a level-1 sleep must leave available (warmth.host_level): else level 2, or a stop.
    host_reserve_gib: float = 16.0
    asleep_residue_gib: float = 2.0  # per GPU, what an asleep engine keeps when nothing can be read of it


# The engine recipes' images (docker backend) and commands (process backend), by engine.
DEFAULT_IMAGES: dict[str, str] = {"vllm": "vllm/vllm-openai:latest", "sglang": "lmsysorg/sglang:latest",
                                  "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda"}
DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "serve"), "sglang": ("python3", "-m", "sglang.launch_server"), "llamacpp": ("llama-server",)}


@dataclasses.dataclass(frozen=True)
class DeployerConfig:
    backend: str = "docker"
    docker_url: str | None = None
    network: str = "dgxmm"
    start_timeout_s: float = 1800.0
    wake_timeout_s: float = 300.0  # a wake (its engine calls and the wake check) longer than this fails
    stop_timeout_s: float = 30.0
    gpus: bool = True
    shm_size_gib: float = 16.0
    # Engine recipes (recipes.py): the images and commands a recipe runs, and what the box gives
    # every engine. Keyed by engine: deployer.images.vllm, deployer.commands.sglang, ...
    images: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_IMAGES))
    commands: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(DEFAULT_COMMANDS))
    model_cache: Path | None = None
    # vLLM's torch.compile and CUDA-graph artifacts, one directory per configuration (compile_cache.py).
    compile_cache: Path | None = None
    hf_token_file: Path | None = None
    volume_roots: tuple[Path, ...] = ()
    sleep_flags: bool = True
    publish_host: str = "127.0.0.1"
    # A recipe without memory_gib is booked its checkpoint's weights plus the KV cache of this many
    # sequences of the model's context, at most max_model_len tokens (recipes.booking).
    kv_sequences: int = 4
    max_model_len: int = 32768


@dataclasses.dataclass(frozen=True)
class LiteLLMConfig:
    url: str | None = None
    master_key_file: str | None = None


_INSTANCE = re.compile(r"[a-z0-9][a-z0-9._-]*")


def default_instance(hostname: str | None = None) -> str:
    """The host name made a valid ``instance``: lower case, every other character ``-``."""
    name = re.sub(r"[^a-z0-9._-]", "-", (hostname if hostname is not None else socket.gethostname()).lower())
    name = name.lstrip("._-")[:63]
    return name or "ondemand"


@dataclasses.dataclass(frozen=True)
class Config:
    state_dir: Path = Path("./state")
    # Names this box in LiteLLM's entries (model_info.dgxmm_instance): several boxes, one LiteLLM.
    instance: str = dataclasses.field(default_factory=default_instance)
    listen: str = "0.0.0.0:8090"
    # None: everything on listen. Else the admin API, the page, /metrics and /healthz here and
    # only the gateway on listen, so that the two can be firewalled apart (design.md, "The HTTP layer").
    admin_listen: str | None = None
    base_path: str = "/dgxmm"
    internal_url: str = "http://dgxmm:8090/dgxmm"
    ondemand_key_file: Path | None = None  # None: {state_dir}/ondemand.key
    admin_token_file: Path | None = None  # None: {state_dir}/admin.token
    ondemand_allowed_cidrs: str | tuple[str, ...] = "auto"
    decider_network: str | None = None
    ondemand_idle_timeout_s: int = 600
    ondemand_queue_timeout_s: int = 900
    ondemand_max_queued: int = 256
    # Open connections on one TCP listener, and from one client IP: over either, closed at the accept.
    max_connections: int = 4096
    max_connections_per_peer: int = 2048
    # The bounds on what one client may make the server hold (http/limits.py), both stacks.
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 300.0
    max_head_kib: int = 128
    max_body_mib: int = 16
    reap_interval_s: float = 15.0
    sleep_timeout_s: int | None = None  # an engine asleep this long is stopped; None: never
    min_idle_timeout_s: int = 60
    scheduler: str = "seed"  # the decision core's: the queue's order, make-room's victims (control/scheduler.py)
    slo_s: float = 5.0  # the longest users should wait for a model: cost aims at it, replay measures it
    metrics_interval_s: float = 10.0
    shutdown_grace_s: float = 30.0
    log_level: str = "info"
    access_log: str = "off"
    metrics_public: bool = False
    retention_days: int = 30
    budget: BudgetConfig = BudgetConfig()
    deployer: DeployerConfig = DeployerConfig()
    litellm: LiteLLMConfig = LiteLLMConfig()

    # Paths derived from state_dir, so that one setting moves them all.
    @property
    def key_file(self) -> Path:
        return self.ondemand_key_file or self.state_dir / "ondemand.key"

    @property
    def token_file(self) -> Path:
        return self.admin_token_file or self.state_dir / "admin.token"

    @property
    def db_path(self) -> Path:
        return self.state_dir / "ondemand.db"

    @property
    def admin_socket(self) -> Path:
        return self.state_dir / "admin.sock"

    @property
    def listen_host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def admin_listen_host_port(self) -> tuple[str, int] | None:
        if self.admin_listen is None:
            return None
        host, _, port = self.admin_listen.rpartition(":")
        return host.strip("[]"), int(port)


# --- validation table: key -> (parse, check, what is allowed). parse turns TOML or env text into
# the value; check returns False when it is out of range.

def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, float) and not v.is_integer():
        raise ValueError
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError
    return v


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    return {"true": True, "false": False, "1": True, "0": False}[str(v).lower()]


def _opt_str(v: Any) -> str | None:
    if v is None or v == "":
        return None
    return _str(v)


def _opt_path(v: Any) -> Path | None:
    s = _opt_str(v)
    return Path(s) if s is not None else None


def _cidrs(v: Any) -> str | tuple[str, ...]:
    if isinstance(v, str):
        if v.strip() == "auto":
            return "auto"
        v = [part for part in v.replace(",", " ").split() if part]
    if not isinstance(v, (list, tuple)):
        raise ValueError
    out = []
    for item in v:
        ipaddress.ip_network(_str(item), strict=True)  # host bits set: a typo that would allow a network
        out.append(item)
    return tuple(out)


def _gib_list(v: Any) -> tuple[float, ...] | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):  # from the environment: "80, 80, 40"
        v = [part for part in v.replace(",", " ").split() if part]
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError
    return tuple(_float(x) for x in v)


def _argv(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):  # from the environment: a shell-quoted command line
        v = shlex.split(v)
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError
    return tuple(_str(x) for x in v)


def _paths(v: Any) -> tuple[Path, ...]:
    if isinstance(v, str):  # from the environment: "/models, /data"
        v = [part for part in v.replace(",", " ").split() if part]
    if not isinstance(v, (list, tuple)):
        raise ValueError
    return tuple(Path(_str(x)) for x in v)


def _address(v: Any) -> str:
    address = ipaddress.ip_address(_str(v))
    if address.is_unspecified:  # every address: the engine has no key of its own
        raise ValueError
    return str(address)


def _listen(v: Any) -> str:
    s = _str(v)
    host, sep, port = s.rpartition(":")
    if not sep or not host or not 0 <= int(port) <= 65535:
        raise ValueError
    return s


def _base_path(v: Any) -> str:
    s = _str(v).rstrip("/")
    if s and (not s.startswith("/") or "//" in s or any(c in s for c in "?#\\ ")):
        raise ValueError
    return s


def _between(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda x: lo <= x <= hi


def _one_of(*names: str) -> Callable[[Any], bool]:
    return lambda x: x in names


_KEYS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], bool], str]] = {
    "state_dir": (_opt_path, lambda p: p is not None, "a directory path"),  # "" is none, not the cwd
    "instance": (_str, lambda s: bool(_INSTANCE.fullmatch(s)) and len(s) <= 63,
                 "lower-case letters, digits, '.', '_', '-' (first a letter or digit), at most 63"),
    "listen": (_listen, bool, "HOST:PORT"),
    "admin_listen": (lambda v: None if v in (None, "") else _listen(v), lambda s: True,
                     "HOST:PORT, or empty (the admin API on listen)"),
    "base_path": (_base_path, lambda s: True, "a path prefix like /dgxmm, or empty"),
    "internal_url": (_str, lambda s: s.startswith(("http://", "https://")), "an http(s) URL"),
    "ondemand_key_file": (_opt_path, lambda s: True, "a file path"),
    "admin_token_file": (_opt_path, lambda s: True, "a file path"),
    "ondemand_allowed_cidrs": (_cidrs, lambda s: True, '"auto" or a list of CIDRs'),
    "decider_network": (_opt_str, lambda s: True, "a Docker network name"),
    # The bound depends on min_idle_timeout_s: checked once both are known (below), so the message is true.
    "ondemand_idle_timeout_s": (_int, lambda x: True, "whole seconds, min_idle_timeout_s (60 unless set) to 86400"),
    "ondemand_queue_timeout_s": (_int, _between(1, 86400), "whole seconds, 1 to 86400"),
    "ondemand_max_queued": (_int, _between(1, 100000), "1 to 100000"),
    "max_connections": (_int, _between(1, 1_000_000), "1 to 1000000 (open connections on one TCP listener)"),
    # At most max_connections: checked once both are known (below).
    "max_connections_per_peer": (_int, _between(1, 1_000_000),
                                 "1 to 1000000, at most max_connections (open connections from one client IP)"),
    "head_timeout_s": (_float, _between(0.5, 300), "seconds, 0.5 to 300 (a request head, from its first byte; a "
                       "connection's first, from the accept)"),
    "body_timeout_s": (_float, _between(1, 3600), "seconds, 1 to 3600 (a whole request body)"),
    "keepalive_timeout_s": (_float, _between(1, 3600), "seconds, 1 to 3600 (an idle keep-alive connection)"),
    "max_head_kib": (_int, _between(64, 1024), "KiB, 64 to 1024 (a request line and its headers)"),
    "max_body_mib": (_int, _between(1, 1024), "MiB, 1 to 1024 (a gateway or admin request's body)"),
    "reap_interval_s": (_float, _between(0.1, 3600), "seconds, 0.1 to 3600"),
    "min_idle_timeout_s": (_int, _between(1, 86400), "whole seconds, 1 to 86400"),
    "sleep_timeout_s": (lambda v: None if v in (None, "", "none") else _int(v),
                        lambda x: x is None or 1 <= x <= 30 * 86400,
                        "whole seconds, 1 to 2592000 (an engine asleep this long is stopped), or none"),
    "scheduler": (_str, _one_of("seed", "cost"), "seed or cost (the core's scheduler: queue, victims, placement)"),
    "slo_s": (_float, _between(0.5, 600), "seconds, 0.5 to 600 (the longest a request should wait for its model)"),
    "metrics_interval_s": (_float, _between(0.1, 3600), "seconds, 0.1 to 3600"),
    "shutdown_grace_s": (_float, _between(0, 3600), "seconds, 0 to 3600"),
    "log_level": (lambda v: _str(v).lower(), _one_of("debug", "info", "warning", "error"),
                  "debug, info, warning or error"),
    "access_log": (lambda v: _str(v).lower(), _one_of("off", "text", "json"), "off, text or json"),
    "metrics_public": (_bool, lambda x: True, "true or false (GET {base_path}/metrics without the admin token)"),
    "retention_days": (_int, _between(1, 3650), "whole days, 1 to 3650"),
    "budget.source": (_str, _one_of("nvidia-smi", "meminfo", "static"), "nvidia-smi, meminfo or static"),
    "budget.capacity_gib": (lambda v: None if v in (None, "") else _float(v),
                            lambda x: x is None or 0 < x <= 1e6, "GiB, more than 0"),
    "budget.gpu_capacity_gib": (_gib_list, lambda x: x is None or (len(x) <= 64 and all(0 < g <= 1e6 for g in x)),
                                "a list of GiB, one per GPU (GPU i is entry i), each more than 0"),
    "budget.reserve_gib": (_float, _between(0, 1e6), "GiB kept free on every GPU, 0 or more"),
    "budget.nvidia_smi": (_str, bool, "the nvidia-smi command (a path or a name on PATH)"),
    "budget.meminfo_path": (_str, bool, "the meminfo file (/proc/meminfo)"),
    "budget.host_reserve_gib": (_float, _between(0, 1e6),
                                "GiB of host memory a level-1 sleep must leave available, 0 or more"),
    "budget.asleep_residue_gib": (_float, _between(0, 1e6),
                                  "GiB per GPU an asleep engine is counted to keep when nothing is read, 0 or more"),
    "deployer.backend": (_str, _one_of("docker", "process"), "docker or process"),
    "deployer.docker_url": (_opt_str, lambda s: True, "a Docker API URL (unix:///var/run/docker.sock)"),
    "deployer.network": (_str, bool, "a Docker network name"),
    "deployer.start_timeout_s": (_float, _between(1, 86400), "seconds, 1 to 86400"),
    "deployer.gpus": (_bool, lambda x: True, "true or false (request every GPU for engine containers)"),
    "deployer.stop_timeout_s": (_float, _between(0, 3600), "seconds, 0 to 3600"),
    "deployer.wake_timeout_s": (_float, _between(1, 86400), "seconds, 1 to 86400 (a longer wake fails)"),
    "deployer.shm_size_gib": (_float, _between(0, 1024),
                              "GiB, 0 to 1024 (size of /dev/shm in engine containers; 0: Docker's 64 MiB)"),
    **{f"deployer.images.{e}": (_str, bool, f"the container image of the {e} recipe")
       for e in DEFAULT_IMAGES},
    **{f"deployer.commands.{e}": (_argv, bool, f"the argv the {e} recipe starts with (process backend), a list")
       for e in DEFAULT_COMMANDS},
    "deployer.model_cache": (_opt_path, lambda p: p is None or p.is_absolute(),
                             "an absolute host directory, mounted at the images' Hugging Face cache"),
    "deployer.compile_cache": (_opt_path, lambda p: p is None or p.is_absolute(),
                               "an absolute host directory (a compile cache per configuration), or empty"),
    "deployer.hf_token_file": (_opt_path, lambda p: True, "a file holding the Hugging Face token (mode 0600)"),
    "deployer.volume_roots": (_paths, lambda ps: all(p.is_absolute() and str(p) != "/" for p in ps),
                              "a list of absolute host directories (not /) deployments may mount from"),
    "deployer.sleep_flags": (_bool, lambda x: True, "true or false (the recipes' sleep flags)"),
    "deployer.kv_sequences": (_int, _between(1, 4096),
                              "1 to 4096 (sequences of the model's context booked without memory_gib)"),
    "deployer.max_model_len": (_int, _between(256, 16_777_216),
                               "tokens, 256 to 16777216 (the context booked and passed without memory_gib)"),
    "deployer.publish_host": (_address, lambda s: True,
                              "one IP address (not 0.0.0.0 or ::) engine ports are published on (beside Docker)"),
    "litellm.url": (_opt_str, lambda s: s is None or s.startswith(("http://", "https://")), "an http(s) URL"),
    "litellm.master_key_file": (_opt_str, lambda s: True, "a file path"),
}

_TABLES = {"budget": BudgetConfig, "deployer": DeployerConfig, "litellm": LiteLLMConfig}


# Tables inside a table: [deployer.images], [deployer.commands].
_SUBTABLES = {"deployer.images", "deployer.commands"}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and ((key in _TABLES and not prefix) or name in _SUBTABLES):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _env_name(key: str) -> str:
    return "ONDEMAND_" + key.replace(".", "_").upper()


def load(path: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None) -> Config:
    """Build the one Config: defaults < file < environment < overrides."""
    env = dict(os.environ) if env is None else env
    path = path or env.get("ONDEMAND_CONFIG") or None
    raw: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                raw = _flatten(tomllib.load(fh))
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8: other bytes are not TOML
            raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
        except OSError as exc:  # a directory, no permission: one line, as for a missing file
            raise ConfigError(f"config file {path}: cannot be read: {exc.strerror or exc}") from None
    for key in raw:
        if key not in _KEYS:
            raise ConfigError(f"unknown configuration key {key!r} in {path}; known keys: {', '.join(_KEYS)}")
    known_env = {_env_name(k): k for k in _KEYS}
    for name, text in env.items():
        if name in known_env:
            raw[known_env[name]] = text
        elif name.startswith("ONDEMAND_") and name != "ONDEMAND_CONFIG" and name not in _IGNORED_ENV:
            raise ConfigError(f"unknown configuration variable {name}; known: {', '.join(known_env)}")
    raw.update(overrides or {})

    values: dict[str, Any] = {}
    for key, value in raw.items():
        parse, check, allowed = _KEYS[key]
        try:
            parsed = parse(value)
            ok = check(parsed)
        except (ValueError, TypeError, LookupError):
            ok = False
        if not ok:
            raise ConfigError(f"configuration key {key} = {value!r} is not allowed: {allowed}")
        values[key] = parsed

    # An unset per-peer cap follows a lower total: one key for an admin who wants fewer connections.
    if "max_connections" in values and "max_connections_per_peer" not in values:
        values["max_connections_per_peer"] = min(Config.max_connections_per_peer, values["max_connections"])
    cfg = Config(**_tables(values))

    if not cfg.min_idle_timeout_s <= cfg.ondemand_idle_timeout_s <= 86400:
        raise ConfigError(
            f"configuration key ondemand_idle_timeout_s = {cfg.ondemand_idle_timeout_s} is not allowed: "
            f"whole seconds, {cfg.min_idle_timeout_s} (min_idle_timeout_s) to 86400")
    if cfg.max_connections_per_peer > cfg.max_connections:
        raise ConfigError(
            f"configuration key max_connections_per_peer = {cfg.max_connections_per_peer} is not allowed: "
            f"1 to {cfg.max_connections} (max_connections)")
    _check_budget(cfg)
    if _same_file(cfg.token_file, cfg.key_file):
        raise ConfigError(
            f"configuration keys admin_token_file ({cfg.token_file}) and ondemand_key_file ({cfg.key_file}) "
            "name the same file: the admin API must never open with the on-demand key; give them two files")
    return cfg


def _tables(values: dict[str, Any]) -> dict[str, Any]:
    """Config's arguments from the checked keys: ``budget.x`` into BudgetConfig, and so on;
    ``deployer.images.vllm`` is one entry of ``DeployerConfig.images`` (the rest default)."""
    top = {k: v for k, v in values.items() if "." not in k}
    for table, cls in _TABLES.items():
        sub: dict[str, Any] = {}
        for k, v in values.items():
            if k.startswith(table + "."):
                name = k.split(".", 1)[1]
                if f"{table}.{name.split('.')[0]}" in _SUBTABLES and "." in name:
                    group, entry = name.split(".", 1)
                    sub.setdefault(group, dict(getattr(cls(), group)))[entry] = v
                else:
                    sub[name] = v
        top[table] = cls(**sub)
    return top


def _check_budget(cfg: Config) -> None:
    b = cfg.budget
    if b.gpu_capacity_gib is not None and b.source != "static":
        raise ConfigError(f"configuration key budget.gpu_capacity_gib is for budget.source = static; with "
                          f"{b.source} each GPU is measured")
    if b.gpu_capacity_gib is not None and b.capacity_gib is not None:
        raise ConfigError("configuration keys budget.capacity_gib (one pool) and budget.gpu_capacity_gib "
                          "(one per GPU) exclude each other: give one")
    if b.source == "static" and b.capacity_gib is None and b.gpu_capacity_gib is None:
        raise ConfigError("configuration key budget.capacity_gib (one pool) or budget.gpu_capacity_gib "
                          "(one per GPU) is required with budget.source = static")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same path once resolved (symbolic
    links, ``..``, relative to the working directory), or, when both exist, the
    same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


# Variables of ours that are not configuration keys (read by the CLI edge).
_IGNORED_ENV = frozenset({"ONDEMAND_CACHE", "ONDEMAND_ADMIN_TOKEN"})


def describe() -> list[tuple[str, str, str]]:
    """(key, default, allowed) for the README and `ondemand doctor`."""
    defaults = Config()
    rows = []
    for key, (_, _, allowed) in _KEYS.items():
        obj: Any = defaults
        for part in key.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        if isinstance(obj, tuple):
            obj = shlex.join(str(x) for x in obj) if obj else ""
        default = "the host name" if key == "instance" else "" if obj is None else str(obj)
        rows.append((key, default, allowed))
    return rows
