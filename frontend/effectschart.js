// Hook effects over steps (issue 14, point 4): per hook, the ratio of the
// gradient norm after it to before it, and the number of elements it changed,
// from each snapshot's hook_effects. A post_accumulate hook acts before "raw"
// is measured (raw and final agree), and an l2 hook changes the norm by a few
// percent: this chart is where both show.

import { LEGEND_ABOVE, SERIES_COLORS } from "./modulechart.js";
import { measuredOf } from "./measured.js";
import { COLORS, axis, baseLayout } from "./theme.js";
import { STEP_CONFIG, sharedRange } from "./timeline.js";
import { plotlyText, plottable } from "./util.js";

const Plotly = window.Plotly;

/** "h3 clip_norm on 0.*": how a hook is named in the legend and hover text. */
function hookName(state, id) {
  const spec = state.hooks.get(id);
  return spec ? `${id} ${spec.kind} @${spec.point} on ${spec.target}` : id;
}

export class EffectsChart {
  constructor(el) {
    this.el = el;
    this.shown = -1;
  }

  render(state, force) {
    const m = measuredOf(state);
    if (!force && m.version === this.shown) return;
    this.shown = m.version;
    const ids = m.effectIds();
    this.el.dataset.hooks = JSON.stringify(ids);
    const x = m.rows.map((r) => r.step);
    const traces = [];
    ids.forEach((id, i) => {
      const color = SERIES_COLORS[i % SERIES_COLORS.length];
      const name = plotlyText(hookName(state, id));
      const val = (r, k) => (r.effects[id] ? plottable(r.effects[id][k]) : null);
      traces.push(
        {
          name,
          legendgroup: id,
          meta: { hook: id, key: "norm_ratio" },
          type: "scatter",
          mode: "lines",
          x,
          y: m.rows.map((r) => val(r, "norm_ratio")),
          line: { color, width: 1.5 },
          text: name, // as text: a template would read "%{" in a target
          hovertemplate: "%{text}<br>step %{x}<br>‖g after‖ / ‖g before‖ %{y:.4g}<extra></extra>",
        },
        {
          name,
          legendgroup: id,
          showlegend: false,
          meta: { hook: id, key: "changed" },
          type: "scatter",
          mode: "lines",
          x,
          y: m.rows.map((r) => val(r, "changed")),
          yaxis: "y2",
          line: { color, width: 1.2, dash: "dot" },
          text: name,
          hovertemplate: "%{text}<br>step %{x}<br>elements changed %{y}<extra></extra>",
        },
      );
    });
    const layout = baseLayout({
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
      annotations: ids.length
        ? []
        : [
            {
              text: "no hook with an effect yet: add a modifying hook",
              xref: "paper",
              yref: "paper",
              x: 0.5,
              y: 0.7,
              showarrow: false,
              font: { size: 12, color: COLORS.muted },
            },
          ],
    });
    Plotly.react(this.el, traces, layout, STEP_CONFIG);
    if (this.timeline) this.timeline.drawn(this, state);
  }

  reset(state) {
    this.render(state, true);
  }

  update(state) {
    this.render(state, false);
  }
}
