// The five charts. Each draws once with Plotly.newPlot / Plotly.react (reset)
// and then streams: time series grow with Plotly.extendTraces over a bounded
// window (maxPoints per trace), the per-parameter charts are redrawn from the
// newest snapshot. The caller batches messages and calls update() at most once
// per animation frame.

import { COLORS, HEAT_SCALE, PLOT_CONFIG, axis, barLogRange, baseLayout, labelPixels } from "./theme.js";
import { decadeTicks, logTicks, shortName, sparseTicks } from "./ticks.js";
import { log10OrNull, plottable, positive } from "./util.js";

const Plotly = window.Plotly;

/** Bottom margin for the rotated parameter names under a bar chart. */
function paramMargin(names) {
  const longest = Math.max(4, ...names.map((n) => shortName(n).length));
  return names.length > 12 ? Math.ceil(longest * 5.6 * 0.77) + 18 : 34;
}

function paramAxis(names, el, extra = {}) {
  const width = (el.clientWidth || 600) - 80;
  return axis({
    type: "category",
    tickmode: "array",
    ...sparseTicks(names, width, 11, 22),
    tickangle: names.length > 12 ? -50 : 0,
    tickfont: { size: 9, color: COLORS.muted },
    showgrid: false,
    ...extra,
  });
}

/** Range and tick labels of a log axis for bars of these values. */
function logAxisFor(values) {
  const range = barLogRange(values);
  return range ? { range, ...logTicks([10 ** range[0], 10 ** range[1]]) } : {};
}

/**
 * Call chart.onPick(name) when a bar or heatmap cell is clicked; `coord` ("x"
 * or "y") is the point's coordinate that holds the parameter name. Bound once
 * per element: the listener survives Plotly.react.
 */
function bindPick(chart, coord) {
  if (chart.bound) return;
  chart.bound = true;
  chart.el.on("plotly_click", (ev) => {
    const p = ev && ev.points && ev.points[0];
    if (p && typeof p[coord] === "string") chart.onPick(p[coord]);
  });
}

// ---------------------------------------------------------------------------
// 1. Loss and global gradient norm, with markers at hook changes and NaN/Inf.

const LOSS = 0;
const NORM_RAW = 1;
const NORM_FINAL = 2;
const MARK_HOOK_LINE = 3;
const MARK_HOOK_TIP = 4;
const MARK_NF_LINE = 5;
const MARK_NF_TIP = 6;

export class LossChart {
  constructor(el) {
    this.el = el;
    this.lossLog = false;
  }

  normTicks(state) {
    const v = [];
    for (const r of state.window()) v.push(positive(r.total_norm_raw), positive(r.total_norm));
    return logTicks(v);
  }

