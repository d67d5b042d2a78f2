// The capacity panel: each scaled model's sites now (serving, starting, wanted) and backlog, and
// one line per scaling event (decisions, sites joining and leaving), as GET /admin/api/scaling
// gives them (formatted only).

import { cell, fixed, row } from "/admin/static/table.js";

const backlog = fixed(2);

function modelRow(m) {
  return row(
    { model: m.model },
    cell("model", m.model),
    cell("actuator", m.actuator),
    cell("serving_sites", String(m.serving_sites), { class: "num" }),
    cell("pending_sites", String(m.pending_sites), { class: "num" }),
    cell("desired_sites", String(m.desired_sites), { class: "num" }),
    cell("bounds", `${m.min_sites}–${m.max_sites}`, { class: "num" }),
    cell("backlog_s", backlog(m.backlog_s), { class: "num", title: `target ${m.target_backlog_s} s per site` }),
    cell("forecast_backlog_s", backlog(m.forecast_backlog_s), { class: "num" }),
    cell("reason", m.reason, { class: "muted" }),
  );
}

function eventRow(e) {
  const when = new Date(e.at * 1000).toLocaleTimeString("en-GB");
  return row(
    { action: e.action },
    cell("at", when),
    cell("model", e.model),
    cell("action", e.action),
    cell("site", e.site ?? "–"),
    cell("actor", e.actor),
    cell("sites", `${e.serving_sites} → ${e.desired_sites}`, { class: "num" }),
    cell("reason", e.reason, { class: "muted" }),
  );
}

export async function loadScaling(api) {
  const s = await api("/admin/api/scaling");
  document.querySelector("#scaling tbody").replaceChildren(...s.models.map(modelRow));
  document.querySelector("#scaling-events tbody").replaceChildren(...s.events.map(eventRow));
  const leaving = s.leaving.length ? ` · draining out: ${s.leaving.join(", ")}` : "";
  document.getElementById("scaling-state").textContent =
    (s.enabled ? "capacity follows predicted work" : "no scaling file: sites are static") + leaving;
}
