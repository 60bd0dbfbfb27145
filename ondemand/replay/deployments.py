"""The deployments a replay runs, and the box it runs them on.

- **A TOML file** of ``[[deployment]]`` tables: deployment fields (``name``, ``served_name``,
  ``engine``, ``model``, ``memory_gib``, ``gpu_count``, ``gpu_ids``, ``mode``, ``idle_timeout_s``,
  ``idle_action``, ``priority``, ``max_inflight``, ``keep_warm``), its engine's costs
  (``cold_start_s``, ``wake_s``, ``wake2_s``, ``sleep_s``, ``prefill_tokens_per_s``,
  ``decode_tokens_per_s``, ``decode_batch_tokens_per_s``, ``max_concurrency``, ``kv_tokens``, or
  ``weights_gib`` and ``kv_bytes_per_token`` to derive it, ``max_model_len``) and ``weight``. A
  deployment is on demand unless it says ``mode = "always_on"``; ``engine`` is ``vllm`` and
  ``model`` its served name unless given (a vLLM recipe: ``idle_action = "auto"`` sleeps at level 1
  on discrete GPUs); one GPU.
- **The state file**, opened read only (``mode=ro``, and ``immutable`` when no write-ahead log
  is there, so that not even its side files are made): the box's own deployments, their engines'
  costs from the recorded history (the median cold start, and the median wake from each sleep
  level, ``wake_s`` and ``wake2_s``, by the box's own rule: ``control.starts.wake_median``; the
  median level-1 sleep, else any, ``sleep_s``), else ``Costs``' defaults,
  and the idle gaps adaptive warmth kept of each (``idle_gaps``): what the box had learned.

Every deployment starts the replay at rest (on demand: stopped; always on: placed at the start).
Bad input is ``DeploymentError``: ``FILE:LINE: what is wrong``, naming the deployment.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sqlite3
import statistics
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..control import placement
from ..control.starts import newest, wake_median
from ..engines import tiers
from ..model import MAX_INFLIGHT, Deployment, IdleAction, KeepWarm, Mode, Priority, Role, State
from ..state.store import deployment_fields
from .types import Box, Costs, Replayed

if TYPE_CHECKING:
    from ..config import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
ENGINES = ("vllm", "sglang", "llamacpp", "custom")
MAX_GPUS = 64  # --gpus
MAX_GPU_GIB = 100_000  # --gpus: a GPU's GiB
# The bounds of a deployments file's numbers, which no real engine leaves: beyond them a replay
# means nothing, or never ends (a prefill of 1e-50 tokens a second ran forever). Sizes: at most
# the largest box --gpus can describe. Speeds: from 1 token a second (the trace's 10^7 tokens
# then take 116 days) to 10^7 (box-mix's fastest prefill is 430,000; a token at 10^7 still
# moves a float clock ten years in, the trace's longest span). Times: at most a day.
MAX_BOX_GIB = MAX_GPUS * MAX_GPU_GIB
MIN_TOKENS_PER_S, MAX_TOKENS_PER_S = 1, 10_000_000
MAX_COST_S = 86400
MAX_KV_BYTES_PER_TOKEN = 1 << 30  # a dense 175B model's KV of a token in FP32 is under 10 MiB
MAX_WEIGHT = 10**9  # relative shares: counts of a week's requests fit
ENGINE_DEFAULT_SHARE = 0.90  # a recipe's booking with nothing to read (BEHAVIOUR.md): of each GPU


class DeploymentError(ValueError):
    """A deployment that cannot be replayed: ``FILE:LINE: what is wrong``."""


def _one_of(*names: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in names:
            raise ValueError(f"{v!r} is not one of {', '.join(names)}")
        return str(v)
    return check


def _number(lo: float, hi: float, unit: str, strict: bool = True) -> Callable[[Any], float]:
    """A finite number above ``lo`` (``strict``) or of at least it, and at most ``hi``, in ``unit``."""
    def check(v: Any) -> float:
        # TOML has inf (a cold start that never ends) and nan (which no comparison refuses).
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not (v > lo if strict else v >= lo) or v > hi:
            raise ValueError(f"{v!r} is not a finite number {'above' if strict else 'of at least'} {lo:g} "
                             f"and at most {hi:,} ({unit})")
        return float(v)
    return check


_SECONDS = _number(0, MAX_COST_S, "seconds", strict=False)
_SPEED = _number(MIN_TOKENS_PER_S, MAX_TOKENS_PER_S, "tokens a second", strict=False)


def _whole(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{v!r} is not a whole number from {lo} to {hi}")
        return v
    return check


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{v!r} is not a non-empty string")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not NAME.fullmatch(v):
        raise ValueError(f"{v!r} is not a name ([a-z0-9][a-z0-9._-]*)")
    return v


def _gpu_ids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v) \
            or len(set(v)) != len(v):
        raise ValueError(f"{v!r} is not a list of distinct GPU indices")
    return tuple(v)


def fields_checks(box: Box) -> dict[str, Callable[[Any], Any]]:
    """Each deployment field a file may give, and its check (ValueError says what is wrong)."""
    return {
        "name": _name, "served_name": _text, "engine": _one_of(*ENGINES), "model": _text,
        "memory_gib": _number(0, MAX_BOX_GIB, "GiB"), "gpu_count": _whole(0, len(box.gpus)), "gpu_ids": _gpu_ids,
        "mode": _one_of(*(m.value for m in Mode)), "idle_timeout_s": _whole(box.min_idle_timeout_s, 86400),
        "idle_action": _one_of(*(a.value for a in IdleAction)), "priority": _one_of(*(p.value for p in Priority)),
        "max_inflight": _whole(1, MAX_INFLIGHT), "keep_warm": _one_of(*(k.value for k in KeepWarm)),
    }


COSTS: dict[str, Callable[[Any], Any]] = {
    "cold_start_s": _SECONDS, "wake_s": _SECONDS, "wake2_s": _SECONDS, "sleep_s": _SECONDS,
    "prefill_tokens_per_s": _SPEED, "decode_tokens_per_s": _SPEED, "max_concurrency": _whole(1, 1_000_000),
    "kv_tokens": _whole(1, 10**9), "decode_batch_tokens_per_s": _SPEED, "max_model_len": _whole(1, 10**7),
}
# What derives kv_tokens when the file gives none: the booking less the weights, at the model's KV
# bytes per token (layers x KV heads x head size x 2 x the dtype's bytes). At least a byte: the
# KV cache's tokens, that booking over it, stay a number (1e-300 made them inf, int() a traceback).
KV_SIZING: dict[str, Callable[[Any], Any]] = {
    "weights_gib": _number(0, MAX_BOX_GIB, "GiB"),
    "kv_bytes_per_token": _number(1, MAX_KV_BYTES_PER_TOKEN, "bytes", strict=False)}
_WEIGHT = _number(0, MAX_WEIGHT, "a share of the rows without a model", strict=False)


class _Lines:
    """Where each ``[[deployment]]`` table and its keys are in the file's text (tomllib gives
    no positions), for the errors' line numbers."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.tables = [i + 1 for i, ln in enumerate(self.lines) if re.match(r"\s*\[\[\s*deployment\s*\]\]", ln)]

    def of(self, table: int, key: str | None = None) -> int:
        if table >= len(self.tables):
            return 1
        start = self.tables[table]
        if key is None:
            return start
        end = self.tables[table + 1] if table + 1 < len(self.tables) else len(self.lines) + 1
        pattern = re.compile(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=")
        return next((n for n in range(start + 1, end) if pattern.match(self.lines[n - 1])), start)


def from_file(path: str, box: Box) -> list[Replayed]:
    """The ``[[deployment]]`` tables of a TOML file, checked; raises DeploymentError."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except OSError as exc:
        raise DeploymentError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DeploymentError(f"{path}:1: not UTF-8 text ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        what = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise DeploymentError(f"{path}:{m.group(1) if m else 1}: not valid TOML: {what}") from None
    lines = _Lines(text)
    unknown = sorted(set(data) - {"deployment"})
    if unknown:
        raise DeploymentError(f"{path}:1: unknown key {unknown[0]!r}: the file holds [[deployment]] tables")
    tables = data.get("deployment")
    if not isinstance(tables, list) or not tables:
        raise DeploymentError(f"{path}:1: no [[deployment]] table")
    out: list[Replayed] = []
    for i, table in enumerate(tables):
        out.append(_one(path, lines, i, table, box))
    _check_unique(path, lines, out)
    check_fits(out, box, lambda i: f"{path}:{lines.of(i)}")
    return out


def _one(path: str, lines: _Lines, i: int, table: dict[str, Any], box: Box) -> Replayed:
    checks = fields_checks(box)
    where = f"{path}:{lines.of(i)}"
    name = table.get("name")
    label = f"deployment {name!r}" if isinstance(name, str) else f"deployment {i + 1}"
    fields: dict[str, Any] = {}
    costs: dict[str, Any] = {}
    sizing: dict[str, float] = {}
    weight = 1.0
    for key, value in table.items():
        at = f"{path}:{lines.of(i, key)}"
        check = (checks.get(key) or COSTS.get(key) or KV_SIZING.get(key)
                 or (_WEIGHT if key == "weight" else None))
        if check is None:
            known = ", ".join([*checks, *COSTS, *KV_SIZING, "weight"])
            raise DeploymentError(f"{at}: {label}: unknown field {key!r} (known: {known})")
        try:
            typed = check(value)
        except ValueError as exc:
            raise DeploymentError(f"{at}: {label}: {key}: {exc}") from None
        if key in COSTS:
            costs[key] = typed
        elif key in KV_SIZING:
            sizing[key] = typed
        elif key == "weight":
            weight = typed
        else:
            fields[key] = typed
    for key in ("name", "memory_gib"):
        if key not in fields:
            raise DeploymentError(f"{where}: {label}: {key} is required")
    fields.setdefault("served_name", fields["name"])
    fields.setdefault("model", fields["served_name"])
    fields.setdefault("gpu_count", 1)
    fields.setdefault("mode", Mode.ON_DEMAND.value)
    ids = fields.get("gpu_ids")
    if ids is not None and (len(ids) != fields["gpu_count"] or any(g >= len(box.gpus) for g in ids)):
        raise DeploymentError(f"{path}:{lines.of(i, 'gpu_ids')}: {label}: gpu_ids {list(ids)}: "
                              f"{fields['gpu_count']} of the box's GPUs 0 to {len(box.gpus) - 1} (gpu_count)")
    if "kv_tokens" not in costs and len(sizing) == len(KV_SIZING):
        left = fields["memory_gib"] - sizing["weights_gib"]
        if left <= 0:
            raise DeploymentError(f"{path}:{lines.of(i, 'weights_gib')}: {label}: weights_gib "
                                  f"{sizing['weights_gib']:g} leaves no KV cache in memory_gib "
                                  f"{fields['memory_gib']:g}")
        costs["kv_tokens"] = max(1, int(left * 2**30 / sizing["kv_bytes_per_token"]))
    dep = Deployment(id=i + 1, name=fields.pop("name"), served_name=fields.pop("served_name"), role=Role.MODEL,
                     state=State.STOPPED).replace(**fields)
    return Replayed(dep, Costs(**costs), weight)


def _check_unique(path: str, lines: _Lines, out: Sequence[Replayed]) -> None:
    seen: dict[str, int] = {}
    for i, r in enumerate(out):
        for key in ("name", "served_name"):
            value = getattr(r.deployment, key)
            if value in seen and seen[value] != i:
                raise DeploymentError(f"{path}:{lines.of(i, key)}: deployment {r.deployment.name!r}: {key} "
                                      f"{value!r} is another deployment's already")
            seen[value] = i


def check_fits(deps: Sequence[Replayed], box: Box, where: Callable[[int], str]) -> None:
    """Each deployment fits on the box when nothing else runs; raises DeploymentError naming the
    first that cannot (``where(i)``: where the i-th was read, ``FILE`` or ``FILE:LINE``)."""
    capacity = [max(0.0, g - box.reserve_gib) for g in box.gpus]
    for i, r in enumerate(deps):
        d = r.deployment
        count, allowed = placement.demand(d.gpu_count, d.gpu_ids, len(box.gpus), box.per_gpu)
        sizes = box.gpus if box.per_gpu else None
        if placement.choose(capacity, d.footprint_gib, count, allowed, sizes) is None:
            need = (f"{count} GPUs with {placement.share(d.footprint_gib, count):g} GiB each" if count > 1
                    else f"{d.footprint_gib:g} GiB")
            box_has = ", ".join(f"{g:g}" for g in capacity)
            raise DeploymentError(f"{where(i)}: deployment {d.name!r} cannot fit on this box at all: it needs "
                                  f"{need}, the box's GPUs offer {box_has} GiB")


def from_state(db_path: str | os.PathLike[str], box: Box) -> list[Replayed]:
    """The box's own deployments from the state file, read only (never written), with their
    engines' costs from the recorded starts and wakes; raises DeploymentError."""
    path = os.fspath(db_path)
    if not os.path.exists(path):
        raise DeploymentError(f"{path}: no state file here (give --deployments FILE)")
    # With no write-ahead log beside it the file holds everything, and immutable opens it
    # without making the log's side files; with one (a server runs), the log must be read.
    query = "mode=ro" + ("" if os.path.exists(path + "-wal") else "&immutable=1")
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(path)}?{query}", uri=True)
        try:
            con.row_factory = sqlite3.Row
            rows = [deployment_fields(r) for r in con.execute("SELECT * FROM deployments ORDER BY id")]
            starts = _starts(con)
            kept = _idle_gaps(con)
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise DeploymentError(f"{path}: cannot read the state file: {exc}") from None
    rows_of: dict[int, list[tuple[str, float, int | None]]] = {}
    for dep_id, kind, duration, level in starts:
        rows_of.setdefault(dep_id, []).append((kind, float(duration), level))
    out = []
    for row in rows:
        dep = _at_rest(Deployment.from_row(row), box)
        history = newest(rows_of.get(dep.id, ()))  # what the box itself would price it by
        cold = history.get("start")
        from_level = {level: history.get(("wake", level), []) for level in tiers.LEVELS}
        every = history.get("wake", [])
        measured: dict[str, Any] = {tiers.STOPPED.cost_key: statistics.median(cold)} if cold else {}
        for level in tiers.LEVELS:  # each sleep's tier, priced by its wakes from that level
            wake = wake_median(level, from_level, every)
            if wake is not None:
                measured[tiers.asleep(level).cost_key] = wake
        slept = history.get(("sleep", 1)) or history.get("sleep")  # its idle sleeps' level first
        if slept:
            measured["sleep_s"] = statistics.median(slept)
        costs = dataclasses.replace(Costs(), **measured)
        out.append(Replayed(dep, costs, gaps=tuple(kept.get(dep.id, ()))))
    if not out:
        raise DeploymentError(f"{path}: the state file holds no deployment (give --deployments FILE)")
    check_fits(out, box, lambda _i: path)
    return out