  layout(state) {
    this.ticks = this.normTicks(state);
    return baseLayout({
      margin: { l: 60, r: 64, t: 8, b: 40 },
      xaxis: axis({ title: { text: "step" } }),
      yaxis: axis({
        title: { text: "loss" },
        type: this.lossLog ? "log" : "linear",
        ...(this.lossLog ? logTicks(state.loss.y) : {}),
      }),
      yaxis2: axis({
        title: { text: "global grad norm (L2)" },
        ...this.ticks,
        type: "log",
        overlaying: "y",
        side: "right",
        showgrid: false,
      }),
      yaxis3: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true },
      hovermode: "closest",
      showlegend: false, // the card header has the legend
    });
  }

  traces(state) {
    const rows = state.window();
    const x = rows.map((r) => r.step);
    const marks = this.markerTraces(state.markers);
    return [
      {
        name: "loss",
        x: state.loss.x.slice(),
        y: state.loss.y.slice(),
        type: "scatter",
        mode: "lines",
        line: { color: COLORS.loss, width: 1.6 },
        hovertemplate: "step %{x}<br>loss %{y:.4g}<extra></extra>",
      },
      {
        name: "grad norm raw",
        x: x.slice(),
        y: rows.map((r) => positive(r.total_norm_raw)),
        yaxis: "y2",
        type: "scatter",
        mode: "lines",
        // Wide and faint under the final line: where a hook changes nothing the
        // two coincide and read as an orange line with a blue halo.
        line: { color: COLORS.raw, width: 3.5 },
        opacity: 0.55,
        hovertemplate: "step %{x}<br>raw norm %{y:.4g}<extra></extra>",
      },
      {
        name: "grad norm final",
        x,
        y: rows.map((r) => positive(r.total_norm)),
        yaxis: "y2",
        type: "scatter",
        mode: "lines",
        line: { color: COLORS.final, width: 1.5 },
        hovertemplate: "step %{x}<br>final norm %{y:.4g}<extra></extra>",
      },
      ...marks,
    ];
  }

  markerTraces(markers) {
    const mk = (kind, name, color, symbol) => {
      const ms = markers.filter((m) => m.kind === kind);
      const line = {
        name,
        legendgroup: kind,
        showlegend: false,
        x: ms.flatMap((m) => [m.x, m.x, null]),
        y: ms.flatMap(() => [0, 0.96, null]),
        yaxis: "y3",
        type: "scatter",
        mode: "lines",
        line: { color, width: 1, dash: "dash" },
        hoverinfo: "skip",
      };
      const tip = {
        name,
        legendgroup: kind,
        x: ms.map((m) => m.x),
        y: ms.map(() => 0.96),
        hovertext: ms.map((m) => m.text),
        yaxis: "y3",
        type: "scatter",
        mode: "markers",
        marker: { color, size: 9, symbol },
        hovertemplate: "%{hovertext}<extra></extra>",
      };
      return [line, tip];
    };
    return [
      ...mk("hook", "hook change", COLORS.hook, "triangle-down"),
      ...mk("nonfinite", "NaN/Inf", COLORS.nonfinite, "x"),
    ];
  }

  reset(state) {
    Plotly.react(this.el, this.traces(state), this.layout(state), PLOT_CONFIG);
  }

  update(state, news) {
    const idx = [];
    const upd = { x: [], y: [] };
    const maxp = { x: [], y: [] };
    if (news.loss.x.length) {
      idx.push(LOSS);
      upd.x.push(news.loss.x);
      upd.y.push(news.loss.y);
      maxp.x.push(state.loss.x.length);
      maxp.y.push(state.loss.x.length);
    }
    if (news.rows.length) {
      const n = state.window().length;
      const xs = news.rows.map((r) => r.step);
      for (const [i, key] of [
        [NORM_RAW, "total_norm_raw"],
        [NORM_FINAL, "total_norm"],
      ]) {
        idx.push(i);
        upd.x.push(xs);
        upd.y.push(news.rows.map((r) => positive(r[key])));
        maxp.x.push(n);
        maxp.y.push(n);
      }
    }
    if (idx.length) Plotly.extendTraces(this.el, upd, idx, maxp);
    if (news.rows.length) {
      const ticks = this.normTicks(state);
      if (ticks.dtick !== this.ticks.dtick) {
        this.ticks = ticks;
        Plotly.relayout(this.el, {
          "yaxis2.tickformat": ticks.tickformat,
          "yaxis2.exponentformat": ticks.exponentformat,
          "yaxis2.dtick": ticks.dtick, // null: back to automatic ticks
        });
      }
    }
    if (news.markers) {
      const t = this.markerTraces(state.markers);
      Plotly.restyle(
        this.el,
        { x: t.map((d) => d.x), y: t.map((d) => d.y), hovertext: t.map((d) => d.hovertext ?? null) },
        [MARK_HOOK_LINE, MARK_HOOK_TIP, MARK_NF_LINE, MARK_NF_TIP],
      );
    }
  }
}

// ---------------------------------------------------------------------------
// 2. Heatmap: per-parameter gradient norm over steps, log colour scale.
// z holds one row per snapshot and `transpose` turns rows into columns, so a
// new step is one extendTraces of a row.

