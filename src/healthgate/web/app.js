// healthgate dashboard: reads only the public REST API, as the caller.
// Open /ui/ (or /ui/#token=TOKEN when the API needs a bearer token: the
// fragment never reaches a server or its logs, and is taken off the address
// bar at once; the token is kept for this tab only, in sessionStorage).
"use strict";

const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) {
  sessionStorage.setItem("healthgate-token", fragment.get("token"));
  history.replaceState(null, "", location.pathname + location.search);
}
const token = sessionStorage.getItem("healthgate-token");
const headers = token ? { Authorization: "Bearer " + token } : {};
let demo = false;
let rates = {};
const upstreamRegion = {};  // "ip:port" of a producer rule -> its region
const lastCounts = {};      // front end -> {region: [count, time]}
const streams = {};

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers, ...(options.headers || {}) } });
  if (!r.ok) { const e = new Error(path + ": " + r.status); e.status = r.status; throw e; }
  return r.json();
}

function esc(s) { return String(s ?? "").replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c])); }
function last(path) { return String(path || "").split("/").pop(); }

function state(obj) { return (obj && obj.status && obj.status.healthState) || "UNKNOWN"; }
function badge(s) { return `<span class="badge ${esc(s)}">${esc(s)}</span>`; }


// The producer's side of one region, from the project's topology (one call
// per project: GET /v1/projects/{p}/topology), as far as the token may see it.
function producerSide(p) {
  if (p === "forbidden") return `<div class="level muted">the producer's side is not visible to this token</div>`;
  if (!p || !p.forwardingRule) return "";
  const fr = p.forwardingRule;
  const port = (fr.ports || [String(fr.portRange).split("-")[0]])[0];
  upstreamRegion[`${fr.IPAddress}:${port}`] = fr.region;
  // (a front end that serves the published rule itself counts its endpoints)
  for (const c of p.composites) for (const src of c.sources) for (const ep of src.endpoints)
    upstreamRegion[`${ep.ipAddress}:${ep.port || port}`] = fr.region;
  let html = `<div class="level">forwarding rule ${esc(fr.name)} ${badge(state(fr))}`;
  for (const c of p.composites) {
    html += `<div class="level">composite ${esc(c.name)}${c.mode === "DRY_RUN" ? " (DRY_RUN)" : ""} ${badge(state(c))}<div class="reason">${esc(c.status && c.status.reason)}</div>`;
    for (const src of c.sources) {
      html += `<div class="level">source ${esc(src.name)} ${badge(state(src))}<div class="reason">${esc(src.status && src.status.reason)}</div>`;
      html += `<div class="chips">` + src.endpoints.map(ep =>
        `<span class="chip ${esc(ep.healthState)}${ep.ejectedUntil ? " ejected" : ""}" title="${esc(ep.reason)}${
          ep.ejectedUntil ? " - ejected from real traffic until " + esc(ep.ejectedUntil) : ""}">${esc(ep.ipAddress)} · ${
          ep.ejectedUntil ? "ejected · " : ""}${
          ep.probedBy ? "probed by " + esc(ep.probedBy.join(", ") || "nobody") : esc(ep.lastProbe || "no probe yet")}</span>`
      ).join("") + `</div></div>`;
    }
    html += `</div>`;
  }
  return html + `</div>`;
}

// Requests per second per region, from the front end's listener counters
// (per upstream "ip:port": served well and failed), which count answered
// requests or connections.
function listenerRates(fr) {
  const upstreams = ((fr.status && fr.status.listener) || {}).upstreams || {};
  const now = Date.now() / 1000;
  const prev = lastCounts[fr.selfLink] || {};
  const out = {};
  const next = {};
  for (const [key, c] of Object.entries(upstreams)) {
    const region = upstreamRegion[key] || key;
    next[region] = (next[region] || 0) + c.served + c.errors;
  }
  for (const [region, count] of Object.entries(next)) {
    const p = prev[region];
    out[region] = p ? Math.max(0, (count - p[0]) / Math.max(0.5, now - p[1])).toFixed(1) : undefined;
  }
  lastCounts[fr.selfLink] = Object.fromEntries(Object.entries(next).map(([r, c]) => [r, [c, now]]));
  return out;
}

