"""status, audit and doctor: what the host and its deployments are doing, what was done, and
what they need."""
from __future__ import annotations

import sys
from typing import Any

import click

from ..admin import client as adminclient
from ..model import Deployment
from .shared import (
    EXIT_FAILED,
    EXIT_NO_SERVER,
    Ctx,
    Whole,
    _call,
    _echo_json,
    _fail,
    _run,
    _table,
    _views,
    cli,
    json_option,
    pass_ctx,
)
from .views import _DEP_HEADER, _dep_rows, _expected, _kept_and_taken

# --- status ------------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def status(ctx: Ctx, as_json: bool) -> None:
    """Host, budget, and each deployment's phase, in-flight and queued counts."""
    views, offline = _views(ctx)
    host: Any = None if offline else _call(ctx, "GET", "/host")  # JSON
    names = _litellm_names(ctx, host)
    if as_json:
        _echo_json({"host": host, "deployments": views, "offline": offline, "litellm_names": names})
        return
    if offline:
        click.echo(f"no server runs: read from {ctx.cfg.db_path} (no live counters)")
    else:
        b = host["budget"]
        budget = (f"{b['free']:g} GiB free of {b['capacity']:g} GiB ({b['source']}), "
                  f"{b['ondemand_capacity']:g} GiB for on-demand models"
                  ) if "free" in b else f"unreadable: {b['error']}"
        od = host["ondemand"]
        click.echo(f"ondemand {host['version']} on {host['listen']} ({host['backend']} backend)")
        click.echo(f"budget: {budget}")
        for g in b.get("gpus") or () if b.get("per_gpu") else ():
            holders = ", ".join(g["deployments"]) or "-"
            click.echo(f"  GPU {g['index']}: {g['used']:.1f} of {g['capacity']:g} GiB used, {g['free']:.1f} free; "
                       f"held by {holders}")
        key = "fingerprint " + od["key_fingerprint"] if od["configured"] else "NOT CONFIGURED (ondemand key init)"
        litellm = ("ready" if od["litellm_ready"] else ("not ready: " + str(od["litellm_error"]))
                   ) if od["litellm_enabled"] else "disabled"
        click.echo(f"key: {key}; LiteLLM: {litellm}; waiting requests: {od['queued']}")
        if od.get("scheduler"):  # (a server older than this command says nothing of it)
            click.echo(f"scheduler: {od['scheduler']}, aiming at a wait of at most {od['slo_s']:g} s for a model")
        if host.get("host_memory"):
            click.echo(_host_memory_line(host["host_memory"]))
        click.echo("")
    click.echo(_table(_dep_rows(views), _DEP_HEADER) if views else "no deployments")
    import time
    for line in [*_expected(views, time.time()), *_kept_and_taken(views)]:
        click.echo(line)
    _echo_names(names)
    over = [v["name"] for v in views if Deployment.from_row(v).over_declared]
    if over:
        click.echo(f"! {', '.join(over)}: measured more than 10 % over the declared memory_gib; "
                   "fit checks count the measured size (raise memory_gib)")


def _host_memory_line(hm: dict[str, Any]) -> str:
    """What tiered warmth watches on the host: available memory, what asleep engines hold,
    the reserve a level-1 sleep must leave."""
    if hm.get("available_gib") is None:
        mem = "unreadable"
    else:
        mem = f"{hm['available_gib']:.1f} GiB available of {hm['total_gib']:.1f} GiB"
    return (f"host memory: {mem}; asleep engines hold {hm.get('asleep_gib') or 0:.1f} GiB; "
            f"a level-1 sleep leaves {hm.get('reserve_gib', 0):g} GiB")


def _litellm_names(ctx: Ctx, host: Any) -> Any:
    """GET /api/litellm/names when LiteLLM is on: the names, or {"error": message}; else None."""
    if not host or not host["ondemand"]["litellm_enabled"]:
        return None
    status, data = _run(adminclient.request(ctx.cfg, "GET", "/litellm/names"))
    if status >= 400:
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        return {"error": f"{err.get('message', status)} ({err.get('code', status)})"}
    return data


def _echo_names(names: Any) -> None:
    """Which instances serve each name in LiteLLM (several boxes), ready ones first."""
    if names is None:
        return
    click.echo("")
    if "error" in names:
        click.echo(f"LiteLLM names: unreadable: {names['error']}")
        return
    rows = [[n["name"], ",".join(n["ready"]) or "none",
             ", ".join(f"{e['instance'] or '(not ondemand)'}{'*' if e['this'] else ''} {e['state']}"
                       for e in n["entries"])] for n in names["names"]]
    click.echo(f"LiteLLM names (* this instance, {names['instance']}):")
    click.echo(_table(rows, ["NAME", "READY ON", "ENTRIES"]) if rows else "none")


# --- audit ---------------------------------------------------------------------

@cli.command()
@click.option("--deployment", "dep_id", type=Whole(18), help="only this deployment's rows")
@click.option("-n", "--limit", default=20, show_default=True, type=click.IntRange(1, 1000), help="how many rows")
@json_option
@pass_ctx
def audit(ctx: Ctx, dep_id: int | None, limit: int, as_json: bool) -> None:
    """The audit log, newest first: time, action, actor, deployment and text (as GET
    /api/audit; read from the state file when no server runs)."""
    query = f"?limit={limit}" + (f"&deployment_id={dep_id}" if dep_id is not None else "")
    names: dict[int, str] = {}
    try:
        status, data = _run(adminclient.request(ctx.cfg, "GET", "/audit" + query))
    except adminclient.NoServer:
        offline = _run(adminclient.offline_audit(ctx.cfg, dep_id, limit))
        if offline is None:
            _fail(f"no server runs and there is no state file at {ctx.cfg.db_path}", EXIT_NO_SERVER)
        data, names = offline
    else:
        if status >= 400:
            err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
            _fail(f"{err.get('message', status)} ({err.get('code', status)})")
        if not as_json and any(r.get("deployment_id") is not None for r in data):
            names = {v["id"]: v["name"] for v in _call(ctx, "GET", "/deployments")}
    if as_json:
        _echo_json(data)
        return
    rows = [[_when(r.get("at")), r["action"], r["actor"] + (f" ({r['user']})" if r.get("user") else ""),
             _who(r.get("deployment_id"), names), r.get("text")] for r in data]
    click.echo(_table(rows, ["TIME", "ACTION", "ACTOR", "DEPLOYMENT", "TEXT"]) if rows else "no audit rows")


def _when(at: float | None) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "-"


def _who(dep_id: int | None, names: dict[int, str]) -> str | None:
    if dep_id is None:
        return None
    return f"{dep_id} ({names[dep_id]})" if dep_id in names else str(dep_id)


# --- doctor ----------------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def doctor(ctx: Ctx, as_json: bool) -> None:
    """Check the Docker socket, nvidia-smi, the key file, LiteLLM and the listener; and
    what the engine recipes need: the images on the Docker host, Docker's GPU runtime,
    the model cache, the token file, each deployment against the box's GPUs."""
    from ..admin import doctor as doctor_mod
    checks = _run(doctor_mod.run(ctx.cfg))
    if as_json:
        _echo_json(checks)
    else:
        for c in checks:
            mark = "OK  " if c["ok"] else "FAIL" if c["ok"] is False else "SKIP"
            click.echo(f"{mark}  {c['check']:10} {c['detail']}")
    if any(c["ok"] is False for c in checks):
        sys.exit(EXIT_FAILED)
