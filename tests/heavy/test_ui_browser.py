"""The web page in a real browser (Debian's chromium driven by playwright-core), against a
real ``ondemand`` (process backend, engine simulators) on an 8-GPU box (the fake
nvidia-smi): the token prompt, a cold start followed live, a mode switch, adding and
removing a deployment, an API error in words, following a start's log, a failed start's
reason, and a server restart under the page. It ends with the screenshot the README
shows (docs/ui.png), kept current by this test."""
import asyncio
import json
import os
import pathlib
import shutil

import aiohttp
import pytest
from helpers import ROOT, free_port, run_app, sim_command

pytestmark = pytest.mark.browser
NODE_PATH = os.environ.get("BROWSER_NODE_PATH") or os.path.expanduser("~/.cache/ondemand/browser/node_modules")
FAKE = str(ROOT / "tests" / "fakes" / "nvidia-smi")
SCREENSHOT = ROOT / "docs" / "ui.png"
GIB_MIB = 1024


@pytest.fixture
def browser_ready():
    if not (shutil.which("node") and os.path.exists("/usr/bin/chromium")
            and os.path.isdir(os.path.join(NODE_PATH, "playwright-core"))):
        if os.environ.get("BROWSER_NODE_PATH"):
            pytest.fail(f"BROWSER_NODE_PATH={NODE_PATH} is set but node, chromium or playwright-core is missing")
        pytest.skip("no browser: run `make test-browser` (scripts/heavy/browser.sh installs chromium and playwright-core)")


