"use strict";
// ondemand's admin page: everything comes from the admin API with the admin token,
// which stays in this tab's sessionStorage (never in a URL). Live updates come from
// GET /api/events (Server-Sent Events, read with fetch so the token goes in a header):
// no polling. After a disconnect the page reconnects, reloads every view and drops the
// ones that are gone, so a row is never stale. Times that run (a start's elapsed time,
// the idle countdown, the end of a backoff) are redrawn every second from the views.

const api = new URL("../api/", location.href);
const $ = (id) => document.getElementById(id);
const views = new Map();
let host = null;
let token = sessionStorage.getItem("ondemand-token") || "";
let stream = null;        // the AbortController of the event stream
let logStream = null;     // the AbortController of a followed log
let auditPages = [];      // the "before" id of each page shown so far (paging back)

// --- the API ---------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, code) { super(message); this.status = status; this.code = code; }
}

async function call(method, path, body) {
  const init = {method, headers: {"Authorization": "Bearer " + token}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(new URL(path, api), init);
  } catch (e) {
    throw new ApiError(0, "ondemand does not answer (" + e.message + ")", "unreachable");
  }
  if (r.status === 401) { signOut("The admin token was refused."); throw new ApiError(401, "signed out", "invalid_admin_token"); }
  const data = (r.headers.get("Content-Type") || "").includes("json") ? await r.json() : await r.text();
  if (!r.ok) {
    const e = (data && data.error) || {};
    throw new ApiError(r.status, e.message || ("HTTP " + r.status), e.code || "");
  }
  return data;
}

function showError(e, where = "error") {
  $(where).textContent = e ? (e.code ? `${e.message} (${e.code})` : e.message || String(e)) : "";
}

// --- signing in ------------------------------------------------------------------------

function signOut(why) {
  token = "";
  sessionStorage.removeItem("ondemand-token");
  if (stream) stream.abort();
  stopLog();
  $("main").hidden = true;
  $("signout").hidden = true;
  $("replay").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = why || "";
  $("token").value = "";
  $("token").focus();
}

$("login").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const tried = $("token").value.trim();
  // The token is checked before anything is shown: the prompt cannot be skipped.
  const r = await fetch(new URL("host", api), {headers: {"Authorization": "Bearer " + tried}}).catch(() => null);
  if (!r || r.status !== 200) {
    $("login-error").textContent = r ? "That is not the admin token." : "ondemand does not answer.";
    return;
  }
  token = tried;
  sessionStorage.setItem("ondemand-token", token);
  begin();
});

$("signout").addEventListener("click", () => signOut(""));

async function begin() {
  try {
    await loadHost();
  } catch (e) {
    if (e.status !== 401) { signOut(e.message); }
    return;
  }
  $("login").hidden = true;
  $("main").hidden = false;
  $("signout").hidden = false;
  follow();
  loadAudit();
  loadReplays();
}

// --- the host and its GPUs ---------------------------------------------------------------

let hostTimer = null;
function refreshHost() {  // at most once a second, however many events arrive
  if (hostTimer === null) {
    hostTimer = setTimeout(() => {
      hostTimer = null;
      loadHost().catch(() => {});
      if (!auditPages.length) loadAudit();  // the newest page follows what happens
    }, 1000);
  }
}

async function loadHost() {
  host = await call("GET", "host");
  const b = host.budget, od = host.ondemand;
  const budget = b.error ? `budget unreadable: ${b.error}` :
    `${fmt(b.free)} of ${fmt(b.capacity)} GiB free (${b.source})`;
  $("host").textContent = `version ${host.version} · ${host.backend} backend · ${budget} · key ` +
    (od.configured ? od.key_fingerprint : "NOT CONFIGURED (ondemand key init)") + " · LiteLLM " +
    (od.litellm_enabled ? (od.litellm_ready ? "ready" : "not ready") : "disabled") +
    (od.queued ? ` · ${od.queued} waiting` : "");
  renderGpus(b);
}

// --- replay reports: the newest page `ondemand replay --html` left in {state_dir}/replays/ ---------

async function loadReplays() {
  const p = $("replay");
  const r = await call("GET", "replays").catch(() => null);
  if (!token) return;  // signed out meanwhile: the line stays hidden
  const newest = r && r.reports.length ? r.reports[0] : null;
  p.hidden = !newest;
  if (!newest) { p.replaceChildren(); return; }
  const get = el("button", {type: "button", "aria-label": `Download the replay report ${newest.name}`}, newest.name);
  get.addEventListener("click", () => downloadReplay(newest.name));
  const more = r.count > 1 ? `; ${r.count} in ${r.dir}` : ` in ${r.dir}`;
  p.replaceChildren("Latest replay report: ", get,
                    ` (written ${new Date(newest.modified * 1000).toLocaleString()}${more})`);
}

