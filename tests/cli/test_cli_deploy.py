"""The command line's deployment commands as an admin uses them (``cli/deploy.py``: add, set,
show, logs; ``cli/warmth.py``: keep-warm, sleep, wake): real processes, the real socket and
state file. The rest of the command line is test_cli's."""
import asyncio
import json
import re
import sys

from helpers import ROOT, run_app, sim_command, wait_for
from test_cli import cli, write_config


async def test_deploy_set_edits_in_place(tmp_path):
    async with run_app(tmp_path) as server:
        cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
        a = await server.add("alpha")
        await server.add("beta")
        rc, out, err = await cli("deploy", "set", str(a), "--served-name", "Alpha-2", "--memory-gib", "6",
                                 "--idle-timeout", "90", "--command", " ".join(sim_command("Alpha-2")),
                                 "--json", config=cfg)
        assert rc == 0, err
        view = json.loads(out)
        assert (view["id"], view["served_name"], view["memory_gib"], view["idle_timeout_s"]) == (a, "Alpha-2", 6.0, 90)
        assert view["command"] == sim_command("Alpha-2")
        rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
        assert "Alpha-2" in out
        (row,) = [r for r in await server.deployer.store.audit(a) if r["action"] == "deployment_update"]
        assert row["detail"]["old"]["served_name"] == "ALPHA" and row["detail"]["new"]["served_name"] == "Alpha-2"
        rc, out, _ = await cli("deploy", "set", str(a), "--idle-timeout", "default", config=cfg)
        assert rc == 0 and out.strip() == f"updated alpha (id {a}, stopped)"
        assert server.deployer.get(a).idle_timeout_s is None
        # refused: a bad value, another's name, nothing to change, no such deployment; nothing changed
        before = server.deployer.get(a).as_dict()
        rc, _, err = await cli("deploy", "set", str(a), "--port", "0", config=cfg)
        assert rc == 1 and "port:" in err and "invalid_field" in err
        rc, _, err = await cli("deploy", "set", str(a), "--name", "beta", config=cfg)
        assert rc == 1 and "name_taken" in err
        rc, _, err = await cli("deploy", "set", str(a), config=cfg)
        assert rc == 2 and "nothing to change" in err
        rc, _, err = await cli("deploy", "set", "99", "--port", "9000", config=cfg)
        assert rc == 1 and "not_found" in err
        assert server.deployer.get(a).as_dict() == before
        # busy while it runs
        await server.deployer.restart(a)
        rc, _, err = await cli("deploy", "set", str(a), "--served-name", "x", config=cfg)
        assert rc == 1 and "deployment_busy" in err and len(err.strip().splitlines()) == 1
        assert server.deployer.get(a).served_name == "Alpha-2"


async def test_deploy_add_and_set_priority_and_max_inflight(tmp_path):
    async with run_app(tmp_path) as server:
        cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
        rc, out, err = await cli("deploy", "add", "coder", "--command", " ".join(sim_command("coder")),
                                 "--mode", "on_demand", "--priority", "high", "--max-inflight", "8", "--json",
                                 config=cfg)
        assert rc == 0, err
        view = json.loads(out)
        assert (view["priority"], view["max_inflight"]) == ("high", 8)
        rc, _, err = await cli("deploy", "add", "x", "--command", "x", "--max-inflight", "0", config=cfg)
        assert rc == 1 and "max_inflight:" in err and "invalid_field" in err
        # a control character in a name (an escape sequence here): refused on add and set, one line
        for verb, target in (("add", "x"), ("set", str(view["id"]))):
            for option in ("--served-name", "--name") if verb == "set" else ("--served-name",):
                rc, _, err = await cli("deploy", verb, target, option, "x\x1b[2Jy", *(
                    ("--command", "x") if verb == "add" else ()), config=cfg)
                assert rc == 1 and f"{option[2:].replace('-', '_')}:" in err and "invalid_field" in err, err
                assert len(err.strip().splitlines()) == 1
        rc, _, err = await cli("deploy", "add", "x\x7f", "--command", "x", config=cfg)
        assert rc == 1 and "name:" in err and "invalid_field" in err
        rc, _, err = await cli("deploy", "add", "x", "--command", "x", "--priority", "urgent", config=cfg)
        assert rc == 2 and "urgent" in err  # click's own choice check
        await server.deployer.restart(view["id"])
        rc, out, err = await cli("deploy", "set", str(view["id"]), "--priority", "low", "--max-inflight", "none",
                                 "--json", config=cfg)  # while it runs: these two need no stop
        assert rc == 0, err
        assert (json.loads(out)["priority"], json.loads(out)["max_inflight"], json.loads(out)["state"]) == \
            ("low", None, "ready")
        rc, out, err = await cli("deploy", "set", str(view["id"]), "--priority", "low", config=cfg)
        assert rc == 0 and out.startswith("updated coder"), err  # as it is: no change, not busy
        rc, out, _ = await cli("deploy", "set", str(view["id"]), "--max-inflight", "2", config=cfg)
        assert rc == 0
        rc, out, _ = await cli("status", config=cfg)
        header, row = [line for line in out.splitlines() if line.startswith(("ID", str(view["id"]) + " "))]
        assert "PRIORITY" in header and " low " in row and " 0/2 " in row
        rc, out, _ = await cli("deploy", "show", str(view["id"]), config=cfg)
        assert re.search(r"^priority: +low$", out, re.M) and re.search(r"^max_inflight: +2$", out, re.M)