async def page_script(tmp_path: pathlib.Path, name: str, source: str, server, timeout: float = 120) -> dict:
    """A playwright script run against the page (its URL and the admin token as arguments):
    its last line of output, as JSON."""
    script = tmp_path / name
    script.write_text(source)
    proc = await asyncio.create_subprocess_exec(
        "node", str(script), f"{server.url}/ui/", server.token, env={**os.environ, "NODE_PATH": NODE_PATH},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail("the page script did not finish")
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def sim(model: str, gib: float, gpus: int = 1, *extra: str) -> list[str]:
    return sim_command(model, "--gpu-mib", str(int(gib * GIB_MIB / max(gpus, 1))), *extra)


def dep(name: str, gib: float, *extra: str, mode: str = "on_demand", state: str = "stopped", gpus: int = 1,
        **kw) -> dict:
    return dict(name=name, served_name=name.upper(), engine="vllm", memory_gib=gib, mode=mode, state=state,
                role="model", gpu_count=gpus, command=sim(name.upper(), gib, gpus, *extra), **kw)


async def test_the_page_does_what_an_admin_does(tmp_path, browser_ready, fake_nvidia_smi):
    fake_nvidia_smi(*(f"{80 * GIB_MIB}, {12 * GIB_MIB if i == 7 else 0}" for i in range(8)))  # GPU 7: another process
    settings = {"listen": f"127.0.0.1:{free_port()}", "budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE,
                "budget.capacity_gib": "", "metrics_interval_s": 0.5, "ondemand_idle_timeout_s": 600,
                "reap_interval_s": 5}
    shot = tmp_path / "ui.png"
    errors = (tmp_path / "page-script.err").open("wb")  # a file: a cut-off read loses nothing
    async with run_app(tmp_path, **settings) as server:
        create = server.deployer.create
        alpha = (await create(dep("alpha", 20, "--startup-delay", "1.5"))).id
        await create(dep("slow", 10, "--startup-delay", "3"))
        await create(dep("broken", 4, "--fail", "exit-at-start"))
        # A start history, so the page can say when alpha is expected to be ready.
        await server.deployer.restart(alpha)
        await server.deployer.stop(alpha)
        proc = await asyncio.create_subprocess_exec(
            "node", str(ROOT / "tests" / "clients" / "ui_check.js"), f"{server.url}/ui/", server.token, str(shot),
            env={**os.environ, "NODE_PATH": NODE_PATH}, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=errors)
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if line.strip() != b"RESTART":
            proc.kill()
            await proc.wait()
            pytest.fail(f"the page script stopped early: {line!r}\n{_tail(tmp_path)}")
    # The server is down (its engines stopped); the same state and port come back.
    async with run_app(tmp_path, **settings) as server:
        # The page's edit sent the masked secret back: it kept its value.
        (recipe,) = [d for d in server.deployer.all() if d.name == "recipe"]
        assert (recipe.model, dict(recipe.env)) == ("Qwen/Qwen3-8B", {"FOO": "c", "HF_X_TOKEN": "s3cret"})
        create = server.deployer.create
        await create(dep("late", 8))
        big = (await create(dep("big", 120, gpus=2, mode="always_on"))).id
        pinned = (await create(dep("pinned", 30, gpu_ids=[3], mode="always_on"))).id
        for d in (big, pinned):
            await server.deployer.restart(d)
        await create(dep("planned", 40, state="planned"))
        broken = [d.id for d in server.deployer.all() if d.name == "broken"][0]
        async with aiohttp.ClientSession() as http:  # a request starts it: its failure sets a backoff
            async with http.post(server.gw(broken, "chat/completions"), headers=server.auth(),
                                 json={"model": "BROKEN", "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "start_failed"
        warming = (await create(dep("warming", 60, "--startup-delay", "60"))).id
        await server.deployer.admit_start(warming)  # starts one at a time: after broken's
        proc.stdin.write(b"GO\n")
        await proc.stdin.drain()
        proc.stdin.close()
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"the page script did not finish after the restart:\n{_tail(tmp_path)}")
    assert proc.returncode == 0, _tail(tmp_path)
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert result["errors"] == [], result  # no script error
    # The console has only the network's own lines: the refused token (401), the name taken
    # (409), the favicon (404), and the server gone during its restart.
    assert all(line.startswith("Failed to load resource") for line in result["console"]), result["console"]
    # The token: a wrong one is refused and shows nothing; the right one never goes in the URL.
    assert result["wrong_token"]["main_hidden"] and "not the admin token" in result["wrong_token"]["error"]
    assert result["token_in_url"] is False
    cold = result["cold"]
    assert cold["before"]["state"] == "stopped" and cold["starting"]["state"] == "starting"
    assert "expected in about" in cold["starting"]["detail"], cold
    assert cold["after"]["state"] == "ready"
    assert result["mode"]["mode"].startswith("always on")
    assert result["add_default_mode"] == "always_on"  # no LiteLLM here: the wizard's default
    assert result["added"]["state"] == "stopped" and result["removed"]
    recipe = result["recipe"]  # a recipe's command line and environment, the secret masked
    assert recipe["argv"] == ("vllm serve Qwen/Qwen3-8B --served-model-name recipe --host 127.0.0.1 --port {port} "
                              "--gpu-memory-utilization 0.20 --enable-sleep-mode --max-model-len 4096")
    assert "HF_X_TOKEN=***" in recipe["info"] and "FOO=a=b" in recipe["info"] and "VLLM_SERVER_DEV_MODE" in recipe["info"]
    assert recipe["env_form"] == "FOO=a=b\nHF_X_TOKEN=***" and "1 wanted" in recipe["gpus"]  # one GPU by default
    assert "FOO=c" in recipe["after"] and "HF_X_TOKEN=***" in recipe["after"]
    assert "s3cret" not in json.dumps(result)
    assert "name_taken" in result["api_error"] and "alpha" in result["api_error"]
    assert "loaded: application startup complete" in result["log"]["text"]
    assert "exited with code 3" in result["failed"]["detail"]
    after = result["after_restart"]
    assert after["alpha"]["state"] == "ready" and "gamma" not in after["names"] and after["late"]
    assert "exited with code 3" in after["broken"]["detail"] and "new starts refused for" in after["broken"]["detail"]
    gpus = result["gpus"]
    assert len(gpus) == 8 and "held by big" in gpus[0] + gpus[1] and "held by pinned" in gpus[3]
    assert "ondemand_mode" in result["audit"] and "ondemand_start" in result["audit"]  # newest first, live
    assert result["keyboard"] == {"opened": True, "closed": True}
    assert result["phone"]["width"] <= result["phone"]["screen"], result["phone"]  # no sideways scrolling
    assert result["phone"]["info"]["width"] <= result["phone"]["info"]["room"], result["phone"]
    assert shot.stat().st_size > 10000
    SCREENSHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT)  # the README's picture, kept current


def _tail(tmp_path: pathlib.Path) -> str:
    return (tmp_path / "page-script.err").read_text(errors="replace")[-3000:]


def test_the_readme_shows_the_pages_picture():
    readme = (ROOT / "README.md").read_text()
    assert "docs/ui.png" in readme and (ROOT / "docs" / "ui.png").exists()
    assert pathlib.Path(SCREENSHOT).stat().st_size > 10000


# Tiered warmth on the page: its own short script (the main one above is long enough).
WARMTH_SCRIPT = r"""
const { chromium } = require("playwright-core");
const row = (name) => `#rows tr[data-name="${name}"]`;
const seen = (page, name) => page.$eval(row(name), (tr) => ({
  state: tr.dataset.state, badge: tr.querySelector(".badge").textContent,
  detail: tr.querySelector(".state .detail").textContent, mode: tr.querySelector(".mode").textContent }));
(async () => {
  const [url, token] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"] });
  const out = { errors: [], posts: [] };
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    page.on("pageerror", (e) => out.errors.push(String(e)));
    page.on("request", (r) => { if (r.method() === "POST" && /\/(sleep|wake)$/.test(r.url()))
      out.posts.push({ path: new URL(r.url()).pathname.split("/").slice(-2).join("/"), body: r.postData() }); });
    await page.goto(url);
    await page.waitForSelector("#login:not([hidden])", { timeout: 10000 });
    await page.fill("#token", token);
    await page.click("#login button[type=submit]");
    await page.waitForSelector(row("dozy"), { timeout: 10000 });
    out.dozy = await seen(page, "dozy");
    // The host bar beside the GPUs' (it needs the host's reading and the views).
    await page.waitForFunction(() => document.querySelector("#gpus .hostmem .seg.asleep"), null, { timeout: 10000 });
    out.host = await page.$eval("#gpus .hostmem", (d) => ({
      aria: d.querySelector(".track").getAttribute("aria-label"), label: d.querySelector(".label").textContent,
      who: d.querySelector(".who").textContent, reserve: !!d.querySelector(".track .reserve"),
      asleep: [...d.querySelectorAll(".seg.asleep")].map((s) => s.title) }));
    out.gpu_bars = await page.$$eval("#gpus .gpu", (gs) => gs.length);
    out.gpu_asleep = await page.$$eval("#gpus .gpu .seg.asleep", (ss) => ss.map((s) => s.title));
    // Sleep nappy from its button, at level 2.
    await page.click(`${row("nappy")} button[aria-label="Sleep nappy"]`);
    await page.waitForFunction(() => document.getElementById("sleep").open, null, { timeout: 5000 });
    out.dialog = { level: await page.$eval("#s-level", (s) => s.value), note: await page.textContent("#sleep-note") };
    await page.selectOption("#s-level", "2");
    await page.click("#sleep-save");
    await page.waitForFunction((sel) => { const tr = document.querySelector(sel);
      return tr && tr.dataset.state === "asleep" && tr.querySelector(".badge").textContent.includes("level 2"); },
      row("nappy"), { timeout: 15000 });
    // The row follows the mark to asleep (the event stream); the dialog closes once the POST answers.
    out.dialog.closed = await page.waitForFunction(() => !document.getElementById("sleep").open, null,
                                                   { timeout: 15000 }).then(() => true, () => false);
    out.nappy = await seen(page, "nappy");
    // SGLang's level is its start flags': the dialog offers that one only.
    await page.click(`${row("sgl")} button[aria-label="Sleep sgl"]`);
    await page.waitForFunction(() => document.getElementById("sleep").open, null, { timeout: 5000 });
    out.sglang = await page.$eval("#s-level", (s) => ({ level: s.value,
      disabled: [...s.options].filter((o) => o.disabled).map((o) => o.value) }));
    await page.click("#sleep-cancel");
    // Wake dozy from its button.
    await page.click(`${row("dozy")} button[aria-label="Wake dozy"]`);
    await page.waitForFunction((sel) => document.querySelector(sel).dataset.state === "ready", row("dozy"),
                               { timeout: 15000 });
    out.woken = await seen(page, "dozy");
    await page.click(`${row("dozy")} button[aria-label="Details dozy"]`);
    out.info = await page.textContent("#info-list");
    await page.keyboard.press("Escape");
    // A new deployment's idle action, from the form, and back in the edit form.
    await page.click("#add");
    await page.fill("#f-name", "deep");
    await page.fill("#f-command", "ondemand sim-engine --port {port} --model DEEP");
    await page.selectOption("#f-mode", "on_demand");
    await page.selectOption("#f-idle-action", "sleep2");
    await page.click("#edit-save");
    await page.waitForSelector(row("deep"), { timeout: 5000 });
    out.deep = await seen(page, "deep");
    await page.click(`${row("deep")} button[aria-label="Edit deep"]`);
    out.deep.form = await page.$eval("#f-idle-action", (s) => s.value);
    await page.click("#edit-cancel");
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


async def test_the_page_shows_sleep_tiers_and_host_memory(tmp_path, browser_ready, fake_nvidia_smi):
    """An asleep deployment shows its level and host memory, the host-memory bar renders beside
    the GPUs' (the asleep engines' share, the reserve marked), the Sleep button asks for a level
    and level 2 is what the row then says, and Wake wakes."""
    fake_nvidia_smi(*(f"{80 * GIB_MIB}, 0" for _ in range(2)))
    settings = {"budget.source": "nvidia-smi", "budget.nvidia_smi": FAKE, "budget.capacity_gib": "",
                "budget.host_reserve_gib": 0.5, "metrics_interval_s": 0.5, "ondemand_idle_timeout_s": 600,
                "reap_interval_s": 3600}
    async with run_app(tmp_path, **settings) as server:
        deployer = server.deployer
        dozy = (await deployer.create(dep("dozy", 2, "--host-mib", "64", "--sleep-gpu-mib", "512",
                                          idle_action="sleep"))).id
        nappy = (await deployer.create(dep("nappy", 2, idle_action="sleep"))).id
        sgl = (await deployer.create({**dep("sgl", 1, "--flavor", "sglang", idle_action="sleep"),
                                      "engine": "sglang"})).id
        for d in (dozy, nappy, sgl):
            await deployer.restart(d)
        assert await deployer.sleep(dozy, 1) == 1
        host_gib = deployer.get(dozy).host_gib
        assert host_gib and host_gib > 0.06  # the simulator's 64 MiB of weights, and the process
        result = await page_script(tmp_path, "warmth_ui.js", WARMTH_SCRIPT, server, 120)
        assert (server.state(nappy), deployer.get(nappy).sleep_level) == ("asleep", 2)  # as its row said
    assert result["errors"] == [], result
    shown = f"{round(host_gib * 100) / 100:g} GiB host" if host_gib < 1 else f"{round(host_gib, 1):g} GiB host"
    dozy_row = result["dozy"]
    assert dozy_row["state"] == "asleep" and dozy_row["badge"] == "asleep · level 1", dozy_row
    assert shown in dozy_row["detail"] and "0.5 GiB on its GPUs" in dozy_row["detail"], dozy_row
    assert "when idle: sleep, level 1" in dozy_row["mode"], dozy_row
    host = result["host"]
    assert host["aria"].startswith("Host memory: ") and "GiB available" in host["label"], host
    assert "asleep engines hold" in host["aria"] and "(dozy)" in host["aria"] and "reserve 0.5 GiB" in host["aria"]
    assert host["reserve"] and len(host["asleep"]) == 1 and host["asleep"][0].startswith("dozy asleep (level 1)")
    assert result["gpu_bars"] == 2 and any(t.startswith("dozy (asleep): 0.5 GiB") for t in result["gpu_asleep"])
    assert result["dialog"]["level"] == "1" and "a level-1 sleep that would leave less" in result["dialog"]["note"]
    assert result["dialog"]["closed"]
    nappy_row = result["nappy"]
    assert nappy_row["badge"] == "asleep · level 2" and "GiB host" in nappy_row["detail"], nappy_row
    assert {"path": f"{nappy}/sleep", "body": '{"level":2,"force":false}'} in result["posts"], result["posts"]
    assert result["sglang"] == {"level": "1", "disabled": ["2"]}  # with idle_action sleep: level 1 only
    assert any(p["path"] == f"{dozy}/wake" for p in result["posts"]), result["posts"]
    assert result["woken"]["state"] == "ready" and result["woken"]["badge"] == "ready"
    assert "When idlesleep, level 1" in result["info"], result["info"]
    assert "when idle: sleep, level 2" in result["deep"]["mode"] and result["deep"]["form"] == "sleep2", result["deep"]


# Adaptive warmth on the page: a learned rhythm's histogram and when the next request is expected.
RHYTHM_SCRIPT = r"""
const { chromium } = require("playwright-core");
const row = (name) => `#rows tr[data-name="${name}"]`;
(async () => {
  const [url, token] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"] });
  const out = { errors: [], patches: [] };
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    page.on("pageerror", (e) => out.errors.push(String(e)));
    page.on("request", (r) => { if (r.method() === "PATCH") out.patches.push(r.postData()); });
    await page.goto(url);
    await page.waitForSelector("#login:not([hidden])", { timeout: 10000 });
    await page.fill("#token", token);
    await page.click("#login button[type=submit]");
    await page.waitForSelector(`${row("rhythmic")} .rhythm .bin`, { timeout: 10000 });
    out.rhythmic = await page.$eval(row("rhythmic"), (tr) => ({
      bins: [...tr.querySelectorAll(".rhythm .bin")].map((b) => parseFloat(b.style.height)),
      aria: tr.querySelector(".rhythm").getAttribute("aria-label"),
      note: tr.querySelector(".rhythm-note").textContent }));
    out.learning = await page.$eval(row("learning"), (tr) => tr.querySelector(".rhythm-note").textContent);
    out.fixed = await page.$eval(row("plain"), (tr) => tr.querySelectorAll(".rhythm, .rhythm-note").length);
    // keep_warm in the mode dialog (a live field) and in the edit form.
    await page.click(`${row("plain")} button[aria-label="Mode plain"]`);
    await page.waitForFunction(() => document.getElementById("mode").open, null, { timeout: 5000 });
    out.mode_form = await page.$eval("#m-keep-warm", (s) => s.value);
    await page.selectOption("#m-keep-warm", "adaptive");
    await page.click("#mode-save");
    await page.waitForFunction((sel) => document.querySelector(sel + " .rhythm-note"), row("plain"), { timeout: 10000 });
    await page.click(`${row("learning")} button[aria-label="Edit learning"]`);
    await page.waitForFunction(() => document.getElementById("edit").open, null, { timeout: 5000 });
    out.edit_form = await page.$eval("#f-keep-warm", (s) => s.value);
    await page.click("#edit-cancel");
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


async def test_the_page_shows_a_learned_rhythm_and_offers_keep_warm(tmp_path, browser_ready):
    """An adaptive deployment's row draws its idle gaps (bursts' seconds and the half hours
    between, on a log scale) and says when its next request is expected; one still learning says
    it behaves as fixed; a fixed one shows none. The mode dialog switches keep_warm on a running
    engine, and the edit form shows it."""
    import random
    rng = random.Random(1)
    gaps = [g for _ in range(10) for g in ([rng.uniform(1, 3) for _ in range(3)] + [1800 + rng.uniform(-60, 60)])]
    async with run_app(tmp_path, reap_interval_s=3600, ondemand_idle_timeout_s=600, min_idle_timeout_s=60) as server, \
            aiohttp.ClientSession() as http:
        create = server.deployer.create
        rhythmic = (await create(dep("rhythmic", 2, keep_warm="adaptive"))).id
        await create(dep("learning", 2, keep_warm="adaptive"))
        plain = (await create(dep("plain", 2))).id
        await server.deployer.restart(plain)
        server.controller.learn({rhythmic: gaps})
        chat = {"model": "RHYTHMIC", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(server.gw(rhythmic, "chat/completions"), json=chat, headers=server.auth()) as r:
            assert r.status == 200, await r.text()  # its idle period begins: the next request is expected
        result = await page_script(tmp_path, "rhythm_ui.js", RHYTHM_SCRIPT, server, 120)
        assert server.deployer.get(plain).keep_warm == "adaptive" and server.state(plain) == "ready"
    assert result["errors"] == [], result
    row = result["rhythmic"]
    assert len(row["bins"]) == 12 and max(row["bins"]) == 100, row
    assert row["bins"][0] > 0 and row["bins"][-1] > 0 and 0 in row["bins"], row  # seconds, and half hours
    assert row["aria"].startswith("Idle gaps of rhythmic: "), row
    assert row["note"].startswith("adaptive · 40 gaps · awake 60 s idle, then stopped"), row
    assert "next request expected in about 2" in row["note"], row  # 26 to 29 min
    assert result["learning"] == "adaptive: too few idle gaps learned yet (as fixed)"
    assert result["fixed"] == 0
    assert result["mode_form"] == "fixed" and '{"keep_warm":"adaptive"}' in result["patches"], result["patches"]
    assert result["edit_form"] == "adaptive"


# The newest replay report in the header, saved with the token (a link could not carry it).
REPLAY_SCRIPT = r"""
const { chromium } = require("playwright-core");
const fs = require("fs");
(async () => {
  const [url, token] = process.argv.slice(2);
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"] });
  const out = { errors: [] };
  try {
    const page = await browser.newPage({ acceptDownloads: true });
    page.on("pageerror", (e) => out.errors.push(String(e)));
    await page.goto(url);
    out.hidden_before = await page.$eval("#replay", (p) => p.hidden);
    await page.waitForSelector("#login:not([hidden])", { timeout: 10000 });
    await page.fill("#token", token);
    await page.click("#login button[type=submit]");
    await page.waitForSelector("#replay:not([hidden]) button", { timeout: 10000 });
    out.text = await page.$eval("#replay", (p) => p.textContent);
    out.label = await page.$eval("#replay button", (b) => b.getAttribute("aria-label"));
    const [download] = await Promise.all([page.waitForEvent("download", { timeout: 10000 }),
                                          page.click("#replay button")]);
    out.filename = download.suggestedFilename();
    out.body = fs.readFileSync(await download.path(), "utf8");
    await page.click("#signout");
    out.hidden_after = await page.$eval("#replay", (p) => p.hidden);
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
"""


async def test_the_page_offers_the_newest_replay_report(tmp_path, browser_ready):
    async with run_app(tmp_path) as server:
        folder = server.cfg.state_dir / "replays"
        folder.mkdir()
        (folder / "sunday.html").write_text("<!doctype html><p>the day before</p>")
        os.utime(folder / "sunday.html", (1_700_000_000, 1_700_000_000))
        (folder / "monday.html").write_text("<!doctype html><p>ondemand replay: monday</p>")
        result = await page_script(tmp_path, "replay_ui.js", REPLAY_SCRIPT, server, 60)
    assert result["errors"] == [], result
    assert result["hidden_before"] and result["hidden_after"], result
    assert result["text"].startswith("Latest replay report: monday.html (written "), result
    assert result["text"].endswith(f"; 2 in {folder})"), result
    assert result["label"] == "Download the replay report monday.html"
    assert result["filename"] == "monday.html" and result["body"] == "<!doctype html><p>ondemand replay: monday</p>"
