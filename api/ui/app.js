// gpufleet cluster map: signs in with a bearer token (kept in sessionStorage), then polls
// GET /v1/cluster every 2 s and redraws. Every string from the API goes in through
// textContent or attributes, never as HTML.
"use strict";

const TOKEN_KEY = "gpufleet.token";
const POLL_MS = 2000;
const LABELS = {
  free: "free", guaranteed: "guaranteed", borrowed: "borrowed", reserved: "reserved",
  hot_spare: "hot spare", cordoned: "cordoned", down: "down", burn_in: "burn-in",
};
const api = (path) => new URL("../" + path, window.location.href).toString();
const $ = (id) => document.getElementById(id);
let timer = null;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return e;
}

class AuthError extends Error {}

async function get(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const r = await fetch(api(path), { headers: { Authorization: "Bearer " + token, Accept: "application/json" } });
  if (r.status === 401 || r.status === 403) {
    let msg = "the token was refused";
    try { msg = (await r.json()).error.message || msg; } catch (_) { /* not the error shape */ }
    throw new AuthError(`${msg} (HTTP ${r.status})`);
  }
  if (!r.ok) throw new Error(`HTTP ${r.status} from ${path}`);
  return r.json();
}

function showLogin(message) {
  if (timer !== null) { clearTimeout(timer); timer = null; }
  sessionStorage.removeItem(TOKEN_KEY);
  $("app").hidden = true;
  $("who").hidden = true;
  $("login").hidden = false;
  const err = $("login-error");
  err.hidden = !message;
  err.textContent = message ? `Sign-in failed: ${message}. Check the token and sign in again.` : "";
  $("token").value = "";
  $("token").focus();
}

async function start() {
  try {
    const me = await get("v1/me");
    $("principal").textContent = me.admin ? `${me.name} (admin)` : `${me.name} (team ${me.team})`;
  } catch (e) {
    showLogin(e instanceof AuthError ? e.message : `cannot reach the API (${e.message})`);
    return;
  }
  $("login").hidden = true;
  $("login-error").hidden = true;
  $("app").hidden = false;
  $("who").hidden = false;
  poll();
}

async function poll() {
  timer = null;
  try {
    render(await get("v1/cluster"));
    $("status").hidden = true;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e instanceof AuthError) { showLogin(e.message); return; }
    $("status").hidden = false;
    $("status").textContent = `Cannot refresh (${e.message}); retrying every ${POLL_MS / 1000} s.`;
  }
  if (sessionStorage.getItem(TOKEN_KEY)) timer = setTimeout(poll, POLL_MS);
}

function gpuTitle(node, g) {
  let t = `${node.node_id} GPU ${g.index}: ${LABELS[g.state] || g.state}`;
  if (g.team) t += ` - team ${g.team}`;
  if (g.job_id) t += `, job ${g.job_id}`;
  return t;
}

function nodeTitle(n) {
  let t = `${n.node_id} (${n.gpu_type}, block ${n.block_id}): ${n.state}`;
  if (n.reason) t += ` - ${n.reason}`;
  return t;
}

function render(c) {
  const legend = $("legend");
  legend.replaceChildren(...c.gpu_states.map((s) => el("li", {}, el("span", { class: "swatch", dataset: { state: s } }), LABELS[s] || s)));

  const t = c.totals;
  $("idle-gpus").textContent = String(t.idle_gpu_total);
  $("idle-cost").textContent = "$" + t.idle_cost_usd_per_hour.toFixed(2);
  const busyIdle = Object.values(t.allocated_idle_gpus).reduce((a, b) => a + b, 0);
  $("allocated-idle").textContent = `${busyIdle} ($${t.allocated_idle_cost_usd_per_hour.toFixed(2)}/h)`;
  $("queued").textContent = String(c.queue.reduce((a, q) => a + q.jobs_queued, 0));

  $("grid").replaceChildren(...c.blocks.map((b) => el("div", { class: "block", dataset: { block: b.block_id } },
    el("h3", {}, b.block_id),
    el("div", { class: "nodes" }, ...b.nodes.map((n) => el("div", { class: `node ${n.state}`, title: nodeTitle(n), dataset: { node: n.node_id } },
      ...n.gpus.map((g) => el("div", { class: "gpu", title: gpuTitle(n, g), dataset: { state: g.state, index: g.index } })),
    ))),
  )));

  $("queue").replaceChildren(...c.queue.map((q) => {
    const table = el("table", { class: "queue-class", dataset: { class: q.priority_class } },
      el("caption", {}, `${q.priority_class}: ${q.jobs_queued} queued, ${q.gpus_queued} GPUs`),
      el("thead", {}, el("tr", {}, ...["#", "job", "team", "GPUs", "reason", "expected start"].map((h) => el("th", {}, h)))));
    const body = el("tbody");
    for (const j of q.jobs) {
      body.append(el("tr", {},
        el("td", {}, j.queue_position ?? "-"),
        el("td", {}, j.job_id ? (j.name ? `${j.job_id} (${j.name})` : j.job_id) : "(another team's job)"),
        el("td", {}, j.team),
        el("td", {}, `${j.gpus} ${j.gpu_type}`),
        el("td", {}, j.pending_reason ?? "-"),
        el("td", {}, j.expected_start ? new Date(j.expected_start).toLocaleString() : "-")));
    }
    if (q.jobs_queued === 0) body.append(el("tr", {}, el("td", { colspan: "6", class: "muted" }, "none queued")));
    else if (q.jobs_queued > q.jobs.length) body.append(el("tr", {}, el("td", { colspan: "6", class: "muted" }, `... and ${q.jobs_queued - q.jobs.length} more`)));
    table.append(body);
    return table;
  }));

  $("teams").tBodies[0].replaceChildren(...c.teams.map((u) => el("tr", {},
    el("td", {}, u.team), el("td", {}, u.gpu_type), el("td", {}, u.guaranteed), el("td", {}, u.borrow_limit),
    el("td", {}, u.in_use), el("td", {}, u.borrowed), el("td", {}, u.allocated_idle))));
  const idleRows = Object.entries(t.allocated_idle_gpus).sort();
  $("idle-teams").tBodies[0].replaceChildren(...(idleRows.length ? idleRows.map(([team, n]) => el("tr", {}, el("td", {}, team), el("td", {}, n)))
    : [el("tr", {}, el("td", { colspan: "2", class: "muted" }, "none"))]));
}

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  start();
});
$("logout").addEventListener("click", () => showLogin(""));
if (sessionStorage.getItem(TOKEN_KEY)) start(); else showLogin("");
