// The mam-fleet hub dashboard: REST for the first view, then server-sent events
// (GET /api/events) keep it live without reloading. No build step, no framework.
"use strict";

const PAGE_ROWS = 50;           // ended jobs per page under "Recent"
const LOG_VIEW_MAX_CHARS = 200000; // the output tail keeps this much text
const params = new URLSearchParams(location.search);
const token = params.get("token") || sessionStorage.getItem("mam_token") || "";
if (params.get("token")) sessionStorage.setItem("mam_token", token);

const ASKS_POLL_MS = 3000;       // the requests waiting for a person are looked up this often (§19)
const state = { runners: [], queue: [], schedules: [], jobs: new Map(), job: null, events: [], logAttempt: null, asks: [], page: 0,
  logNext: null, logHeld: [] };
const TERMINAL = new Set(["completed", "error", "cancelled"]);

function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  return fetch(path, { headers }).then((r) => r.ok ? r.json() : r.json().then((b) => Promise.reject(b.error)));
}

function post(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers.Authorization = "Bearer " + token;
  return fetch(path, { method: "POST", headers, body: JSON.stringify(body || {}) })
    .then((r) => r.ok ? r.json() : r.json().then((b) => Promise.reject(b.error)));
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function badge(status) { return el("span", status, "st " + status); }

function jobLink(id) {
  const a = el("a", id);
  a.href = "#job/" + id;
  return a;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell === null || cell === undefined ? "" : String(cell);
    tr.appendChild(td);
  }
  return tr;
}

