// The admin dashboard. It renders the admin API's JSON as given (formatted, never recomputed),
// so every number on the page equals the API's. Live values arrive as server-sent events
// (one overview snapshot a second); history is fetched per window and extended with live points.

import { chartWidth, makeChart } from "/admin/static/charts.js";
import { loadPredictors } from "/admin/static/predictors.js";
import { loadScaling } from "/admin/static/scaling.js";
import { loadWorkload } from "/admin/static/workload.js";

const CLOUD_COLORS = { aws: "#e8890c", gcp: "#3b78e7", azure: "#0a8f8f" };
const PALETTE = ["#8e44ad", "#c0392b", "#27ae60", "#7f8c8d", "#d35400", "#2c3e50"];
const SITE_COLUMNS = [
  "queued_requests", "running_requests", "queued_tokens", "running_tokens",
  "predicted_remaining_tokens", "token_load", "requests_per_min", "ttft_ms", "e2e_ms",
  "prefix_cache_hit_rate",
];
const FORMATS = {
  requests_per_min: fmt2, ttft_ms: fmt1, e2e_ms: fmt1, prefix_cache_hit_rate: fmtPct,
};

const state = {
  windowS: 3600,
  overview: null,
  history: null,
  chart: null,
  live: [], // [at, {cloud: token_load}] since the history was loaded
  detail: null, // the site shown in the drill-down
  detailCharts: [],
  offloadsRecent: null,
};

function fmtInt(v) { return v == null ? "–" : Math.round(v).toLocaleString("en-US"); }
function fmt1(v) { return v == null ? "–" : v.toFixed(1); }
function fmt2(v) { return v == null ? "–" : v.toFixed(2); }
function fmtPct(v) { return v == null ? "–" : `${(100 * v).toFixed(1)}%`; }
function fmtField(field, v) { return (FORMATS[field] || fmtInt)(v); }
function fmtTime(epoch) { return new Date(epoch * 1000).toLocaleTimeString("en-GB"); }
function compact(v) {
  if (v == null) return "";
  const a = Math.abs(v);
  return a >= 1e6 ? `${+(v / 1e6).toFixed(1)}M` : a >= 1e3 ? `${+(v / 1e3).toFixed(1)}k` : `${+v.toFixed(1)}`;
}
function cloudColor(cloud, i) { return CLOUD_COLORS[cloud] || PALETTE[i % PALETTE.length]; }
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

function showError(message) {
  const box = document.getElementById("page-error");
  box.textContent = message;
  box.hidden = false;
}

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (response.status === 401) {
    location.assign("/admin/login");
    throw new Error("signed out");
  }
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function bucketTimes(h) {
  const t = new Array(h.points);
  for (let i = 0; i < h.points; i++) t[i] = h.start + i * h.step_s;
  return t;
}

// ---- overview (live) ----

function renderPolicy(ov) {
  document.getElementById("policy").textContent = `routing: ${ov.policy.routing}`;
  document.getElementById("offload-policy").textContent = `offload: ${ov.policy.offload ? "on" : "off"}`;
  document.getElementById("recent-s").textContent = String(ov.recent_s);
}

function renderClouds(ov) {
  const root = document.getElementById("clouds");
  root.dataset.at = String(ov.at);
  for (const [i, c] of ov.clouds.entries()) {
    let card = root.querySelector(`[data-cloud="${c.cloud}"]`);
    if (!card) {
      card = el("article", { class: "card", "data-cloud": c.cloud });
      card.style.setProperty("--accent", cloudColor(c.cloud, i));
      card.innerHTML = `
        <h3></h3>
        <div class="big"><span data-field="token_load"></span> <small>tokens</small></div>
        <dl>
          <dt>queued</dt><dd data-field="queued_tokens"></dd>
          <dt>running</dt><dd data-field="running_tokens"></dd>
          <dt>predicted</dt><dd data-field="predicted_remaining_tokens"></dd>
          <dt>requests</dt><dd><span data-field="queued_requests"></span> q · <span data-field="running_requests"></span> r</dd>
          <dt>req/min</dt><dd data-field="requests_per_min"></dd>
          <dt>TTFT / E2E ms</dt><dd><span data-field="ttft_ms"></span> / <span data-field="e2e_ms"></span></dd>
          <dt>sites healthy</dt><dd><span data-field="healthy_sites"></span>/<span data-field="sites"></span></dd>
        </dl>`;
      card.querySelector("h3").textContent = c.cloud;
      root.append(card);
    }
    for (const node of card.querySelectorAll("[data-field]")) {
      node.textContent = fmtField(node.dataset.field, c[node.dataset.field]);
    }
  }
}

