"""Test helpers: engine-simulator deployments, waiting, a running deployer."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from pathlib import Path

from ondemand.control.budget import Budget
from ondemand.engines.backends.process import ProcessBackend
from ondemand.engines.deployer import Deployer

ROOT = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"


async def serving(proc, cfg, what: str, log: Path, timeout: float = 30) -> None:
    """Wait until an ``ondemand serve`` child answers on its admin socket (``log``: its
    output, quoted when it exited first)."""
    from ondemand.admin import client as adminclient

    def output() -> str:
        return log.read_text(errors="replace")[-3000:]

    async def up():
        assert proc.returncode is None, output()
        with contextlib.suppress(adminclient.NoServer):
            status, _ = await adminclient.request(cfg, "GET", "/host")
            return status == 200
    await wait_for(up, timeout=timeout, interval=0.05, what=what)


async def terminate(proc, timeout: float = 15) -> None:
    """SIGTERM a child, SIGKILL it after ``timeout``; idempotent."""
    if proc is not None and proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def admin_ok(cfg, method: str, path: str, body=None, who: str = ""):
    """An admin API call over the socket that must succeed; its JSON."""
    from ondemand.admin import client as adminclient
    status, data = await adminclient.request(cfg, method, path, body)
    assert status < 400, (who, method, path, status, data)
    return data


def load_script(name: str):
    """A script of scripts/ (not a package) imported as a module of its own name."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def sim_command(model: str = "m", *extra: str) -> list[str]:
    """The process backend's command for the engine simulator."""
    return ["ondemand", "sim-engine", "--port", "{port}", "--model", model, *extra]


def dep_fields(name: str, memory_gib: float = 10, mode: str = "on_demand", *sim_args: str, **kw) -> dict:
    fields = dict(name=name, served_name=name.upper(), engine="vllm", memory_gib=memory_gib, mode=mode,
                  state="stopped", command=sim_command(name.upper(), *sim_args), role="model")
    fields.update(kw)
    return fields


def fill_the_disk(store, monkeypatch) -> None:
    """Every write to ``store``'s file fails as on a full disk (SQLite's own words, raised where
    the statement runs): a write then ends in the store's StateFileError, as on a real full disk
    (tests/state/test_full_disk.py fills a tmpfs, which needs root)."""
    import sqlite3
    real = store.db.execute

    def execute(sql, *args, **kw):
        if sql.lstrip().upper().startswith(("INSERT", "DELETE", "UPDATE")):
            raise sqlite3.OperationalError("database or disk is full")
        return real(sql, *args, **kw)
    monkeypatch.setattr(store.db, "execute", execute)


def one_line_errors(caplog, logger: str) -> list[str]:
    """The records ``logger`` wrote, each as the log shows it; asserts each is one line (no traceback)."""
    import logging
    lines = [logging.Formatter("%(levelname)s %(name)s: %(message)s").format(r)
             for r in caplog.records if r.name == logger]
    assert all("\n" not in line for line in lines), lines
    return lines


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str | None = None):
    """Wait until ``predicate()`` (a function, or one returning an awaitable) is truthy and
    return its value: the way to wait for something to happen, instead of a fixed sleep.
    On timeout, fail saying what was awaited (``what``, else the predicate's source) and the
    last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what or _source(predicate)} "
                         f"(last value: {value!r})")


def _source(fn) -> str:
    try:
        return " ".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


@contextlib.asynccontextmanager
async def running_deployer(tmp_path, store, capacity: float = 24, budget=None, **kw):
    d = Deployer(store, ProcessBackend(tmp_path), budget or Budget("static", capacity),
                 start_timeout_s=kw.pop("start_timeout_s", 20), stop_timeout_s=kw.pop("stop_timeout_s", 5),
                 **kw)
    await d.load()
    try:
        yield d
    finally:
        await d.close(stop_engines=True)




class Env:
    """A deployer, a metrics sampler and the controller (core, effects, admission) over one state file."""

    def __init__(self, deployer, sampler, controller, admission, effects, bus, store):
        self.deployer = deployer
        self.sampler = sampler
        self.controller = controller
        self.admission = admission
        self.effects = effects
        self.bus = bus
        self.store = store
        self.published: list[int] = []
        self.skipped = [0.0]

    async def add(self, name, memory_gib=10, *sim_args, **kw):
        return (await self.deployer.create(dep_fields(name, memory_gib, kw.pop("mode", "on_demand"),
                                                      *sim_args, **kw))).id

    def state(self, dep_id):
        dep = self.deployer.get(dep_id)
        return dep and dep.state.value

    async def start(self, dep_id):
        await self.deployer.restart(dep_id)

    async def fresh_metrics(self):
        await self.sampler.sample_once()

    def acquire(self, dep_id, **kw):
        return self.admission.acquire(dep_id, **kw)

    def skip(self, seconds: float) -> None:
        """Move the controller's clock on (idle timers, backoff, deadlines) without waiting."""
        self.skipped[0] += seconds

    async def reap(self) -> list[int]:
        """The reaper's step, and the stops it asked for, to their end."""
        asked = self.controller.reap()
        await self.effects_done()
        return [i for i in asked if self.state(i) == "stopped"]

    async def effects_done(self, timeout: float = 30.0) -> None:
        """Wait until no effect task of the controller runs."""
        await wait_for(lambda: len(self.effects.tasks) == 0, timeout=timeout, interval=0.005,
                       what="the controller's effects to end")