function fill(id, rows, empty, width) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows);
  if (!rows.length) {
    const td = el("td", empty, "empty");
    td.colSpan = width;
    const tr = document.createElement("tr");
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

function age(epochS) {
  const s = Math.max(0, Date.now() / 1000 - epochS);
  return s < 60 ? s.toFixed(0) + " s ago" : s < 3600 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
}

function duration(job) {
  let s = job.duration_s;
  if (!TERMINAL.has(job.status)) {
    const start = Date.parse(job.created_at);
    if (!isNaN(start)) s = (Date.now() - start) / 1000;
  }
  if (s === null || s === undefined) return "";
  return s < 60 ? s.toFixed(1) + " s" : s < 3600 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h";
}

function renderFleet() {
  fill("runners", state.runners.map((r) => row([r.session, badge(r.status), r.labels.join(", "),
    r.status === "revoked" ? "-" : r.slots_used + " / " + r.max_jobs, r.running.join(", "), r.version, r.host,
    r.status === "revoked" ? "revoked " + r.revoked_at : age(r.last_seen), drainButton(r)])),
    "no runner has announced itself", 9);
  const titleOf = (id) => (state.jobs.get(id) || {}).title || "";
  fill("queue", state.queue.map((q) => row([jobLink(q.job_id), titleOf(q.job_id), badge(q.status),
    q.target + (q.group ? " · group " + q.group : ""), q.priority, q.why_waiting])), "nothing waits", 6);
  fill("schedules", state.schedules.map((s) => row([s.name, s.cron + " (" + s.tz + ")", s.target, s.title,
    s.paused ? "paused" : (s.next_fire || "-"), s.last_job ? jobLink(s.last_job) : "-",
    s.last_skipped ? "skipped " + s.last_skipped : ""])), "no schedule", 7);
  const jobs = [...state.jobs.values()].sort((a, b) => b.created_at.localeCompare(a.created_at));
  const open = jobs.filter((j) => j.status === "pending" || j.status === "running");
  const matching = jobs.filter((j) => TERMINAL.has(j.status) && matches(j));
  const pages = Math.max(1, Math.ceil(matching.length / PAGE_ROWS));
  state.page = Math.min(state.page, pages - 1);
  const ended = matching.slice(state.page * PAGE_ROWS, (state.page + 1) * PAGE_ROWS);
  document.getElementById("page-note").textContent = matching.length
    ? (state.page * PAGE_ROWS + 1) + "–" + (state.page * PAGE_ROWS + ended.length) + " of " + matching.length : "";
  document.getElementById("page-prev").disabled = state.page === 0;
  document.getElementById("page-next").disabled = state.page >= pages - 1;
  fillRunnerChoices(jobs);
  const asking = new Set(state.asks.map((a) => a.job_id));  // §19: a person's answer is what it waits for
  fill("running", open.map((j) => row([jobLink(j.job_id), j.title, badge(j.status), j.session, j.attempt_id,
    duration(j), asking.has(j.job_id) ? "waiting for approval" : j.last_event])), "no job runs", 7);
  fill("recent", ended.map((j) => row([jobLink(j.job_id), j.title, badge(j.status), j.session, j.attempt_id,
    duration(j), j.last_event, j.close_reason || (j.late_outcome ? "late " + j.late_outcome : "")])),
    filtering() ? "no ended job matches" : "no job ended yet", 8);
  const online = state.runners.filter((r) => r.status === "online").length;
  document.getElementById("summary").textContent =
    online + " runners online · " + state.queue.filter((q) => q.status === "queued").length + " queued · " +
    state.queue.filter((q) => q.status === "blocked").length + " blocked · " + open.length + " running";
}

// Drain or undrain a runner from the hub (§7): a signed, retained order; its row turns
// `draining` (or back) once the runner hears, over the live feed.
function drainButton(r) {
  if (r.status === "revoked" || r.status === "unverified") return "";
  const verb = r.status === "draining" ? "undrain" : "drain";
  const b = el("button", verb === "drain" ? "Drain" : "Undrain");
  b.dataset.verb = verb;
  b.addEventListener("click", () => {
    if (!window.confirm((verb === "drain" ? "Drain" : "Undrain") + " runner " + r.session + "?")) return;
    b.disabled = true;
    post("/api/runners/" + encodeURIComponent(r.session) + "/" + verb, {})
      .then((answer) => { b.replaceWith(el("span", answer.line, "muted")); })
      .catch((err) => { b.replaceWith(el("span", "refused: " + err, "error")); });
  });
  return b;
}

// The filters of "Recent": status, runner, label and repository exactly; the search in titles and ids.
const FILTERS = ["f-status", "f-runner", "f-label", "f-repo", "f-text"];
function filterValue(id) { return document.getElementById(id).value.trim(); }
function filtering() { return FILTERS.some((id) => filterValue(id) !== ""); }

function matches(job) {
  const status = filterValue("f-status"), runner = filterValue("f-runner"), label = filterValue("f-label");
  const repo = filterValue("f-repo"), text = filterValue("f-text").toLowerCase();
  return (!status || job.status === status) && (!runner || job.session === runner) &&
    (!label || (job.labels || []).includes(label)) && (!repo || job.repo === repo) &&
    (!text || (job.title || "").toLowerCase().includes(text) || job.job_id.includes(text));
}

function fillRunnerChoices(jobs) {
  const select = document.getElementById("f-runner");
  const known = new Set([...select.options].map((o) => o.value));
  const sessions = new Set([...state.runners.map((r) => r.session), ...jobs.map((j) => j.session)]);
  for (const session of [...sessions].filter((s) => s && !known.has(s)).sort()) select.appendChild(el("option", session));
}

// Agents' permission requests that wait for a person (§19), each with Approve and Deny.
function loadAsks() {
  return api("/api/asks").then((found) => { state.asks = found.asks; renderAsks(); render(); }).catch(() => {});
}

function renderAsks() {
  document.getElementById("asks-section").hidden = !state.asks.length;
  fill("asks", state.asks.map((a) => {
    const reason = el("input");
    reason.placeholder = "denied by the dashboard";
    reason.maxLength = 256;
    const buttons = el("span");
    const answer = (verb) => {
      const body = verb === "deny" && reason.value.trim() ? { reason: reason.value.trim() } : {};
      for (const b of buttons.children) b.disabled = true;
      post("/api/jobs/" + a.job_id + "/asks/" + a.request_id + "/" + verb, body)
        .then(() => loadAsks())
        .catch((err) => { buttons.replaceChildren(el("span", "refused: " + err, "error")); });
    };
    for (const verb of ["approve", "deny"]) {
      const b = el("button", verb === "approve" ? "Approve" : "Deny");
      b.dataset.verb = verb;
      b.addEventListener("click", () => answer(verb));
      buttons.appendChild(b);
    }
    return row([jobLink(a.job_id), a.tool, el("code", a.input), a.asked_at, reason, buttons]);
  }), "nothing waits for you", 6);
}

function renderJob() {
  const detail = state.job;
  if (!detail) return;
  const job = state.jobs.get(detail.job.job_id) || detail.job;
  document.getElementById("job-id").textContent = job.job_id;
  document.getElementById("job-title").textContent = job.title || "";
  const status = document.getElementById("job-status");
  status.textContent = job.status;
  status.className = "st " + job.status;
  document.getElementById("job-cancel").hidden = TERMINAL.has(job.status);
  document.getElementById("job-retry").hidden = !(job.status === "error" || job.status === "cancelled");
  document.getElementById("job-facts").textContent = "target " + job.target +
    (job.group ? " · group " + job.group : "") + " · runner " + (job.session || "-") +
    " · attempt " + job.attempt_id + " · duration " + duration(job) + (job.close_reason ? " · closed " + job.close_reason : "") +
    (job.exit_code !== null && job.exit_code !== undefined ? " · agent exit " + job.exit_code : "") +
    agentFacts(job.agent);
  const waiting = state.queue.find((q) => q.job_id === job.job_id);
  if ((job.status === "queued" || job.status === "blocked") && waiting) document.getElementById("job-facts").textContent += " · " + waiting.why_waiting;
  fill("attempts", detail.attempts.map((a) => row([a.attempt_id, a.session, a.status, a.reason, a.log || ""])), "", 5);
  fill("events", eventRows(detail), "no event yet", 4);
  renderChange(job.job_id, detail.result);
  // the result lands after the job's end (§18): ask once when an ended job shows none ready
  if (TERMINAL.has(job.status) && !(detail.result && detail.result.ready) && !detail.resultAsked) {
    detail.resultAsked = true;
    api("/api/jobs/" + job.job_id + "/result").then((result) => {
      detail.result = result;
      if (state.job === detail) renderChange(job.job_id, result);
    }).catch(() => {});
  }
}

// The job's events grouped by attempt: a heading row per attempt (its runner and end), then its events.
function eventRows(detail) {
  const rows = [];
  let current = null;
  for (const e of state.events) {
    const attempt = (e.data && e.data.attempt_id) || 1;
    if (attempt !== current) {
      current = attempt;
      const known = detail.attempts.find((a) => a.attempt_id === attempt) || {};
      const td = el("td", "attempt " + attempt + " · runner " + (known.session || "-") +
        (known.reason ? " · " + known.reason : known.status ? " · " + known.status : ""));
      td.colSpan = 4;
      const head = document.createElement("tr");
      head.className = "attempt-head";
      head.appendChild(td);
      rows.push(head);
    }
    rows.push(row([e.seq, e.event, e.timestamp, e.detail]));
  }
  return rows;
}

// What the agent spent (§18): kind, turns, tokens, cost and its session id.
function agentFacts(agent) {
  if (!agent) return "";
  const tokens = agent.tokens || {};
  const cost = typeof agent.cost_usd === "number" ? " · $" + agent.cost_usd.toFixed(4) : "";
  return " · " + agent.kind + ": " + agent.turns + " turns · " + (tokens.input || 0) + " in / " +
    (tokens.output || 0) + " out / " + (tokens.cached || 0) + " cached tokens" + cost +
    (agent.session_id ? " · session " + agent.session_id : "");
}

// A repository job's change (§18): its commits, diffstat and links to the patch and the transcript.
function renderChange(id, result) {
  const section = document.getElementById("change-section");
  section.hidden = !result;
  if (!result) return;
  const facts = result.ready
    ? "repo " + result.repo + " @ " + result.ref + " · base " + String(result.base_sha).slice(0, 12) +
      " → head " + String(result.head_sha).slice(0, 12) + " · " + result.commits_total + " commits · " +
      result.files_total + " files +" + result.insertions + " −" + result.deletions +
      (result.note ? " · " + result.note : "") + " · attempt " + result.attempt_id
    : "attempt " + result.attempt_id + ": the result is still arriving";
  document.getElementById("change-facts").textContent = facts;
  for (const [which, shown] of [["patch", result.has_patch], ["transcript", result.has_transcript]]) {
    const link = document.getElementById(which + "-link");  // the change, and the agent's conversation
    link.hidden = !shown;
    link.href = "/api/jobs/" + id + "/result/" + which + "?attempt=" + result.attempt_id +
      (token ? "&token=" + encodeURIComponent(token) : "");
  }
  fill("change", (result.files || []).map((f) => row([f.path, f.added === null ? "binary" : f.added,
    f.deleted === null ? "" : f.deleted])), "no file changed", 3);
  // the files the agent left in $MAM_ARTIFACTS_DIR, each a download link
  const names = result.artifacts || [];
  document.getElementById("artifacts-block").hidden = !names.length && !(result.artifact_notes || []).length;
  fill("artifacts", names.map((name) => {
    const a = el("a", name);
    a.href = "/api/jobs/" + id + "/artifacts/" + encodeURIComponent(name) + "?attempt=" + result.attempt_id +
      (token ? "&token=" + encodeURIComponent(token) : "");
    a.setAttribute("download", name);
    return row([a]);
  }), "no artifact", 1);
  document.getElementById("artifact-notes").textContent = (result.artifact_notes || []).join(" · ");
}

function showJob(id) {
  document.getElementById("fleet-view").hidden = true;
  document.getElementById("job-view").hidden = false;
  state.job = null;
  state.events = [];
  state.logNext = null;  // the output's next byte offset, once read; chunks wait in logHeld until then
  state.logHeld = [];
  document.getElementById("log").textContent = "";
  document.getElementById("job-action").textContent = "";
  api("/api/jobs/" + id).then((detail) => {
    state.job = detail;
    state.jobs.set(id, detail.job);
    state.events = detail.audit.filter((l) => "schema_version" in l && l.job_id === id);
    state.logAttempt = detail.job.attempt_id;
    renderJob();
    return api("/api/jobs/" + id + "/log");
  }).then((log) => {
    document.getElementById("log").textContent = log.text;
    document.getElementById("log-note").textContent = log.exists ? "(attempt " + log.attempt + ")" : "(no output received yet)";
    takeLog(log.exists ? log.next_offset : 0);
  }).catch((err) => { document.getElementById("job-facts").textContent = "error: " + err; });
}

// Cancel and retry from the job page (behind the API token, as every POST): `mam-orch cancel`
// and `mam-orch redispatch` on the hub service; the job's row then changes over the live feed.
function jobAction(verb) {
  const id = state.job && state.job.job.job_id;
  if (!id || !window.confirm((verb === "cancel" ? "Cancel" : "Retry") + " job " + id + "?")) return;
  const note = document.getElementById("job-action");
  note.textContent = verb === "cancel" ? "cancelling…" : "queueing a new attempt…";
  post("/api/jobs/" + id + "/" + verb, {})
    .then((r) => { note.textContent = verb === "cancel" ? "cancelled" : "attempt " + r.attempt_id + " queued"; })
    .catch((err) => { note.textContent = "refused: " + err; });
}

function route() {
  const m = location.hash.match(/^#job\/([0-9a-f]{8})$/);
  if (m) { showJob(m[1]); return; }
  state.job = null;
  document.getElementById("fleet-view").hidden = false;
  document.getElementById("job-view").hidden = true;
  renderFleet();
}

// The live output exactly once: each chunk of the feed says at which byte of the hub's copy it
// starts; what the page already read (the first read, a read after a gap) is skipped.
function takeLog(next) {
  state.logNext = next;
  const held = state.logHeld;
  state.logHeld = [];
  for (const chunk of held) addChunk(chunk);
}

function addChunk(msg) {
  if (state.logNext === null) { state.logHeld.push(msg); return; }
  const bytes = new TextEncoder().encode(msg.text);
  const end = msg.offset + msg.size;
  if (end <= state.logNext) return;  // read already
  if (msg.offset === state.logNext) { appendLog(msg.text); state.logNext = end; return; }
  if (msg.offset < state.logNext && bytes.length === msg.size) {  // partly read: the rest
    appendLog(new TextDecoder().decode(bytes.slice(state.logNext - msg.offset)));
    state.logNext = end;
    return;
  }
  // a gap (or text that is not byte-exact): read the copy from where the page stands
  const id = state.job && state.job.job.job_id, from = state.logNext, attempt = state.logAttempt;
  state.logNext = null;
  state.logHeld.push(msg);
  api("/api/jobs/" + id + "/log?attempt=" + attempt + "&offset=" + from).then((log) => {
    if (!state.job || state.job.job.job_id !== id || state.logAttempt !== attempt) return;
    appendLog(log.text);
    takeLog(log.next_offset);
  }).catch(() => {  // the copy cannot be read now: show what came, as it came
    const held = state.logHeld;
    state.logHeld = [];
    state.logNext = from;
    for (const chunk of held) { appendLog(chunk.text); state.logNext = chunk.offset + chunk.size; }
  });
}

function appendLog(text) {
  const pre = document.getElementById("log");
  const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = (pre.textContent + text).slice(-LOG_VIEW_MAX_CHARS);
  document.getElementById("log-note").textContent = "(live)";
  if (atEnd) pre.scrollTop = pre.scrollHeight;
}

function render() { if (state.job) renderJob(); else renderFleet(); }

function connect() {
  const source = new EventSource("/api/events" + (token ? "?token=" + encodeURIComponent(token) : ""));
  const conn = document.getElementById("conn");
  source.onopen = () => { conn.textContent = "live"; };
  source.onerror = () => { conn.textContent = "reconnecting…"; };
  source.addEventListener("runners", (e) => { state.runners = JSON.parse(e.data).runners; render(); });
  source.addEventListener("queue", (e) => { state.queue = JSON.parse(e.data).queue; render(); });
  source.addEventListener("schedules", (e) => { state.schedules = JSON.parse(e.data).schedules; render(); });
  source.addEventListener("job", (e) => {
    const job = JSON.parse(e.data).job;
    state.jobs.set(job.job_id, job);
    if (state.job && state.job.job.job_id === job.job_id) {
      if (job.attempt_id !== state.logAttempt) { showJob(job.job_id); return; }
      renderJob();
    } else renderFleet();
  });
  source.addEventListener("event", (e) => {
    const msg = JSON.parse(e.data);
    if (msg.event && msg.event.event === "permission_required") loadAsks();
    if (state.job && state.job.job.job_id === msg.job_id) { state.events.push(msg.event); renderJob(); }
  });
  source.addEventListener("log", (e) => {
    const msg = JSON.parse(e.data);
    if (state.job && state.job.job.job_id === msg.job_id && msg.attempt === state.logAttempt) addChunk(msg);
  });
}

Promise.all([api("/api/runners"), api("/api/queue"), api("/api/jobs"), api("/api/schedules")]).then(([r, q, j, s]) => {
  state.runners = r.runners;
  state.queue = q.queue;
  state.schedules = s.schedules;
  for (const job of j.jobs) state.jobs.set(job.job_id, job);
  route();
  loadAsks();
}).catch((err) => { document.getElementById("conn").textContent = "error: " + err; });
window.addEventListener("hashchange", route);
document.getElementById("job-cancel").addEventListener("click", () => jobAction("cancel"));
document.getElementById("job-retry").addEventListener("click", () => jobAction("retry"));
for (const id of FILTERS) document.getElementById(id).addEventListener("input", () => { state.page = 0; renderFleet(); });
document.getElementById("page-prev").addEventListener("click", () => { state.page -= 1; renderFleet(); });
document.getElementById("page-next").addEventListener("click", () => { state.page += 1; renderFleet(); });
setInterval(render, 1000);
setInterval(loadAsks, ASKS_POLL_MS);  // answers given elsewhere (the CLI) leave the list too
connect();
