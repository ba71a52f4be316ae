// fenceline run UI: renders what /api/v1/events streams (see runui/doc.go).
"use strict";

const state = {
  repo: new URLSearchParams(location.search).get("repo") || "",
  leases: new Map(),   // leaseId -> lease record
  shards: null,        // {pools: [...], attempts: [...]} or null
  offset: 0,           // server time - local time, ms
  source: null,
};

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function scopeText(s) {
  if (!s) return "";
  const parts = [];
  if (s.kind === "whole-repo") parts.push("whole repo");
  else if (s.kind === "none") parts.push("no paths");
  else parts.push((s.paths || []).join(", "));
  if (s.tables && s.tables.length) parts.push("tables " + s.tables.join(", "));
  return parts.join(" · ");
}

function ownerText(o) {
  if (!o) return "";
  return [o.taskId && "task " + o.taskId, o.agentId && "agent " + o.agentId, o.attemptId && "attempt " + o.attemptId, o.hostId && "host " + o.hostId]
    .filter(Boolean).join(" / ");
}

function expiresText(l) {
  if (l.status !== "active") return l.reason ? l.reason : "";
  const left = Date.parse(l.expiresAt) - (Date.now() + state.offset);
  if (left <= 0) return "due now";
  const s = Math.ceil(left / 1000);
  return s >= 120 ? `in ${Math.floor(s / 60)}m ${s % 60}s` : `in ${s}s`;
}

function renderLeases() {
  const body = $("#leases tbody");
  const rows = [...state.leases.values()]
    .filter((l) => !state.repo || l.repo === state.repo)
    .sort((a, b) => (a.status === "active") - (b.status === "active") || a.fence - b.fence)
    .reverse();
  body.replaceChildren(...rows.map((l) => {
    const tr = el("tr", { "data-lease-id": l.leaseId, "data-status": l.status, class: l.status === "active" ? "" : "ended" },
      el("td", {}, el("code", {}, l.leaseId)),
      el("td", { class: "repo-col" }, l.repo),
      el("td", {}, scopeText(l.scope)),
      el("td", {}, `${l.workspaceId} (${l.workspaceMode})`),
      el("td", {}, ownerText(l.owner)),
      el("td", { class: "mono" }, String(l.fence)),
      el("td", { class: "status", "data-status": l.status }, l.status),
      el("td", { class: "expires" }, expiresText(l)));
    return tr;
  }));
  const active = rows.filter((l) => l.status === "active").length;
  $("#lease-count").textContent = `${active} active, ${rows.length - active} recently ended`;
  $("#leases-empty").hidden = rows.length > 0;
}

function tick() {
  for (const tr of document.querySelectorAll("#leases tbody tr")) {
    const l = state.leases.get(tr.dataset.leaseId);
    if (!l) continue;
    const cell = tr.querySelector(".expires");
    cell.textContent = expiresText(l);
    const left = Date.parse(l.expiresAt) - (Date.now() + state.offset);
    cell.classList.toggle("soon", l.status === "active" && left < 10000);
  }
}

// table renders rows of objects with the given columns ([key, title, fn?]).
function table(rows, cols, idKey) {
  return el("table", {},
    el("thead", {}, el("tr", {}, ...cols.map(([, t]) => el("th", {}, t)))),
    el("tbody", {}, ...rows.map((r) => el("tr", idKey ? { "data-id": r[idKey] } : {},
      ...cols.map(([k, , fn]) => el("td", {}, fn ? fn(r) : String(r[k] ?? "")))))));
}

function occupants(repo, shardId) {
  return [...state.leases.values()].filter((l) => l.status === "active" && l.repo === repo && l.workspaceId === shardId);
}

function renderShards() {
  const pools = (state.shards && state.shards.pools || []).filter((p) => !state.repo || p.repo === state.repo);
  const box = $("#shards");
  if (!pools.length) { box.replaceChildren(el("p", { class: "empty" }, "No shard pool declared.")); return; }
  box.replaceChildren(...pools.map((p) => el("div", {},
    el("h3", {}, `${p.repo} — ${(p.shards || []).length} of ${p.size} shards, max-sharers ${p.maxSharers || "unbounded"}`),
    table(p.shards || [], [
      ["id", "shard"],
      ["state", "state"],
      ["occupants", "occupants", (s) => occupants(p.repo, s.id).map((l) => `${l.leaseId} (${l.workspaceMode}, ${scopeText(l.scope)})`).join("; ") || "empty"],
      ["commit", "commit capacity", (s) => occupants(p.repo, s.id + "/commit").map((l) => `${l.leaseId} ${ownerText(l.owner)}`).join("; ") || "free"],
      ["path", "path"],
    ], "id"))));
}

function renderAttempts() {
  const rows = (state.shards && state.shards.attempts || []).filter((a) => !state.repo || a.repo === state.repo);
  const box = $("#attempts");
  if (!rows.length) { box.replaceChildren(el("p", { class: "empty" }, "No attempts.")); return; }
  const time = (t) => (t && !t.startsWith("0001") ? new Date(t).toLocaleTimeString() : "");
  box.replaceChildren(table(rows.slice().reverse(), [
    ["attemptId", "attempt"], ["taskId", "task"], ["agentId", "agent"], ["shard", "shard"], ["mode", "mode"],
    ["status", "status"], ["startedAt", "started", (a) => time(a.startedAt)], ["settledAt", "settled", (a) => time(a.settledAt)],
    ["exitCode", "exit"], ["command", "command", (a) => (a.command || []).join(" ")],
  ], "attemptId"));
}