function frontend(fr) {
  const route = (fr.status && fr.status.route) || {};
  const served = listenerRates(fr);
  const target = route.target;
  const cards = fr.negs.map(neg => {
    const negPath = neg.selfLink;
    const region = neg.region;
    const s = state(neg);
    const current = negPath === target ? " current" : "";
    const r = served[region] !== undefined ? served[region] : rates[region];
    const rate = r !== undefined ? `${r} req/s` : "";
    const controls = demo ? `<div>${["hang", "refuse", "503"].map(m =>
      `<button data-region="${esc(region)}" data-mode="${m}">break: ${m}</button>`).join("")}
      <button data-region="${esc(region)}" data-mode="heal">heal</button></div>` : "";
    return `<div class="card ${esc(s)}${current}" data-neg="${esc(neg.name)}" data-region="${esc(region)}">
      <div><strong>${esc(region)}</strong> ${esc(neg.name)} ${badge(s)} ${current ? "◀ routing here" : ""} <span class="muted">${esc(rate)}</span></div>
      <div class="reason">${esc(neg.status && neg.status.reason)}</div>
      ${producerSide(neg.producer)}
      ${controls}</div>`;
  }).join("");
  // every region down (FAIL_OPEN keeps the first, FAIL_CLOSED refuses): say so loudly
  const alarm = route.mode === "fail-open" || route.mode === "fail-closed";
  const banner = alarm ? `<div class="banner">every region is UNHEALTHY: ${
    route.mode === "fail-open" ? "FAIL_OPEN keeps sending to " + esc(last(target)) : "FAIL_CLOSED refuses new traffic"}</div>` : "";
  return `<div class="frontend${alarm ? " alarm" : ""}" data-frontend="${esc(fr.name)}">${banner}
    <div class="route">front end <strong>${esc(fr.name)}</strong> (${esc(fr.IPAddress)}:${esc(fr.portRange || (fr.ports || []).join(","))})
      → <strong id="route-${esc(fr.name)}" class="target">${esc(target ? last(target) : "refusing")}</strong>
      <span class="muted">${esc(route.mode || "")}</span></div>
    <div class="reason">why: ${esc(route.reason || "")}</div>
    ${splitBar(route.shares || [], served)}
    <div class="negs">${cards}</div></div>`;
}

// A route that splits its new traffic (trafficDial, spill, a ramp: SPEC §6):
// one stacked bar, a segment per share, the share's reason as its tooltip;
// under it, the split the front end measured (requests per second by region).
function splitBar(shares, served) {
  if (shares.length < 2) return "";
  const bar = `<div class="split" aria-label="traffic split">${shares.map((s, i) =>
    `<div class="share s${i % 4}" style="width:${Number(s.percent)}%" title="${esc(s.reason)}" data-region="${esc(s.region)}">${esc(s.percent)}% ${esc(s.region)}</div>`).join("")}</div>`;
  const total = shares.reduce((sum, s) => sum + Number(served[s.region] || 0), 0);
  if (!(total > 0)) return bar;
  const measured = shares.map(s =>
    `${(100 * Number(served[s.region] || 0) / total).toFixed(0)}% ${esc(s.region)}`).join(", ");
  return bar + `<div class="muted measured">measured: ${measured} (${total.toFixed(1)} req/s)</div>`;
}

// Cluster mode: the live nodes, their regions, how many endpoints each
// probes, and the leader (GET /v1/cluster; "embedded" hides the panel).
async function cluster() {
  let c;
  try { c = await api("/v1/cluster"); } catch (e) { return; }
  if (c.mode !== "cluster") return;
  document.getElementById("cluster").hidden = false;
  document.getElementById("nodes").innerHTML = Object.entries(c.members).map(([node, region]) =>
    `<div class="node" data-node="${esc(node)}"><strong>${esc(node)}</strong> ${esc(region)}
      ${node === c.leader ? '<span class="badge HEALTHY">leader</span>' : ""}
      ${node === c.node ? '<span class="muted">(this API)</span>' : ""}
      <span class="muted">probes ${esc((c.probingByNode || {})[node] ?? 0)}</span></div>`).join("");
}

