// The Optimizer card: what the optimizer did with the gradient, from each snapshot's `optim`
// (inspector/stats/optim_state.py). Left, the newest measured step, one bar per tensor (a small
// run) or per group (a large run): the effective step ‖Δθ‖/‖g‖, the cosines cos(Δθ, −g) and
// cos(g, g_prev), and for the Adam family the share of v below eps² and the moments' norms.
// Right, over steps, the whole model's cosines and effective step (and Adam's share below eps²).
// Both read the rows of state.js (the one store); the time chart joins the shared step axis.

import { LEGEND_ABOVE } from "./modulechart.js";
import { COLORS, PLOT_CONFIG, TIME_HOVER, axis, baseLayout, centerNote } from "./theme.js";
import { logTicks } from "./ticks.js";
import { StepChart, sharedRange } from "./timeline.js";
import { fmt, plotlyText, plottable, positive } from "./util.js";

const Plotly = window.Plotly;

const C = {
  step: "#56d4dd",
  cosUpdate: "#ffa657",
  cosPrev: "#6ea8fe",
  below: "#ff6b81",
  m: "#d2a8ff",
  v: "#7ee787",
};

/** The newest row of the state that carries `optim`, or null. */
function newest(state) {
  const rows = state.snapshots;
  for (let k = rows.length - 1; k >= 0; k--) if (rows[k].optim) return rows[k];
  return null;
}

/** What the bars show of `optim`: per tensor for a small run, per group for a large one. */
function barsOf(state, optim) {
  if (state.large || !Array.isArray(optim.step_ratio)) {
    const names = (state.groups && state.groups.names) || [];
    return { names, values: optim.groups || {}, by: "group" };
  }
  return { names: state.params, values: optim, by: "tensor" };
}

/**
 * A positive quantity's axis: log with decade ticks where the values span a decade or more, else
 * linear (a log axis over a narrow range labels every tick alike: SGD's effective step is its lr).
 */
function scaleOf(values) {
  const v = values.filter((x) => x !== null && x > 0);
  if (!v.length) return { type: "linear" };
  const lo = Math.min(...v);
  const hi = Math.max(...v);
  if (hi / lo < 10) return { type: "linear", range: [0, hi * 1.12], nticks: 6, tickformat: ".2~g" };
  return { type: "log", ...logTicks(v) };
}

/** A short label for a bar: the end of the name, which is what tells tensors apart. */
function label(name) {
  const s = name === "" ? "(root)" : name;
  return s.length > 22 ? `…${s.slice(-21)}` : s;
}

export class OptimNowChart {
  constructor(el, note) {
    this.el = el;
    this.note = note;
    this.shown = -1;
  }

  reset(state) {
    this.render(state, true);
  }

  update(state) {
    this.render(state, false);
  }