@contextlib.asynccontextmanager
async def controller_env(tmp_path, store, capacity: float = 24, *, queue_timeout_s: float = 30,
                         max_queued: int = 256, idle_timeout_s: int = 1, **kw):
    from ondemand.control.admission import Admission
    from ondemand.control.controller import Controller
    from ondemand.control.effects import DeployerEffects
    from ondemand.engines.metrics import MetricsSampler
    from ondemand.events import CountersChanged, DeploymentChanged, EventBus
    from ondemand.model import State

    bus = EventBus()
    skipped = [0.0]  # the controller's clock runs ahead of the loop's by this much (Env.skip)
    deployer_kw = {"publish": bus.publish, **kw.pop("deployer_kw", {})}
    async with running_deployer(tmp_path, store, capacity, kw.pop("budget", None), **deployer_kw) as d:
        sampler = MetricsSampler(lambda: d.engines_in((State.READY, State.ASLEEP)), interval_s=0.1)
        effects = DeployerEffects(d, d.budget, sampler, publish=bus.publish, settle_poll_s=0.05)
        c = Controller(effects, clock=kw.pop("clock", lambda: time.monotonic() + skipped[0]), wall=time.time,
                       queue_timeout_s=queue_timeout_s, max_queued=max_queued,
                       idle_timeout_s=idle_timeout_s, min_idle_timeout_s=1, **kw)
        effects.bind(c)
        env = Env(d, sampler, c, Admission(c, d), effects, bus, store)
        env.skipped = skipped
        bus.subscribe(DeploymentChanged, lambda e: c.on_deployment(e.dep_id, e.dep, e.old))
        bus.subscribe(CountersChanged, lambda e: env.published.append(e.dep_id))
        task = asyncio.get_running_loop().create_task(sampler.run())
        try:
            yield env
        finally:
            task.cancel()
            c.close()
            await effects.close()
            await sampler.close()


class Server:
    """A whole ondemand running on loopback, for end-to-end tests."""

    def __init__(self, app, url: str, cfg, key: str, token: str):
        self.app = app
        self.url = url  # http://127.0.0.1:PORT/dgxmm
        self.cfg = cfg
        self.key = key
        self.token = token
        self.http = None  # the HttpServer (run_app sets it)
        self.skipped = 0.0  # the controller's clock runs ahead of the loop's by this much (skip)

    def clock(self) -> float:
        return time.monotonic() + self.skipped

    def skip(self, seconds: float) -> None:
        """Move the controller's clock on (idle timers, sleep timeouts, backoff, queue deadlines)
        instead of waiting them out: the reaper's next step sees the time passed."""
        self.skipped += seconds

    async def idle_for(self, seconds: float, *dep_ids: int) -> None:
        """Let deployments ``dep_ids`` be idle for ``seconds`` on the controller's clock: once their
        last requests have let go (their activity is stamped then), skip the time, and wait until
        the reaper's rule finds them idle (their engines' metrics read quiet too)."""
        await wait_for(lambda: not any(self.controller.inflight(i) for i in dep_ids), what=f"{dep_ids} let go")
        self.skip(seconds)
        await wait_for(lambda: all(self.controller.is_idle(self.deployer.get(i)) for i in dep_ids),
                       what=f"{dep_ids} idle by the reaper's rule")

    def set_limits(self, **changes) -> None:
        """Other HTTP bounds for the connections that open from now on (``ondemand.http.Limits``)."""
        import dataclasses
        front = self.http.front
        front.limits = dataclasses.replace(front.limits, **changes)

    @property
    def deployer(self):
        from ondemand import app as app_mod
        return self.app[app_mod.DEPLOYER]

    @property
    def controller(self):
        from ondemand import app as app_mod
        return self.app[app_mod.CONTROLLER]

    @property
    def admission(self):
        from ondemand import app as app_mod
        return self.app[app_mod.ADMISSION]

    @property
    def keys(self):
        from ondemand import app as app_mod
        return self.app[app_mod.KEYS]

    def gw(self, dep_id, route: str) -> str:
        return f"{self.url}/ondemand/{dep_id}/v1/{route}"

    def auth(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.key}"}

    def admin_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"}

    async def add(self, name, memory_gib=10, *sim_args, **kw) -> int:
        fields = dep_fields(name, memory_gib, kw.pop("mode", "on_demand"), *sim_args, **kw)
        return (await self.deployer.create(fields)).id

    def state(self, dep_id):
        dep = self.deployer.get(dep_id)
        return dep and dep.state.value