// Active shifts (SPEC §6): traffic moved away by hand until a time, each
// with who, why, the time left (counted down here between reads) and a
// button that ends it (DELETE; the API says no if the token may not).
let shiftList = [];
async function shifts(projects) {
  const lists = await Promise.all(projects.map(p =>
    api(`/v1/projects/${p}/shifts`).then(r => r.items).catch(() => [])));
  const read = Date.now();
  shiftList = lists.flat().map(s => ({ ...s, until: read + s.secondsLeft * 1000 }));
  drawShifts();
}

function left(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${s % 60} s` : `${s} s`;
}

function drawShifts() {
  const now = Date.now();
  const live = shiftList.filter(s => s.until > now);
  document.getElementById("shifts-panel").hidden = live.length === 0;
  document.getElementById("shifts").innerHTML = live.map(s =>
    `<li class="shift" data-shift="${esc(s.selfLink)}"><strong>${esc(s.project)}</strong> away from
      <strong>${esc(last(s.awayFrom))}</strong> · <span class="left">${esc(left(s.until - now))} left</span>
      <div class="reason">${esc(s.actor)}: ${esc(s.comment)}</div>
      <button data-end="/v1/projects/${esc(s.project)}/shifts/${esc(s.name)}" data-link="${esc(s.selfLink)}">End now</button></li>`).join("");
}
setInterval(drawShifts, 1000);

// Practice runs (SPEC §11): each with the run under way, its next start and
// its last outcome; "Start now" asks for one (the API says why not).
async function practiceRuns(projects) {
  const lists = await Promise.all(projects.map(p =>
    api(`/v1/projects/${p}/global/practiceRuns`).then(r => r.items).catch(() => [])));
  const runs = lists.flat();
  document.getElementById("practice-panel").hidden = runs.length === 0;
  document.getElementById("practice").innerHTML = runs.map(r => {
    const st = r.status || {};
    const lastRun = st.last;
    const now = st.underWay ? `<div><span class="badge UNHEALTHY">under way</span> until ${esc(st.underWay.until)}</div>` : "";
    const next = st.next ? `next: ${esc(st.next)}` : (r.schedule ? "" : "started by hand only");
    const was = lastRun ? `<div class="last">last: <span class="kind">${esc(lastRun.to)}</span> ${esc(lastRun.timestamp)}<div class="reason">${esc(lastRun.reason)}</div></div>` : `<div class="muted">never run yet</div>`;
    return `<li class="practice" data-run="${esc(r.selfLink)}"><strong>${esc(r.project)}/${esc(r.name)}</strong> away from
      <strong>${esc(last(r.awayFrom))}</strong> for ${esc(Math.round(r.durationSec / 60))} min
      ${now}<div class="next">${next}</div>${was}
      ${st.underWay ? "" : `<button data-start="/v1/projects/${esc(r.project)}/global/practiceRuns/${esc(r.name)}:start">Start now</button>`}</li>`;
  }).join("");
}

async function refresh() {
  cluster();
  try {
    if (demo) { try { rates = (await api("/v1/demo")).requestsPerSecond; } catch (e) { rates = {}; } }
    const projects = (await api("/v1/projects")).items;
    // one call per project: its front ends, regions and producers' sides
    const tops = await Promise.all(projects.map(p =>
      api(`/v1/projects/${p}/topology`).catch(() => ({ frontends: [] }))));
    let html = "";
    shifts(projects);
    practiceRuns(projects);
    tops.forEach((top, i) => {
      for (const fr of top.frontends) html += frontend(fr);
      watch(projects[i]);
    });
    document.getElementById("topology").innerHTML = html || `<p class="muted">no front ends (global forwarding rules) visible</p>`;
    document.getElementById("status").textContent = "live · " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("status").textContent = "cannot reach the API: " + e.message;
  }
  if (demo) {
    document.getElementById("rates").innerHTML = Object.entries(rates).map(([r, v]) =>
      `<div>${esc(r)} ${esc(v)}/s<div class="bar" style="width:${Math.min(100, v * 4)}%"></div></div>`).join("") || "no traffic yet";
  }
}

// The transition log, live: the event stream read with fetch (so that the
// token goes in a header, never in a URL), resumed from the last id seen.
function watch(project) {
  if (streams[project]) return;
  streams[project] = { last: null };
  follow(project);
}

async function follow(project) {
  const s = streams[project];
  for (;;) {
    try {
      const h = { ...headers };
      if (s.last !== null) h["Last-Event-ID"] = s.last;
      const r = await fetch(`/v1/projects/${project}/events/stream` + (s.last === null ? "?tail=200" : ""), { headers: h });
      if (!r.ok || !r.body) throw new Error(String(r.status));
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, end);
          buf = buf.slice(end + 2);
          const fields = {};
          for (const line of block.split("\n")) {
            const i = line.indexOf(":");
            if (i > 0) fields[line.slice(0, i)] = line.slice(i + 1).trimStart();
          }
          if (fields.id) s.last = fields.id;
          if (fields.event === "transition" && fields.data) transition(JSON.parse(fields.data));
        }
      }
    } catch (e) {
      // (the API restarting, or a network error: try again shortly)
    }
    await new Promise(ok => setTimeout(ok, 2000));
  }
}

function transition(d) {
  const li = document.createElement("li");
  const name = d.name || last(d.frontend);
  const t = new Date(d.time * 1000).toLocaleTimeString();
  li.innerHTML = `${esc(t)} <span class="kind">${esc(d.kind)}</span> ${esc(d.project)}/${esc(d.region || "global")}/${esc(name)}: ${esc(last(d.from) || "-")} → ${esc(last(d.to) || "refuse")}<div class="reason">${esc(d.reason)}</div>`;
  // newest first, in time order across projects (each project's stream
  // replays its own history, so arrivals interleave)
  li.dataset.time = d.time;
  const list = document.getElementById("timeline");
  const after = [...list.children].find(c => Number(c.dataset.time) < d.time);
  list.insertBefore(li, after || null);
  while (list.children.length > 200) list.lastChild.remove();
  soon();  // a transition: the topology changed, show it now
}

// The topology is read again when a transition arrives (debounced) and every
// 5 s for the traffic rates: one call per project each time.
let pending = null;
function soon() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; refresh(); }, 150);
}

document.addEventListener("click", async ev => {
  const start = ev.target.closest("button[data-start]");
  if (start) {
    start.disabled = true;
    try { await api(start.dataset.start, { method: "POST" }); refresh(); }
    catch (e) { start.textContent = "not started: " + e.status + " (see its last outcome)"; refresh(); }
    return;
  }
  const end = ev.target.closest("button[data-end]");
  if (end) {
    end.disabled = true;
    try { await api(end.dataset.end, { method: "DELETE" }); }
    catch (e) { end.disabled = false; end.textContent = "cannot end it: " + e.status; return; }
    shiftList = shiftList.filter(s => s.selfLink !== end.dataset.link);
    drawShifts();
    refresh();
    return;
  }
  const b = ev.target.closest("button[data-region]");
  if (!b) return;
  const { region, mode } = b.dataset;
  const path = mode === "heal" ? `/v1/demo/regions/${region}/heal` : `/v1/demo/regions/${region}/break`;
  await api(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ mode }) });
  refresh();
});

(async () => {
  try { await api("/v1/demo"); demo = true; document.getElementById("demo").hidden = false; } catch (e) { demo = false; }
  await refresh();
  setInterval(refresh, 5000);
})();