def _starts(con: sqlite3.Connection) -> list[tuple[int, str, float, int | None]]:
    """Every recorded start, wake and sleep, oldest first: (deployment, kind, duration_s, the level
    a wake woke from or a sleep went to); no level in a state file from before schema 9, which a
    replay does not migrate (and no sleep before schema 10)."""
    columns = {row[1] for row in con.execute("PRAGMA table_info(starts)")}
    level = "level" if "level" in columns else "NULL"
    return con.execute(f"SELECT deployment_id, kind, duration_s, {level} FROM starts ORDER BY id").fetchall()


def _idle_gaps(con: sqlite3.Connection) -> dict[int, list[float]]:
    """Each deployment's kept idle gaps, oldest first (none in a state file from before
    adaptive warmth, which a replay does not migrate)."""
    if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idle_gaps'").fetchone() is None:
        return {}
    out: dict[int, list[float]] = {}
    for dep_id, gap in con.execute("SELECT deployment_id, gap_s FROM idle_gaps ORDER BY id"):
        out.setdefault(dep_id, []).append(float(gap))
    return out


def _at_rest(dep: Deployment, box: Box) -> Deployment:
    """A stored deployment as the replay begins it: nothing running (planned stays planned);
    a recipe booked with nothing to read gets the engine's default share of its GPUs."""
    state = State.PLANNED if dep.state is State.PLANNED else State.STOPPED
    dep = dep.replace(state=state, state_reason=None, gpus=(), sleep_level=None, host_gib=None,
                      pending_mode=None, wake_check=None)
    if dep.footprint_gib <= 0 and dep.gpu_count != 0:
        count, _ = placement.demand(dep.gpu_count, dep.gpu_ids, len(box.gpus), box.per_gpu)
        dep = dep.replace(memory_gib=round(ENGINE_DEFAULT_SHARE * min(box.gpus) * max(count, 1), 3))
    return dep


