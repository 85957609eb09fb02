// Hook effects over steps: per hook, the ratio of the
// gradient norm after it to before it, and the number of elements it changed,
// from each snapshot's hook_effects. A post_accumulate hook acts before "raw"
// is measured (raw and final agree), and an l2 hook changes the norm by a few
// percent: this chart is where both show.

import { LEGEND_ABOVE, SERIES_COLORS } from "./modulechart.js";
import { COLORS, TIME_HOVER, axis, baseLayout, centerNote } from "./theme.js";
import { StepChart, sharedRange } from "./timeline.js";
import { plotlyText, plottable } from "./util.js";

/** "h3 clip_norm on 0.*": how a hook is named in the legend and hover text. */
function hookName(state, id) {
  const spec = state.hooks.get(id);
  return spec ? `${id} ${spec.kind} @${spec.point} on ${spec.target}` : id;
}

export class EffectsChart extends StepChart {
  constructor(el) {
    super();
    this.el = el;
    this.shown = -1;
  }

  render(state, force) {
    if (!force && state.version === this.shown) return;
    this.shown = state.version;
    const rows = state.snapshots;
    const ids = state.effectIds();
    this.el.dataset.hooks = JSON.stringify(ids);
    const x = rows.map((r) => r.step);
    const traces = [];
    ids.forEach((id, i) => {
      const color = SERIES_COLORS[i % SERIES_COLORS.length];
      const name = plotlyText(hookName(state, id));
      const val = (r, k) => (r.hook_effects[id] ? plottable(r.hook_effects[id][k]) : null);
      traces.push(
        {
          name,
          legendgroup: id,
          meta: { hook: id, key: "norm_ratio" },
          type: "scatter",
          mode: "lines",
          x,
          y: rows.map((r) => val(r, "norm_ratio")),
          line: { color, width: 1.5 },
          text: name, // as text: a template would read "%{" in a target
          hovertemplate: "%{text}: ‖g after‖ / ‖g before‖ %{y:.4g}<extra></extra>",
        },
        {
          name,
          legendgroup: id,
          showlegend: false,
          meta: { hook: id, key: "changed" },
          type: "scatter",
          mode: "lines",
          x,
          y: rows.map((r) => val(r, "changed")),
          yaxis: "y2",
          line: { color, width: 1.2, dash: "dot" },
          text: name,
          hovertemplate: "%{text}: elements changed %{y}<extra></extra>",
        },
      );
    });
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 60, r: 16, t: 26, b: 40 },
      showlegend: ids.length > 0,
      legend: { ...LEGEND_ABOVE },
      xaxis: axis({ title: { text: "step" }, anchor: "y2", ...sharedRange(this, state) }),
      yaxis: axis({ domain: [0.45, 1], title: { text: "‖g‖ after/before" } }),
      yaxis2: axis({ domain: [0, 0.36], title: { text: "changed" }, rangemode: "tozero" }),
      shapes: [
        {
          type: "line",
          xref: "paper",
          yref: "y",
          x0: 0,
          x1: 1,
          y0: 1,
          y1: 1,
          line: { color: COLORS.zero, width: 1, dash: "dot" },
        },
      ],
      annotations: ids.length ? [] : [centerNote("no hook with an effect yet: add a modifying hook", 0.7)],
    });
    this.draw(traces, layout, state);
  }
}