async def test_deploy_logs_tail_follow_and_ctrl_c(tmp_path, server):
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    dep_id = await server.add("lg")
    rc, out, err = await cli("deploy", "logs", str(dep_id), config=cfg)
    assert (rc, out) == (0, "")  # it never ran: an empty log
    rc, _, err = await cli("deploy", "logs", "99", config=cfg)
    assert rc == 1 and "not_found" in err
    rc, _, err = await cli("deploy", "logs", str(dep_id), "-n", "-1", config=cfg)
    assert rc == 2
    await server.deployer.restart(dep_id)
    rc, out, err = await cli("deploy", "logs", str(dep_id), "-n", "1", config=cfg)
    assert rc == 0 and "serving LG" in out and out.count("\n") == 1, (out, err)
    # -f runs until Ctrl-C, which ends it cleanly: exit 0, no traceback.
    argv = [sys.executable, "-m", "ondemand", "--config", str(cfg), "deploy", "logs", str(dep_id), "-f"]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        seen = b""
        while b"serving LG" not in seen:
            seen += await asyncio.wait_for(proc.stdout.readline(), 20)
        await asyncio.sleep(0.3)
        assert proc.returncode is None  # following
        proc.send_signal(2)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0 and err == b"", err
    await wait_for(lambda: server.deployer.backend.followers("lg") == 0, what="the follower gone")


async def test_deploy_logs_without_a_server(tmp_path):
    cfg = write_config(tmp_path / "c.toml", tmp_path / "s")
    rc, _, err = await cli("deploy", "logs", "1", config=cfg)
    assert rc == 3 and "no server" in err


async def test_numbers_beyond_what_the_client_sends_are_usage_errors(tmp_path, server):
    """One line and exit 2: a number beyond 64 bits was orjson's TypeError, a traceback and
    exit 1. A number in reach goes to the server, whose 400 is relayed as before."""
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    a = await server.add("alpha")
    before = server.deployer.get(a).as_dict()
    huge = "99999999999999999999999"
    add = ("deploy", "add", "x", "--command", "x {port}")
    for argv, flag in (((*add, "--port", huge), "--port"), ((*add, "--gpu-count", huge), "--gpu-count"),
                       ((*add, "--idle-timeout", huge), "--idle-timeout"),
                       (("deploy", "set", str(a), "--port", huge), "--port"),
                       (("deploy", "set", str(a), "--gpu-count", huge), "--gpu-count"),
                       (("deploy", "set", str(a), "--gpu-ids", huge), "--gpu-ids"),
                       (("deploy", "set", str(a), "--gpu-ids", f"0,{huge}"), "--gpu-ids"),
                       (("deploy", "set", str(a), "--port", "٣"), "--port")):
        rc, out, err = await cli(*argv, config=cfg)
        assert rc == 2 and err.startswith(f"ondemand: {flag} takes a whole number") and err.count("\n") == 1, \
            (argv, rc, err)
    rc, _, err = await cli("deploy", "set", str(a), "--port", "999999999", config=cfg)
    assert rc == 1 and "port:" in err and "invalid_field" in err, err
    assert [d.name for d in server.deployer.all()] == ["alpha"] and server.deployer.get(a).as_dict() == before