  render(state, force) {
    if (!force && state.version === this.shown) return;
    this.shown = state.version;
    const row = newest(state);
    if (!row) {
      this.el.dataset.kind = "";
      Plotly.react(
        this.el,
        [],
        baseLayout({
          xaxis: axis({ visible: false }),
          yaxis: axis({ visible: false }),
          annotations: [centerNote("no optimizer measurement yet (off with optim_state=False)")],
        }),
        PLOT_CONFIG,
      );
      this.note.textContent = "";
      return;
    }
    const o = row.optim;
    const adam = o.kind === "adam";
    const { names, values, by } = barsOf(state, o);
    const y = names.map((n) => plotlyText(label(n)));
    const full = names.map((n) => plotlyText(n === "" ? "(root)" : n));
    const get = (k) => names.map((_, j) => plottable((values[k] || [])[j]));
    this.el.dataset.kind = o.kind;
    this.el.dataset.by = by;
    // columns: effective step | cosines | (Adam) share below eps² | (Adam) moments
    const cols = adam ? 4 : 2;
    const gap = 0.04;
    const width = (1 - gap * (cols - 1)) / cols;
    const dom = (c) => [c * (width + gap), c * (width + gap) + width];
    const bar = (name, k, xaxis, color, fmtHover, extra = {}) => ({
      name,
      type: "bar",
      orientation: "h",
      x: get(k === "sqrt" ? "exp_avg_sq_sqrt_norm" : k),
      y,
      customdata: full,
      textposition: "none",
      xaxis,
      marker: { color },
      hovertemplate: `%{customdata}<br>${fmtHover}<extra></extra>`,
      ...extra,
    });
    const traces = [
      bar("‖Δθ‖/‖g‖", "step_ratio", "x", C.step, "‖Δθ‖/‖g‖ %{x:.3g}"),
      bar("cos(Δθ, −g)", "cos_update_grad", "x2", C.cosUpdate, "cos(Δθ, −g) %{x:.3f}"),
      bar("cos(g, g prev)", "cos_grad_prev", "x2", C.cosPrev, "cos(g, g prev) %{x:.3f}"),
    ];
    if (adam) {
      traces.push(
        bar("v < eps²", "below_eps_frac", "x3", C.below, "share of v below eps² %{x:.2%}"),
        bar("‖m‖", "exp_avg_norm", "x4", C.m, "‖m‖ %{x:.3g}"),
        bar("‖√v‖", "sqrt", "x4", C.v, "‖√v‖ %{x:.3g}"),
      );
    }
    for (const t of traces) if (t.xaxis === "x" || t.xaxis === "x4") t.x = t.x.map(positive); // (log axes)
    const title = (text) => ({ text, font: { size: 11, color: COLORS.muted }, standoff: 4 });
    const logAxis = (vals, extra) => ({ ...scaleOf(vals), ...extra });
    const layout = baseLayout({
      barmode: "group",
      bargap: 0.25,
      margin: { l: 128, r: 10, t: 24, b: 38 },
      showlegend: true,
      legend: { ...LEGEND_ABOVE, font: { size: 10, color: COLORS.text } },
      yaxis: axis({
        type: "category",
        autorange: "reversed",
        tickfont: { size: 9, color: COLORS.muted },
        showgrid: false,
      }),
      xaxis: axis({ domain: dom(0), title: title("effective step ‖Δθ‖/‖g‖"), ...logAxis(traces[0].x, {}) }),
      xaxis2: axis({ domain: dom(1), title: title("cosine"), range: [-1.05, 1.05], zeroline: true }),
    });
    if (adam) {
      layout.xaxis3 = axis({ domain: dom(2), title: title("v below eps² (share)"), range: [0, 1.02] });
      layout.xaxis4 = axis({
        domain: dom(3),
        title: title("Adam ‖m‖, ‖√v‖"),
        ...logAxis([...traces[4].x, ...traces[5].x], {}),
      });
    }
    Plotly.react(this.el, traces, layout, PLOT_CONFIG);
    const gapText =
      o.cos_prev_gap === null || o.cos_prev_gap === undefined
        ? "no earlier sampled step yet"
        : `${o.cos_prev_gap} step${o.cos_prev_gap === 1 ? "" : "s"} earlier`;
    this.note.textContent =
      `step ${row.step}, per ${by}; ${adam ? "Adam family" : "no Adam state"}; ` +
      `g prev: the previous sampled step's gradient (${gapText}; none for a tensor that had no gradient then)`;
  }
}

export class OptimTimeChart extends StepChart {
  constructor(el) {
    super();
    this.el = el;
    this.shown = -1;
  }

  render(state, force) {
    if (!force && state.version === this.shown) return;
    this.shown = state.version;
    const rows = [...(state.history ? state.history.rows : []), ...state.snapshots].filter(
      (r) => r.optim && r.optim.model,
    );
    const x = rows.map((r) => r.step);
    const m = (k) => rows.map((r) => plottable(r.optim.model[k]));
    const adam = rows.some((r) => r.optim.kind === "adam");
    const line = (name, k, color, yaxis, hover, dash = "solid") => ({
      name,
      type: "scatter",
      mode: rows.length > 60 ? "lines" : "lines+markers",
      marker: { size: 3 },
      x,
      y: k === "step_ratio" ? m(k).map(positive) : m(k),
      yaxis,
      line: { color, width: 1.5, dash },
      hovertemplate: `${hover}<extra></extra>`,
    });
    const traces = [
      line("cos(Δθ, −g)", "cos_update_grad", C.cosUpdate, "y", "cos(Δθ, −g) %{y:.3f}"),
      line("cos(g, g prev)", "cos_grad_prev", C.cosPrev, "y", "cos(g, g prev) %{y:.3f}"),
      line("‖Δθ‖/‖g‖", "step_ratio", C.step, "y2", "‖Δθ‖/‖g‖ %{y:.3g}"),
    ];
    if (adam)
      traces.push(line("v < eps²", "below_eps_frac", C.below, "y", "share below eps² %{y:.2%}", "dot"));
    const steps = traces[2].y.filter((v) => v !== null);
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 48, r: 56, t: 24, b: 38 },
      showlegend: true,
      legend: { ...LEGEND_ABOVE, font: { size: 10, color: COLORS.text } },
      xaxis: axis({ title: { text: "step" }, ...sharedRange(this, state) }),
      yaxis: axis({ title: { text: "cosine, share" }, range: [-1.05, 1.05] }),
      yaxis2: axis({
        title: { text: "‖Δθ‖/‖g‖" },
        overlaying: "y",
        side: "right",
        showgrid: false,
        tickmode: "auto",
        ...scaleOf(steps),
      }),
      annotations: rows.length
        ? []
        : [centerNote("the whole model's cosines and effective step, per sampled step")],
    });
    this.el.dataset.points = String(rows.length);
    this.el.dataset.last = rows.length ? fmt(rows[rows.length - 1].optim.model.cos_update_grad) : "";
    this.draw(traces, layout, state);
  }
}