// The report comes with the token like everything else, so it is saved as a file, not opened
// from a link (a link cannot carry the token). Its bytes as written, and typed so that no browser
// opens it as a page of this origin (where it could read the token).
async function downloadReplay(name) {
  try {
    const r = await fetch(new URL("replays/" + encodeURIComponent(name), api),
                          {headers: {"Authorization": "Bearer " + token}});
    if (r.status === 401) { signOut("The admin token was refused."); return; }
    if (!r.ok) {
      const e = ((await r.json().catch(() => null)) || {}).error || {};
      throw new ApiError(r.status, e.message || ("HTTP " + r.status), e.code || "");
    }
    const url = URL.createObjectURL(new Blob([await r.arrayBuffer()], {type: "application/octet-stream"}));
    const a = el("a", {href: url, download: name});
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  } catch (e) {
    showError(e);
  }
}

function renderGpus(b) {
  const box = $("gpus");
  box.replaceChildren();
  if (b.error) box.append(el("p", {className: "gpu-error"}, b.error));
  const byName = new Map([...views.values()].map((v) => [v.name, v]));
  for (const g of b.error ? [] : b.gpus || []) {
    const div = el("div", {className: "gpu meter"});
    const title = b.per_gpu ? `GPU ${g.index}` : (b.source === "meminfo" ? "Unified memory" : "Memory");
    const label = el("div", {className: "label"}, el("strong", {}, title),
                     el("span", {}, `${fmt(g.used)} of ${fmt(g.capacity)} GiB used`));
    const track = el("div", {className: "track", role: "img"});
    let ours = 0;
    for (const name of g.deployments) {
      const v = byName.get(name);
      const share = v ? shareOn(v, b) : 0;
      const asleep = v && v.state === "asleep";
      ours += share;
      track.append(el("div", {className: asleep ? "seg asleep" : "seg",
                              title: `${name}${asleep ? " (asleep)" : ""}: ${gib(share)} GiB`,
                              style: `width:${pct(share, g.capacity)}%`}));
    }
    const foreign = Math.max(0, g.used - ours);
    if (foreign > 0.05) {
      track.append(el("div", {className: "seg foreign", title: `other processes and starts: ${fmt(foreign)} GiB`,
                              style: `width:${pct(foreign, g.capacity)}%`}));
    }
    track.setAttribute("aria-label", `${title}: ${fmt(g.used)} of ${fmt(g.capacity)} GiB used, ` +
                                     `${fmt(g.free)} free` + (g.deployments.length ? `, held by ${g.deployments.join(", ")}` : ""));
    div.append(label, track, el("div", {className: "who"},
      `${fmt(g.free)} GiB free` + (g.starting > 0.05 ? ` · ${fmt(g.starting)} held for a start` : "") +
      (g.deployments.length ? " · " + g.deployments.join(", ") : "")));
    box.append(div);
  }
  const hm = hostMemory();
  if (hm) box.append(hm);
}

function shareOn(v, b) {
  let size = Math.max(v.memory_gib || 0, v.measured_gib || 0);
  if (v.state === "asleep") size = Math.min(size, v.asleep_gib || 0);  // what it keeps asleep, as measured
  if (!b.per_gpu) return size;
  const n = (v.gpus || []).length || (b.gpus || []).length || 1;
  return size / n;
}

// Host memory (GET /api/host's host_memory, tiered warmth): the total, what is available, the
// asleep engines' share (a level-1 sleeper's weights are there) and the reserve a level-1 sleep
// must leave available (below it, a sleep goes to level 2). Nothing when the server says nothing.
function hostMemory() {
  const hm = host && host.host_memory;
  if (!hm || typeof hm !== "object") return null;
  const total = hm.total_gib, avail = hm.available_gib, reserve = hm.reserve_gib || 0;
  const sleepers = [...views.values()].filter((v) => v.state === "asleep").sort((a, b) => a.id - b.id);
  const known = sleepers.reduce((sum, v) => sum + (v.host_gib || 0), 0);
  const asleep = hm.asleep_gib ?? known;
  const readable = total > 0 && avail !== null && avail !== undefined;
  const div = el("div", {className: "meter hostmem"});
  const label = el("div", {className: "label"}, el("strong", {}, "Host memory"),
                   el("span", {}, readable ? `${fmt(avail)} of ${fmt(total)} GiB available` : "not readable"));
  const track = el("div", {className: "track", role: "img"});
  if (readable) {
    for (const v of sleepers) {
      if (v.host_gib) {
        track.append(el("div", {className: "seg asleep", title: `${v.name} asleep (level ${v.sleep_level ?? "?"}): ` +
                                `${gib(v.host_gib)} GiB`, style: `width:${pct(v.host_gib, total)}%`}));
      }
    }
    if (asleep - known > 0.005) {  // measured by the server, not (yet) in the views
      track.append(el("div", {className: "seg asleep", title: `asleep engines: ${gib(asleep - known)} GiB`,
                              style: `width:${pct(asleep - known, total)}%`}));
    }
    const other = Math.max(0, total - avail - Math.max(asleep, known));
    track.append(el("div", {className: "seg foreign", title: `everything else: ${fmt(other)} GiB`,
                            style: `width:${pct(other, total)}%`}));
    if (reserve > 0) {
      track.append(el("div", {className: "reserve", title: `reserve: ${gib(reserve)} GiB a level-1 sleep must leave available`,
                              style: `width:${pct(reserve, total)}%`}));
    }
  }
  const names = sleepers.filter((v) => v.host_gib).map((v) => v.name);
  track.setAttribute("aria-label", "Host memory: " + (readable ? `${fmt(avail)} of ${fmt(total)} GiB available, ` : "not readable, ") +
                     `asleep engines hold ${gib(asleep)} GiB` + (names.length ? ` (${names.join(", ")})` : "") +
                     `, reserve ${gib(reserve)} GiB`);
  const low = readable && avail < reserve;
  const held = asleep > 0.005 || sleepers.length ?
    `${gib(asleep)} GiB asleep engines` + (names.length ? ` (${names.join(", ")})` : "") : "no engine asleep";
  const who = el("div", {className: low ? "who low" : "who"},
                 `${held} · reserve ${gib(reserve)} GiB` + (low ? " · below it: a sleep goes to level 2" : ""));
  div.append(label, track, who);
  return div;
}