async def test_a_command_with_an_unbalanced_quote_is_a_usage_error(tmp_path, server):
    """One line and exit 2: shlex's ValueError was a traceback and exit 1."""
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    a = await server.add("alpha")
    before = server.deployer.get(a).as_dict()
    for argv, why in ((("deploy", "add", "ok1", "--dry-run", "--command", "'unterminated"), "no closing quotation"),
                      (("deploy", "add", "ok1", "--command", 'x "{port}'), "no closing quotation"),
                      (("deploy", "set", str(a), "--command", "'bad"), "no closing quotation"),
                      (("deploy", "set", str(a), "--command", "x \\"), "no escaped character")):
        rc, _, err = await cli(*argv, config=cfg)
        assert rc == 2 and err.startswith(f"ondemand: --command: {why}") and err.count("\n") == 1, (argv, rc, err)
    assert [d.name for d in server.deployer.all()] == ["alpha"] and server.deployer.get(a).as_dict() == before


async def test_deploy_add_show_and_set_with_a_recipe(tmp_path, server):
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    add = ("deploy", "add", "qwen", "--engine", "vllm", "--model", "Qwen/Qwen3-8B", "--memory-gib", "12",
           "--env", "FOO=a=b", "--env", "API_KEY=s3cret", "--arg", "--max-model-len", "--arg", "4096",
           "--mode", "on_demand")
    # --dry-run: the command line it would run (the box's 24 GiB pool: a share of 0.5), nothing made
    rc, out, err = await cli(*add, "--dry-run", config=cfg)
    assert rc == 0, err
    assert out == ("vllm serve Qwen/Qwen3-8B --served-model-name qwen --host 127.0.0.1 --port '{port}' "
                   "--gpu-memory-utilization 0.50 --max-model-len 4096\n")
    assert err.startswith("dry run, nothing created: environment API_KEY, FOO")
    rc, out, err = await cli(*add, "--dry-run", "--json", config=cfg)
    view = json.loads(out)
    assert rc == 0 and view["dry_run"] and view["gpu_count"] == 1 and view["env"] == {"API_KEY": "***", "FOO": "a=b"}
    assert "s3cret" not in out and server.deployer.all() == []
    # made, then shown: argv and the environment's names, the secret masked
    rc, out, err = await cli(*add, "--json", config=cfg)
    assert rc == 0, err
    dep_id = json.loads(out)["id"]
    assert dict(server.deployer.get(dep_id).env) == {"API_KEY": "s3cret", "FOO": "a=b"}
    rc, out, _ = await cli("deploy", "show", str(dep_id), config=cfg)
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.startswith(("model:", "argv:", "env")))
    assert lines["model:"] == "Qwen/Qwen3-8B"
    assert lines["argv:"].startswith("vllm serve Qwen/Qwen3-8B --served-model-name qwen")
    assert lines["env:"] == "API_KEY='***' FOO=a=b" and lines["env_names:"] == "API_KEY, FOO"
    assert "s3cret" not in out
    # set: --env replaces the whole env; a secret sent back as *** keeps its value
    rc, out, err = await cli("deploy", "set", str(dep_id), "--env", "API_KEY=***", "--env", "BAR=1",
                             "--model", "Qwen/Qwen3-4B", config=cfg)
    assert rc == 0, err
    dep = server.deployer.get(dep_id)
    assert (dict(dep.env), dep.model) == ({"API_KEY": "s3cret", "BAR": "1"}, "Qwen/Qwen3-4B")
    rc, out, err = await cli("deploy", "set", str(dep_id), "--no-env", "--engine", "sglang", config=cfg)
    assert rc == 0, err
    assert (server.deployer.get(dep_id).env, server.deployer.get(dep_id).engine) == ((), "sglang")
    # refused by the API (its message as it is) or as bad usage; nothing changed
    before = server.deployer.get(dep_id).as_dict()
    rc, _, err = await cli("deploy", "set", str(dep_id), "--volume", "/srv/models:/models:ro", config=cfg)
    assert rc == 1 and "volumes:" in err and "docker backend" in err and "invalid_field" in err
    rc, _, err = await cli("deploy", "set", str(dep_id), "--env", "CUDA_VISIBLE_DEVICES=1", config=cfg)
    assert rc == 1 and "env:" in err and "CUDA_VISIBLE_DEVICES" in err
    rc, _, err = await cli("deploy", "set", str(dep_id), "--env", "NOEQUALS", config=cfg)
    assert rc == 2 and "--env takes NAME=VALUE, not 'NOEQUALS'" in err
    rc, _, err = await cli("deploy", "set", str(dep_id), "--env", "A=1", "--no-env", config=cfg)
    assert rc == 2 and "exclude each other" in err
    # "²" and "³" pass str.isdigit() and int() refuses them: bad usage, not a traceback
    rc, _, err = await cli("deploy", "set", str(dep_id), "--max-inflight", "²", config=cfg)
    assert rc == 2 and "--max-inflight takes a whole number" in err and "Traceback" not in err
    rc, _, err = await cli("deploy", "set", str(dep_id), "--idle-timeout", "³", config=cfg)
    assert rc == 2 and "--idle-timeout takes whole seconds" in err and "Traceback" not in err
    rc, _, err = await cli("deploy", "set", str(dep_id), "--engine", "custom", config=cfg)
    assert rc == 1 and "model:" in err and "custom" in err
    assert server.deployer.get(dep_id).as_dict() == before
    rc, _, err = await cli("deploy", "add", "x", "--model", "m", "--env", "=v", "--dry-run", config=cfg)
    assert rc == 2 and "NAME=VALUE" in err
    rc, _, err = await cli("deploy", "add", "x", "--engine", "tgi", "--model", "m", config=cfg)
    assert rc == 2 and "tgi" in err  # not one of the engines (click's usage error)
    rc, _, err = await cli("deploy", "add", "x", "--model", "m", "--memory-gib", "24", "--dry-run", config=cfg)
    assert rc == 1 and "memory_gib:" in err and "at most 0.95" in err
    # back to a command as given
    rc, out, err = await cli("deploy", "set", str(dep_id), "--no-model", "--engine", "vllm",
                             "--command", " ".join(sim_command("QWEN")), config=cfg)
    assert rc == 0, err
    assert server.deployer.get(dep_id).model is None
    rc, out, _ = await cli("deploy", "show", str(dep_id), config=cfg)
    assert "argv:            ondemand sim-engine --port '{port}' --model QWEN" in out


