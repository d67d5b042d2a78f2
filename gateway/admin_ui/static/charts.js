// The dashboard's time-series charts (uPlot), drawn so that they read at a glance:
// - the time axis covers the data there is, not the whole window (a gateway minutes old does not
//   draw a few minutes at the right edge of an empty quarter hour);
// - the value axis starts at 0 and is not set by one outlier: when the highest point exceeds
//   CLIP_RATIO times the 95th percentile, the axis stops at HEADROOM times that percentile and a
//   note under the chart says so, how many points are above and the highest (a button shows the
//   full scale);
// - series are lines of distinct colours and dash patterns, never fills over one another;
// - the legend shows each series' latest value whenever the cursor is off the chart.
// What was drawn is kept on the chart's node (data-x-min, data-x-max, data-y-max, data-clipped,
// data-legend, data-segments) for the browser tests.

export const CLIP_QUANTILE = 0.95;
export const CLIP_RATIO = 4;
export const HEADROOM = 1.5;
const DASHES = [[], [10, 4], [2, 3], [12, 3, 2, 3], [6, 6], [1, 5]];

function markerDash(pattern) {
  if (!pattern || !pattern.length) return "solid";
  return pattern[0] <= 2 ? "dotted" : "dashed";
}

export function chartWidth(node) { return Math.max(node.clientWidth, 240); }

export function dash(i) { return DASHES[i % DASHES.length]; }

// Line segments a chart can draw: neighbouring points both present (uPlot leaves a gap at a
// null, so a chart of lone points draws nothing).
export function countSegments(node, data) {
  let segments = 0;
  for (const ys of data.slice(1)) {
    for (let i = 1; i < ys.length; i++) if (ys[i] != null && ys[i - 1] != null) segments++;
  }
  node.dataset.segments = String(segments);
}

// A minute at least (a gateway seconds old would get an axis of fractions of seconds), and two
// buckets.
export function minSpan(step) { return Math.max(60, 2 * step); }

// The x range the data covers: from the first bucket any series has a value in to the last x,
// at least `minSpan` seconds wide. Null when there is no value at all (uPlot's own range then).
export function dataSpan(data, minSpan) {
  const xs = data[0];
  if (!xs.length) return null;
  let first = null;
  for (let i = 0; i < xs.length && first == null; i++) {
    if (data.slice(1).some((ys) => ys[i] != null)) first = xs[i];
  }
  if (first == null) return null;
  const last = xs[xs.length - 1];
  return [Math.min(first, last - minSpan), last];
}

// The value axis' top, robust to a few outliers: {top, clipped, highest}.
export function robustTop(data, full = false) {
  const values = [];
  for (const ys of data.slice(1)) for (const v of ys) if (v != null) values.push(v);
  if (!values.length) return { top: 1, clipped: 0, highest: null };
  values.sort((a, b) => a - b);
  const highest = values[values.length - 1];
  const rank = Math.max(0, Math.ceil(CLIP_QUANTILE * values.length) - 1);
  const quantile = values[rank];
  if (full || !(quantile > 0) || highest <= CLIP_RATIO * quantile) {
    return { top: highest > 0 ? highest * 1.05 : 1, clipped: 0, highest };
  }
  const top = HEADROOM * quantile;
  return { top, clipped: values.filter((v) => v > top).length, highest };
}

// Each series' latest value in the legend (not "–") while the cursor is away.
function showLatest(u) {
  if (u.cursor.idx != null) return;
  const idxs = u.data.map((ys) => {
    for (let i = ys.length - 1; i >= 0; i--) if (ys[i] != null) return i;
    return null;
  });
  const present = idxs.slice(1).filter((i) => i != null);
  idxs[0] = present.length ? Math.max(...present) : null;
  u.setLegend({ idxs }, false);
  u.root.parentNode.dataset.legend = present.length ? "latest" : "empty";
}

function note(node) {
  let box = node.querySelector(".scale-note");
  if (!box) {
    box = document.createElement("p");
    box.className = "scale-note";
    box.hidden = true;
    node.append(box);
  }
  return box;
}

function describe(node, u, stats, format) {
  const box = note(node);
  node.dataset.clipped = String(stats.clipped);
  const full = node.dataset.fullScale === "true";
  if (!stats.clipped && !full) { box.hidden = true; return; }
  box.hidden = false;
  box.replaceChildren(full
    ? "Full scale. "
    : `Scale clipped at ${format(stats.top)} (${HEADROOM}x the ${CLIP_QUANTILE * 100}th percentile): `
      + `${stats.clipped} point${stats.clipped === 1 ? "" : "s"} above, up to ${format(stats.highest)}. `);
  const toggle = document.createElement("button");
  toggle.type = "button";
  toggle.className = "link";
  toggle.textContent = full ? "Clip outliers" : "Show full scale";
  toggle.addEventListener("click", () => {
    node.dataset.fullScale = full ? "false" : "true";
    u.setData(u.data);
  });
  box.append(toggle);
}

// A chart of `series` over `data` ([xs, ...ys]) in `node`; `step` is the data's bucket width (s);
// `onSpan(u)` runs whenever the time axis is set (at the start, on new data, on a zoom).
export function makeChart(node, series, data,
  { height = 180, yFormat = String, step = 60, onSpan = () => {} } = {}) {
  if (typeof uPlot === "undefined") return null; // the page shows the missing-asset banner
  node.replaceChildren();
  countSegments(node, data);
  const format = yFormat;
  let stats = robustTop(data);
  const chart = new uPlot({
    width: chartWidth(node),
    height,
    cursor: { drag: { x: true, y: false } },
    scales: {
      x: { time: true, range: (u, min, max) => dataSpan(u.data, minSpan(step)) ?? [min, max] },
      y: {
        range: (u) => {
          stats = robustTop(u.data, node.dataset.fullScale === "true");
          return [0, stats.top];
        },
      },
    },
    // The legend's markers in each line's pattern: dotted, dashed or solid.
    legend: { markers: { width: 3, dash: (u, i) => markerDash(u.series[i].dash) } },
    axes: [{ stroke: "#667" }, { stroke: "#667", size: 56, values: (u, vals) => vals.map(format) }],
    series: [{}, ...series.map((s, i) => ({ width: 2, dash: dash(i), ...s }))],
    hooks: {
      // After a scale is committed (at start, on new data, on a zoom): `stats` is the y range's.
      setScale: [(u, key) => {
        if (key === "x") {
          node.dataset.xMin = String(u.scales.x.min);
          node.dataset.xMax = String(u.scales.x.max);
          onSpan(u);
        } else if (key === "y") {
          node.dataset.yMax = String(u.scales.y.max);
          describe(node, u, stats, format);
        }
      }],
      setData: [(u) => { countSegments(node, u.data); showLatest(u); }],
      setLegend: [showLatest],
      ready: [(u) => { describe(node, u, stats, format); showLatest(u); }],
    },
  }, data, node);
  return chart;
}