// --- deployments, live -------------------------------------------------------------------

async function follow() {
  if (stream) stream.abort();
  const ctl = stream = new AbortController();
  let delay = 1000;
  while (!ctl.signal.aborted && token) {
    try {
      const r = await fetch(new URL("events", api), {headers: {"Authorization": "Bearer " + token},
                                                     signal: ctl.signal});
      if (r.status === 401) { signOut("The admin token was refused."); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      // Catch up: the whole list, so deployments removed meanwhile go from the page.
      const all = await call("GET", "deployments");
      views.clear();
      for (const v of all) views.set(v.id, stamped(v));
      render();
      loadHost().catch(() => {});
      if (!auditPages.length) loadAudit();
      if ($("error").textContent.includes("does not answer")) showError(null);  // it answers again
      $("conn").textContent = "live";
      delay = 1000;
      await readEvents(r.body.getReader());
    } catch (e) {
      if (ctl.signal.aborted) return;
    }
    $("conn").textContent = "reconnecting…";
    await new Promise((done) => setTimeout(done, delay));
    delay = Math.min(delay * 2, 5000);
  }
}

async function readEvents(reader) {
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data) continue;
      const v = JSON.parse(data);
      if (v.removed) views.delete(v.id); else views.set(v.id, stamped(v));
      render();
      refreshHost();  // the budget follows the states
    }
  }
}