async def test_keep_warm_commands(tmp_path, server):
    """deploy add/set --keep-warm, and deploy show's line: while nothing is learned it says it
    behaves as fixed; set while the engine runs (a live field)."""
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    sim = " ".join(sim_command("alpha"))
    rc, out, err = await cli("deploy", "add", "alpha", "--command", sim, "--memory-gib", "1", "--mode", "on_demand",
                             "--keep-warm", "adaptive", "--json", config=cfg)
    assert rc == 0, err
    a = json.loads(out)["id"]
    assert json.loads(out)["keep_warm"] == "adaptive" and json.loads(out)["adaptive"] is None
    rc, _, err = await cli("deploy", "add", "x", "--command", sim, "--keep-warm", "sometimes", config=cfg)
    assert rc == 2 and "sometimes" in err
    rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
    assert re.search(r"^keep_warm: +adaptive \(as fixed: too few idle gaps learned yet\)$", out, re.M), out
    await server.deployer.restart(a)
    rc, out, err = await cli("deploy", "set", str(a), "--keep-warm", "fixed", config=cfg)
    assert rc == 0 and out.strip() == f"updated alpha (id {a}, ready)", err
    rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
    assert re.search(r"^keep_warm: +fixed$", out, re.M), out


async def test_tiered_warmth_commands(tmp_path, server):
    # A fake /proc/meminfo: 48 of 64 GiB available, so a level-1 sleep keeps its level here.
    (tmp_path / "meminfo").write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {48 * 2**20} kB\n")
    server.deployer.budget.meminfo_path = str(tmp_path / "meminfo")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    sim = " ".join(sim_command("alpha", "--host-mib", "32"))
    rc, out, err = await cli("deploy", "add", "alpha", "--command", sim, "--memory-gib", "1", "--mode", "on_demand",
                             "--idle-action", "sleep", "--json", config=cfg)
    assert rc == 0, err
    a = json.loads(out)["id"]
    assert json.loads(out)["idle_action"] == "sleep"
    # refused: no sleep API (the server's message and code), an unknown action (click's usage error)
    rc, _, err = await cli("deploy", "add", "gemma", "--engine", "llamacpp", "--command", sim, "--idle-action",
                           "sleep", config=cfg)
    assert rc == 1 and err.startswith("ondemand: idle_action:") and "(invalid_field)" in err
    rc, _, err = await cli("deploy", "add", "x", "--command", sim, "--idle-action", "nap", config=cfg)
    assert rc == 2 and "nap" in err
    assert [d.name for d in server.deployer.all()] == ["alpha"]
    rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
    assert re.search(r"^idle_action: +sleep \(idle, it sleeps at level 1\)$", out, re.M), out
    rc, out, err = await cli("deploy", "set", str(a), "--idle-action", "stop", config=cfg)
    assert rc == 0 and out.strip() == f"updated alpha (id {a}, stopped)", err
    rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
    assert re.search(r"^idle_action: +stop \(idle, it is stopped\)$", out, re.M), out
    rc, _, err = await cli("deploy", "set", str(a), "--idle-action", "sleep", config=cfg)
    assert rc == 0, err
    # sleep at level 1, and the tier everywhere it is shown
    rc, out, err = await cli("deploy", "start", str(a), "--wait", config=cfg)
    assert rc == 0 and "ready" in out, err
    rc, _, err = await cli("deploy", "sleep", str(a), "--level", "3", config=cfg)
    assert rc == 2 and "--level" in err
    rc, out, err = await cli("deploy", "sleep", str(a), "--level", "1", config=cfg)
    assert rc == 0 and re.fullmatch(r"alpha: asleep \(level 1, \d+\.\d GiB host\)\n", out), (out, err)
    for args in (("status",), ("deploy", "list")):
        rc, out, _ = await cli(*args, config=cfg)
        (row,) = [line for line in out.splitlines() if line.startswith(f"{a} ")]
        assert re.search(r" asleep \(level 1, \d+\.\d GiB host\) ", row), out
    rc, out, _ = await cli("status", config=cfg)
    assert re.search(r"^host memory: 48\.0 GiB available of 64\.0 GiB; asleep engines hold \d+\.\d GiB; "
                     r"a level-1 sleep leaves 16 GiB$", out, re.M), out
    rc, out, _ = await cli("deploy", "show", str(a), config=cfg)
    assert re.search(r"^state: +asleep \(level 1, ", out, re.M)
    assert re.search(r"^sleep: +level 1; host memory \d+\.\d GiB, GPU memory kept -$", out, re.M), out
    rc, _, err = await cli("deploy", "sleep", str(a), config=cfg)  # asleep already
    assert rc == 1 and err.startswith("ondemand: ") and "(invalid_state)" in err
    rc, out, err = await cli("deploy", "wake", str(a), "--wait", config=cfg)
    assert rc == 0 and out == "alpha: ready\n", err
    rc, _, err = await cli("deploy", "wake", str(a), config=cfg)  # not asleep
    assert rc == 1 and "it is not asleep (invalid_state)" in err
    # level 2, asked; a wake without --wait answers at once
    rc, out, err = await cli("deploy", "sleep", str(a), "--level", "2", "--json", config=cfg)
    assert rc == 0 and (json.loads(out)["state"], json.loads(out)["sleep_level"]) == ("asleep", 2), err
    rc, out, err = await cli("deploy", "wake", str(a), config=cfg)
    assert rc == 0 and out in ("alpha: starting\n", "alpha: ready\n"), err
    await wait_for(lambda: server.state(a) == "ready", what="woken")
    # a wake that fails is started cold, and audited
    b = (await server.deployer.create(dict(name="beta", served_name="beta", engine="vllm", memory_gib=1,
                                           mode="on_demand", state="stopped", idle_action="sleep2",
                                           command=sim_command("beta", "--fail", "wake-fails")))).id
    await cli("deploy", "start", str(b), "--wait", config=cfg)
    rc, out, err = await cli("deploy", "sleep", str(b), config=cfg)
    assert rc == 0 and out.startswith("beta: asleep (level 2"), (out, err)
    rc, out, err = await cli("deploy", "wake", str(b), "--wait", config=cfg)
    assert rc == 0 and out == "beta: ready\n", err
    # the audit: newest first, time, action, actor, deployment and text
    rc, out, err = await cli("audit", config=cfg)
    assert rc == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["TIME", "ACTION", "ACTOR", "DEPLOYMENT", "TEXT"]
    assert re.match(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d +ondemand_wake_failed +ondemand +{b} \(beta\) +wake from "
                    r"sleep level 2 failed", rows[0]), out
    assert any(re.search(rf" deployment_update +admin \(socket\) +{a} \(alpha\) +edited idle_action", r)
               for r in rows), out
    rc, out, _ = await cli("audit", "--deployment", str(a), "-n", "1", "--json", config=cfg)
    (row,) = json.loads(out)
    assert (row["action"], row["deployment_id"], row["detail"]["new"]) == ("deployment_update", a,
                                                                           {"idle_action": "sleep"})
    rc, out, _ = await cli("audit", "--deployment", "99", config=cfg)
    assert rc == 0 and out == "no audit rows\n"
    rc, _, err = await cli("audit", "-n", "0", config=cfg)
    assert rc == 2

