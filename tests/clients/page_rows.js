// The web page's rows without a browser: loads ondemand/admin/ui/app.js into a bare context with a
// fake DOM just large enough for it (elements that hold children, attributes and text), renders
// app.js's row() for each deployment view read as a JSON list on stdin, and prints one JSON list:
// per view, the text of each of its cells ({"state": ..., "mode": ...}, by data-label) and the
// title attributes found in them. The browser test (test_ui_browser.py) is the page for real.
// Usage: node page_rows.js APP_JS < views.json
const fs = require("fs");
const vm = require("vm");

class El {
  constructor(tag, text) {
    this.tag = tag; this.children = []; this.attrs = {}; this.dataset = {}; this.style = {};
    this.className = ""; this.hidden = false; this.value = ""; this._text = text;
    this.classList = { add() {}, remove() {}, toggle() {}, contains() { return false; } };
  }
  append(...c) { this.children.push(...c); }
  replaceChildren(...c) { this.children = c; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return this.attrs[k] ?? null; }
  addEventListener() {}
  querySelector() { return null; }
  querySelectorAll() { return []; }
  focus() {} showModal() {} close() {}
  get textContent() { return this._text !== undefined ? this._text : this.children.map((c) => c.textContent).join(""); }
  set textContent(v) { this._text = String(v); this.children = []; }
  titles() { return [...(this.attrs.title ? [this.attrs.title] : []), ...this.children.flatMap((c) => c.titles())]; }
}

const byId = {};
const document = {
  createElement: (tag) => new El(tag),
  createTextNode: (text) => new El("#text", String(text)),
  getElementById: (id) => (byId[id] ||= new El("div")),
  querySelector: () => null, addEventListener() {}, activeElement: null,
};
const context = vm.createContext({
  document, Node: El, URL, console, location: { href: "http://ondemand.test/ui/" },
  sessionStorage: { getItem: () => null, setItem() {}, removeItem() {} },
  setInterval: () => 0, clearInterval() {}, setTimeout: () => 0, clearTimeout() {},
  fetch: () => new Promise(() => {}), CSS: { escape: (s) => s },
});
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), context);
const views = JSON.parse(fs.readFileSync(0, "utf8"));
context.shown = views;  // (app.js has a "views" of its own)
const out = vm.runInContext("shown.map((v) => row(stamped(v)))", context).map((tr) => {
  const cells = {};
  for (const td of tr.children) cells[td.attrs["data-label"]] = { text: td.textContent, titles: td.titles() };
  return cells;
});
console.log(JSON.stringify(out));
