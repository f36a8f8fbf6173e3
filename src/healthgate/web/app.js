// healthgate dashboard: reads only the public REST API, as the caller.
// Open /ui/ (or /ui/#token=TOKEN when the API needs a bearer token: the
// fragment never reaches a server or its logs, and is taken off the address
// bar at once; the token is kept for this tab only, in sessionStorage).
//
// The charts are drawn by hand on canvases (no library, nothing fetched
// from anywhere but this API: a few hundred lines cost less than a
// dependency to vet and ship, and the page's Content-Security-Policy allows
// nothing else). Per front end, one GET .../traffic brings the last 15
// minutes (series per region and second, the decisions as markers, each
// region's endpoints); then the event stream brings each new second and
// every record, so the picture moves with the incident.
"use strict";

const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) {
  sessionStorage.setItem("healthgate-token", fragment.get("token"));
  history.replaceState(null, "", location.pathname + location.search);
}
const token = sessionStorage.getItem("healthgate-token");
const headers = token ? { Authorization: "Bearer " + token } : {};
const PAGE = 10;          // front ends per page, per project
const WINDOW = 900;       // seconds charted
let demo = false;
let rates = {};
const upstreamRegion = {};  // "ip:port" of a producer rule -> its region
const lastCounts = {};      // front end -> {region: [count, time]}
const streams = {};         // project -> its event stream
const pages = {};           // project -> page shown (0-based)
let search = "";
const charts = {};          // front end path -> {series, markers, endpoints, regions, loaded}
window.healthgateCharts = charts;  // (what is drawn, for the browser tests)

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers, ...(options.headers || {}) } });
  if (!r.ok) { const e = new Error(path + ": " + r.status); e.status = r.status; throw e; }
  return r.json();
}

function esc(s) { return String(s ?? "").replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c])); }
function last(path) { return String(path || "").split("/").pop(); }

function state(obj) { return (obj && obj.status && obj.status.healthState) || "UNKNOWN"; }
function badge(s) { return `<span class="badge ${esc(s)}">${esc(s)}</span>`; }

const PALETTE = ["#1a73e8", "#12b5cb", "#9334e6", "#e8710a", "#188038", "#c5221f", "#f9ab00", "#5f6368"];
const STATE_COLOR = { HEALTHY: "#1e8e3e", DEGRADED: "#e37400", UNHEALTHY: "#d93025", UNKNOWN: "#bdc1c6" };
function regionColor(chart, region) {
  const order = Object.keys(chart.regions || {});
  const i = order.indexOf(region);
  return PALETTE[(i < 0 ? order.length : i) % PALETTE.length];
}


