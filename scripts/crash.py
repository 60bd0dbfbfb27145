"""Crash safety: SIGKILL a real `ondemand serve` at random moments (during starts, stops,
mode switches, LiteLLM syncs, key rotations) and check, after each restart, what must hold.

    python scripts/crash.py --seed 1 --kills 50

ondemand runs with the process backend, the engine simulator (slow to start and to stop, so
kills land inside both), a static budget where 2 of the 4 deployments fit, and a LiteLLM
admin double (tests/litellm_double.py) as its `litellm.url`. Each round sends requests and
administrator calls, waits for the moment it aims at, and kills ondemand. Then:

- the state file as the kill left it passes PRAGMA integrity_check (checked on a copy);
- the restarted ondemand shows every deployment in a state BEHAVIOUR.md allows after a
  restart ("At start-up": the process backend adopts nothing, so stopped, failed or planned;
  never stopping, never a switch to always on left pending with nothing starting; an always-on
  deployment that lost its engine is started again, "After a restart of ondemand": stopped or
  starting with its pending mode until ready);
- engines the dead ondemand left behind are gone once the new one answers, and no deployment
  ever has two simulator processes;
- LiteLLM's entries converge: after a sync, the double holds exactly the entries the
  deployments call for (one gateway entry per on-demand deployment that is not failed or
  planned, and per always-on one whose start after the restart is pending, with the current
  key; a direct entry per always-on one that is ready; none for the others), and nothing else
  of ours.

The exit code is 1 when a check failed; the summary says which.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soaklib  # noqa: E402
from soaklib import ROOT, Ondemand, sim_command, sim_processes  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from litellm_double import litellm_double  # type: ignore[import-not-found]  # noqa: E402

from ondemand.gateway import keys  # noqa: E402

NAMES = ("alpha", "bravo", "charlie", "delta")
SIM_ARGS = ("--startup-delay", "0.6", "--shutdown-delay", "0.4", "--token-delay", "0.02", "--tokens", "20")
MOMENTS = ("start", "spawn", "stop", "mode_switch", "sync", "key_rotation", "random")
AFTER_RESTART = {"stopped", "failed", "planned"}


def allowed_after_restart(v: dict[str, Any]) -> bool:
    """A switch to always on left pending is cleared at start-up; a pending mode left is the
    start an always-on deployment that lost its engine is owed (mode always_on), not yet ready."""
    if v.get("pending_mode"):
        return v["mode"] == "always_on" and v["state"] in ("stopped", "starting")
    return v["state"] in AFTER_RESTART or (v["mode"] == "always_on" and v["state"] == "ready")


class Crash:
    def __init__(self, seed: int, kills: int, work: Path, double: Any, master: str):
        self.rng = random.Random(seed)
        self.kills = kills
        self.aims = MOMENTS
        self.work = work
        self.journal = work / "journal.jsonl"
        (work / "litellm.key").write_text(master + "\n")
        self.od = Ondemand(work, {
            "min_idle_timeout_s": 1, "ondemand_idle_timeout_s": 2, "ondemand_queue_timeout_s": 10,
            "reap_interval_s": 0.3, "metrics_interval_s": 0.3, "shutdown_grace_s": 1},
            {"budget": {"source": "static", "capacity_gib": 20},
             "deployer": {"backend": "process", "start_timeout_s": 10, "stop_timeout_s": 3},
             "litellm": {"url": double.url, "master_key_file": str(work / "litellm.key")}})
        self.double = double  # tests/litellm_double.py's: what LiteLLM was told
        self.ids: list[int] = []
        self.moments: collections.Counter[str] = collections.Counter()
        self.at_death: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.checked: collections.Counter[str] = collections.Counter()
        self.tasks: set[asyncio.Future[Any]] = set()

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checked[name] += 1
        if not ok:
            self.failures.append(f"{name}: {detail}")

    async def setup(self) -> None:
        self.od.write_key()
        await self.od.start()
        for name in NAMES:
            status, view = await self.od.api("POST", "/deployments", {
                "name": name, "served_name": name.upper(), "memory_gib": 10, "mode": "on_demand",
                "idle_timeout_s": 1, "command": sim_command(name.upper(), self.journal, *SIM_ARGS)})
            assert status == 201, (status, view)
            self.ids.append(view["id"])

    # --- what a round does before the kill ------------------------------------------------

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def request(self, n: int) -> None:
        url = f"{self.od.url}/ondemand/{self.ids[n]}/v1/chat/completions"
        with contextlib.suppress(Exception):
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json={"model": NAMES[n].upper(), "messages": [{"role": "user",
                                                                                      "content": "x"}]},
                                  headers={"Authorization": f"Bearer {self.od.key()}"}) as r:
                    await r.read()

    async def admin(self, method: str, path: str, body: Any = None) -> None:
        with contextlib.suppress(Exception):
            await self.od.api(method, path, body)

    async def views(self) -> dict[int, dict[str, Any]]:
        status, views = await self.od.api("GET", "/deployments")
        return {v["id"]: v for v in views} if status == 200 else {}

    async def wait_state(self, state: str, timeout: float = 8) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if any(v["state"] == state for v in (await self.views()).values()):
                    return True
            await asyncio.sleep(0.01)
        return False

    async def wait_spawn(self, timeout: float = 8) -> bool:
        """Until an engine process appears (the moment the backend forks it), looking at /proc
        as fast as it can: the kill then lands while the backend is still setting it up."""
        before = set(sim_processes(self.journal))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(sim_processes(self.journal)) - before:
                return True
            await asyncio.sleep(0)
        return False

    async def aim(self, moment: str) -> str:
        """Set the round going and return once the moment aimed at has come (what came)."""
        rng = self.rng
        for n in rng.sample(range(4), rng.randint(1, 3)):
            for _ in range(rng.randint(1, 4)):
                self.spawn(self.request(n))
        if moment == "start":
            return "start" if await self.wait_state("starting") else "random"
        if moment == "spawn":
            return "spawn" if await self.wait_spawn() else "random"
        if moment == "stop":
            await self.wait_state("ready")
            for i, v in (await self.views()).items():
                if v["state"] in ("ready", "starting"):
                    self.spawn(self.admin("POST", f"/deployments/{i}/stop"))
            return "stop" if await self.wait_state("stopping") else "random"
        elif moment == "mode_switch":
            i = rng.choice(self.ids)
            self.spawn(self.admin("PATCH", f"/deployments/{i}/mode",
                                  {"mode": rng.choice(["always_on", "always_on", "on_demand"])}))
        elif moment == "sync":
            self.spawn(self.admin("POST", "/sync"))
        elif moment == "key_rotation":
            keys.write_key_file(self.od.cfg.key_file, keys.generate_key())
        await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.02, 0.1, rng.uniform(0, 1.5)]))
        return moment

    # --- the kill and the checks after it ---------------------------------------------------

    async def round(self, k: int) -> None:
        moment = await self.aim(self.rng.choice(self.aims))
        await self.od.kill()
        self.moments[moment] += 1
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.file_checks(k)
        left = sim_processes(self.journal)
        await self.od.start()
        await self.after_restart(k, left)

    def file_checks(self, k: int) -> None:
        db = self.od.cfg.db_path
        copy = self.work / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(db) + suffix)
            if src.exists():
                shutil.copy2(src, copy / (db.name + suffix))
        verdict = soaklib.integrity(copy / db.name)
        self.check("state file intact after the kill (PRAGMA integrity_check)", verdict == "ok", f"kill {k}: {verdict}")
        for row in soaklib.rows(copy / db.name, "SELECT state, pending_mode FROM deployments"):
            self.at_death[row["state"] + (" (switch pending)" if row["pending_mode"] else "")] += 1

    async def after_restart(self, k: int, left: dict[int, dict[str, Any]]) -> None:
        views = await self.views()
        wrong = {v["name"]: (v["mode"], v["state"], v.get("pending_mode")) for v in views.values()
                 if not allowed_after_restart(v)}
        self.check("after a restart: stopped, failed or planned, or an always-on one started again; "
                   "no switch left pending", not wrong, f"kill {k}: {wrong}")
        alive = [p for p in left if p in sim_processes(self.journal)]
        self.check("engines left behind are gone once the new ondemand answers", not alive,
                   f"kill {k}: {len(alive)} of {len(left)} alive")
        await self.converged(k, views)
        self.no_twins(k)

    def no_twins(self, k: int) -> None:
        per = collections.Counter(p["model"] for p in sim_processes(self.journal).values())
        twins = {m: c for m, c in per.items() if c > 1}
        self.check("never two engines of one deployment", not twins, f"kill {k}: {twins}")

    def wanted(self, views: dict[int, dict[str, Any]]) -> set[tuple[Any, ...]]:
        """The entries the sync should write (BEHAVIOUR.md, "The entries"), as comparable tuples."""
        out = set()
        key = self.od.key()
        for i, v in views.items():
            pending = v.get("pending_mode") == "always_on"  # a start to always on: the gateway entry until ready
            if (v["mode"] == "on_demand" or pending) and v["state"] not in ("failed", "planned"):
                out.add((v["served_name"], f"{self.od.url}/ondemand/{i}/v1", key, i,
                         1 if v["state"] == "ready" else 2 if v["state"] == "asleep" else 3))  # warmth
            elif v["mode"] == "always_on" and v["state"] == "ready" and v.get("base_url"):
                out.add((v["served_name"], f"{v['base_url']}/v1", "none", i, 1))
        return out

    async def converged(self, k: int, views: dict[int, dict[str, Any]]) -> None:
        deadline = time.monotonic() + 15
        while True:
            status, result = await self.od.api("POST", "/sync")
            views = await self.views()
            have = sorted((e["model_name"], e["litellm_params"].get("api_base"), e["litellm_params"].get("api_key"),
                           e["model_info"].get("dgxmm_id"), e["litellm_params"].get("order"))
                          for e in self.double.models if e["model_info"].get("dgxmm_id") is not None)
            want = self.wanted(views)
            if (status == 200 and not result.get("error") and sorted(want) == have) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        self.check("LiteLLM's entries converge to what the deployments call for (one each, current key)",
                   sorted(want) == have, f"kill {k}: want {sorted(want)} have {have} ({status} {result})")

    async def run(self) -> None:
        await self.setup()
        for k in range(1, self.kills + 1):
            await self.round(k)
        rc = await self.od.stop()
        self.check("ondemand stops on SIGTERM with exit code 0", rc == 0, f"exit code {rc}")
        await asyncio.sleep(0.5)
        orphans = sim_processes(self.journal)
        self.check("no engine process left after ondemand stops", not orphans, str(orphans))
        hits = soaklib.secrets_found(soaklib.log_files(self.work), [self.od.key(), self.od.token()])
        self.check("no secret in any log", not hits, "; ".join(hits))

    def summary(self) -> str:
        out = [f"Crash safety: {self.kills} SIGKILLs of ondemand.", ""]
        out.append(soaklib.table("Kills by moment", self.moments.most_common(), ("moment", "kills")))
        out += ["", soaklib.table("Deployment states in the file at the kills", self.at_death.most_common(),
                                  ("state", "deployments"))]
        failed = collections.Counter(f.split(":")[0] for f in self.failures)
        out += ["", soaklib.table("Checks", [(name, n, f"FAILED x{failed[name]}" if failed[name] else "ok")
                                             for name, n in self.checked.items()], ("check", "times", "result"))]
        return "\n".join(out) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ondemand-crash-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        async with litellm_double("sk-master-crash") as double:
            crash = Crash(args.seed, args.kills, work, double, "sk-master-crash")
            crash.aims = tuple(args.moments.split(",")) if args.moments else MOMENTS
            try:
                await crash.run()
            finally:
                await crash.od.stop()
                for p in sim_processes(crash.journal):
                    soaklib.kill_pid(p)
        print(crash.summary())
        if crash.failures:
            print("FAILED:\n  " + "\n  ".join(crash.failures[:20]), file=sys.stderr)
            return 1
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    ap.add_argument("--moments", metavar="M,M", help=f"aim at these moments only (of {', '.join(MOMENTS)})")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