const HEATMAP_COLUMNS = 300; // steps shown: every redraw paints columns x parameters cells

export class HeatmapChart {
  constructor(el, onPick) {
    this.el = el;
    this.source = "raw"; // or "final"
    this.onPick = onPick;
    this.bound = false;
    this.range = null;
  }

  key() {
    return this.source === "raw" ? "grad_norm_raw" : "grad_norm";
  }

  rowOf(r) {
    return (r[this.key()] || []).map(log10OrNull);
  }

  zRange(rows) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const r of rows) {
      for (const v of r) {
        if (v === null) continue;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
    if (!Number.isFinite(lo)) return [-4, 1];
    if (hi - lo < 1) return [lo - 0.5, hi + 0.5];
    return [lo, hi];
  }

  colorbar(lo, hi) {
    const t = decadeTicks(lo, hi);
    return {
      title: { text: `${this.source} ‖g‖`, side: "right", font: { size: 10, color: COLORS.muted } },
      tickvals: t.vals,
      ticktext: t.text,
      tickfont: { size: 9, color: COLORS.muted },
      thickness: 10,
      outlinewidth: 0,
      len: 1,
      x: 1.01,
      xanchor: "left",
      xpad: 0,
    };
  }

  reset(state) {
    const rows = state.window().slice(-HEATMAP_COLUMNS);
    const z = rows.map((r) => this.rowOf(r));
    const [lo, hi] = this.zRange(z);
    this.range = [lo, hi];
    const names = state.params;
    const trace = {
      type: "heatmap",
      name: this.source,
      x: rows.map((r) => r.step),
      y: names,
      z,
      transpose: true,
      zmin: lo,
      zmax: hi,
      colorscale: HEAT_SCALE,
      colorbar: this.colorbar(lo, hi),
      hoverongaps: false,
      xgap: 0,
      hovertemplate: "%{y}<br>step %{x}<br>log₁₀ ‖g‖ = %{z:.2f}<extra></extra>",
    };
    const longest = Math.max(4, ...names.map((n) => shortName(n, 26).length));
    // Rows of at least 8 px, at most 640 px in all; labels thinned to fit.
    const height = Math.max(260, Math.min(640, 48 + names.length * 10));
    if (this.el.style.height !== `${height}px`) this.el.style.height = `${height}px`;
    const layout = baseLayout({
      height,
      margin: { l: labelPixels(longest), r: 72, t: 8, b: 40 },
      xaxis: axis({ title: { text: "step" }, showgrid: false }),
      yaxis: axis({
        type: "category",
        autorange: "reversed",
        tickmode: "array",
        ...sparseTicks(names, height - 48, 11, 26),
        tickfont: { size: 9, color: COLORS.muted },
        showgrid: false,
      }),
    });
    Plotly.react(this.el, [trace], layout, PLOT_CONFIG);
    bindPick(this, "y");
  }

  update(state, news) {
    if (!news.rows.length) return;
    const rows = news.rows.slice(-HEATMAP_COLUMNS);
    const z = rows.map((r) => this.rowOf(r));
    const n = Math.min(HEATMAP_COLUMNS, state.window().length);
    Plotly.extendTraces(this.el, { x: [rows.map((r) => r.step)], z: [z] }, [0], n);
    // Widen the colour range when new values fall outside it (never narrows
    // while streaming, so colours stay comparable; a reset recomputes it).
    const [lo, hi] = this.zRange(z);
    if (lo < this.range[0] || hi > this.range[1]) {
      this.range = [Math.min(lo, this.range[0]), Math.max(hi, this.range[1])];
      Plotly.restyle(this.el, {
        zmin: this.range[0],
        zmax: this.range[1],
        colorbar: this.colorbar(this.range[0], this.range[1]),
      });
    }
  }
}

