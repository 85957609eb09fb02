// The HTML report's page script: draws the four charts of a recorded run from the
// JSON in #report-data (numbers, or "nan" / "inf" / "-inf" for non-finite values).
// The report is one offline file, so server/history/report_assets.py inlines this module
// with ticks.js as one classic script: the import below becomes a destructuring of
// what ticks.js exports (it accepts only this one form of import). Every user string
// (parameter names, marker labels and hover lines: the data holds them as they are)
// goes to Plotly through plotlyText, once.

import { decadeTicks, logTicks, plotlyText, sparseTicks } from "../ticks.js";

const Plotly = window.Plotly; // plotly.js, inlined in the page before this script
const D = JSON.parse(document.getElementById("report-data").textContent);
const C = {
  raw: "#1f6fd1",
  final: "#e8710a",
  loss: "#1a7f37",
  hook: "#8250df",
  bad: "#d1242f",
  grid: "#e6e9ed",
  text: "#1f2328",
  muted: "#57606a",
};
const FONT = { family: 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif', size: 13, color: C.text };
const CONFIG = { responsive: true, displaylogo: false, scrollZoom: false };
const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
const bad = (v) => typeof v === "string"; // "nan", "inf", "-inf"
const pos = (v) => (typeof v === "number" && v > 0 ? v : null);
// user text (a branch label names hooks and targets) for Plotly, which reads a few HTML tags
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
const fmt = (v) =>
  v === null || v === undefined ? "no gradient" : typeof v === "string" ? v : v.toPrecision(3);
const steps = D.steps;
const names = D.params.map(plotlyText); // the parameter axes' categories, as Plotly text
// with many parameters only every k-th is labelled, its name shortened (hover has all)
function paramTicks(plotHeight) {
  return { tickmode: "array", ...sparseTicks(D.params, plotHeight, 14, 34) };
}

function axis(extra) {
  return Object.assign(
    {
      gridcolor: C.grid,
      zerolinecolor: C.grid,
      linecolor: "#8c959f",
      showline: true,
      ticks: "outside",
      tickcolor: "#8c959f",
      automargin: true,
      title: { font: { size: 13, color: C.muted } },
    },
    extra || {},
  );
}
function layout(extra) {
  return Object.assign(
    {
      font: FONT,
      paper_bgcolor: "#ffffff",
      plot_bgcolor: "#ffffff",
      margin: { l: 70, r: 30, t: TOP, b: 50 },
      hovermode: "closest",
      legend: { orientation: "h", x: 0, y: -0.1, xanchor: "left", yanchor: "top" },
    },
    extra,
  );
}

// vertical markers: a line (shape) per event and a hoverable label (annotation) at the top
function markerShapes() {
  return D.markers.map((m) => ({
    type: "line",
    xref: "x",
    yref: "paper",
    x0: m.step,
    x1: m.step,
    y0: 0,
    y1: 1,
    layer: "above",
    line:
      m.type === "hook"
        ? { color: C.hook, width: 1.5, dash: "dash" }
        : { color: C.bad, width: 1, dash: "dot" },
  }));
}
// labels close together go on up to three rows above the plot
const MANY = D.markers.length > 24;
const ROWS = (function () {
  const span = steps.length ? Math.max(1, steps[steps.length - 1] - steps[0]) : 1;
  const gap = span * (MANY ? 0.012 : 0.075);
  const last = [];
  return D.markers.map((m) => {
    let r = 0;
    while (r < 2 && last[r] !== undefined && m.step - last[r] < gap) r++;
    last[r] = m.step;
    return r;
  });
})();
const TOP = 34 + 15 * (ROWS.length ? Math.max(...ROWS) : 0);
function markerNotes() {
  return D.markers.map((m, i) => ({
    xref: "x",
    yref: "paper",
    x: m.step,
    y: 1,
    yanchor: "bottom",
    yshift: 2 + 15 * ROWS[i],
    showarrow: false,
    text: MANY ? (m.type === "hook" ? "◆" : "▼") : (m.type === "hook" ? "◆ " : "▼ ") + plotlyText(m.label),
    font: { size: 11, color: m.type === "hook" ? C.hook : C.bad },
    hovertext: m.lines.map(plotlyText).join("<br>"),
    hoverlabel: {
      bgcolor: "#ffffff",
      bordercolor: m.type === "hook" ? C.hook : C.bad,
      font: { color: C.text, size: 12 },
    },
  }));
}

// 1. loss (top) and the global gradient norm raw/final (bottom, log y)
function drawNorms() {
  const lossVals = D.loss.values.map(num);
  const finiteLoss = lossVals.filter((v) => v !== null);
  const lossLog =
    finiteLoss.length > 0 &&
    finiteLoss.every((v) => v > 0) &&
    Math.max(...finiteLoss) > 10 * Math.min(...finiteLoss);
  const traces = [
    {
      x: steps,
      y: D.total_norm_raw.map(pos),
      name: "global grad norm, raw",
      type: "scatter",
      mode: "lines",
      line: { color: C.raw, width: 3 },
      xaxis: "x",
      yaxis: "y",
      hovertemplate: "step %{x}<br>raw ‖g‖ %{y:.4g}<extra></extra>",
    },
    {
      x: steps,
      y: D.total_norm.map(pos),
      name: "global grad norm, final",
      type: "scatter",
      mode: "lines",
      line: { color: C.final, width: 1.6 },
      xaxis: "x",
      yaxis: "y",
      hovertemplate: "step %{x}<br>final ‖g‖ %{y:.4g}<extra></extra>",
    },
    {
      x: D.loss.steps,
      y: lossVals,
      name: "loss",
      type: "scatter",
      mode: "lines",
      line: { color: C.loss, width: 1.6 },
      xaxis: "x",
      yaxis: "y2",
      hovertemplate: "step %{x}<br>loss %{y:.4g}<extra></extra>",
    },
  ];
  // what-if branches of this run (a shadow, an abandoned branch): dashed, from their branch step
  for (const b of D.branches || []) {
    const name = esc(b.label || `${b.branch} #${b.id}`);
    const dashed = (x, y, what, yaxis, color) => ({
      x,
      y,
      name: `${name}: ${what}`,
      type: "scatter",
      mode: "lines",
      line: { color, width: 1.3, dash: "dash" },
      xaxis: "x",
      yaxis,
      hovertemplate: `${name}<br>step %{x}<br>${what} %{y:.4g}<extra></extra>`,
    });
    traces.push(dashed(b.steps, b.total_norm_raw.map(pos), "raw ‖g‖", "y", C.raw));
    traces.push(dashed(b.steps, b.total_norm.map(pos), "final ‖g‖", "y", C.final));
    traces.push(dashed(b.loss.steps, b.loss.values.map(num), "loss", "y2", C.loss));
  }
  // non-finite global norms: red crosses along the bottom of the norm panel
  const nfSteps = steps.filter((s, i) => bad(D.total_norm_raw[i]) || bad(D.total_norm[i]));
  if (nfSteps.length) {
    traces.push({
      x: nfSteps,
      y: nfSteps.map(() => 0),
      yaxis: "y3",
      xaxis: "x",
      type: "scatter",
      mode: "markers",
      name: "non-finite norm",
      marker: { color: C.bad, symbol: "x-thin-open", size: 8 },
      hovertemplate: "step %{x}: non-finite global norm<extra></extra>",
    });
  }
  const lay = layout({
    height: 600,
    legend: { orientation: "h", x: 0, y: -0.16, xanchor: "left", yanchor: "top" },
    xaxis: axis({ title: { text: "step (optimizer steps)" }, anchor: "y" }),
    yaxis: axis(
      Object.assign(
        { type: "log", domain: [0, 0.56], title: { text: "global ‖g‖ (L2, log)" } },
        logTicks(traces[0].y.concat(traces[1].y)),
      ),
    ),
    yaxis2: axis(
      Object.assign(
        {
          type: lossLog ? "log" : "linear",
          domain: [0.66, 1],
          anchor: "x",
          title: { text: lossLog ? "loss (log)" : "loss" },
        },
        lossLog ? logTicks(lossVals) : {},
      ),
    ),
    yaxis3: {
      domain: [0, 0.56],
      range: [0, 1],
      visible: false,
      anchor: "x",
      overlaying: "y",
      fixedrange: true,
    },
    shapes: markerShapes(),
    annotations: markerNotes(),
  });
  Plotly.newPlot("chart-norms", traces, lay, CONFIG);
}

// heatmap of a per-parameter series: colour log10(value); red for non-finite; grey for no value
function drawHeat(id, rows, label, unit) {
  const logs = [];
  for (const row of rows) for (const v of row) if (typeof v === "number" && v > 0) logs.push(Math.log10(v));
  let lo = logs.length ? Math.min(...logs.slice(0, 1e5)) : -3;
  let hi = logs.length ? Math.max(...logs.slice(0, 1e5)) : 0;
  for (let i = 1e5; i < logs.length; i++) {
    lo = Math.min(lo, logs[i]);
    hi = Math.max(hi, logs[i]);
  }
  if (hi - lo < 1e-6) {
    lo -= 0.5;
    hi += 0.5;
  }
  const z = rows.map((row) => row.map((v) => (typeof v === "number" ? (v > 0 ? Math.log10(v) : lo) : null)));
  const text = rows.map((row) => row.map(fmt));
  const nf = rows.map((row) => row.map((v) => (bad(v) ? 1 : null)));
  const ticks = decadeTicks(lo, hi);
  const h = Math.max(340, Math.min(900, 120 + 18 * names.length));
  const traces = [
    {
      type: "heatmap",
      x: steps,
      y: names,
      z: z,
      text: text,
      zmin: lo,
      zmax: hi,
      colorscale: "Viridis",
      hoverongaps: false,
      xgap: 0,
      ygap: steps.length < 150 ? 1 : 0,
      hovertemplate: `%{y}<br>step %{x}<br>${label} %{text}<extra></extra>`,
      colorbar: {
        title: { text: unit, side: "right" },
        tickvals: ticks.vals,
        ticktext: ticks.text,
        thickness: 16,
        len: 1,
        outlinewidth: 0,
      },
    },
  ];
  if (nf.some((row) => row.some((v) => v !== null))) {
    traces.push({
      type: "heatmap",
      x: steps,
      y: names,
      z: nf,
      text: text,
      showscale: false,
      hoverongaps: false,
      colorscale: [
        [0, C.bad],
        [1, C.bad],
      ],
      zmin: 0,
      zmax: 1,
      name: "non-finite",
      hovertemplate: `%{y}<br>step %{x}<br>${label} %{text} (non-finite)<extra></extra>`,
    });
  }
  const lay = layout({
    height: h,
    plot_bgcolor: "#d0d4d9",
    xaxis: axis({ title: { text: "step (optimizer steps)" }, showgrid: false }),
    yaxis: axis(
      Object.assign(
        {
          title: { text: "parameter" },
          autorange: "reversed",
          type: "category",
          showgrid: false,
          tickfont: { size: names.length > 40 ? 10 : 12 },
        },
        paramTicks(h - 120),
      ),
    ),
    shapes: markerShapes(),
    annotations: markerNotes(),
  });
  Plotly.newPlot(id, traces, lay, CONFIG);
}

// 3. abs-max raw vs final at the last step, horizontal bars, log x
function drawAbsmax() {
  const raw = D.last.absmax_raw;
  const fin = D.last.absmax;
  const h = Math.max(320, Math.min(1400, 110 + 26 * names.length));
  const bar = (vals, name, color) => ({
    type: "bar",
    orientation: "h",
    y: names,
    x: vals.map(pos),
    name: name,
    marker: { color: color },
    text: vals.map(fmt),
    textposition: "none",
    hovertemplate: `%{y}<br>${name}: %{text}<extra></extra>`,
  });
  const traces = [bar(raw, "abs-max, raw", C.raw), bar(fin, "abs-max, final", C.final)];
  const nf = names.filter((_, i) => bad(raw[i]) || bad(fin[i]));
  const lay = layout({
    height: h,
    barmode: "group",
    bargap: 0.25,
    margin: { l: 70, r: 30, t: 34, b: 50 },
    legend: { orientation: "h", x: 0, y: 1, xanchor: "left", yanchor: "bottom" },
    xaxis: axis(
      Object.assign(
        { type: "log", title: { text: "max |gradient element| (log)" } },
        logTicks(raw.map(pos).concat(fin.map(pos))),
      ),
    ),
    yaxis: axis(
      Object.assign(
        { autorange: "reversed", type: "category", title: { text: "parameter" } },
        paramTicks(h - 90),
      ),
    ),
    annotations: nf.length
      ? [
          {
            xref: "paper",
            yref: "paper",
            x: 1,
            y: 1,
            yanchor: "bottom",
            xanchor: "right",
            showarrow: false,
            font: { color: C.bad },
            text: `non-finite at this step: ${nf.length} parameter(s)`,
          },
        ]
      : [],
  });
  Plotly.newPlot("chart-absmax", traces, lay, CONFIG);
}

if (steps.length) {
  drawNorms();
  drawHeat("chart-heatmap", D.grad_norm, "final ‖g‖", "final ‖g‖ (log scale)");
  drawAbsmax();
  drawHeat("chart-ratio", D.update_ratio, "‖Δθ‖/‖θ‖", "update ratio (log scale)");
} else {
  for (const el of document.querySelectorAll(".chart")) el.style.display = "none";
}
document.body.dataset.drawn = "true";
