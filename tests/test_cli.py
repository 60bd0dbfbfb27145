"""The command line as an admin uses it: real processes, the real socket and state file."""
import asyncio
import json
import os
import re
import stat
import sys

import pytest
from helpers import ROOT, run_app, sim_command, wait_for


async def cli(*args, config=None, env=None):
    argv = [sys.executable, "-m", "ondemand"] + (["--config", str(config)] if config else []) + list(args)
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}, **(env or {})})
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:  # a wait_for ran out: leave no process behind
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


def write_config(path, state_dir, **extra):
    settings = {"state_dir": str(state_dir), "listen": "127.0.0.1:0", "ondemand_allowed_cidrs": ["127.0.0.0/8"],
                "min_idle_timeout_s": 1, **extra}
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines += ["[budget]", 'source = "static"', "capacity_gib = 24", "[deployer]", 'backend = "process"']
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_key_init_show_rotate(tmp_path):
    cfg = write_config(tmp_path / "c.toml", tmp_path / "s")
    rc, out, err = await cli("key", "show", config=cfg)
    assert rc == 1 and "key init" in err
    rc, out, _ = await cli("key", "init", config=cfg)
    assert rc == 0
    key_file = tmp_path / "s" / "ondemand.key"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert key not in out
    rc, out, _ = await cli("key", "show", config=cfg)
    assert rc == 0 and re.fullmatch(r"[0-9a-f]{12}\n", out)
    rc, _, err = await cli("key", "init", config=cfg)
    assert rc == 1 and "rotate" in err
    rc, out, _ = await cli("key", "rotate", "--json", config=cfg)
    assert rc == 0 and json.loads(out)["fingerprint"] != out
    assert key_file.read_text().strip() != key


@pytest.mark.parametrize("text, key", [("bogus = 1\n", "bogus"),
                                       ("ondemand_queue_timeout_s = -1\n", "ondemand_queue_timeout_s")])
