"""replay: a trace of requests against this box's deployments under one or more policies, in
virtual time (ondemand/replay/), and what each policy gives: a table on stdout, ``--json FILE``,
``--html FILE``. Bad input stops it before it starts: one line on stderr, exit 2.

The replay's modules are imported when the command runs, not with the command line: every
other command (and each ``serve``) would pay for them at its start."""
from __future__ import annotations

import math
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

import click

from ..files import write_atomic
from .shared import EXIT_FAILED, EXIT_USAGE, Ctx, _fail, _run, cli, pass_ctx

if TYPE_CHECKING:
    from .. import config as config_mod
    from ..replay.trace import Trace
    from ..replay.types import Box, Policy, PolicyResult, Replayed


def _bad(message: str) -> NoReturn:
    """Bad input: the one line (``FILE:LINE: what is wrong``, a deployment's or a policy's name)."""
    click.echo(message, err=True)
    sys.exit(EXIT_USAGE)


class Progress:
    """A bar on stderr, drawn only on a terminal and once the replay has run ``delay_s``; redrawn
    at most every ``every_s``, and wiped at the end (the table follows on stdout)."""
    WIDTH = 30

    def __init__(self, total: int, what: str, stream: TextIO | None = None, *, delay_s: float = 2.0,
                 every_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.total = max(total, 1)
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        self.every_s = every_s
        self.clock = clock
        self.began = clock()
        self.drawn = -float("inf")
        self.shown = 0  # the width of what is on the line

    def __call__(self, done: int) -> None:
        now = self.clock()
        if now - self.began < self.delay_s or now - self.drawn < self.every_s or not self.stream.isatty():
            return
        self.drawn = now
        filled = round(self.WIDTH * min(done, self.total) / self.total)
        line = f"replaying [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done:,}/{self.total:,} {self.what}"
        self.stream.write("\r" + line.ljust(self.shown))
        self.stream.flush()
        self.shown = len(line)

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0


def _policies(given: tuple[str, ...]) -> list[Policy]:
    from ..replay.types import Policy
    out: list[Policy] = []
    for text in given or ("current",):
        try:
            policy = Policy.parse(text)
        except ValueError as exc:
            _bad(str(exc))
        if any(p.name == policy.name for p in out):
            _bad(f"policy {policy.name!r} is given twice")
        out.append(policy)
    return out


def _box(cfg: config_mod.Config, gpus: str | None, host_gib: float | None) -> Box:
    """The box: --gpus, else the configuration's budget (measured when it measures); its host
    memory: --host-gib, else this host's MemTotal."""
    from ..control.budget import Budget
    from ..errors import BudgetError
    from ..replay.deployments import box_of, parse_gpus
    try:
        declared = parse_gpus(gpus) if gpus else None
    except ValueError as exc:
        _bad(str(exc))
    budget = Budget.from_config(cfg)
    if host_gib is None:
        try:
            host_gib = budget.meminfo().total
        except BudgetError as exc:
            _bad(f"cannot read this host's memory ({exc}): give --host-gib G")
    else:
        _finite("--host-gib", host_gib)
        if host_gib <= 0:
            _bad(f"--host-gib {host_gib:g}: GiB above 0")
    measured = None
    if declared is None and cfg.budget.source != "static":
        try:
            measured = tuple(g.total for g in _run(budget.measure()) or ())
        except BudgetError as exc:
            _bad(f"the box's GPUs cannot be read ({exc}): give --gpus NxGIB")
    try:
        return box_of(cfg, host_gib, declared, measured)
    except ValueError as exc:
        _bad(str(exc))


def _deployments(ctx: Ctx, path: str | None, box: Box) -> list[Replayed]:
    from ..replay.deployments import DeploymentError, from_file, from_state
    try:
        return from_file(path, box) if path else from_state(ctx.cfg.db_path, box)
    except DeploymentError as exc:
        _bad(str(exc))


def _finite(option: str, value: float) -> None:
    """nan passes every comparison (a nan warm-up became a timer the clock cannot order), and
    inf means nothing here."""
    if not math.isfinite(value):
        _bad(f"{option} {value:g}: not a finite number")


def _check_numbers(slo_s: float, speed: float, live: bool, warmup_s: float) -> float:
    """The SLO to measure against, once every number is checked (exit 2 naming a bad one)."""
    for option, value in (("--slo-s", slo_s), ("--speed", speed), ("--warmup-s", warmup_s)):
        _finite(option, value)
    if slo_s <= 0:
        _bad(f"--slo-s {slo_s:g}: seconds above 0")
    if speed <= 0 or (speed != 1.0 and not live):
        _bad(f"--speed {speed:g}: above 0, and only with --live")
    if warmup_s < 0 or (warmup_s > 0 and live):
        _bad(f"--warmup-s {warmup_s:g}: seconds of 0 or more, and not with --live (which compares whole runs)")
    return slo_s


def _check_policies(policies: list[Policy], box: Box) -> None:
    from ..replay.run import check_policy
    for policy in policies:
        try:
            check_policy(policy, box)
        except ValueError as exc:
            _bad(str(exc))


def _write(path: str, data: bytes) -> None:
    """The whole file or none (``files.write_atomic``), so a reader (the admin page lists
    {state_dir}/replays/) never sees half a page. Through a link, the file it names is replaced;
    a file that was there keeps its mode; a device or a pipe (/dev/stdout) is written to as it is."""
    target = os.path.realpath(path)
    try:
        try:
            st: os.stat_result | None = os.stat(target)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(target, "wb") as fh:
                fh.write(data)
        elif st is not None:
            write_atomic(target, data, stat.S_IMODE(st.st_mode), exact_mode=True)
        else:
            write_atomic(target, data, 0o666)  # as open() makes a file: 0666 less the umask
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED)