function addAudit(ev, front) {
  if (state.repo && ev.repo !== state.repo) return;
  const li = el("li", { "data-type": ev.type, "data-boundary": ev.boundary, "data-lease-id": ev.leaseId || "" },
    el("span", { class: "time" }, new Date(ev.time).toLocaleTimeString()),
    el("span", { class: "type" }, ev.type),
    el("span", { class: "boundary" }, ev.boundary),
    el("span", { class: "message" }, ev.message || ev.reason || ""));
  const list = $("#audit");
  if (front) list.prepend(li); else list.append(li);
  while (list.children.length > 500) list.lastElementChild.remove();
}

// loadPolicy shows the policies in force for the chosen repository (the
// default's and its own), their versions and the latest shadow refusals.
async function loadPolicy() {
  try {
    const res = await fetch("api/v1/policy" + (state.repo ? "?repo=" + encodeURIComponent(state.repo) : ""));
    if (!res.ok) return;
    const v = await res.json();
    const time = (t) => (t ? new Date(t).toLocaleString() : "");
    const box = $("#policy");
    if (!v.inForce.length) box.replaceChildren(el("p", { class: "empty" }, "No policy: every fence behaves as without one."));
    else box.replaceChildren(...v.inForce.map((d) => el("div", { class: "policy", "data-scope": d.repo || "default", "data-mode": d.mode },
      el("h3", {}, `${d.repo || "default"} policy (${d.mode}), version ${d.version}`),
      el("p", { class: "mono" }, `${d.digest} · set by ${d.setBy} at ${time(d.setAt)}`),
      el("pre", {}, d.text))));
    const hist = Object.entries(v.history).flatMap(([k, vs]) => vs.map((d) => ({ ...d, key: k })));
    $("#policy-history").replaceChildren(hist.length ? table(hist.reverse(), [
      ["key", "policy"], ["version", "version"], ["setBy", "set by"], ["setAt", "set at", (d) => time(d.setAt)],
      ["digest", "digest", (d) => (d.text ? d.digest : "removed")],
    ]) : el("p", { class: "empty" }, "No versions."));
    $("#shadow").replaceChildren(v.shadowRefused.length ? table(v.shadowRefused.slice().reverse(), [
      ["time", "time", (e) => new Date(e.time).toLocaleTimeString()], ["boundary", "boundary"], ["leaseId", "lease"],
      ["message", "would refuse"],
    ]) : el("p", { class: "empty" }, "No shadow refusals."));
  } catch (e) { /* the stream shows the connection state */ }
}

async function loadRepos() {
  try {
    const res = await fetch("api/v1/repos");
    if (!res.ok) return;
    const repos = await res.json();
    const sel = $("#repo");
    const have = new Set([...sel.options].map((o) => o.value));
    for (const r of repos) if (!have.has(r.repo)) sel.append(el("option", { value: r.repo }, r.repo));
    sel.value = state.repo;
  } catch (e) { /* the stream shows the connection state */ }
}

function connect() {
  if (state.source) state.source.close();
  $("#audit").replaceChildren();
  const conn = $("#conn");
  conn.dataset.state = "connecting"; conn.textContent = "connecting…";
  const src = new EventSource("api/v1/events" + (state.repo ? "?repo=" + encodeURIComponent(state.repo) : ""));
  state.source = src;
  src.addEventListener("snapshot", (e) => {
    const snap = JSON.parse(e.data);
    state.offset = Date.parse(snap.serverTime) - Date.now();
    state.leases = new Map((snap.leases || []).map((l) => [l.leaseId, l]));
    state.shards = snap.shards;
    conn.dataset.state = "live"; conn.textContent = "live";
    renderLeases(); renderShards(); renderAttempts();
  });
  src.addEventListener("lease", (e) => {
    const l = JSON.parse(e.data);
    const old = state.leases.get(l.leaseId);
    if (old && old.version > l.version) return;
    state.leases.set(l.leaseId, l);
    renderLeases(); renderShards();
    if (!document.querySelector(`#repo option[value="${CSS.escape(l.repo)}"]`)) loadRepos();
  });
  src.addEventListener("shards", (e) => {
    state.shards = JSON.parse(e.data);
    renderShards(); renderAttempts();
  });
  src.addEventListener("audit", (e) => addAudit(JSON.parse(e.data), true));
  src.onerror = () => { conn.dataset.state = "down"; conn.textContent = "reconnecting…"; };
}

$("#repo").addEventListener("change", (e) => {
  state.repo = e.target.value;
  const u = new URL(location.href);
  if (state.repo) u.searchParams.set("repo", state.repo); else u.searchParams.delete("repo");
  history.replaceState(null, "", u);
  document.body.classList.toggle("one-repo", !!state.repo);
  connect();
  loadPolicy();
});

document.body.classList.toggle("one-repo", !!state.repo);
loadRepos();
connect();
loadPolicy();
setInterval(tick, 1000);
setInterval(loadPolicy, 2000);