// The producer's side of one region, from the project's topology (one call
// per project page: GET /v1/projects/{p}/topology), as far as the token may
// see it; a source of many endpoints is counted, its unwell ones listed.
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
      if (src.endpointCounts) {
        const n = src.endpointCounts;
        html += `<div class="counts">${esc(n.total)} endpoints: ${["HEALTHY", "DEGRADED", "UNKNOWN", "UNHEALTHY"].filter(s => n[s]).map(s =>
          `<span class="chip ${s}">${esc(n[s])} ${s}</span>`).join(" ")}</div>`;
      }
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
  return `<div class="frontend${alarm ? " alarm" : ""}" data-frontend="${esc(fr.name)}" data-path="${esc(fr.selfLink)}">${banner}
    <div class="route">front end <strong>${esc(fr.name)}</strong> (${esc(fr.IPAddress)}:${esc(fr.portRange || (fr.ports || []).join(","))})
      → <strong id="route-${esc(fr.name)}" class="target">${esc(target ? last(target) : "refusing")}</strong>
      <span class="muted">${esc(route.mode || "")}</span></div>
    <div class="reason">why: ${esc(route.reason || "")}</div>
    ${splitBar(route.shares || [], served)}
    ${chartBlock(fr.selfLink)}
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

// ------------------------------------------------------------------ charts

function chartBlock(path) {
  return `<div class="charts" data-charts="${esc(path)}">
    <div class="legend"></div>
    <div class="plot"><canvas class="c-requests" data-h="120"></canvas><div class="markers"></div><div class="label">requests/s by region (each try counts)</div></div>
    <div class="plot"><canvas class="c-errors" data-h="60"></canvas><div class="label">errors/s</div></div>
    <div class="plot"><canvas class="c-latency" data-h="60"></canvas><div class="label">latency p50 (solid), p99 (dashed), ms</div></div>
    <div class="strips"></div>
    <div class="axis"></div>
  </div>`;
}

// One GET per front end: the window, the markers, the endpoints.
async function loadChart(path) {
  const [, project, , , name] = path.split("/");
  try {
    const t = await api(`/v1/projects/${project}/global/forwardingRules/${name}/traffic?seconds=${WINDOW}`);
    charts[path] = { ...t, loaded: Date.now() };
  } catch (e) {
    return;
  }
  draw(path);
}

// The event stream's traffic event: seconds of the front end, put in their
// place (the chart may have been read again meanwhile: they may overlap it).
function addSeconds(ev) {
  const c = charts[ev.frontend];
  if (!c || !c.series) return;
  const s = c.series;
  const length = seriesLength(s);
  const add = ev.regions || {};
  const n = Object.values(add).length ? Object.values(add)[0].requests.length : 0;
  const end = ev.start + n;  // (one past the last second it brings)
  const grow = Math.max(0, end - (s.start + length));
  for (const region of Object.keys(add)) {
    if (!s.regions[region]) {
      s.regions[region] = {};
      for (const k of ["requests", "errors", "p50Ms", "p99Ms"]) s.regions[region][k] = new Array(length).fill(0);
    }
  }
  for (const [region, r] of Object.entries(s.regions)) {
    const got = add[region];
    for (const k of ["requests", "errors", "p50Ms", "p99Ms"]) {
      for (let i = 0; i < grow; i++) r[k].push(0);
      for (let i = 0; i < n; i++) {
        const at = ev.start + i - s.start;
        if (at >= 0) r[k][at] = got ? got[k][i] : 0;
      }
    }
  }
  const total = seriesLength(s);
  if (total > WINDOW) {
    const drop = total - WINDOW;
    for (const r of Object.values(s.regions)) for (const k of Object.keys(r)) r[k].splice(0, drop);
    s.start += drop;
  }
  c.now = Math.max(c.now || 0, end - 1);
  draw(ev.frontend);
}

function seriesLength(s) {
  const r = Object.values(s.regions || {})[0];
  return r ? r.requests.length : 0;
}

const MARKER_KINDS = new Set(["Route", "Ramp", "Change", "Hold", "PracticeRun", "Convergence",
  "NetworkEndpointGroup", "Ejection", "HealthSource"]);

function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.parentElement.clientWidth || 600;
  const h = Number(canvas.dataset.h) || 60;
  canvas.style.width = w + "px";
  canvas.style.height = h + "px";
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [ctx, w, h];
}

function draw(path) {
  const c = charts[path];
  const el = document.querySelector(`.charts[data-charts="${CSS.escape(path)}"]`);
  if (!c || !el) return;
  const s = c.series || { start: c.now, regions: {} };
  // the span drawn: from the first second anything happened (at least a
  // minute, at most the window), so a young server's picture is not a sliver
  const now = c.now || s.start;
  const span = Math.max(60, Math.min(WINDOW, now - firstActivity(c) + 10));
  const t0 = now - span + 1;
  const x = (t, w) => ((t - t0) / (span - 1)) * w;
  el.dataset.span = String(span);
  const ticks = el.querySelector(".axis");
  ticks.innerHTML = [span, (2 * span) / 3, span / 3].map(v =>
    `<span>−${v >= 120 ? Math.round(v / 60) + " min" : Math.round(v) + " s"}</span>`).join("") + "<span>now</span>";
  const regions = Object.keys(c.regions || {}).filter(r => s.regions[r]).concat(
    Object.keys(s.regions).filter(r => !(c.regions || {})[r]));
  // requests: stacked areas, by region in failover order
  {
    const canvas = el.querySelector(".c-requests");
    const [ctx, w, h] = sizeCanvas(canvas);
    const n = seriesLength(s);
    const total = new Array(n).fill(0);
    for (const r of regions) s.regions[r].requests.forEach((v, i) => { total[i] += v; });
    const max = Math.max(1, ...total);
    const base = new Array(n).fill(0);
    for (const r of regions) {
      const vals = s.regions[r].requests;
      ctx.beginPath();
      for (let i = 0; i < n; i++) ctx.lineTo(x(s.start + i, w), h - (h - 4) * (base[i] + vals[i]) / max);
      for (let i = n - 1; i >= 0; i--) ctx.lineTo(x(s.start + i, w), h - (h - 4) * base[i] / max);
      ctx.closePath();
      ctx.fillStyle = regionColor(c, r) + "b0";
      ctx.fill();
      vals.forEach((v, i) => { base[i] += v; });
    }
    ctx.fillStyle = "#5f6368";
    ctx.font = "11px system-ui";
    ctx.fillText(`${max}/s`, 4, 11);
    el.dataset.max = String(max);
  }
  lines(el.querySelector(".c-errors"), s, regions, c, x, ["errors"], "/s");
  lines(el.querySelector(".c-latency"), s, regions, c, x, ["p50Ms", "p99Ms"], " ms");
  // the legend: each region's color and its rate now (the last 5 s)
  el.querySelector(".legend").innerHTML = regions.map(r => {
    const vals = s.regions[r].requests.slice(-5);
    const rate = vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : 0;
    return `<span class="swatch" style="background:${regionColor(c, r)}"></span>${esc(r)} ${rate.toFixed(1)}/s`;
  }).join(" · ");
  // the decisions, where they happened (each one's reason its tooltip)
  const marks = el.querySelector(".markers");
  marks.innerHTML = (c.markers || []).filter(m => m.time >= t0).map(m => {
    const left = Math.max(0, Math.min(100, 100 * (m.time - t0) / (span - 1)));
    const what = `${new Date(m.time * 1000).toLocaleTimeString()} ${m.kind} ${last(m.name || m.path)} → ${last(m.to) || "refuse"}: ${m.reason}`;
    return `<div class="marker k-${esc(m.kind)} to-${esc(m.to)}" style="left:${left.toFixed(2)}%" title="${esc(what)}" data-kind="${esc(m.kind)}" data-time="${esc(m.time)}"></div>`;
  }).join("");
  strips(el.querySelector(".strips"), c, t0, span);
}

function firstActivity(c) {
  const s = c.series || {};
  let first = c.now || 0;
  for (const r of Object.values(s.regions || {})) {
    const i = r.requests.findIndex(v => v > 0);
    if (i >= 0) first = Math.min(first, s.start + i);
  }
  for (const m of c.markers || []) first = Math.min(first, m.time);
  return first;
}

function lines(canvas, s, regions, c, x, keys, unit) {
  const [ctx, w, h] = sizeCanvas(canvas);
  let max = 0;
  for (const r of regions) for (const k of keys) max = Math.max(max, ...s.regions[r][k]);
  max = max || 1;
  for (const r of regions) {
    keys.forEach((k, j) => {
      const vals = s.regions[r][k];
      ctx.beginPath();
      ctx.setLineDash(j ? [4, 3] : []);
      vals.forEach((v, i) => ctx.lineTo(x(s.start + i, w), h - (h - 4) * v / max));
      ctx.strokeStyle = regionColor(c, r);
      ctx.lineWidth = 1.5;
      ctx.stroke();
    });
  }
  ctx.setLineDash([]);
  ctx.fillStyle = "#5f6368";
  ctx.font = "11px system-ui";
  ctx.fillText(`${Number(max.toFixed(1))}${unit}`, 4, 11);
}

// Per region, its endpoints over the window: a row each (a cell per second,
// colored by state), or above a few hundred, the count in each state.
function strips(el, c, t0, span) {
  const parts = [];
  for (const [region, info] of Object.entries(c.endpoints || {})) {
    if (!info.visible) { parts.push(`<div class="strip muted">${esc(region)}: the producer's endpoints are not visible to this token</div>`); continue; }
    const rows = info.endpoints ? info.endpoints.length : 0;
    const height = info.endpoints ? Math.min(120, Math.max(8, rows * 3)) : 40;
    parts.push(`<div class="strip" data-region="${esc(region)}" data-endpoints="${esc(rows || (info.counts ? "counted" : 0))}"><div class="label">${esc(region)}: ${info.endpoints ? rows + " endpoints" : "endpoints by state (counted)"}</div><canvas data-h="${height}" style="height:${height}px"></canvas></div>`);
  }
  el.innerHTML = parts.join("");
  for (const strip of el.querySelectorAll(".strip[data-region]")) {
    const info = c.endpoints[strip.dataset.region];
    const [ctx, w, h] = sizeCanvas(strip.querySelector("canvas"));
    const now = (c.now || t0 + span - 1);
    const x = t => Math.max(0, Math.min(w, ((t - t0) / (span - 1)) * w));
    if (info.endpoints) {
      const rowH = h / Math.max(1, info.endpoints.length);
      info.endpoints.forEach((ep, row) => {
        let stateNow = ep.start, from = t0;
        for (const [t, to] of ep.changes.concat([[now + 1, null]])) {
          ctx.fillStyle = STATE_COLOR[stateNow] || STATE_COLOR.UNKNOWN;
          ctx.fillRect(x(from), row * rowH, Math.max(1, x(t) - x(from)), Math.max(1, rowH - (rowH > 3 ? 1 : 0)));
          stateNow = to; from = t;
        }
      });
    } else if (info.counts) {
      const states = ["UNHEALTHY", "UNKNOWN", "DEGRADED", "HEALTHY"];
      const n = info.counts.HEALTHY.length;
      const from = c.now - n + 1;  // (the counts' first second)
      for (let i = Math.max(0, t0 - from); i < n; i++) {
        const total = states.reduce((a, st) => a + info.counts[st][i], 0) || 1;
        let y = 0;
        for (const st of states) {
          const part = h * info.counts[st][i] / total;
          ctx.fillStyle = STATE_COLOR[st];
          ctx.fillRect(x(from + i), y, Math.max(1, w / span), part);
          y += part;
        }
      }
    }
  }
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
    // one call per project: a page of its front ends (those matching the
    // search), their regions and producers' sides
    const q = encodeURIComponent(search);
    const tops = await Promise.all(projects.map(p =>
      api(`/v1/projects/${p}/topology?pageSize=${PAGE}&pageToken=${(pages[p] || 0) * PAGE}&search=${q}`)
        .catch(() => ({ frontends: [], total: 0 }))));
    let html = "";
    shifts(projects);
    practiceRuns(projects);
    const shown = [];
    tops.forEach((top, i) => {
      const p = projects[i];
      if (top.total > PAGE) {
        const page = pages[p] || 0, count = Math.ceil(top.total / PAGE);
        html += `<div class="pager" data-project="${esc(p)}">${esc(p)}: front ends ${page * PAGE + 1}-${Math.min(top.total, (page + 1) * PAGE)} of ${esc(top.total)}
          <button data-page="${page - 1}" data-project="${esc(p)}" ${page ? "" : "disabled"}>◀</button>
          <button data-page="${page + 1}" data-project="${esc(p)}" ${page + 1 < count ? "" : "disabled"}>▶</button></div>`;
      }
      for (const fr of top.frontends) { html += frontend(fr); shown.push(fr.selfLink); }
      watch(p, top.frontends.map(fr => fr.name));
    });
    document.getElementById("topology").innerHTML = html || `<p class="muted">no front ends (global forwarding rules) ${search ? "match the search" : "visible"}</p>`;
    for (const path of shown) {
      if (!charts[path] || Date.now() - charts[path].loaded > 60_000) loadChart(path);
      else draw(path);
    }
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
// token goes in a header, never in a URL), resumed from the last id seen;
// with it, each second of the front ends on show (their traffic events).
function watch(project, frontends) {
  const wanted = frontends.slice(0, 50).join(",");
  const s = streams[project];
  if (s && s.traffic === wanted) return;
  if (s) { s.traffic = wanted; if (s.abort) s.abort.abort(); return; }
  streams[project] = { last: null, traffic: wanted, abort: null };
  follow(project);
}

