"""ondemand/cli/status.py: ``status``, ``audit`` and ``doctor`` as an admin runs them (real
processes of ``python -m ondemand``, the real socket and state file, with and without a server),
and the lines ``status`` writes of the host's memory and of LiteLLM's names."""
import json
import re

from helpers import run_app, sim_command
from test_cli import cli, write_config

from ondemand.cli import status


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


def test_the_host_memory_line():
    hm = {"total_gib": 128.0, "available_gib": 100.25, "asleep_gib": 12.5, "reserve_gib": 16.0}
    assert status._host_memory_line(hm) == ("host memory: 100.2 GiB available of 128.0 GiB; asleep engines hold "
                                            "12.5 GiB; a level-1 sleep leaves 16 GiB")
    assert status._host_memory_line({"available_gib": None, "asleep_gib": None}) == (
        "host memory: unreadable; asleep engines hold 0.0 GiB; a level-1 sleep leaves 0 GiB")


def test_litellms_names_ready_ones_and_this_instance_marked(capsys):
    status._echo_names(None)
    assert capsys.readouterr().out == ""
    status._echo_names({"instance": "box1", "names": [
        {"name": "qwen", "ready": ["box2"], "entries": [{"instance": "box1", "this": True, "state": "asleep"},
                                                        {"instance": "box2", "this": False, "state": "ready"}]},
        {"name": "other", "ready": [], "entries": [{"instance": None, "this": False, "state": "unknown"}]}]})
    assert capsys.readouterr().out.splitlines() == [
        "", "LiteLLM names (* this instance, box1):", "NAME   READY ON  ENTRIES",
        "qwen   box2      box1* asleep, box2 ready", "other  none      (not ondemand) unknown"]
    status._echo_names({"error": "refused (litellm_unreachable)"})
    assert capsys.readouterr().out.splitlines() == ["", "LiteLLM names: unreadable: refused (litellm_unreachable)"]


async def test_audit_of_one_deployment_against_a_running_server_names_it(tmp_path, server):
    a, b = await server.add("alpha"), await server.add("beta")
    await server.deployer.edit(a, {"idle_action": "sleep2"}, user="socket")
    await server.deployer.edit(b, {"idle_action": "sleep2"}, user="socket")
    cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
    rc, out, err = await cli("audit", "--deployment", str(b), config=cfg)
    assert rc == 0, err
    rows = out.splitlines()[1:]
    assert len(rows) == 1 and re.search(rf" deployment_update +admin \(socket\) +{b} \(beta\) ", rows[0]), out
    rc, out, _ = await cli("audit", "-n", "1", "--json", config=cfg)
    assert [r["deployment_id"] for r in json.loads(out)] == [b]
    rc, _, err = await cli("audit", "-n", "0", config=cfg)
    assert rc == 2 and "limit" in err


async def test_audit_of_a_deployment_id_beyond_64_bits_is_a_usage_error(tmp_path):
    # Relayed as the server's 500, and without a server SQLite's OverflowError as a traceback.
    huge = "99999999999999999999999"
    async with run_app(tmp_path) as server:
        a = await server.add("alpha")
        await server.deployer.edit(a, {"idle_action": "sleep2"}, user="socket")
        cfg = write_config(tmp_path / "c.toml", server.cfg.state_dir)
        rc, _, err = await cli("audit", "--deployment", huge, config=cfg)
        assert rc == 2 and err.startswith("ondemand: --deployment takes a whole number") and err.count("\n") == 1, err
        rc, out, err = await cli("audit", "--deployment", "999999999999999999", config=cfg)
        assert rc == 0 and out == "no audit rows\n", err
    for value in (huge, "abc", "¹"):
        rc, _, err = await cli("audit", "--deployment", value, config=cfg)
        assert rc == 2 and "--deployment takes a whole number" in err and err.count("\n") == 1, (value, err)
    rc, out, err = await cli("audit", "--deployment", str(a), config=cfg)
    assert rc == 0 and "edited idle_action" in out, err
