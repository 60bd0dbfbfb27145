// Drives Debian's chromium with playwright-core against ondemand's web page:
// enters the admin token, waits for the deployments to appear from the event
// stream, clicks a deployment's start button, waits for its phase to change,
// and prints what the page shows as JSON (and a screenshot to argv[4]).
// Usage: node ui_check.js URL TOKEN DEPLOYMENT_NAME SCREENSHOT
const { chromium } = require("playwright-core");

(async () => {
  const [url, token, name, shot] = process.argv.slice(2);
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const result = {};
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(url);
    await page.waitForSelector("#login:not([hidden])", { timeout: 10000 });
    result.asked_for_token = true;
    await page.fill("#token", token);
    await page.click("#login button");
    const row = `tr:has(td:text-is("${name}"))`;
    await page.waitForSelector(row, { timeout: 10000 });
    result.before = await page.$$eval("#rows tr", (trs) => trs.map((tr) => [...tr.cells].map((c) => c.textContent)));
    await page.click(`${row} button`);
    await page.waitForFunction((n) => [...document.querySelectorAll("#rows tr")]
      .some((tr) => tr.cells[0].textContent === n && tr.cells[3].textContent === "ready"), name, { timeout: 20000 });
    result.after = await page.$$eval("#rows tr", (trs) => trs.map((tr) => [...tr.cells].map((c) => c.textContent)));
    await page.waitForFunction(() => !document.getElementById("host").textContent.includes("24 of 24"),
                               null, { timeout: 10000 });  // the budget follows the start
    result.host = await page.textContent("#host");
    result.errors = errors;
    await page.screenshot({ path: shot, fullPage: true });
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify(result));
})().catch((e) => { console.error(e); process.exit(1); });
