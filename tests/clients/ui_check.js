// Drives Debian's chromium with playwright-core through ondemand's web page, as an
// admin would, and prints what it saw as one JSON line (the test asserts on it).
// Usage: node ui_check.js URL TOKEN SCREENSHOT
// Steps: a wrong token, the right one; a cold start followed live to ready (and its
// ETA while starting); a mode switch; adding and removing a deployment; following the
// log of a start; a failed start's reason; then "RESTART" on stdout, and after the test
// answers "GO" on stdin (the server restarted meanwhile), the page must reconnect and
// show the rows as they are now; last, a screenshot of the page.
const { chromium } = require("playwright-core");
const readline = require("readline");

const row = (name) => `#rows tr[data-name="${name}"]`;

async function stateOf(page, name) {
  return page.$eval(row(name), (tr) => ({
    state: tr.dataset.state, detail: tr.querySelector(".state .detail").textContent,
    mode: tr.querySelector(".mode").textContent,
  }));
}

async function waitState(page, name, state, timeout = 20000) {
  await page.waitForFunction(([sel, st]) => {
    const tr = document.querySelector(sel);
    return tr && tr.dataset.state === st;
  }, [row(name), state], { timeout });
}

async function click(page, name, label) {
  await page.click(`${row(name)} button[aria-label="${label} ${name}"]`);
}

function waitForLine(expected) {
  const rl = readline.createInterface({ input: process.stdin });
  return new Promise((resolve) => rl.on("line", (line) => { if (line.trim() === expected) { rl.close(); resolve(); } }));
}