function render() {
  const body = $("rows");
  const focused = document.activeElement && document.activeElement.dataset.key;
  body.replaceChildren();
  const all = [...views.values()].sort((a, b) => a.id - b.id);
  $("empty").hidden = all.length > 0;
  for (const v of all) body.append(row(v));
  if (focused) {  // keep the keyboard where it was across a redraw
    const again = body.querySelector(`[data-key="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
  if (host) renderGpus(host.budget);
  if ($("info").open && views.has(showing)) fillInfo(views.get(showing));  // the details follow the view
}

function row(v) {
  const od = v.ondemand || {};
  const tr = el("tr", {});
  tr.dataset.id = v.id;
  tr.dataset.name = v.name;
  tr.dataset.state = v.state;
  const name = el("td", {"data-label": "Deployment"}, el("strong", {className: "name"}, v.name),
                  el("span", {className: "sub"}, `${v.served_name} · ${v.engine}` + (v.model ? ` · ${v.model}` : "") +
                     (v.role !== "model" ? ` · ${v.role}` : "")));
  const state = el("td", {"data-label": "State", className: "state"}, badge(v), el("span", {className: "sub detail"}, stateDetail(v)),
                   ...warmthNotes(v), ...phaseBars(v));
  const mode = el("td", {"data-label": "Mode", className: "mode"},
                  v.mode === "on_demand" ? "on demand" : "always on",
                  el("span", {className: "sub"}, modeDetail(v)), ...rhythm(v));
  const limit = v.max_inflight ? `/${v.max_inflight}` : "";
  const place = od.queue_position ? ` (place ${od.queue_position})` : "";
  const load = el("td", {"data-label": "Load"}, `${od.inflight || 0}${limit} in flight · ${od.queued || 0} queued${place}`,
                  el("span", {className: "sub"}, "last request " + ago(od.last_request_at)));
  const gpus = el("td", {"data-label": "GPUs"}, (v.gpus || []).length ? v.gpus.join(", ") :
                  (v.gpu_count === 0 ? "none" : "–"),
                  el("span", {className: "sub"}, v.gpu_count === null || v.gpu_count === undefined ? "every GPU" :
                     `${v.gpu_count} wanted` + (v.gpu_ids ? ` (pinned ${v.gpu_ids.join(",")})` : "")));
  const over = v.measured_gib !== null && v.measured_gib !== undefined && v.measured_gib > v.memory_gib * 1.1;
  const mem = el("td", {"data-label": "Memory"}, `${fmt(v.memory_gib)} GiB`,
                 el("span", {className: "sub"}, v.measured_gib != null ?
                    `measured ${fmt(v.measured_gib)} GiB` + (over ? " — over what it declares" : "") : "not measured"));
  const ll = !v.litellm || v.litellm.code === "litellm_disabled" ? "not used" :
    v.litellm.status + (v.litellm.code ? ` (${v.litellm.code})` : "");
  const litellm = el("td", {"data-label": "LiteLLM"}, ll);
  const actions = el("td", {"data-label": "Actions", className: "actions"}, ...buttons(v));
  tr.append(name, state, mode, load, gpus, mem, litellm, actions);
  return tr;
}

// When a view arrived: a start's phases and what is left of it run on from there.
function stamped(v) {
  v._at = Date.now() / 1000;
  return v;
}

const PHASE_WORDS = {container: "creating its engine", process: "starting its engine", weights: "loading weights",
                     compile: "compiling", serving: "starting its server"};

// A cold start's progress: a bar per phase, filled by its time so far against its median.
function phaseBars(v) {
  if (v.state !== "starting" || !v.start_phase || !(v.start_phases || []).length) return [];
  const now = Date.now() / 1000;
  const bars = el("span", {className: "phases"});
  for (const p of v.start_phases) {
    const current = p.phase === v.start_phase;
    const elapsed = p.elapsed_s + (current ? Math.max(0, now - v._at) : 0);
    const share = p.done ? 1 : p.expected_s ? Math.min(1, elapsed / p.expected_s) : 0;
    const fill = el("span", {className: "fill"});
    fill.style.width = `${Math.round(share * 100)}%`;
    const title = `${p.phase}: ${dur(elapsed)}` + (p.expected_s !== null ? ` of about ${dur(p.expected_s)}` : "");
    bars.append(el("span", {className: "phase" + (current ? " current" : "") + (p.done ? " done" : ""), title},
                   el("span", {className: "bar"}, fill), el("span", {className: "label"}, p.phase)));
  }
  return [bars];
}

const REST_WORDS = {asleep_1: "asleep at level 1", asleep_2: "asleep at level 2", stopped: "stopped"};

// Adaptive warmth: the rhythm learned of its idle gaps (a small histogram, its bins spaced on a
// log scale from a second to the longest gap), what its plan does, and when it expects the next
// request (the view's adaptive object: null before its 20th gap; its plan's fields null while it
// finds no rhythm worth acting on, and behaves as fixed).
function rhythm(v) {
  if (v.keep_warm !== "adaptive" || v.mode !== "on_demand") return [];
  const a = v.adaptive;
  if (!a) return [el("span", {className: "sub rhythm-note"}, "adaptive: too few idle gaps learned yet (as fixed)")];
  const h = a.histogram || {counts: [], edges_s: []};
  const top = Math.max(1, ...h.counts);
  const chart = el("span", {className: "rhythm", role: "img",
                            "aria-label": `Idle gaps of ${v.name}: ` + h.counts.map((n, i) =>
                              `${n} of ${dur(h.edges_s[i])} to ${dur(h.edges_s[i + 1])}`).join(", ")});
  h.counts.forEach((n, i) => {
    const bar = el("span", {className: "bin", title: `${dur(h.edges_s[i])} to ${dur(h.edges_s[i + 1])}: ${n}`});
    bar.style.height = `${Math.max(n ? 8 : 0, Math.round((n / top) * 100))}%`;
    chart.append(bar);
  });
  if (a.awake_for_s === null || a.awake_for_s === undefined) {
    return [chart, el("span", {className: "sub rhythm-note"}, `adaptive · ${a.gaps} gaps · no pattern worth acting on (as fixed)`)];
  }
  let s = `adaptive · ${a.gaps} gaps · awake ${dur(a.awake_for_s)} idle, then ` +
    (a.rest ? REST_WORDS[a.rest] || a.rest : "as when idle");
  if (a.expected_at) {
    const left = a.expected_at - Date.now() / 1000;
    s += left > 0 ? ` · next request expected in about ${dur(left)}` : " · next request expected now";
  } else if (a.prewarm_in_s !== null && a.prewarm_in_s !== undefined) {
    s += ` · woken ${dur(a.prewarm_in_s)} after its last request`;
  }
  return [chart, el("span", {className: "sub rhythm-note"}, s)];
}

const HELD_WORDS = {slo: "kept awake: its wake would miss the SLO"};

// Why an idle engine is kept awake past where the seed's rule would rest it (ondemand.held_for),
// and, while it rests, that make-room put it away before its idle timeout (ondemand.put_away_early).
function warmthNotes(v) {
  const od = v.ondemand || {};
  const out = [];
  if (od.held_for) out.push(el("span", {className: "sub held-for"}, HELD_WORDS[od.held_for] || `kept awake (${od.held_for})`));
  const early = od.put_away_early;
  if (early) {
    let title = `${dur(early.idle_for_s)} idle of its ${dur(early.idle_after_s)} idle timeout`;
    if (early.wait_s !== undefined && early.loss_s !== undefined) {
      title += ` · ${early.for} would have waited ${dur(early.wait_s)}, more than its expected loss of ${fmt(early.loss_s)} s`;
    }
    out.push(el("span", {className: "sub put-away-early", title}, `put away early for ${early.for} by ${early.rule}`));
  }
  return out;
}

function badge(v) {
  const text = v.state === "asleep" && v.sleep_level ? `asleep · level ${v.sleep_level}` : v.state;
  return el("span", {className: "badge " + v.state}, text);
}

function stateDetail(v) {
  const od = v.ondemand || {};
  const now = Date.now() / 1000;
  if (v.state === "starting") {
    const elapsed = Math.max(0, now - v.updated_at);
    if (v.sleep_level) {  // a wake: the cold starts' ETA says nothing of it
      return `waking from level ${v.sleep_level} for ${dur(elapsed)}` +
        (od.phase === "starting_for_request" ? " · for a request" : "");
    }
    let s = `for ${dur(elapsed)}`;
    // With a start_phase the view's start_eta_s is what was left when it was published.
    const left = v.start_phase ? v.start_eta_s - (now - v._at) : v.start_eta_s - elapsed;
    if (v.start_phase) s += ` · ${PHASE_WORDS[v.start_phase] || v.start_phase}`;
    if (v.start_eta_s) s += ` · expected in about ${dur(Math.max(0, left))}`;
    if (od.phase === "starting_for_request") s += " · for a request";
    return s;
  }
  if (v.state === "failed") {
    let s = v.state_reason || "failed";
    if (od.backoff_until && od.backoff_until > now) s += ` · new starts refused for ${dur(od.backoff_until - now)}`;
    return s;
  }
  if (v.state === "asleep") return asleepDetail(v);
  if (v.state === "ready" && v.last_start_s) return `started in ${dur(v.last_start_s)}`;
  if (od.phase === "queued") return "queued for memory";
  if (v.state === "planned") return "an administrator starts it";
  return "";
}

// What an asleep engine holds: host memory (a level-1 sleeper's weights), and on its GPUs.
function asleepDetail(v) {
  let s = v.host_gib !== null && v.host_gib !== undefined ? `${gib(v.host_gib)} GiB host` : "host memory not measured";
  if (v.asleep_gib !== null && v.asleep_gib !== undefined) s += ` · ${gib(v.asleep_gib)} GiB on its GPUs`;
  return s;
}

// The tier an idle engine goes to: 0 (a stop), 1 or 2; the view's idle_level when the server
// gives it, else what idle_action names (auto: null, the server decides).
function idleLevel(v) {
  if (typeof v.idle_level === "number") return v.idle_level;
  return {stop: 0, sleep: 1, sleep2: 2}[v.idle_action] ?? null;
}

function idleText(v) {
  if (!v.idle_action) return null;  // a server without tiered warmth
  const level = idleLevel(v);
  const what = level === null ? "" : level === 0 ? "stop" : `sleep, level ${level}`;
  return v.idle_action === "auto" ? "auto" + (what ? ` (${what})` : "") : what || v.idle_action;
}

function modeDetail(v) {
  const od = v.ondemand || {};
  const idle = v.idle_timeout_s ? `idle timeout ${dur(v.idle_timeout_s)}` : "default idle timeout";
  let s = v.mode === "on_demand" ? idle : "";
  const when = idleText(v);
  if (v.mode === "on_demand" && when) s += ` · when idle: ${when}`;
  if (v.priority && v.priority !== "normal") s += `${s ? " · " : ""}${v.priority} priority`;
  if (v.pending_mode) s = `switching to ${v.pending_mode.replace("_", " ")} at the start`;
  if (od.idle_until) {
    // Asleep, the reaper's next step is a stop (sleep_timeout_s); awake, the idle action's.
    const verb = v.state === "asleep" || idleLevel(v) === 0 ? "stops" : "sleeps";
    const left = od.idle_until - Date.now() / 1000;
    s += left > 0 ? ` · ${verb} in ${dur(left)}` : ` · ${verb} at the next look`;
  }
  return s;
}

function buttons(v) {
  const out = [];
  const add = (label, fn, cls) => {
    const b = el("button", {type: "button", className: cls || ""}, label);
    b.dataset.key = `${v.id}:${label}`;
    b.setAttribute("aria-label", `${label} ${v.name}`);
    b.addEventListener("click", fn);
    out.push(b);
  };
  const st = v.state;
  if (["stopped", "failed", "planned"].includes(st)) add("Start", () => act(v, "start"));
  if (["ready", "starting", "asleep"].includes(st) || (st === "failed" && v.base_url)) add("Stop", () => act(v, "stop"));
  // A recipe whose idle action is a stop was started without the sleep flags: it cannot sleep.
  const canSleep = ["vllm", "sglang"].includes(v.engine) && !(v.model && idleLevel(v) === 0);
  if (st === "ready" && canSleep) add("Sleep", () => openSleep(v));
  if (st === "asleep") add("Wake", () => act(v, "wake"));
  if (v.role === "model") add("Mode", () => openMode(v));
  if (["stopped", "failed", "planned"].includes(st)) add("Edit", () => openEdit(v));
  add("Details", () => openInfo(v));
  add("Log", () => openLog(v));
  add("Remove", () => remove(v), "danger");
  return out;
}

async function act(v, verb) {
  showError(null);
  try {
    await call("POST", `deployments/${v.id}/${verb}`);
  } catch (e) { if (e.status !== 401) showError(e); }
}

// The sleep asks for its level: 1 (weights kept in host memory) or 2 (weights dropped).
let sleeping = null;
$("sleep-cancel").addEventListener("click", () => $("sleep").close());

function openSleep(v) {
  sleeping = v;
  $("sleep-error").textContent = "";
  $("sleep-title").textContent = `Put ${v.name} to sleep`;
  // SGLang's level is the one its start flags chose (the CPU backup of the weights: level 1).
  const fixed = v.engine === "sglang" ? (idleLevel(v) === 1 ? 1 : 2) : null;
  for (const o of $("s-level").options) o.disabled = fixed !== null && Number(o.value) !== fixed;
  $("s-level").value = String(fixed ?? (idleLevel(v) === 2 ? 2 : 1));
  const hm = host && host.host_memory;
  $("sleep-note").textContent = (fixed ? `SGLang sleeps at the level its start flags chose: ${fixed}. ` : "") +
    "Level 1 wakes in seconds; level 2 frees host memory too, and its wake reads the weights again." + (hm && hm.available_gib !== null && hm.available_gib !== undefined ?
    ` Host memory: ${fmt(hm.available_gib)} GiB available, ${gib(hm.reserve_gib || 0)} GiB reserved; ` +
    "a level-1 sleep that would leave less sleeps at level 2." : "");
  $("s-force").checked = false;
  $("sleep-save").disabled = false;
  $("sleep").showModal();
  $("s-level").focus();
}

$("sleep-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("sleep-save").disabled = true;  // the drain and the engine's sleep call take a moment: one at a time
  try {
    // A 409 deployment_busy (still busy after the drain) shows its message here: force sleeps at once.
    await call("POST", `deployments/${sleeping.id}/sleep`,
               {level: Number($("s-level").value), force: $("s-force").checked});
    $("sleep").close();
  } catch (e) {
    if (e.status !== 401) showError(e, "sleep-error");
  } finally {
    $("sleep-save").disabled = false;
  }
});

// --- forms ---------------------------------------------------------------------------------

let editing = null;  // the deployment being edited, or null for a new one

$("add").addEventListener("click", () => openEdit(null));
$("edit-cancel").addEventListener("click", () => $("edit").close());
$("mode-cancel").addEventListener("click", () => $("mode").close());

function openEdit(v) {
  editing = v;
  const f = $("edit-form");
  f.reset();
  $("edit-error").textContent = "";
  $("edit-title").textContent = v ? `Edit ${v.name}` : "Add a deployment";
  const docker = !host || host.backend === "docker";
  for (const e of document.querySelectorAll(".docker")) e.classList.toggle("hidden-field", !docker);
  for (const e of document.querySelectorAll(".process")) e.classList.toggle("hidden-field", docker);
  for (const e of document.querySelectorAll(".new-only")) e.classList.toggle("hidden-field", !!v);
  if (v) {
    f.name.value = v.name; f.served_name.value = v.served_name; f.engine.value = v.engine;
    f.model.value = v.model || ""; f.image.value = v.image || ""; f.args.value = (v.args || []).join("\n");
    // Secrets' values come masked (***): sent back unchanged, they keep what is stored.
    f.env.value = Object.entries(v.env || {}).map(([k, x]) => `${k}=${x}`).join("\n");
    f.volumes.value = (v.volumes || []).join("\n");
    f.command.value = (v.command || []).map(quote).join(" "); f.port.value = v.port;
    f.memory_gib.value = v.declared_gib ?? v.memory_gib; f.gpu_count.value = v.gpu_count ?? "";
    f.gpu_ids.value = (v.gpu_ids || []).join(","); f.role.value = v.role;
    f.idle_timeout_s.value = v.idle_timeout_s ?? "";
    f.priority.value = v.priority || "normal";
    f.max_inflight.value = v.max_inflight ?? "";
    f.idle_action.value = v.idle_action || "auto";
    f.keep_warm.value = v.keep_warm || "fixed";
  } else {
    // As the design's wizard: on demand when LiteLLM is there to route to it.
    f.mode.value = host && host.ondemand.litellm_ready ? "on_demand" : "always_on";
  }
  $("edit").showModal();
  f.name.focus();
}

function editBody(f) {
  const num = (x) => x === "" ? null : Number(x);
  const lines = (x) => x.split("\n").map((l) => l.trim()).filter(Boolean);
  const body = {
    name: f.name.value.trim(), served_name: f.served_name.value.trim() || f.name.value.trim(),
    engine: f.engine.value, model: f.model.value.trim() || null, port: Number(f.port.value || 8000),
    memory_gib: Number(f.memory_gib.value || 0), gpu_count: num(f.gpu_count.value), role: f.role.value,
    idle_timeout_s: num(f.idle_timeout_s.value), args: lines(f.args.value), env: parseEnv(f.env.value),
    gpu_ids: f.gpu_ids.value.trim() ? f.gpu_ids.value.split(",").map((x) => Number(x.trim())) : null,
    priority: f.priority.value, max_inflight: num(f.max_inflight.value),
  };
  // auto is the default: sent when chosen otherwise, or to a server whose views carry the field.
  if (f.idle_action.value !== "auto" || (editing && "idle_action" in editing)) body.idle_action = f.idle_action.value;
  if (f.keep_warm.value !== "fixed" || (editing && "keep_warm" in editing)) body.keep_warm = f.keep_warm.value;
  // A pin sets the count; a new one left empty gets the server's default (1 with a model).
  if (body.gpu_count === null && (body.gpu_ids || !editing)) delete body.gpu_count;
  if (!host || host.backend === "docker") {
    body.image = f.image.value.trim() || null;
    body.volumes = lines(f.volumes.value);
  } else {
    body.command = splitCommand(f.command.value);
  }
  if (!editing) { body.mode = f.mode.value; body.start = f.start.checked; }
  return body;
}

function parseEnv(text) {  // NAME=value per line, split at the first "="; the server checks the names
  const env = {};
  for (const line of text.split("\n")) {
    if (!line.trim()) continue;
    const i = line.indexOf("=");
    if (i <= 0) throw new ApiError(400, `env: "${line.trim()}" is not NAME=value`, "invalid_field");
    env[line.slice(0, i).trim()] = line.slice(i + 1);
  }
  return env;
}

$("edit-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = $("edit-form");
  try {
    const body = editBody(f);
    if (editing) {
      const changed = {};
      for (const [k, val] of Object.entries(body)) {
        if (JSON.stringify(val) !== JSON.stringify(editing[k] ?? null)) changed[k] = val;
      }
      if (Object.keys(changed).length) await call("PATCH", `deployments/${editing.id}`, changed);
    } else {
      await call("POST", "deployments", body);
    }
    $("edit").close();
  } catch (e) { if (e.status !== 401) showError(e, "edit-error"); }
});

// --- a deployment's details: what it runs ---------------------------------------------------

let showing = null;  // the id of the deployment whose details are open

function openInfo(v) {
  showing = v.id;
  fillInfo(v);
  $("info").showModal();
  $("info-close").focus();
}

function fillInfo(v) {
  $("info-title").textContent = `${v.name}: what it runs`;
  const own = v.env || {};
  const env = el("ul", {});
  for (const name of v.env_names || Object.keys(own)) {
    env.append(el("li", {}, el("code", {}, name in own ? `${name}=${own[name]}` : name),
                  name in own ? "" : el("span", {className: "by"}, " · set by ondemand")));
  }
  const items = [
    ["Engine", v.engine + (v.model ? "" : " (no model: run as given)")],
    ["Model", v.model || "–"],
    v.engine_image ? ["Image", el("code", {}, v.engine_image)] : null,
    ["Command line", v.argv ? el("pre", {id: "info-argv"}, v.argv.map(quote).join(" "))
                            : `not derived: ${v.argv_error || "unknown"}`],
    ["Environment", (v.env_names || []).length || Object.keys(own).length ? env : "nothing of its own"],
    (v.volumes || []).length ? ["Volumes", el("ul", {}, ...v.volumes.map((x) => el("li", {}, el("code", {}, x))))] : null,
    idleText(v) ? ["When idle", idleText(v)] : null,
    v.keep_warm ? ["Keep warm", v.keep_warm === "adaptive" ? "adaptive: awake as long as its learned rhythm says, " +
                   "within its idle timeout; woken ahead of its next expected request" : "fixed: its idle timeout"] : null,
    v.state === "asleep" ? ["Asleep", (v.sleep_level ? `level ${v.sleep_level} · ` : "") + asleepDetail(v)] : null,
  ];
  const list = $("info-list");
  list.replaceChildren();
  for (const item of items.filter(Boolean)) list.append(el("dt", {}, item[0]), el("dd", {}, item[1]));
}

let moding = null;
function openMode(v) {
  moding = v;
  $("mode-error").textContent = "";
  $("mode-title").textContent = `Mode of ${v.name}`;
  $("m-mode").value = v.pending_mode || v.mode;
  $("m-idle").value = v.idle_timeout_s ?? "";
  $("m-priority").value = v.priority || "normal";
  $("m-max-inflight").value = v.max_inflight ?? "";
  $("m-keep-warm").value = v.keep_warm || "fixed";
  $("mode").showModal();
  $("m-mode").focus();
}

$("mode-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const idle = $("m-idle").value;
  const limit = $("m-max-inflight").value;
  // Priority, limit and keep_warm are no part of the mode: an edit, allowed in any state.
  const limits = {priority: $("m-priority").value, max_inflight: limit === "" ? null : Number(limit),
                  keep_warm: $("m-keep-warm").value};
  const changed = Object.fromEntries(Object.entries(limits).filter(([k, val]) => val !== (moding[k] ?? null)));
  try {
    if (Object.keys(changed).length) await call("PATCH", `deployments/${moding.id}`, changed);
    await call("PATCH", `deployments/${moding.id}/mode`,
               {mode: $("m-mode").value, idle_timeout_s: idle === "" ? null : Number(idle)});
    $("mode").close();
  } catch (e) { if (e.status !== 401) showError(e, "mode-error"); }
});

async function remove(v) {
  $("confirm-text").textContent = `Remove ${v.name}? Its engine is stopped and the deployment is deleted.`;
  const dlg = $("confirm");
  dlg.returnValue = "";
  dlg.showModal();
  await new Promise((done) => dlg.addEventListener("close", done, {once: true}));
  if (dlg.returnValue !== "yes") return;
  try { await call("DELETE", `deployments/${v.id}`); } catch (e) { if (e.status !== 401) showError(e); }
}

// --- the engine log --------------------------------------------------------------------------

function stopLog() {
  if (logStream) logStream.abort();
  logStream = null;
}

$("logs-close").addEventListener("click", () => { stopLog(); $("logs").hidden = true; });

async function openLog(v) {
  stopLog();
  const ctl = logStream = new AbortController();
  $("logs").hidden = false;
  $("logs-title").textContent = `Engine log of ${v.name}`;
  const pre = $("log");
  pre.textContent = "";
  pre.focus();
  try {
    const r = await fetch(new URL(`deployments/${v.id}/logs?tail=200&follow=1`, api),
                          {headers: {"Authorization": "Bearer " + token}, signal: ctl.signal});
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      pre.textContent = (e.error && e.error.message) || `HTTP ${r.status}`;
      return;
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.textContent += dec.decode(value, {stream: true});
      if (atEnd) pre.scrollTop = pre.scrollHeight;
    }
  } catch (e) {
    if (!ctl.signal.aborted) pre.textContent += `\n(the log ended: ${e.message})`;
  }
}

// --- the audit log ------------------------------------------------------------------------------

const AUDIT_PAGE = 20;

async function loadAudit(before) {
  try {
    const rows = await call("GET", `audit?limit=${AUDIT_PAGE}` + (before ? `&before=${before}` : ""));
    const body = $("audit-rows");
    body.replaceChildren();
    for (const r of rows) {
      const dep = r.deployment_id !== null ? (views.get(r.deployment_id)?.name || `#${r.deployment_id}`) : "–";
      body.append(el("tr", {},
        el("td", {"data-label": "When"}, new Date(r.at * 1000).toLocaleString()),
        el("td", {"data-label": "Action"}, r.action),
        el("td", {"data-label": "By"}, r.actor + (r.user ? ` (${r.user})` : "")),
        el("td", {"data-label": "Deployment"}, dep),
        el("td", {"data-label": "What"}, r.text)));
    }
    $("audit-older").disabled = rows.length < AUDIT_PAGE;
    $("audit-older").dataset.before = rows.length ? rows[rows.length - 1].id : "";
    $("audit-newer").disabled = !before;
  } catch (e) { if (e.status !== 401) showError(e); }
}

