// The heatmap and the per-parameter charts (the loss chart is losschart.js). Each draws
// once with Plotly.newPlot / Plotly.react (reset) and then streams: the heatmap grows
// with Plotly.extendTraces over a bounded window, the per-parameter charts are redrawn
// from the newest snapshot. The time charts (loss, heatmap) share a step axis
// (timeline.js); while they show older history fetched ahead of the window, they
// redraw instead of extending. The caller batches messages and calls update() at most
// once per animation frame.

import {
  COLORS,
  HEAT_SCALE,
  PLOT_CONFIG,
  axis,
  barLogRange,
  baseLayout,
  centerNote,
  labelPixels,
} from "./theme.js";
import { decadeTicks, logTicks, shortName, sparseTicks } from "./ticks.js";
import { MAX_SNAPSHOTS } from "./state.js";
import { markerShapes } from "./timeline.js";
import { log10OrNull, plotlyText, plottable, positive, quantileRange } from "./util.js";

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
 * or "y") is the point's coordinate that holds the parameter's category, its
 * name as Plotly text (`plotlyText`), which `chart.byLabel` maps back to the
 * name. Bound once per element: the listener survives Plotly.react.
 */
function bindPick(chart, coord) {
  if (chart.bound) return;
  chart.bound = true;
  chart.el.on("plotly_click", (ev) => {
    const p = ev && ev.points && ev.points[0];
    const name = p && chart.byLabel ? chart.byLabel.get(p[coord]) : undefined;
    if (name !== undefined) chart.onPick(name);
  });
}

/** Parameter names as an axis's categories (Plotly text), and the map back to the names. */
function categories(names) {
  const labels = names.map(plotlyText);
  return { labels, byLabel: new Map(labels.map((l, i) => [l, names[i]])) };
}

// ---------------------------------------------------------------------------
// 2. Heatmap: per-parameter gradient norm over steps, log colour scale, its range
// from robust quantiles (one 1e31 outlier does not wash every other cell out).
// z holds one row per snapshot and `transpose` turns rows into columns, so a
// new step is one extendTraces of a row. The fetched older history (zoomed out)
// comes first, then the streamed window.

// Streamed steps shown: the whole window, so the heatmap covers the loss chart's shared range
// (every redraw paints columns x parameters cells; the scheduler spaces costly draws out).
const HEATMAP_COLUMNS = MAX_SNAPSHOTS;
const HEAT_QUANTILE = 0.02; // the colour range: the 2nd to the 98th percentile of log10 |g|

export class HeatmapChart {
  constructor(el, onPick) {
    this.el = el;
    this.source = "raw"; // or "final"
    this.onPick = onPick;
    this.bound = false;
    this.range = null;
    this.base = 0;
  }

  key() {
    return this.source === "raw" ? "grad_norm_raw" : "grad_norm";
  }

  rowOf(r) {
    return (r[this.key()] || []).map(log10OrNull);
  }

  zRange(rows) {
    const q = quantileRange(rows.flat(), HEAT_QUANTILE);
    if (!q) return [-4, 1];
    const [lo, hi] = q;
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
    const rows = [...state.history.rows, ...state.window().slice(-HEATMAP_COLUMNS)];
    this.base = state.history.rows.length;
    const z = rows.map((r) => this.rowOf(r));
    const [lo, hi] = this.zRange(z);
    this.range = [lo, hi];
    this.el.dataset.zmin = String(lo);
    this.el.dataset.zmax = String(hi);
    const names = state.params;
    const cats = categories(names);
    this.byLabel = cats.byLabel;
    const trace = {
      type: "heatmap",
      name: this.source,
      x: rows.map((r) => r.step),
      y: cats.labels,
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
    const range = this.timeline ? this.timeline.range(state) : null;
    const layout = baseLayout({
      height,
      margin: { l: labelPixels(longest), r: 72, t: 8, b: 40 },
      xaxis: axis({
        title: { text: "step" },
        showgrid: false,
        ...(range ? { range, autorange: false } : {}),
      }),
      yaxis: axis({
        type: "category",
        autorange: "reversed",
        tickmode: "array",
        ...sparseTicks(names, height - 48, 11, 26),
        tickfont: { size: 9, color: COLORS.muted },
        showgrid: false,
      }),
      shapes: markerShapes(state.markers),
    });
    Plotly.react(this.el, [trace], layout, PLOT_CONFIG);
    bindPick(this, "y");
    if (this.timeline) {
      this.timeline.bind(this);
      this.timeline.sync(this, state);
    }
  }

  update(state, news) {
    if (this.base && (news.rows.length || news.markers)) {
      this.reset(state); // history ahead of the streamed columns: as the loss chart, redrawn
      return;
    }
    if (news.markers) Plotly.relayout(this.el, { shapes: markerShapes(state.markers) });
    if (!news.rows.length) return;
    const rows = news.rows.slice(-HEATMAP_COLUMNS);
    const z = rows.map((r) => this.rowOf(r));
    const n = this.base + Math.min(HEATMAP_COLUMNS, state.window().length);
    Plotly.extendTraces(this.el, { x: [rows.map((r) => r.step)], z: [z] }, [0], n);
    // Widen the colour range when the robust range of what is shown grows (never narrows
    // while streaming, so colours stay comparable; a reset recomputes it).
    const [lo, hi] = this.zRange(Array.from(this.el.data[0].z).slice(-HEATMAP_COLUMNS));
    if (lo < this.range[0] || hi > this.range[1]) {
      this.range = [Math.min(lo, this.range[0]), Math.max(hi, this.range[1])];
      this.el.dataset.zmin = String(this.range[0]);
      this.el.dataset.zmax = String(this.range[1]);
      Plotly.restyle(this.el, {
        zmin: this.range[0],
        zmax: this.range[1],
        colorbar: this.colorbar(this.range[0], this.range[1]),
      });
    }
    if (this.timeline) this.timeline.sync(this, state);
  }
}

// ---------------------------------------------------------------------------
// The per-parameter bar charts (3 and 5): one bar (or an overlaid pair) per
// parameter for the newest snapshot, on a log axis, redrawn when a newer one
// arrives; a click on a bar picks that parameter. Each chart adds its own part
// as figure(row, names, labels), given the newest row (null before any), the
// parameter names and the x axis's categories (the names as Plotly text):
// {traces, title (of the y axis), values (the log range shows
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
    const cats = categories(names);
    this.byLabel = cats.byLabel;
    const { traces, title, values, top = 8, layout = {} } = this.figure(row, names, cats.labels);
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

  figure(row, names, labels) {
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
        x: labels,
        y: yr,
        marker: { color: COLORS.raw, opacity: 0.45 },
        hovertemplate: `%{x}<br>raw ${label} %{y:.4g}<extra></extra>`,
      },
      {
        name: "final",
        type: "bar",
        x: labels,
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
    const hg = this.param ? state.latestHist(this.param) : null;
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
    const note = centerNote;
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
        : [
            note(
              this.param ? plotlyText(`waiting for a histogram of ${this.param}…`) : "pick a parameter",
              0.5,
            ),
          ],
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
  figure(row, names, labels) {
    const y = row ? names.map((_, i) => positive((row.update_ratio || [])[i])) : [];
    const colors = y.map((v) =>
      v !== null && v >= RATIO_BAND[0] && v <= RATIO_BAND[1] ? COLORS.ratioIn : COLORS.ratioOut,
    );
    const traces = [
      {
        name: "update / param",
        type: "bar",
        x: labels,
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