async function follow(project) {
  const s = streams[project];
  for (;;) {
    try {
      const h = { ...headers };
      if (s.last !== null) h["Last-Event-ID"] = s.last;
      const params = new URLSearchParams();
      if (s.last === null) params.set("tail", "200");
      if (s.traffic) params.set("traffic", s.traffic);
      s.abort = new AbortController();
      const r = await fetch(`/v1/projects/${project}/events/stream?${params}`, { headers: h, signal: s.abort.signal });
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
          if (fields.event === "traffic" && fields.data) addSeconds(JSON.parse(fields.data));
        }
      }
    } catch (e) {
      // (the API restarting, a network error, or new front ends on show: again shortly)
      if (e && e.name === "AbortError") continue;
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
  if (MARKER_KINDS.has(d.kind) || d.kind === "Endpoint") {
    // (a decision or a change of health: the charts' markers and strips, anew)
    for (const path of Object.keys(charts)) reloadSoon(path);
  }
  soon();  // a transition: the topology changed, show it now
}

const reloads = {};
function reloadSoon(path) {
  if (reloads[path] || !document.querySelector(`.charts[data-charts="${CSS.escape(path)}"]`)) return;
  reloads[path] = setTimeout(() => { delete reloads[path]; loadChart(path); }, 1000);
}

// The topology is read again when a transition arrives (debounced) and every
// 5 s for the traffic rates: one call per project each time.
let pending = null;
function soon() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; refresh(); }, 150);
}

document.addEventListener("click", async ev => {
  const pager = ev.target.closest("button[data-page]");
  if (pager) {
    pages[pager.dataset.project] = Number(pager.dataset.page);
    refresh();
    return;
  }
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

let typing = null;
document.getElementById("search").addEventListener("input", ev => {
  clearTimeout(typing);
  typing = setTimeout(() => {
    search = ev.target.value.trim();
    for (const p of Object.keys(pages)) pages[p] = 0;
    refresh();
  }, 250);
});
window.addEventListener("resize", () => { for (const path of Object.keys(charts)) draw(path); });

(async () => {
  try { await api("/v1/demo"); demo = true; document.getElementById("demo").hidden = false; } catch (e) { demo = false; }
  await refresh();
  setInterval(refresh, 5000);
})();