$("audit-older").addEventListener("click", () => {
  auditPages.push($("audit-older").dataset.before);
  loadAudit(auditPages[auditPages.length - 1]);
});
$("audit-newer").addEventListener("click", () => {
  auditPages.pop();
  loadAudit(auditPages[auditPages.length - 1]);
});

// --- small things ----------------------------------------------------------------------------------

function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "className") e.className = v;
    else if (k === "style") e.style.cssText = v;  // CSSOM: allowed by the page's CSP, a style attribute is not
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? "–"));
  return e;
}

function fmt(x) { return x === null || x === undefined ? "–" : String(Math.round(x * 10) / 10); }
function gib(x) { return x === null || x === undefined || x >= 1 ? fmt(x) : String(Math.round(x * 100) / 100); }
function pct(part, whole) { return whole > 0 ? Math.min(100, (100 * part) / whole).toFixed(2) : 0; }
function dur(s) {
  s = Math.round(s);
  if (s < 90) return `${s} s`;
  if (s < 5400) return `${Math.floor(s / 60)} min ${s % 60 ? (s % 60) + " s" : ""}`.trim();
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
function ago(ts) { return ts ? dur(Math.max(0, Date.now() / 1000 - ts)) + " ago" : "never"; }
function quote(a) { return /^[\w@%+=:,./{}-]+$/.test(a) ? a : "'" + a.replace(/'/g, "'\\''") + "'"; }
function splitCommand(s) {  // a shell-like split: quotes group, no expansion
  const out = [];
  const re = /'([^']*)'|"((?:\\.|[^"])*)"|(\S+)/g;
  let m;
  while ((m = re.exec(s)) !== null) out.push(m[1] ?? (m[2] !== undefined ? m[2].replace(/\\(.)/g, "$1") : m[3]));
  return out;
}

setInterval(() => { if (!$("main").hidden) render(); }, 1000);  // running times, not data

if (token) begin(); else signOut("");
