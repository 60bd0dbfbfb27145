"""Two boxes behind one LiteLLM: two real `ondemand serve` processes on loopback, each with
its own state dir, port, budget, `instance` and LiteLLM key, the same deployment ids, and
one LiteLLM admin double (tests/litellm_double.py) that records who deleted what.

Neither box ever deletes the other's entries, through restarts, removals, a mode switch and
a key rotation; an entry from before instances is adopted by its owner only; both see, in
`GET /api/litellm/names` and `ondemand status`, which box serves a name and how."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from helpers import ROOT, admin_ok, free_port, serving, sim_command, terminate, wait_for
from litellm_double import litellm_double

from ondemand import config
from ondemand.gateway import keys
from ondemand.litellm.entries import entry_instance, entry_owned, ondemand_entry

MASTER = "sk-master"

# About 8 s (four starts of `ondemand serve`, an engine start): the fast suite has the same
# rules in-process (tests/litellm/test_sync.py, "Several boxes behind one LiteLLM").
pytestmark = pytest.mark.slow


class Box:
    """One `ondemand serve` process with its own everything."""

    def __init__(self, tmp, instance: str, litellm_url: str, litellm_key: str):
        self.instance = instance
        self.litellm_key = litellm_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/dgxmm"
        state = tmp / instance
        state.mkdir()
        (state / "litellm.key").write_text(litellm_key + "\n")
        self.path = tmp / f"{instance}.toml"
        settings = {"state_dir": str(state), "listen": f"127.0.0.1:{self.port}", "internal_url": self.url,
                    "instance": instance, "ondemand_allowed_cidrs": ["127.0.0.0/8"], "min_idle_timeout_s": 1,
                    "shutdown_grace_s": 1}
        lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        lines += ["[budget]", 'source = "static"', "capacity_gib = 24", "[deployer]", 'backend = "process"',
                  "[litellm]", f"url = {json.dumps(litellm_url)}",
                  f"master_key_file = {json.dumps(str(state / 'litellm.key'))}"]
        self.path.write_text("\n".join(lines) + "\n")
        self.cfg = config.load(self.path, env={})
        keys.write_key_file(self.cfg.key_file, keys.generate_key())
        self.proc: asyncio.subprocess.Process | None = None
        self.log = tmp / f"{instance}.log"

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
        with open(self.log, "ab") as log:  # a pipe nobody reads would fill and stall the server
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ondemand", "--config", str(self.path), "serve", cwd=ROOT, env=env,
                stdout=log, stderr=log)
        await serving(self.proc, self.cfg, f"{self.instance} serving", self.log, timeout=20)

    async def stop(self) -> None:
        await terminate(self.proc)

    async def api(self, method: str, path: str, body=None):
        return await admin_ok(self.cfg, method, path, body, self.instance)

    async def sync(self) -> dict:
        result = await self.api("POST", "/sync")
        assert result["error"] is None, result
        return result


def owners(double) -> list[tuple]:
    return sorted((entry_instance(m) or "-", m["model_info"]["dgxmm_id"], m["model_name"],
                   m["litellm_params"].get("order")) for m in double.models if "dgxmm_id" in m["model_info"])


def entries_of(double, instance: str) -> dict[str, dict]:
    return {m["model_info"]["id"]: m for m in double.models if entry_instance(m) == instance}


def assert_each_deleted_only_its_own(double, boxes) -> None:
    by_key = {b.litellm_key: b for b in boxes}
    for key, entry in double.deletes:
        box = by_key[key]
        assert entry_owned(entry, box.instance, box.url), (box.instance, entry)


async def test_two_boxes_never_delete_each_others_entries(tmp_path):
    async with litellm_double(MASTER) as double:
        a = Box(tmp_path, "box-a", double.url, "sk-box-a")
        b = Box(tmp_path, "box-b", double.url, "sk-box-b")
        double.other_keys |= {a.litellm_key, b.litellm_key}
        # Entries from before instances: one of each box (under its internal_url), one of a box gone.
        legacy = {}
        for url in (a.url, b.url, "http://old-box:8090/dgxmm"):
            old = ondemand_entry({"id": 1, "name": "m1", "served_name": "M1", "state": "stopped"}, "old-key",
                                 url, 900, instance="x")
            del old["model_info"]["dgxmm_instance"], old["model_info"]["dgxmm_state"], old["litellm_params"]["order"]
            legacy[url] = double.seed(old["model_name"], old["litellm_params"], old["model_info"])
        try:
            await asyncio.gather(a.start(), b.start())
            for box in (a, b):
                for name in ("m1", "m2"):
                    await box.api("POST", "/deployments", {
                        "name": name, "served_name": name.upper(), "mode": "on_demand", "memory_gib": 4,
                        "command": sim_command(name.upper())})
                await box.sync()
            assert owners(double) == [("-", 1, "M1", None), ("box-a", 1, "M1", 3), ("box-a", 2, "M2", 3),
                                      ("box-b", 1, "M1", 3), ("box-b", 2, "M2", 3)]  # cold: order 3
            ids = {m["model_info"]["id"] for m in double.models}
            assert legacy["http://old-box:8090/dgxmm"] in ids and not {legacy[a.url], legacy[b.url]} & ids
            assert {key for key, e in double.deletes if e["model_info"]["id"] == legacy[a.url]} == {a.litellm_key}
            assert {key for key, e in double.deletes if e["model_info"]["id"] == legacy[b.url]} == {b.litellm_key}

            # Restarts: each box's start-up sync leaves the other's entries alone.
            before_b = entries_of(double, "box-b")
            await a.stop()
            await a.start()
            await a.sync()
            assert entries_of(double, "box-b") == before_b
            before_a = entries_of(double, "box-a")
            await b.stop()
            await b.start()
            assert (await b.sync())["deleted"] == []
            assert entries_of(double, "box-a") == before_a

            # A removal on A: its m2 entry goes, B's stays.
            await a.api("DELETE", "/deployments/2")
            await a.sync()
            assert [o for o in owners(double) if o[1] == 2] == [("box-b", 2, "M2", 3)]

            # A mode switch on B: its m1 becomes a direct entry of a ready engine (order 1).
            await b.api("PATCH", "/deployments/1/mode", {"mode": "always_on"})

            async def switched():
                return (await b.api("GET", "/deployments/1"))["mode"] == "always_on"
            await wait_for(switched, timeout=20, what="m1 always on at box-b")
            await b.sync()
            assert [o for o in owners(double) if o[0] == "box-b" and o[1] == 1] == [("box-b", 1, "M1", 1)]
            assert entries_of(double, "box-a").keys() == {k for k in before_a
                                                          if before_a[k]["model_info"]["dgxmm_id"] == 1}

            # A key rotation on A: A's entries are replaced, B's untouched.
            before_b = entries_of(double, "box-b")
            keys.write_key_file(a.cfg.key_file, keys.generate_key())
            await wait_for(lambda: a.cfg.key_file.stat().st_size > 0)
            fp = keys.fingerprint(a.cfg.key_file.read_text().strip())

            async def rotated():
                await a.sync()
                return all(m["model_info"]["dgxmm_key_fp"] == fp for m in entries_of(double, "box-a").values())
            await wait_for(rotated, timeout=10, interval=0.2, what="A's entries carrying the new key")
            assert entries_of(double, "box-b") == before_b

            # Both see who serves M1, read from LiteLLM alone.
            names = await a.api("GET", "/litellm/names")
            m1 = next(n for n in names["names"] if n["name"] == "M1")
            assert names["instance"] == "box-a" and m1["ready"] == ["box-b"]
            assert [(e["instance"], e["state"], e["this"]) for e in m1["entries"]] == [
                ("box-b", "ready", False), ("box-a", "cold", True), (None, "unknown", False)]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ondemand", "--config", str(a.path), "status", cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")})
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            text = out.decode()
            assert "LiteLLM names (* this instance, box-a):" in text, text
            assert any(line.split()[:2] == ["M1", "box-b"] and "box-a* cold" in line for line in text.splitlines())
        finally:
            await asyncio.gather(a.stop(), b.stop())
        assert_each_deleted_only_its_own(double, (a, b))
        assert len(double.deletes) >= 5  # two adoptions, a removal, a switch and a rotation deleted