def free_port() -> int:
    """A port for a test's server: the process backend's rule (below the ephemeral range, so no
    outgoing connection or bind to 0 of another test takes it before the server binds)."""
    from ondemand.engines.backends.ports import free_port as engine_port
    return engine_port()


@contextlib.asynccontextmanager
async def run_app(tmp_path, *, write_key: bool = True, limits=None, **overrides):
    """Start ondemand (process backend, static budget) on 127.0.0.1 with a key and a token;
    ``limits``: the HTTP bounds (``ondemand.http.Limits``) instead of the defaults."""
    from ondemand import app as app_mod
    from ondemand import config
    from ondemand.gateway import keys
    from ondemand.http.server import LIMITS, HttpServer

    port = int(overrides["listen"].rpartition(":")[2]) if "listen" in overrides else free_port()
    settings = {"state_dir": str(tmp_path / "state"), "listen": f"127.0.0.1:{port}",
                "ondemand_allowed_cidrs": ["127.0.0.0/8"], "deployer.backend": "process",
                "budget.source": "static", "budget.capacity_gib": 24, "min_idle_timeout_s": 1,
                # A host with plenty of memory: no sleep level depends on what this machine has
                # free (a test of the host reserve gives a meminfo of its own).
                "budget.meminfo_path": str(FAKES / "meminfo"),
                "ondemand_idle_timeout_s": 60, "ondemand_queue_timeout_s": 30, "reap_interval_s": 0.2,
                "metrics_interval_s": 0.2, "deployer.start_timeout_s": 20, "shutdown_grace_s": 1}
    settings.update(overrides)
    cfg = config.load(env={}, overrides=settings)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    key = keys.generate_key()
    if write_key:
        keys.write_key_file(cfg.key_file, key)
    token = app_mod.ensure_token(cfg.token_file)
    srv = Server(None, f"http://127.0.0.1:{port}{cfg.base_path}", cfg, key, token)
    app = srv.app = app_mod.build_app(cfg, clock=srv.clock)
    if limits is not None:
        app[LIMITS] = limits
    server = HttpServer(app, shutdown_timeout=1)
    await server.start()
    admin = cfg.admin_listen_host_port  # as serve listens
    await server.listen_tcp("127.0.0.1", port, serves="gateway" if admin else "all")
    if admin is not None:
        await server.listen_tcp(admin[0], admin[1], serves="admin")
    await server.listen_unix(str(cfg.admin_socket))
    cfg.admin_socket.chmod(0o600)  # as serve makes it
    srv.http = server
    try:
        yield srv
    finally:
        await server.stop()


class TwoPools:
    """An aiohttp client session whose gateway requests and other requests use connections of
    their own, as LiteLLM's and an admin's do: a connection that carried an admin request is
    aiohttp's for good and answers a gateway request 421 (design.md, "The HTTP layer")."""

    def __init__(self, gateway, other):
        self._gateway = gateway
        self._other = other

    def _for(self, url) -> object:
        return self._gateway if "/ondemand/" in str(url) else self._other

    def request(self, method, url, **kw):
        return self._for(url).request(method, url, **kw)

    def get(self, url, **kw):
        return self._for(url).get(url, **kw)

    def post(self, url, **kw):
        return self._for(url).post(url, **kw)

    def put(self, url, **kw):
        return self._for(url).put(url, **kw)

    def patch(self, url, **kw):
        return self._for(url).patch(url, **kw)

    def delete(self, url, **kw):
        return self._for(url).delete(url, **kw)

    def head(self, url, **kw):
        return self._for(url).head(url, **kw)

    def __getattr__(self, name):
        return getattr(self._other, name)


@contextlib.asynccontextmanager
async def two_pools():
    """A :class:`TwoPools` client session."""
    import aiohttp
    async with aiohttp.ClientSession() as gateway, aiohttp.ClientSession() as other:
        yield TwoPools(gateway, other)


# The files that take longest, most of it waiting on engines and clocks: tests/conftest.py collects
# them first, and `make test` hands whole files to its six workers in that order
# (--no-loadscope-reorder); one of these handed out last kept its worker busy 15 to 20 s after the
# others had ended (a 16 s rhythm of adaptive warmth).
FIRST = ("e2e/test_adaptive_warmth.py", "cli/test_cli_deploy.py", "control/test_controller_races.py",
         "gateway/test_gateway.py", "e2e/test_tiered_warmth.py", "engines/test_deployer.py", "replay/test_replay_cli.py",
         "replay/test_replay_run.py", "engines/backends/test_backend_contract.py", "http/test_protocol.py",
         "cli/test_cli.py", "engines/test_unit.py", "e2e/test_sleep_drain.py", "engines/test_start.py",
         "e2e/test_priorities.py", "hostile/test_hostile.py")
