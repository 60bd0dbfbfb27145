"""The README's demo, run as printed: `make run`, then its shell block in a
second terminal. The issue's check is that a newcomer can copy and paste it."""
import asyncio
import os
import re
import socket

import orjson
import pytest
from helpers import ROOT, wait_for

pytestmark = pytest.mark.slow

RUN = [".venv/bin/python", "-m", "ondemand", "--config", "packaging/demo.toml", "serve", "--demo"]


def readme_demo_block() -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index("`make run` starts ondemand"):]
    return re.search(r"```sh\n(.*?)```", after, re.S).group(1)


def test_make_run_is_the_command_this_test_runs():
    recipe = re.search(r"^run: install\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.split() == ["$(PY)"] + RUN[1:]


async def test_readme_demo_as_printed(tmp_path):
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8090)) == 0:
            pytest.fail("port 8090 is taken: the README's demo needs it")
    # A fresh working directory that looks like the clone: the state is made here.
    for name in (".venv", "packaging"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_")}
    server = await asyncio.create_subprocess_exec(
        *[str(ROOT / RUN[0])] + RUN[1:], cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async def listening():
            assert server.returncode is None, (await server.stderr.read()).decode()
            return (tmp_path / "state/demo/admin.sock").exists()
        await wait_for(listening, timeout=20, what="the demo's admin socket")
        shell = await asyncio.create_subprocess_exec(
            "bash", "-c", readme_demo_block(), cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(shell.communicate(), 180)
        out = out.decode()
        assert shell.returncode == 0, (out, err.decode())
    finally:
        server.send_signal(2)  # Ctrl-C, as the README says
        try:
            await asyncio.wait_for(server.wait(), 30)
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    assert server.returncode == 0

    lines = out.splitlines()
    # 1. The cold start answered (one line of JSON).
    answer = orjson.loads(lines[0])
    assert answer["object"] == "chat.completion" and answer["model"] == "demo-small"
    # 2. The stream began with the queued notice and ended with demo-large's tokens.
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert orjson.loads(events[0])["id"] == "ondemand-queued"
    assert events[-1] == "[DONE]"
    assert any(orjson.loads(e).get("model") == "demo-large" for e in events[1:-1])
    # 3 and 4. Two status tables: demo-small asleep and demo-large up, then both asleep.
    tables, rows = [], None
    for line in lines:
        if line.startswith("ID "):
            rows = {}
            tables.append(rows)
        elif rows is not None and line[:1].isdigit():
            cols = line.split()
            rows[cols[1]] = (cols[5], cols[6:8])  # state, then the tier (after mode and priority)
        else:
            rows = None
    assert len(tables) == 2, out
    assert tables[0]["demo-small"] == ("asleep", ["(level", "1,"]) and tables[0]["demo-large"][0] == "ready"
    assert {name: row[:2] for name, row in tables[1].items()} == {
        "demo-small": ("asleep", ["(level", "1,"]), "demo-large": ("asleep", ["(level", "1,"])}, out
    # 5. The wake: the same engine, in well under its 5 s cold start.
    woken = next(line for line in lines if line.startswith("woken and answered in "))
    assert float(woken.split()[-2]) < 3, woken
    # The audit over the socket (the last line): two starts, two sleeps and a wake, by ondemand.
    audit = orjson.loads(lines[-1])
    actions = [(a["action"], a["text"]) for a in audit if a["actor"] == "ondemand" and a["user"] is None]
    assert sorted(a for a, _ in actions) == ["ondemand_sleep"] * 2 + ["ondemand_start"] * 3, audit
    assert ("ondemand_start", "Woken for a request") in actions
