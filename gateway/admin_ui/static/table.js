// What the dashboard's table panels (predictors.js, scaling.js, workload.js) build their rows
// from: one cell a field, and numbers shown to fixed digits, a dash for a missing one.

export const fixed = (digits) => (v) => (v == null ? "–" : v.toFixed(digits));

export function cell(field, text, attrs = {}) {
  const td = document.createElement("td");
  td.dataset.field = field;
  for (const [k, v] of Object.entries(attrs)) td.setAttribute(k, v);
  td.textContent = text;
  return td;
}