async def test_bad_config_names_the_key(tmp_path, text, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    rc, out, err = await cli("migrate", config=cfg)
    assert rc == 2 and key in err and len(err.strip().splitlines()) == 1


async def test_bad_environment_names_the_key(tmp_path):
    rc, _, err = await cli("migrate", env={"ONDEMAND_ONDEMAND_MAX_QUEUED": "0",
                                           "ONDEMAND_STATE_DIR": str(tmp_path)})
    assert rc == 2 and "ondemand_max_queued" in err


async def test_serve_refuses_one_file_for_admin_token_and_ondemand_key(tmp_path):
    state = tmp_path / "s"
    cfg = write_config(tmp_path / "c.toml", state, admin_token_file=str(state / "ondemand.key"))
    rc, out, err = await asyncio.wait_for(cli("serve", config=cfg), 30)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "admin_token_file" in err and "ondemand_key_file" in err
    assert not (state / "ondemand.db").exists()  # stopped before it touched anything


async def test_migrate(tmp_path):
    cfg = write_config(tmp_path / "c.toml", tmp_path / "s")
    rc, out, _ = await cli("migrate", "--json", config=cfg)
    assert rc == 0 and json.loads(out)["schema_version"] >= 2


async def test_commands_against_a_running_server(tmp_path, server):
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("deploy", "add", "alpha", "--command", " ".join(sim_command("alpha")),
                             "--memory-gib", "8", "--mode", "on_demand", "--json", config=cfg)
    assert rc == 0, err
    dep = json.loads(out)
    assert (dep["mode"], dep["state"]) == ("on_demand", "stopped")
    rc, _, err = await cli("deploy", "add", "Bad Name", "--command", "x", config=cfg)
    assert rc == 1 and "name:" in err
    rc, out, _ = await cli("deploy", "list", config=cfg)
    assert "alpha" in out and "on_demand" in out and "sleeping" in out
    rc, out, _ = await cli("deploy", "start", str(dep["id"]), "--wait", config=cfg)
    assert rc == 0 and "ready" in out
    rc, out, _ = await cli("status", config=cfg)
    assert rc == 0 and "budget: 16 GiB free of 24 GiB" in out
    header = [l for l in out.splitlines() if l.startswith("ID")][0]
    for col in ("NAME", "MODE", "STATE", "PHASE", "IN-FLIGHT", "QUEUED", "LAST REQUEST", "MEMORY"):
        assert col in header
    rc, out, _ = await cli("mode", "get", str(dep["id"]), config=cfg)
    assert out.strip() == "on_demand"
    rc, out, _ = await cli("mode", "set", str(dep["id"]), "on_demand", "--idle-timeout", "120", config=cfg)
    assert rc == 0
    rc, out, _ = await cli("mode", "get", str(dep["id"]), "--json", config=cfg)
    assert json.loads(out)["idle_timeout_s"] == 120
    rc, _, err = await cli("mode", "set", str(dep["id"]), "on_demand", "--idle-timeout", "5000000", config=cfg)
    assert rc == 1 and "idle_timeout_s" in err
    rc, out, _ = await cli("deploy", "show", str(dep["id"]), config=cfg)
    assert "base_url:" in out and "phase idle" in out
    rc, out, _ = await cli("deploy", "stop", str(dep["id"]), config=cfg)
    assert rc == 0 and "stopped" in out
    rc, _, err = await cli("sync", config=cfg)
    assert rc == 1 and "litellm_disabled" in err
    rc, out, _ = await cli("doctor", "--json", config=cfg)
    checks = {c["check"]: c for c in json.loads(out)}
    assert checks["key"]["ok"] and checks["server"]["ok"] and checks["budget"]["ok"]
    rc, out, _ = await cli("deploy", "rm", str(dep["id"]), config=cfg)
    assert rc == 0
    rc, _, err = await cli("deploy", "show", str(dep["id"]), config=cfg)
    assert rc == 1


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
        rc, _, err = await cli("deploy", "add", "x", "--command", "x", "--priority", "urgent", config=cfg)
        assert rc == 2 and "urgent" in err  # click's own choice check
        await server.deployer.restart(view["id"])
        rc, out, err = await cli("deploy", "set", str(view["id"]), "--priority", "low", "--max-inflight", "none",
                                 "--json", config=cfg)  # while it runs: these two need no stop
        assert rc == 0, err
        assert (json.loads(out)["priority"], json.loads(out)["max_inflight"], json.loads(out)["state"]) == \
            ("low", None, "ready")
        rc, out, _ = await cli("deploy", "set", str(view["id"]), "--max-inflight", "2", config=cfg)
        assert rc == 0
        rc, out, _ = await cli("status", config=cfg)
        header, row = [line for line in out.splitlines() if line.startswith(("ID", str(view["id"]) + " "))]
        assert "PRIORITY" in header and " low " in row and " 0/2 " in row
        rc, out, _ = await cli("deploy", "show", str(view["id"]), config=cfg)
        assert re.search(r"^priority: +low$", out, re.M) and re.search(r"^max_inflight: +2$", out, re.M)


async def test_read_only_commands_without_a_server(tmp_path):
    async with run_app(tmp_path) as server:
        await server.add("alpha")
        await server.deployer.update(1, env={"HF_X_TOKEN": "s3cret", "A": "1"}, model="Qwen/Qwen3-8B")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, _ = await cli("status", config=cfg)
    assert rc == 0 and "no server runs" in out and "alpha" in out
    for args in (("deploy", "show", "1"), ("deploy", "show", "1", "--json"), ("deploy", "list", "--json")):
        rc, out, _ = await cli(*args, config=cfg)
        assert rc == 0 and "s3cret" not in out and "HF_X_TOKEN" in out  # masked as a view masks it
    rc, out, _ = await cli("deploy", "show", "1", config=cfg)
    assert "argv:            - (derived by the running server" in out and "model:           Qwen/Qwen3-8B" in out
    rc, out, _ = await cli("deploy", "list", "--json", config=cfg)
    assert json.loads(out)[0]["name"] == "alpha"
    rc, _, err = await cli("deploy", "start", "1", config=cfg)
    assert rc == 3 and "ondemand serve" in err
    rc, _, err = await cli("deploy", "set", "1", "--memory-gib", "4", config=cfg)
    assert rc == 3 and "ondemand serve" in err  # a change goes through the server, like start
    rc, out, _ = await cli("doctor", config=cfg)
    assert rc == 0 and "no server runs" in out


async def test_second_serve_on_the_same_state_dir_refuses_and_touches_nothing(tmp_path):
    # A second `serve` (another terminal, an overlapping restart) must not adopt
    # or kill the engines of the running one, busy or not, nor take its socket.
    import aiohttp
    async with run_app(tmp_path) as server:
        a = await server.add("a", 10, "--token-delay", "0.05", "--tokens", "60")
        await server.deployer.restart(a)
        engine_url = server.deployer.base_url(a)
        cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
        async with aiohttp.ClientSession() as http, \
                http.post(server.gw(a, "chat/completions"), headers=server.auth(),
                          json={"model": "A", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # mid-stream
            for args in (("serve",), ("serve", "--demo")):
                rc, out, err = await asyncio.wait_for(cli(*args, config=cfg), 30)
                assert rc == 1, (out, err)
                assert f"another ondemand (pid {os.getpid()}) is running" in err and len(err.strip().splitlines()) == 1
            body = await r.read()  # the stream went on to its end
        assert body.rstrip().endswith(b"data: [DONE]")
        assert server.state(a) == "ready" and server.deployer.base_url(a) == engine_url
        assert server.cfg.admin_socket.exists()
        assert [d["name"] for d in await server.deployer.store.deployments()] == ["a"]  # no demo rows
    # Once the first one stopped, the state directory is free again (this
    # serve gets past the lock and stops at a listen address that is taken).
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir, listen=f"127.0.0.1:{taken.getsockname()[1]}")
        rc, out, err = await asyncio.wait_for(cli("serve", "--demo", config=cfg), 30)
    assert rc == 1 and "another ondemand" not in err and "cannot listen" in err, err


async def test_serve_demo_answers_and_stops_on_sigint(tmp_path):
    import aiohttp
    from helpers import free_port
    port = free_port()
    cfg = write_config(tmp_path / "c.toml", tmp_path / "s", listen=f"127.0.0.1:{port}", shutdown_grace_s=2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ondemand", "--config", str(cfg), "serve", "--demo", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as s:
            async def models():
                assert proc.returncode is None, (await proc.stderr.read(4000)).decode()
                try:
                    key = (tmp_path / "s" / "ondemand.key").read_text().strip()
                    async with s.get(f"http://127.0.0.1:{port}/dgxmm/ondemand/1/v1/models",
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                        return await r.json()
                except (OSError, aiohttp.ClientError):
                    return None  # not listening yet
            body = await wait_for(models, what="`ondemand serve --demo` answering")
            assert body["data"][0]["id"] == "demo-small"
        proc.send_signal(2)  # Ctrl-C
        await asyncio.wait_for(proc.wait(), 15)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_doctor_flags_llamacpp_without_metrics(tmp_path, server):
    await server.deployer.create(dict(name="blind", served_name="b", engine="llamacpp", mode="on_demand",
                                      state="stopped", role="model", command=["llama-server", "--port", "{port}"]))
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, _ = await cli("doctor", "--json", config=cfg)
    checks = {c["check"]: c for c in json.loads(out)}
    assert rc == 1 and checks["engines"]["ok"] is False and "blind" in checks["engines"]["detail"]


async def test_doctor_flags_open_files_and_a_footprint_over_its_declared_size(tmp_path, server):
    import stat
    assert stat.S_IMODE(server.cfg.state_dir.stat().st_mode) == 0o700  # serve made it private
    dep = await server.deployer.create(dict(name="liar", served_name="l", engine="vllm", mode="on_demand",
                                            state="stopped", role="model", memory_gib=20,
                                            command=sim_command("l")))
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, _ = await cli("doctor", "--json", config=cfg)
    checks = {c["check"]: c for c in json.loads(out)}
    assert checks["files"]["ok"] and "footprints" not in checks
    await server.deployer.update(dep.id, measured_gib=30.0)
    server.cfg.token_file.chmod(0o644)
    rc, out, _ = await cli("doctor", "--json", config=cfg)
    checks = {c["check"]: c for c in json.loads(out)}
    assert rc == 1 and checks["files"]["ok"] is False and "admin.token is mode 644" in checks["files"]["detail"]
    assert checks["footprints"]["ok"] is False and "liar (declared 20 GiB, measured 30.0)" in checks["footprints"]["detail"]
    rc, out, _ = await cli("status", config=cfg)
    assert "20 GiB (measured 30.0 !)" in out and "liar: measured more than 10 % over" in out


async def test_adding_or_switching_llamacpp_without_metrics_warns(tmp_path, server):
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("deploy", "add", "blind", "--engine", "llamacpp", "--mode", "on_demand",
                             "--command", "llama-server --port {port}", config=cfg)
    assert rc == 0 and "created blind" in out
    assert err.startswith("warning: blind: llama.cpp without --metrics") and "never put to sleep" in err
    rc, out, err = await cli("deploy", "add", "seen", "--engine", "llamacpp", "--mode", "on_demand",
                             "--command", "llama-server --metrics --port {port}", config=cfg)
    assert rc == 0 and err == ""
    rc, out, err = await cli("deploy", "add", "later", "--engine", "llamacpp", "--no-start",
                             "--command", "llama-server --port {port}", config=cfg)
    assert rc == 0 and err == ""  # always on: nothing to put to sleep
    later = server.deployer.all()[-1].id
    rc, out, err = await cli("mode", "set", str(later), "on_demand", config=cfg)
    assert rc == 0 and "warning: later:" in err


def test_every_command_says_what_it_does():
    import click

    from ondemand.cli import cli as root

    def walk(cmd, path):
        assert cmd.help or cmd.short_help, f"`{path} --help` has no description"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
    walk(root, "ondemand")
    assert isinstance(root, click.Group) and len(root.commands) >= 8


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
    assert re.search(r"^keep_warm: +adaptive \(as fixed: no pattern in its idle gaps yet\)$", out, re.M), out
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


async def test_audit_without_a_server(tmp_path):
    async with run_app(tmp_path) as server:
        a = await server.add("alpha")
        await server.deployer.edit(a, {"idle_action": "sleep2"}, user="socket")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("audit", config=cfg)
    assert rc == 0, err
    assert re.search(rf" deployment_update +admin \(socket\) +{a} \(alpha\) +edited idle_action$", out, re.M), out
    rc, out, _ = await cli("audit", "--json", config=cfg)
    assert [r["action"] for r in json.loads(out)] == ["deployment_update"]
    rc, _, err = await cli("audit", config=write_config(tmp_path / "d.toml", tmp_path / "empty"))
    assert rc == 3 and "no state file" in err