function renderSites(ov) {
  const body = document.querySelector("#sites tbody");
  body.dataset.at = String(ov.at);
  for (const s of ov.sites) {
    let row = body.querySelector(`tr[data-site="${s.name}"]`);
    if (!row) {
      row = el("tr", { "data-site": s.name, tabindex: "0", title: "show this site's charts" });
      row.append(
        el("td", {}, el("strong", {}, s.name), el("div", { class: "muted" }, s.region),
          // An OpenAI-compatible engine keeps its own queue: offload cannot take work from it.
          el("div", { class: "muted", "data-field": "kind",
                      title: s.can_release_queued ? "queued work can be offloaded to other sites"
                        : "the engine owns its queue: queued work cannot be released for offload" },
             s.kind === "openai" ? "OpenAI API · no offload release" : "gRPC engine")),
        el("td", { "data-field": "cloud" }, s.cloud),
        el("td", { "data-field": "model" }, s.model),
        el("td", { "data-field": "healthy" }),
        ...SITE_COLUMNS.map((f) => el("td", { class: "num", "data-field": f })),
      );
      row.addEventListener("click", () => openDetail(s.name));
      row.addEventListener("keydown", (e) => { if (e.key === "Enter") openDetail(s.name); });
      body.append(row);
    }
    row.classList.toggle("selected", state.detail === s.name);
    const health = row.querySelector('[data-field="healthy"]');
    health.textContent = s.healthy ? "healthy" : "down";
    health.className = s.healthy ? "ok" : "bad";
    health.title = s.last_error || "";
    for (const f of SITE_COLUMNS) row.querySelector(`[data-field="${f}"]`).textContent = fmtField(f, s[f]);
  }
}

function appendLive(ov) {
  if (!state.history || !state.chart) return;
  const last = state.live.length ? state.live[state.live.length - 1][0] : -Infinity;
  if (ov.at <= last) return;
  state.live.push([ov.at, Object.fromEntries(ov.clouds.map((c) => [c.cloud, c.token_load]))]);
  state.chart.setData(headlineData());
}

function onOverview(ov) {
  const first = state.overview == null;
  state.overview = ov;
  if (first && state.chart) describeSpan(state.chart); // the history came first
  renderPolicy(ov);
  renderClouds(ov);
  renderSites(ov);
  appendLive(ov);
  if (state.detail) renderDetailNow(ov.sites.find((s) => s.name === state.detail), ov.at);
  if (state.offloadsRecent !== null && ov.offloads_recent !== state.offloadsRecent) loadOffloads();
  state.offloadsRecent = ov.offloads_recent;
}

function connectStream() {
  const live = document.getElementById("live");
  const source = new EventSource("/admin/api/stream");
  let first = true;
  return new Promise((resolve) => {
    source.addEventListener("overview", (event) => {
      live.dataset.state = "live";
      live.textContent = "live";
      onOverview(JSON.parse(event.data));
      if (first) { first = false; resolve(); }
    });
    source.addEventListener("error", () => {
      // The server ends each stream after a few seconds and the browser reconnects by itself;
      // a closed source means it gave up (e.g. signed out): api() sends us to the login page.
      live.dataset.state = "reconnecting";
      live.textContent = "reconnecting";
      if (source.readyState === EventSource.CLOSED) {
        api("/admin/api/overview").then(() => setTimeout(connectStream, 1000), () => {});
      }
    });
  });
}

// ---- history ----

function headlineData() {
  const h = state.history;
  const xs = bucketTimes(h).concat(state.live.map(([at]) => at));
  return [xs, ...h.series.map((s) => s.token_load.concat(state.live.map(([, v]) => v[s.key] ?? null)))];
}

async function loadHistory() {
  const h = await api(`/admin/api/history?window_s=${state.windowS}`);
  state.history = h;
  state.live = [];
  const node = document.getElementById("cloud-chart");
  node.dataset.points = String(h.points);
  if (state.chart) state.chart.destroy();
  // Lines, one colour and dash pattern per cloud: fills over one another hid the lower ones.
  state.chart = makeChart(node, h.series.map((s, i) => ({
    label: s.key,
    stroke: cloudColor(s.key, i),
    value: (u, v) => fmtInt(v),
  })), headlineData(), { height: 280, yFormat: compact, step: h.step_s, onSpan: describeSpan });
}

