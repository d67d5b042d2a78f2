// What the dashboard's table panels (predictors.js, scaling.js, workload.js) build their rows
// from: a row keyed by its data attributes, one cell a field, and numbers shown to fixed
// digits, a dash for a missing one.

export const fixed = (digits) => (v) => (v == null ? "–" : v.toFixed(digits));

export function cell(field, text, attrs = {}) {
  const td = document.createElement("td");
  td.dataset.field = field;
  for (const [k, v] of Object.entries(attrs)) td.setAttribute(k, v);
  td.textContent = text;
  return td;
}

// A row with `data` as its data-* attributes (what the tests find it by) and `cells` in order.
export function row(data, ...cells) {
  const tr = document.createElement("tr");
  for (const [k, v] of Object.entries(data)) tr.dataset[k] = String(v);
  tr.append(...cells);
  return tr;
}