// ---------------------------------------------------------------------------
// The per-parameter bar charts (3 and 5): one bar (or an overlaid pair) per
// parameter for the newest snapshot, on a log axis, redrawn when a newer one
// arrives; a click on a bar picks that parameter. Each chart adds its own part
// as figure(row, names), given the newest row (null before any) and the
// parameter names: {traces, title (of the y axis), values (the log range shows
// them), top (margin, px; 8 by default), layout (more layout keys)}.

class ParamBarChart {
  constructor(el, onPick) {
    this.el = el;
    this.onPick = onPick;
    this.bound = false;
    this.shownStep = null;
  }

  render(state, force) {
    const row = state.latest;
    if (!force && row && row.step === this.shownStep) return;
    this.shownStep = row ? row.step : null;
    const names = state.params;
    const { traces, title, values, top = 8, layout = {} } = this.figure(row, names);
    const full = baseLayout({
      showlegend: false, // the card header says which colour is which
      margin: { l: 60, r: 12, t: top, b: paramMargin(names) },
      xaxis: paramAxis(names, this.el),
      yaxis: axis({ type: "log", title: { text: title }, ...logAxisFor(values) }),
      ...layout,
    });
    Plotly.react(this.el, traces, full, PLOT_CONFIG);
    bindPick(this, "x");
  }

  reset(state) {
    this.render(state, true);
  }

  update(state, news) {
    if (news.rows.length) this.render(state, false);
  }
}

// ---------------------------------------------------------------------------
// 3. Gradient flow: per-parameter raw and final, norm or abs-max, log scale.

export class FlowChart extends ParamBarChart {
  constructor(el, onPick) {
    super(el, onPick);
    this.metric = "norm"; // or "absmax"
  }

  keys() {
    return this.metric === "norm" ? ["grad_norm_raw", "grad_norm"] : ["grad_absmax_raw", "grad_absmax"];
  }

  figure(row, names) {
    // What is drawn, for tests and scripts/screenshots.py to wait on.
    this.el.dataset.step = row ? String(row.step) : "";
    this.el.dataset.metric = this.metric;
    const [kr, kf] = this.keys();
    const label = this.metric === "norm" ? "‖g‖₂" : "max |g|";
    const yr = row ? names.map((_, i) => positive((row[kr] || [])[i])) : [];
    const yf = row ? names.map((_, i) => positive((row[kf] || [])[i])) : [];
    const traces = [
      {
        name: "raw",
        type: "bar",
        x: names,
        y: yr,
        marker: { color: COLORS.raw, opacity: 0.45 },
        hovertemplate: `%{x}<br>raw ${label} %{y:.4g}<extra></extra>`,
      },
      {
        name: "final",
        type: "bar",
        x: names,
        y: yf,
        width: 0.45,
        marker: { color: COLORS.final },
        hovertemplate: `%{x}<br>final ${label} %{y:.4g}<extra></extra>`,
      },
    ];
    const layout = {
      barmode: "overlay",
      bargap: 0.15,
      annotations: row
        ? [
            {
              text: `step ${row.step}`,
              xref: "paper",
              yref: "paper",
              x: 1,
              y: 1,
              xanchor: "right",
              yanchor: "bottom",
              showarrow: false,
              font: { size: 10, color: COLORS.muted },
            },
          ]
        : [],
    };
    return { traces, title: `${label} per parameter`, values: [...yr, ...yf], top: 18, layout };
  }
}

// ---------------------------------------------------------------------------
// 4. Histogram of one parameter's gradient, raw and final overlaid.

export class HistChart {
  constructor(el) {
    this.el = el;
    this.param = null;
    this.logY = true; // gradients pile up near 0: a log count axis shows the tails
    this.shown = null;
  }