(async () => {
  const [url, token, shot] = process.argv.slice(2);
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const out = { errors: [], console: [] };
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    page.on("pageerror", (e) => out.errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") out.console.push(m.text()); });
    await page.goto(url);

    // The token prompt: nothing shows before a good token.
    await page.waitForSelector("#login:not([hidden])", { timeout: 10000 });
    await page.fill("#token", "oda-not-the-token");
    await page.click("#login button[type=submit]");
    await page.waitForFunction(() => document.getElementById("login-error").textContent !== "", null, { timeout: 5000 });
    out.wrong_token = { error: await page.textContent("#login-error"), main_hidden: await page.$eval("#main", (m) => m.hidden) };
    await page.fill("#token", token);
    await page.click("#login button[type=submit]");
    await page.waitForSelector(row("alpha"), { timeout: 10000 });
    out.token_in_url = page.url().includes(token);

    // A cold start, followed live: stopped, starting (with its ETA), ready.
    out.cold = { before: await stateOf(page, "alpha") };
    await click(page, "alpha", "Start");
    await waitState(page, "alpha", "starting", 5000);
    await page.waitForFunction((sel) => document.querySelector(sel + " .state .detail").textContent.includes("expected in"),
                               row("alpha"), { timeout: 5000 }).catch(() => {});
    out.cold.starting = await stateOf(page, "alpha");
    await waitState(page, "alpha", "ready");
    out.cold.after = await stateOf(page, "alpha");

    // A mode switch.
    await click(page, "alpha", "Mode");
    await page.selectOption("#m-mode", "always_on");
    await page.click("#mode-save");
    await page.waitForFunction((sel) => document.querySelector(sel + " .mode").textContent.startsWith("always on"),
                               row("alpha"), { timeout: 5000 });
    out.mode = await stateOf(page, "alpha");

    // Add a deployment, then remove it (with the confirmation).
    await page.click("#add");
    out.add_default_mode = await page.$eval("#f-mode", (s) => s.value);
    await page.fill("#f-name", "gamma");
    await page.fill("#f-command", "ondemand sim-engine --port {port} --model GAMMA");
    await page.fill("#f-memory", "2");
    await page.selectOption("#f-mode", "on_demand");
    await page.click("#edit-save");
    await page.waitForSelector(row("gamma"), { timeout: 5000 });
    out.added = await stateOf(page, "gamma");
    await click(page, "gamma", "Remove");
    await page.click("#confirm-yes");
    await page.waitForSelector(row("gamma"), { state: "detached", timeout: 10000 });
    out.removed = true;

    // A deployment from a recipe: engine, model, env (a secret's value shown masked, and kept
    // when the form sends the mask back), arguments after the recipe's.
    await page.click("#add");
    await page.fill("#f-name", "recipe");
    await page.selectOption("#f-engine", "vllm");
    await page.fill("#f-model", "Qwen/Qwen3-8B");
    await page.fill("#f-memory", "16");
    await page.fill("#f-env", "HF_X_TOKEN=s3cret\nFOO=a=b");
    await page.fill("#f-args", "--max-model-len\n4096");
    await page.selectOption("#f-mode", "on_demand");
    await page.click("#edit-save");
    await page.waitForSelector(row("recipe"), { timeout: 5000 });
    await click(page, "recipe", "Details");
    out.recipe = { info: await page.textContent("#info-list"), argv: await page.textContent("#info-argv"),
                   gpus: await page.$eval(row("recipe"), (tr) => tr.cells[4].textContent) };
    await page.keyboard.press("Escape");
    await click(page, "recipe", "Edit");
    out.recipe.env_form = await page.$eval("#f-env", (t) => t.value);
    await page.fill("#f-env", out.recipe.env_form.replace("FOO=a=b", "FOO=c"));
    await page.click("#edit-save");
    await page.waitForFunction(() => !document.getElementById("edit").open, null, { timeout: 5000 });
    await click(page, "recipe", "Details");
    await page.waitForFunction(() => document.getElementById("info-list").textContent.includes("FOO=c"), null,
                               { timeout: 5000 });
    out.recipe.after = await page.textContent("#info-list");
    await page.click("#info-close");

    // An API error is shown in words: a second deployment named alpha.
    await page.click("#add");
    await page.fill("#f-name", "alpha");
    await page.fill("#f-command", "ondemand sim-engine --port {port}");
    await page.click("#edit-save");
    await page.waitForFunction(() => document.getElementById("edit-error").textContent !== "", null, { timeout: 5000 });
    out.api_error = await page.textContent("#edit-error");
    await page.click("#edit-cancel");

    // Follow the log of a start in progress.
    await click(page, "slow", "Start");
    await waitState(page, "slow", "starting", 5000);
    await click(page, "slow", "Log");
    await page.waitForFunction(() => document.getElementById("log").textContent.includes("application startup complete"), null,
                               { timeout: 20000 });
    out.log = { text: await page.textContent("#log"), state_when_seen: (await stateOf(page, "slow")).state };
    await page.click("#logs-close");

    // A failed start's reason.
    await click(page, "broken", "Start");
    await waitState(page, "broken", "failed");
    out.failed = await stateOf(page, "broken");

    // The server restarts under the page.
    console.log("RESTART");
    await waitForLine("GO");
    // "late" was made after the restart: once it shows, the page reads the new server.
    await page.waitForFunction(() => document.getElementById("conn").textContent === "live" &&
                               document.querySelector('#rows tr[data-name="late"]'), null, { timeout: 30000 });
    out.after_restart = { broken: await stateOf(page, "broken"), names: await page.$$eval("#rows tr", (trs) => trs.map((t) => t.dataset.name)), late: true };
    // alpha (always on) lost its engine with the server: it is started again, and the page follows it.
    await waitState(page, "alpha", "ready", 30000);
    out.after_restart.alpha = await stateOf(page, "alpha");

    // The bars follow the host's budget, read again at most once a second after changes.
    await page.waitForFunction(() => [...document.querySelectorAll("#gpus .track")]
      .some((t) => (t.getAttribute("aria-label") || "").includes("held by pinned")), null, { timeout: 10000 });
    out.gpus = await page.$$eval("#gpus .gpu", (gs) => gs.map((g) => g.querySelector(".track").getAttribute("aria-label")));
    await page.waitForFunction(() => [...document.querySelectorAll("#audit-rows tr")]
      .some((t) => t.cells[1].textContent === "ondemand_start"), null, { timeout: 5000 }).catch(() => {});
    out.audit = await page.$$eval("#audit-rows tr", (trs) => trs.map((t) => t.cells[1].textContent));
    await page.waitForTimeout(1500);  // the counters' last publish (at most one a second) is in
    await page.screenshot({ path: shot, fullPage: true });

    // By keyboard: the add form opens with Enter and closes with Escape.
    await page.focus("#add");
    await page.keyboard.press("Enter");
    out.keyboard = { opened: await page.$eval("#edit", (d) => d.open) };
    await page.keyboard.press("Escape");
    out.keyboard.closed = !(await page.$eval("#edit", (d) => d.open));
    // On a phone: nothing wider than the screen (the tables become cards).
    await page.setViewportSize({ width: 390, height: 844 });
    await page.waitForTimeout(300);
    out.phone = await page.evaluate(() => ({ width: document.documentElement.scrollWidth, screen: window.innerWidth }));
    await click(page, "recipe", "Details");  // the command line wraps: the details fit a phone too
    out.phone.info = await page.$eval("#info", (d) => ({ width: d.scrollWidth, room: d.clientWidth }));
    await page.keyboard.press("Escape");
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(out));
  process.exit(0);  // stdin stays open after the readline: do not wait for it
})().catch((e) => { console.error(e); process.exit(1); });