// Says when the chart starts after the window does: the history kept is younger than it.
function describeSpan(u) {
  const span = document.getElementById("cloud-span");
  const since = state.overview?.history_since;
  const fitted = state.history && u.scales.x.min > state.history.start + state.history.step_s;
  const young = fitted && since != null;
  span.hidden = !young;
  span.textContent = young ? `history since ${fmtTime(since)}, all there is` : "";
}

function windowLabel() {
  const select = document.getElementById("window");
  return select.options[select.selectedIndex].textContent;
}

async function loadDrift() {
  const d = await api(`/admin/api/drift?window_s=${state.windowS}&series=false`);
  document.getElementById("drift-scope").textContent =
    `per site and model, over the requests completed in the last ${windowLabel()} (the history window)`;
  const body = document.querySelector("#drift tbody");
  body.replaceChildren(...d.summary.map((s) => el("tr", { "data-site": s.site, "data-model": s.model },
    el("td", {}, s.site), el("td", {}, s.model),
    el("td", { class: "num", "data-field": "count" }, fmtInt(s.count)),
    el("td", { class: "num", "data-field": "mean_predicted" }, fmt1(s.mean_predicted)),
    el("td", { class: "num", "data-field": "mean_actual" }, fmt1(s.mean_actual)),
    el("td", { class: "num", "data-field": "bias" }, fmt1(s.bias)),
    el("td", { class: "num", "data-field": "mae" }, fmt1(s.mae)))));
  if (!d.summary.length) body.append(el("tr", {}, el("td", { colspan: "7", class: "muted" }, "no predicted requests in this window")));
}

function offloadRows(events) {
  if (!events.length) return [el("tr", {}, el("td", { colspan: "4", class: "muted" }, "none in this window"))];
  return events.map((e) => el("tr", {},
    el("td", {}, fmtTime(e.at)), el("td", { class: "mono" }, e.request_id),
    el("td", {}, e.from_site ?? "–"), el("td", {}, e.to_site ?? "–")));
}

async function loadOffloads() {
  const o = await api(`/admin/api/offloads?window_s=${state.windowS}&limit=20`);
  document.querySelector("#offloads tbody").replaceChildren(...offloadRows(o.events));
  const total = document.getElementById("offload-total");
  total.dataset.total = String(o.total);
  total.textContent = `${fmtInt(o.total)} in the window`;
}

// ---- drill-down ----

const DETAIL_NOW = [
  ["health", "healthy"], ["token load", "token_load"], ["queued tok", "queued_tokens"],
  ["running tok", "running_tokens"], ["predicted tok", "predicted_remaining_tokens"],
  ["queued", "queued_requests"], ["running", "running_requests"], ["in flight (gateway)", "in_flight"],
  ["ledger tok", "ledger_tokens"], ["req/min", "requests_per_min"], ["TTFT ms", "ttft_ms"], ["E2E ms", "e2e_ms"],
  ["prefix cache hits", "prefix_cache_hit_rate"],
];

function renderDetailNow(site, at) {
  if (!site) return;
  const stats = document.getElementById("detail-stats");
  stats.dataset.at = String(at);
  if (!stats.querySelector("[data-field]")) {
    stats.replaceChildren(...DETAIL_NOW.flatMap(([label, f]) => [el("dt", {}, label), el("dd", { "data-field": f })]));
    stats.append(el("dt", {}, "completed (window)"), el("dd", { "data-field": "completed_window" }));
  }
  for (const [, f] of DETAIL_NOW) {
    const node = stats.querySelector(`[data-field="${f}"]`);
    node.textContent = f === "healthy" ? (site.healthy ? "healthy" : "down") : fmtField(f, site[f]);
  }
}