@cli.command()
@click.argument("trace_file", metavar="TRACE")
@click.option("--deployments", "deployments_file", metavar="FILE",
              help="a TOML file of [[deployment]] tables (default: the state file's deployments, read only)")
@click.option("--policy", "policies", multiple=True, metavar="P",
              help="current, always-on, ttl=S, sleep-ttl=S, lru=S, sleep-lru=S, fixed=S, adaptive, seed, cost, "
                   "clairvoyant[=S] (knows every arrival; =S: no rest before S s idle); repeatable (default: current)")
@click.option("--gpus", metavar="NxGIB", help="the box's GPUs, e.g. 8x80 (default: the configuration's budget)")
@click.option("--host-gib", type=float, metavar="G", help="the box's host memory (default: this host's)")
@click.option("--slo-s", type=float, metavar="S",
              help="a request meets the SLO when it waits at most this for its engine (default: slo_s, 5 s unset)")
@click.option("--seed", type=int, default=0, show_default=True, help="for the model of rows that name none")
@click.option("--warmup-s", type=float, default=0.0, metavar="S",
              help="replay the trace's first S seconds without counting them: each policy is measured from the "
                   "state its own decisions left then (what runs, what sleeps, what adaptive warmth learned)")
@click.option("--json", "json_file", metavar="FILE", help="write the results as JSON")
@click.option("--html", "html_file", metavar="FILE", help="write one self-contained page of charts")
@click.option("--live", is_flag=True, help="also send the requests through a real serve on loopback with engine "
                                           "simulators, and check the virtual replay against it")
@click.option("--speed", type=float, default=1.0, show_default=True, metavar="X",
              help="with --live: every duration divided by X")
@pass_ctx
def replay(ctx: Ctx, trace_file: str, deployments_file: str | None, policies: tuple[str, ...], gpus: str | None,
           host_gib: float | None, slo_s: float | None, seed: int, warmup_s: float, json_file: str | None,
           html_file: str | None, live: bool, speed: float) -> None:
    """Replay TRACE (a CSV file, or the JSON access log) against the deployments under each
    policy, in virtual time through ondemand's own decisions: who waited for what, for how
    long, and what the box held. The state file is never written. With --live the same
    requests also go through a real serve, and the two are compared (exit 1 when they differ)."""
    from ..replay import page, report
    from ..replay.run import replay as run_replay
    from ..replay.trace import Trace, TraceError
    parsed = _policies(policies)
    slo_s = _check_numbers(ctx.cfg.slo_s if slo_s is None else slo_s, speed, live, warmup_s)  # cost's aim
    box = _box(ctx.cfg, gpus, host_gib)
    _check_policies(parsed, box)
    replayed = _deployments(ctx, deployments_file, box)
    trace = Trace(trace_file, replayed, seed)
    try:
        summary = trace.check()
    except TraceError as exc:
        _bad(str(exc))
    if warmup_s and warmup_s > summary.span_s:
        _bad(f"--warmup-s {warmup_s:g}: after the trace's last arrival ({summary.span_s:g} s): nothing would be "
             "measured")
    progress = Progress(summary.requests, f"requests x {len(parsed)} {'policy' if len(parsed) == 1 else 'policies'}")
    try:
        results = run_replay(trace, replayed, box, parsed, slo_s=slo_s, measure_from_s=warmup_s, progress=progress,
                             timelines=html_file is not None)  # only a page draws them: they grow with the trace
    finally:
        progress.close()
    click.echo(report.table(results, slo_s), nl=False)
    if json_file:
        _write(json_file, report.json_bytes(report.to_json(results, box, summary.requests, len(summary.models),
                                                           measured_from_s=warmup_s)))
    if html_file:
        title = f"ondemand replay: {trace_file}"
        _write(html_file, page.document(title, [page.section(results, box, title=title, slo_s=slo_s)]).encode())
    if live:
        _live(trace, replayed, box, results, speed=speed, slo_s=slo_s)


def _live(trace: Trace, replayed: list[Replayed], box: Box, results: list[PolicyResult], *, speed: float,
          slo_s: float) -> None:
    """Each policy again through a real serve; the two side by side, and whether they agree."""
    from ..replay import live as live_mod
    from ..replay import report
    from ..replay.run import configure
    pairs, differ = [], False
    for virtual in results:
        if virtual.policy.kind == "clairvoyant":  # it reads the trace ahead: no serve can
            click.echo(f"{virtual.policy.name}: a reference that knows every arrival in advance, "
                       "not run live", err=True)
            continue
        configured = configure(replayed, virtual.policy, box)
        with tempfile.TemporaryDirectory(prefix="ondemand-replay-") as work:
            measured = _run(live_mod.run_live(trace, configured, box, virtual.policy, speed=speed, slo_s=slo_s,
                                              workdir=Path(work)))
        pairs.append((virtual, measured))
        wrong = live_mod.disagreements(virtual, measured)
        differ = differ or bool(wrong)
        click.echo(f"{virtual.policy.name}: " + ("; ".join(wrong) if wrong else "the live run agrees"), err=True)
    click.echo(report.comparison(pairs, slo_s), nl=False)
    if differ:
        sys.exit(EXIT_FAILED)