  render(state, force) {
    const hg = this.param ? state.hist.get(this.param) : null;
    if (!force && hg === this.shown) return;
    this.shown = hg;
    const traces = [];
    if (hg) {
      const edges = (hg.edges || []).map(plottable);
      const centers = [];
      const widths = [];
      for (let i = 0; i + 1 < edges.length; i++) {
        centers.push((edges[i] + edges[i + 1]) / 2);
        widths.push(edges[i + 1] - edges[i]);
      }
      const counts = (a) => (a || []).map((c) => (this.logY ? positive(c) : plottable(c)));
      // final as bars, raw as a step outline over them: equal when no hook acts. No final
      // (null) when the optimizer sees no gradient (a frozen parameter): raw alone.
      if (hg.final) {
        traces.push({
          name: "final",
          type: "bar",
          x: centers,
          y: counts(hg.final),
          width: widths,
          marker: { color: COLORS.final, opacity: 0.7, line: { width: 0 } },
          hovertemplate: "final %{x:.3g}: %{y}<extra></extra>",
        });
      }
      traces.push({
        name: "raw",
        type: "scatter",
        mode: "lines",
        x: centers,
        y: counts(hg.raw),
        line: { color: COLORS.raw, width: 1.5, shape: "hvh" },
        hovertemplate: "raw %{x:.3g}: %{y}<extra></extra>",
      });
    }
    const note = (text, y) => ({
      text,
      xref: "paper",
      yref: "paper",
      x: 0.5,
      y,
      showarrow: false,
      font: { size: 12, color: COLORS.muted },
    });
    const layout = baseLayout({
      barmode: "overlay",
      showlegend: false,
      margin: { l: 56, r: 12, t: 8, b: 40 },
      xaxis: axis({ title: { text: "gradient value" }, visible: Boolean(hg) }),
      yaxis: axis({
        title: { text: "count" },
        type: this.logY ? "log" : "linear",
        visible: Boolean(hg),
        ...(this.logY && hg ? logTicks([...(hg.raw || []), ...(hg.final || [])].map(positive)) : {}),
      }),
      annotations: hg
        ? hg.final
          ? []
          : [note("no final gradient: the optimizer sees none (frozen)", 0.98)]
        : [note(this.param ? `waiting for a histogram of ${this.param}…` : "pick a parameter", 0.5)],
    });
    Plotly.react(this.el, traces, layout, PLOT_CONFIG);
  }

  reset(state) {
    this.render(state, true);
  }

  update(state) {
    this.render(state, false);
  }
}

// ---------------------------------------------------------------------------
// 5. Update-to-parameter ratio per parameter (|Δθ| / |θ| of the last update).

const RATIO_BAND = [1e-4, 1e-2]; // the usual healthy range; 1e-3 is the rule of thumb

export class RatioChart extends ParamBarChart {
  figure(row, names) {
    const y = row ? names.map((_, i) => positive((row.update_ratio || [])[i])) : [];
    const colors = y.map((v) =>
      v !== null && v >= RATIO_BAND[0] && v <= RATIO_BAND[1] ? COLORS.ratioIn : COLORS.ratioOut,
    );
    const traces = [
      {
        name: "update / param",
        type: "bar",
        x: names,
        y,
        marker: { color: colors },
        hovertemplate: "%{x}<br>‖Δθ‖/‖θ‖ %{y:.3g}<extra></extra>",
      },
    ];
    const layout = {
      shapes: [
        {
          type: "rect",
          xref: "paper",
          yref: "y",
          x0: 0,
          x1: 1,
          y0: RATIO_BAND[0],
          y1: RATIO_BAND[1],
          fillcolor: COLORS.band,
          line: { width: 0 },
          layer: "below",
        },
        {
          type: "line",
          xref: "paper",
          yref: "y",
          x0: 0,
          x1: 1,
          y0: 1e-3,
          y1: 1e-3,
          line: { color: COLORS.ratioIn, width: 1, dash: "dot" },
        },
      ],
    };
    return { traces, title: "‖Δθ‖ / ‖θ‖", values: [...y, RATIO_BAND[0] / 3, RATIO_BAND[1] * 3], layout };
  }
}
