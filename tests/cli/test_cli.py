"""The command line as an admin uses it: real processes, the real socket and state file: the
commands against a running server, key, migrate and serve. The deployment commands (add, set,
show, logs, warmth) are test_cli_deploy's; what every command shares, test_shared's; status,
audit and doctor, test_status's; how a view reads, test_views's. `cli` and `write_config` are
theirs too."""
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


async def test_serve_refuses_one_file_for_admin_token_and_ondemand_key(tmp_path):
    state = tmp_path / "s"
    cfg = write_config(tmp_path / "c.toml", state, admin_token_file=str(state / "ondemand.key"))
    rc, out, err = await asyncio.wait_for(cli("serve", config=cfg), 30)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "admin_token_file" in err and "ondemand_key_file" in err
    assert not (state / "ondemand.db").exists()  # stopped before it touched anything


@pytest.mark.parametrize("command", [["serve"], ["serve", "--demo"], ["migrate"]], ids=" ".join)
@pytest.mark.parametrize("under", [False, True], ids=["state_dir a file", "state_dir under a file"])
async def test_a_state_dir_that_is_a_file_is_one_line(tmp_path, command, under):
    """Not mkdir's FileExistsError or NotADirectoryError in a traceback: one line naming the file
    in the way, exit 1, as `key init` says it; the file is left as it was."""
    (tmp_path / "f").write_text("mine\n")
    state = tmp_path / "f" / "s" if under else tmp_path / "f"
    cfg = write_config(tmp_path / "c.toml", state)
    rc, out, err = await asyncio.wait_for(cli(*command, config=cfg), 30)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{tmp_path / 'f'} is a file" in err and str(state) in err
    assert (tmp_path / "f").read_text() == "mine\n"


async def test_an_admin_token_file_under_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("mine\n")
    cfg = write_config(tmp_path / "c.toml", tmp_path / "s", admin_token_file=str(tmp_path / "f" / "admin.token"))
    rc, out, err = await asyncio.wait_for(cli("serve", config=cfg), 30)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "admin_token_file" in err and f"{tmp_path / 'f'} is a file" in err


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
    assert "scheduler: seed, aiming at a wait of at most 5 s for a model" in out.splitlines()
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


def test_a_lock_whose_pid_cannot_be_written_is_let_go(tmp_path, monkeypatch):
    """A disk that takes no write fails the start at the lock's pid, and leaves no descriptor
    holding the lock: the next start (the disk freed) takes it."""
    import errno

    from ondemand.state.lock import lock_state_dir
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        lock_state_dir(tmp_path / "s")
    assert len(os.listdir("/proc/self/fd")) == before
    monkeypatch.setattr(os, "pwrite", real)
    fd = lock_state_dir(tmp_path / "s")
    os.close(fd)


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
