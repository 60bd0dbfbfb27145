"""The web page in a real browser (Debian's chromium driven by playwright-core):
the token prompt, live rows from the event stream, and a start from the page."""
import asyncio
import json
import os
import shutil

import pytest
from helpers import ROOT, sim_command

pytestmark = pytest.mark.browser
NODE_PATH = os.environ.get("BROWSER_NODE_PATH") or os.path.expanduser("~/.cache/ondemand/browser/node_modules")


@pytest.fixture
def browser_ready():
    if not (shutil.which("node") and os.path.exists("/usr/bin/chromium")
            and os.path.isdir(os.path.join(NODE_PATH, "playwright-core"))):
        if os.environ.get("BROWSER_NODE_PATH"):
            pytest.fail(f"BROWSER_NODE_PATH={NODE_PATH} is set but node, chromium or playwright-core is missing")
        pytest.skip("no browser: run `make test-browser` (scripts/heavy/browser.sh installs chromium and playwright-core)")


async def test_page_shows_live_deployments_and_starts_one(tmp_path, browser_ready, server):
    await server.deployer.create(dict(name="alpha", served_name="alpha", engine="vllm", memory_gib=8,
                                      mode="on_demand", state="stopped", role="model",
                                      command=sim_command("alpha", "--startup-delay", "0.5")))
    shot = tmp_path / "ui.png"
    proc = await asyncio.create_subprocess_exec(
        "node", str(ROOT / "tests" / "clients" / "ui_check.js"), f"{server.url}/ui/", server.token, "alpha",
        str(shot), env={**os.environ, "NODE_PATH": NODE_PATH},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["asked_for_token"] and result["errors"] == []
    before = [r for r in result["before"] if r[0] == "alpha"][0]
    assert before[2] == "on_demand" and before[3] == "stopped" and before[4] == "sleeping"
    after = [r for r in result["after"] if r[0] == "alpha"][0]
    assert after[3] == "ready" and after[4] == "idle"
    assert "16 of 24 GiB free (static)" in result["host"] and "process backend" in result["host"]
    assert shot.stat().st_size > 1000
