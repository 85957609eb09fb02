// Histograms over time, TensorBoard's "distributions": for
// the parameter the histogram card shows, quantile bands of its gradient's
// distribution at every step that has a histogram (min-max, 7-93 %, 16-84 %,
// 31-69 %, and the median), raw or final. Each step's histogram has its own
// edges (its own range), so quantiles, not a common bin grid, are drawn.

import { TIME_HOVER, axis, baseLayout, centerNote, labelPixels } from "./theme.js";
import { logTicksIn, positiveRange, tickLabels } from "./ticks.js";
import { StepChart, sharedRange } from "./timeline.js";
import { plotlyText, plottable } from "./util.js";

// The normal distribution's -inf, -1.5, -1, -0.5, 0, ... sigma: TensorBoard's bands.
export const QUANTILES = [0, 0.0668, 0.1587, 0.3085, 0.5, 0.6915, 0.8413, 0.9332, 1];

/**
 * The values at QUANTILES of a histogram (counts over edges), linear within a
 * bin; null when it holds no count.
 */
export function histQuantiles(edges, counts) {
  const e = (edges || []).map(plottable);
  const c = (counts || []).map((v) => Math.max(0, plottable(v) ?? 0));
  const total = c.reduce((a, b) => a + b, 0);
  if (!(total > 0) || e.length !== c.length + 1 || e.some((v) => v === null)) return null;
  const first = c.findIndex((v) => v > 0);
  const last = c.length - 1 - [...c].reverse().findIndex((v) => v > 0);
  return QUANTILES.map((q) => {
    if (q === 0) return e[first];
    if (q === 1) return e[last + 1];
    const target = q * total;
    let acc = 0;
    for (let i = 0; i < c.length; i++) {
      if (c[i] > 0 && acc + c[i] >= target) return e[i] + ((target - acc) / c[i]) * (e[i + 1] - e[i]);
      acc += c[i];
    }
    return e[last + 1];
  });
}

export class HistTimeChart extends StepChart {
  constructor(el) {
    super();
    this.el = el;
    this.param = null;
    this.source = "raw"; // or "final"
    this.shown = null;
  }

  render(state, force) {
    const key = `${this.param}|${this.source}|${state.histVersion}`;
    if (!force && key === this.shown) return;
    this.shown = key;
    const list = (this.param && state.hists.get(this.param)) || [];
    const x = [];
    const qs = QUANTILES.map(() => []);
    for (const hg of list) {
      const q = histQuantiles(hg.edges, this.source === "raw" ? hg.raw : hg.final);
      if (!q) continue;
      x.push(hg.step);
      q.forEach((v, i) => qs[i].push(v));
    }
    this.el.dataset.param = this.param || "";
    this.el.dataset.points = String(x.length);
    // Values over more than three decades (an exploding run's tails): a symmetric log axis.
    const sym = symlog(qs.flat());
    const ys = sym ? qs.map((q) => q.map(sym.f)) : qs;
    const real = (i) => (sym ? { customdata: qs[i] } : {});
    const yv = sym ? "%{customdata:.3g}" : "%{y:.3g}";
    const color = this.source === "raw" ? "110, 168, 254" : "255, 166, 87";
    const traces = [];
    const n = QUANTILES.length;
    for (let i = 0; i < (n - 1) / 2; i++) {
      const lo = QUANTILES[i];
      const hi = QUANTILES[n - 1 - i];
      const band = `${Math.round(lo * 100)}–${Math.round(hi * 100)} %`;
      traces.push(
        {
          name: `q${lo}`,
          x,
          y: ys[i],
          type: "scatter",
          mode: "lines",
          line: { width: 0 },
          hoverinfo: "skip",
          showlegend: false,
        },
        {
          name: `q${hi}`,
          x,
          y: ys[n - 1 - i],
          ...real(n - 1 - i),
          type: "scatter",
          mode: "lines",
          line: { width: 0 },
          fill: "tonexty",
          fillcolor: `rgba(${color}, ${0.16 + 0.14 * i})`,
          showlegend: false,
          hovertemplate: `${band}: up to ${yv}<extra></extra>`,
        },
      );
    }
    traces.push({
      name: "median",
      x,
      y: ys[(n - 1) / 2],
      ...real((n - 1) / 2),
      type: "scatter",
      mode: "lines",
      line: { color: `rgb(${color})`, width: 1.5 },
      showlegend: false,
      hovertemplate: `median ${yv}<extra></extra>`,
    });
    const note = !this.param
      ? "pick a parameter"
      : x.length
        ? null
        : `waiting for histograms of ${this.param}${this.source === "final" ? " with a final gradient" : ""}…`;
    const layout = baseLayout({
      ...TIME_HOVER,
      // room for the tick labels and, left of them, the axis title
      margin: {
        l: sym ? labelPixels(Math.max(...sym.ticktext.map((t) => t.length))) + 22 : 72,
        r: 12,
        t: 8,
        b: 40,
      },
      showlegend: false,
      xaxis: axis({ title: { text: "step" }, visible: x.length > 0, ...sharedRange(this, state) }),
      yaxis: axis({
        title: { text: `${this.source} gradient value${sym ? " (symmetric log)" : ""}`, standoff: 4 },
        visible: x.length > 0,
        ...(sym ? { tickmode: "array", tickvals: sym.tickvals, ticktext: sym.ticktext } : {}),
      }),
      annotations: note ? [centerNote(plotlyText(note))] : [],
    });
    this.draw(traces, layout, state);
  }
}

/**
 * A symmetric log scale for signed values whose magnitudes span more than three decades:
 * v -> sign(v) log10(1 + |v| / c), c the smallest magnitude shown, with ticks at 0 and at
 * ± round powers of ten in one number format. null when a linear axis reads well.
 */
export function symlog(values) {
  const [lo, hi] = positiveRange(values.map((v) => (v === null ? null : Math.abs(v))));
  if (!Number.isFinite(lo) || hi / lo <= 1e3) return null;
  const c = lo;
  const f = (v) =>
    v === null || !Number.isFinite(v) ? null : Math.sign(v) * Math.log10(1 + Math.abs(v) / c);
  const any = (pred) => values.some((v) => v !== null && pred(v));
  const t = logTicksIn(Math.log10(lo), Math.log10(hi), 5).tickvals || [];
  const vals = [...(any((v) => v < 0) ? t.map((v) => -v).reverse() : []), 0, ...(any((v) => v > 0) ? t : [])];
  return { f, tickvals: vals.map(f), ticktext: tickLabels(vals) };
}