async function openDetail(name) {
  state.detail = name;
  const d = await api(`/admin/api/sites/${encodeURIComponent(name)}?window_s=${state.windowS}`);
  if (state.detail !== name) return; // another site was clicked meanwhile
  const panel = document.getElementById("detail");
  panel.hidden = false;
  panel.dataset.site = name;
  document.getElementById("detail-title").textContent = name;
  document.getElementById("detail-place").textContent = `${d.site.cloud} · ${d.site.region} · ${d.site.model}`;
  document.getElementById("detail-stats").replaceChildren();
  renderDetailNow(d.site, state.overview ? state.overview.at : 0);
  if (state.overview) renderDetailNow(state.overview.sites.find((s) => s.name === name), state.overview.at);
  const series = d.history.series[0];
  const completed = series.completed.reduce((a, v) => a + (v ?? 0), 0);
  document.querySelector('#detail-stats [data-field="completed_window"]').textContent = fmtInt(completed);
  for (const chart of state.detailCharts) chart?.destroy();
  const xs = bucketTimes(d.history);
  const line = (label, stroke, fmt = fmtInt) => ({ label, stroke, width: 1.5, value: (u, v) => fmt(v) });
  const drift = d.drift.series[0];
  const opts = (step) => ({ yFormat: compact, step });
  state.detailCharts = [
    makeChart(document.getElementById("detail-tokens"),
      [line("queued", "#e67e22"), line("running", "#2980b9"), line("predicted", "#8e44ad")],
      [xs, series.queued_tokens, series.running_tokens, series.predicted_remaining_tokens],
      opts(d.history.step_s)),
    makeChart(document.getElementById("detail-rate"), [line("req/min", "#27ae60", fmt2)],
      [xs, series.requests_per_min], opts(d.history.step_s)),
    makeChart(document.getElementById("detail-latency"),
      [line("TTFT", "#16a085", fmt1), line("E2E", "#c0392b", fmt1)],
      [xs, series.ttft_ms, series.e2e_ms], opts(d.history.step_s)),
    makeChart(document.getElementById("detail-drift"),
      [line("predicted", "#8e44ad", fmt1), line("actual", "#2c3e50", fmt1)],
      [bucketTimes(d.drift), drift ? drift.mean_predicted : [], drift ? drift.mean_actual : []],
      opts(d.drift.step_s)),
  ];
  document.querySelector("#detail-offloads tbody").replaceChildren(...offloadRows(d.offloads.events));
  panel.dataset.loaded = "true";
  for (const row of document.querySelectorAll("#sites tbody tr")) row.classList.toggle("selected", row.dataset.site === name);
  panel.scrollIntoView({ behavior: "smooth", block: "nearest" });
}

function closeDetail() {
  state.detail = null;
  const panel = document.getElementById("detail");
  panel.hidden = true;
  delete panel.dataset.loaded;
  for (const row of document.querySelectorAll("#sites tbody tr")) row.classList.remove("selected");
}

// ---- start ----

async function loadWindow() {
  await Promise.all([loadHistory(), loadDrift(), loadOffloads(), loadPredictors(api), loadScaling(api),
    loadWorkload(api, state.windowS)]);
  if (state.detail) await openDetail(state.detail);
}

// The shortest window that shows all the history there is (a demo's minutes are not a sliver
// of an hour); the longest when there is more.
function fittingWindow(select, overview) {
  const windows = [...select.options].map((o) => Number(o.value));
  if (overview.history_since == null) return windows[0];
  const age = overview.at - overview.history_since;
  return windows.find((w) => w >= age) ?? windows[windows.length - 1];
}

async function main() {
  const select = document.getElementById("window");
  // ?window=<seconds> picks the history window (the page keeps it in the URL when changed);
  // without it, the window that fits the history kept.
  const asked = new URLSearchParams(location.search).get("window");
  if (asked && [...select.options].some((o) => o.value === asked)) select.value = asked;
  else select.value = String(fittingWindow(select, await api("/admin/api/overview")));
  state.windowS = Number(select.value);
  select.addEventListener("change", () => {
    state.windowS = Number(select.value);
    window.history.replaceState(null, "", `?window=${state.windowS}`);
    loadWindow().catch((e) => showError(String(e)));
  });
  document.getElementById("detail-close").addEventListener("click", closeDetail);
  window.addEventListener("resize", () => {
    for (const chart of [state.chart, ...state.detailCharts]) {
      if (chart) chart.setSize({ width: chartWidth(chart.root.parentNode), height: chart.height });
    }
  });
  await Promise.all([loadWindow(), connectStream()]);
  document.documentElement.dataset.ready = "true";
  performance.mark("dashboard-ready");
  // History and prediction error come from the database: refresh them now and then (the
  // headline chart's live points cover the time in between).
  setInterval(() => loadHistory().catch((e) => showError(String(e))), 60_000);
  setInterval(() => loadDrift().catch((e) => showError(String(e))), 10_000);
  setInterval(() => loadPredictors(api).catch((e) => showError(String(e))), 10_000);
  setInterval(() => loadScaling(api).catch((e) => showError(String(e))), 5_000);
  setInterval(() => loadWorkload(api, state.windowS).catch((e) => showError(String(e))), 5_000);
}

main().catch((e) => showError(`dashboard failed to load: ${e}`));