def parse_gpus(text: str) -> tuple[float, ...]:
    """``--gpus``: ``NxGIB`` (``8x80``), or several joined by commas (``4x80,4x40``)."""
    out: list[float] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,9}(?:\.\d{1,9})?)\s*", part)
        if m is None or int(m.group(1)) < 1 or not 0 < float(m.group(2)) <= MAX_GPU_GIB:
            raise ValueError(f"--gpus {text[:60]!r}: how many GPUs and the GiB of each, as NxGIB (8x80), "
                             f"at most {MAX_GPU_GIB:,} GiB each")
        if len(out) + int(m.group(1)) > MAX_GPUS:  # counted before the list is made: 10^9 x 80 was a MemoryError
            raise ValueError(f"--gpus {text[:60]!r}: at most {MAX_GPUS} GPUs")
        out += [float(m.group(2))] * int(m.group(1))
    return tuple(out)


def box_of(cfg: Config, host_gib: float, gpus: tuple[float, ...] | None = None,
           measured: tuple[float, ...] | None = None) -> Box:
    """The box from the configuration: its budget's GPUs (``static``: declared; ``nvidia-smi``
    and ``meminfo``: ``measured``, each GPU or the one pool), unless ``gpus`` (``--gpus``) says
    otherwise, and the keys the decisions read. Raises ValueError when the GPUs are not known."""
    b = cfg.budget
    per_gpu = True
    if gpus is None:
        if b.source == "static":
            per_gpu = b.gpu_capacity_gib is not None
            gpus = tuple(b.gpu_capacity_gib) if b.gpu_capacity_gib else (float(b.capacity_gib or 0),)
        elif measured:
            per_gpu = b.source == "nvidia-smi"
            gpus = measured
        else:
            raise ValueError(f"the box's GPUs cannot be read (budget.source {b.source}): give --gpus NxGIB")
    return Box(tuple(gpus), host_gib, per_gpu, reserve_gib=b.reserve_gib,
               queue_timeout_s=cfg.ondemand_queue_timeout_s, max_queued=cfg.ondemand_max_queued,
               reap_interval_s=cfg.reap_interval_s, idle_timeout_s=cfg.ondemand_idle_timeout_s,
               min_idle_timeout_s=cfg.min_idle_timeout_s, sleep_timeout_s=cfg.sleep_timeout_s,
               host_reserve_gib=b.host_reserve_gib, asleep_residue_gib=b.asleep_residue_gib,
               scheduler=cfg.scheduler)
