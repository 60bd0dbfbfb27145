"""serve (and its demo), migrate and the engine simulator."""
from __future__ import annotations

import os
import sys

import click

from .. import config as config_mod
from .shared import EXIT_USAGE, Ctx, _echo_json, _fail, _run, cli, disk_error, json_option, pass_ctx

# --- serve -----------------------------------------------------------------

DEMO_DEPLOYMENTS = [
    # (name, GiB, simulator arguments): both do not fit in the demo's 24 GiB.
    # A cold start of 3 or 5 s; asleep, a wake of half a second (the simulator's sleep mode; its
    # weights "kept" in 64 MiB of host memory, really held).
    ("demo-small", 10, ["--startup-delay", "3", "--wake-delay", "0.5", "--host-mib", "64",
                        "--token-delay", "0.05", "--tokens", "40"]),
    ("demo-large", 16, ["--startup-delay", "5", "--wake-delay", "0.5", "--host-mib", "64",
                        "--token-delay", "0.05", "--tokens", "40"]),
]


async def _seed_demo(cfg: config_mod.Config) -> list[str]:
    """The two on-demand demo deployments, unless they exist; and a key."""
    from ..gateway import keys
    from ..state.store import Store
    made = []
    if keys.read_key_file(cfg.key_file) is None:
        cfg.key_file.parent.mkdir(parents=True, exist_ok=True)
        keys.write_key_file(cfg.key_file, keys.generate_key())
        made.append(f"key {cfg.key_file}")
    store = await Store.open(cfg.db_path)
    try:
        names = {d["name"] for d in await store.deployments()}
        for name, gib, sim in DEMO_DEPLOYMENTS:
            if name not in names:
                # A recipe, as an admin would write one: the demo's config runs the simulator as
                # its vLLM (deployer.commands.vllm), and the simulator's own options come last.
                await store.insert_deployment(dict(
                    name=name, served_name=name, engine="vllm", model=f"demo/{name}", memory_gib=gib,
                    gpu_count=1, mode="on_demand", state="stopped", role="model", args=sim))
                made.append(f"deployment {name}")
    finally:
        await store.close()
    return made


@cli.command()
@click.option("--demo", is_flag=True, help="first make a key and two on-demand demo deployments backed by "
                                           "the engine simulator (the embedded default of `make run`)")
@pass_ctx
def serve(ctx: Ctx, demo: bool) -> None:
    """Run the gateway, the admin API, the controller and the deployer."""
    from .. import app
    from ..errors import StartupError
    from ..state.lock import lock_state_dir
    cfg = ctx.cfg
    if demo:
        if cfg.deployer.backend != "process":
            _fail("--demo runs the engine simulator as child processes: set deployer.backend = process", EXIT_USAGE)
        try:  # not behind the back of a server that owns this state directory
            lock = lock_state_dir(cfg.state_dir)
        except StartupError as exc:
            _fail(str(exc))
        try:
            for item in _run(_seed_demo(cfg)):
                click.echo(f"demo: made {item}", err=True)
        finally:
            os.close(lock)
    try:
        _run(app.serve(cfg))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        # A disk that takes no more writes fails the start (the token, the lock, the state
        # file's migrations, each whole or not at all): one line, as any other start-up error.
        line = disk_error(exc, cfg, cfg.state_dir)
        if line is None and not isinstance(exc, StartupError):
            raise
        _fail(f"cannot start: {line}" if line else str(exc))


# --- migrate ---------------------------------------------------------------

@cli.command()
@json_option
@pass_ctx
def migrate(ctx: Ctx, as_json: bool) -> None:
    """Apply the state file's migrations and print its schema version."""
    from ..errors import StateFileError
    from ..state.migrations import SchemaTooNew
    from ..state.store import Store

    async def go() -> int:
        store = await Store.open(ctx.cfg.db_path)
        try:
            return await store.version()
        finally:
            await store.close()
    try:
        version = _run(go())
    except (SchemaTooNew, StateFileError) as exc:  # StateFileError: a state_dir that is a file
        _fail(str(exc))
    _echo_json({"db": str(ctx.cfg.db_path), "schema_version": version}) if as_json else \
        click.echo(f"{ctx.cfg.db_path}: schema version {version}")


# --- the engine simulator --------------------------------------------------

@cli.command("sim-engine", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                             "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sim_engine(args: tuple[str, ...]) -> None:
    """Run the engine simulator (not a real engine): vLLM's routes for demos and tests.

    Options are the simulator's own; see `ondemand sim-engine --help`.
    """
    from ..sim import engine
    sys.exit(engine.main(list(args)))
