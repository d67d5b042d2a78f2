// The batches panel: each batch not yet final with its progress by planned tokens and the time
// it is estimated to need still (GET /admin/api/batches: the batch objects of /v1/batches), and
// one line per LoRA adapter with its requests and tokens over the history window
// (GET /admin/api/adapters). Formatted only: every number is the API's.

import { cell, row } from "/admin/static/table.js";

function duration(s) {
  if (s == null) return "–";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function progressCell(p) {
  const td = cell("fraction", p == null ? "–" : `${(p.fraction * 100).toFixed(1)} %`, { class: "num" });
  if (p != null) {
    td.dataset.value = String(p.fraction);
    td.title = `${p.finished_tokens} of ${p.planned_tokens} planned tokens`;
    const bar = document.createElement("progress");
    bar.max = 1;
    bar.value = p.fraction;
    td.prepend(bar, " ");
  }
  return td;
}

function batchRow(b) {
  const counts = b.request_counts;
  const eta = b.progress?.eta_seconds ?? null;
  return row(
    { batch: b.id },
    cell("id", b.id, { class: "mono" }),
    cell("model", b.model),
    cell("status", b.status),
    cell("requests", `${counts.completed + counts.failed} / ${counts.total}`, { class: "num" }),
    progressCell(b.progress),
    cell("eta", duration(eta), { class: "num", "data-value": eta == null ? "" : String(eta) }),
  );
}

function adapterRow(a) {
  return row(
    { adapter: a.adapter },
    cell("adapter", a.adapter),
    cell("model", a.model),
    cell("requests", String(a.requests), { class: "num" }),
    cell("prompt_tokens", String(a.prompt_tokens), { class: "num" }),
    cell("completion_tokens", String(a.completion_tokens), { class: "num" }),
  );
}

export async function loadWorkload(api, windowS) {
  const [b, a] = await Promise.all([
    api("/admin/api/batches"),
    api(`/admin/api/adapters?window_s=${windowS}`),
  ]);
  document.querySelector("#batches tbody").replaceChildren(...b.data.map(batchRow));
  document.getElementById("batches-state").textContent = b.data.length
    ? `${b.data.length} batch${b.data.length === 1 ? "" : "es"} not yet final`
    : "no batch running";
  document.querySelector("#adapters tbody").replaceChildren(...a.adapters.map(adapterRow));
  document.getElementById("adapters-state").textContent = a.adapters.length
    ? `over the last ${duration(a.window_s)}`
    : `no adapter request over the last ${duration(a.window_s)}`;
}
