// The predictor drift panel: each served model's rolling error on recent traffic, its drift
// verdict and its last retrain job, as GET /admin/api/predictors gives them (formatted only).

import { cell, fixed, row } from "/admin/static/table.js";

const FIELDS = [
  ["samples", (r) => r?.samples, (v) => (v == null ? "0" : String(v))],
  ["mae_tokens", (r) => r?.mae_tokens, fixed(1)],
  ["served_mean_mae_tokens", (r) => r?.served_mean_mae_tokens, fixed(1)],
  ["mae_ratio", (r) => r?.mae_ratio, fixed(2)],
  ["spearman", (r) => r?.spearman, fixed(3)],
];

function jobText(job) {
  if (!job) return "none";
  const outcome = job.state === "done" ? (job.activated ? "activated" : "not activated") : job.state;
  return `#${job.id} ${job.reason} ${job.mode}: ${outcome}`;
}

function modelRow(m) {
  const tr = row(
    { model: m.model, drifted: m.drifted },
    cell("model", m.model),
    cell("version", m.window_version ?? m.serving_version ?? "–", { class: "mono" }),
  );
  for (const [field, get, fmt] of FIELDS) tr.append(cell(field, fmt(get(m.rolling)), { class: "num" }));
  // The API's verdict: "not judged" while the window holds fewer samples than the rule needs.
  const drift = cell("drifted", m.verdict, { title: m.reason });
  drift.className = { drifted: "bad", ok: "good" }[m.verdict] ?? "muted";
  tr.append(drift, cell("last_job", jobText(m.last_job), { title: m.last_job?.error ?? "" }));
  return tr;
}

export async function loadPredictors(api) {
  const p = await api("/admin/api/predictors");
  const body = document.querySelector("#predictors tbody");
  body.replaceChildren(...p.models.map(modelRow));
  body.dataset.refreshedAt = String(p.refreshed_at ?? "");
  const days = p.window_s > 0 ? ` of the last ${+(p.window_s / 86400).toFixed(1)} days` : "";
  document.getElementById("predictors-rule").textContent =
    `each model's last ${p.window_samples} finished requests${days}, predicted by the version shown` +
    (p.include_censored ? "" : ", answers cut at max_tokens left out") +
    ` (not the history window) · drifted at MAE ≥ ${p.max_mae_ratio}× the served mean's ` +
    `or Spearman < ${p.min_spearman}, judged from ${p.min_samples} samples` +
    (p.retrain_on_drift ? " · retrains on drift" : "");
}
