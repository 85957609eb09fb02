// Module gradients: the norm of each logged module's
// grad_output (and grad_input, when its module_log hook asks for it) over
// steps, on a log axis. The card stays hidden until a snapshot carries module
// values (a module_log hook exists and has run).

import { logTicks } from "./ticks.js";
import { StepChart, sharedRange } from "./timeline.js";
import { LEGEND_OUTSIDE, TIME_HOVER, axis, baseLayout } from "./theme.js";
import { plotlyText, positive } from "./util.js";

export const SERIES_COLORS = [
  "#6ea8fe",
  "#ffa657",
  "#7ee787",
  "#d2a8ff",
  "#56d4dd",
  "#f0b849",
  "#ff9bce",
  "#a5d6ff",
];
/** A legend in one line above the plot, off the lines. */
export const LEGEND_ABOVE = LEGEND_OUTSIDE;
const MAX_LEGEND = 8;
const WHICH = [
  ["grad_output_norm", "grad_output", "solid"],
  ["grad_input_norm", "grad_input", "dot"],
];

/** The root module's name is "" on the wire; the page shows it as (root). */
export const moduleLabel = (name) => (name === "" ? "(root)" : name);

export class ModuleChart extends StepChart {
  constructor(el) {
    super();
    this.el = el;
    this.card = el.closest(".card");
    this.note = this.card.querySelector('[data-role="modules-note"]');
    this.shown = -1;
  }

  render(state, force) {
    if (!force && state.version === this.shown) return;
    this.shown = state.version;
    const rows = state.snapshots;
    const names = state.moduleNames();
    this.card.hidden = names.length === 0;
    this.el.dataset.modules = JSON.stringify(names);
    if (!names.length) return;
    const x = rows.map((r) => r.step);
    const traces = [];
    const values = [];
    names.forEach((name, i) => {
      for (const [key, label, dash] of WHICH) {
        if (!rows.some((r) => r.modules[name] && r.modules[name][key] !== undefined)) continue;
        const y = rows.map((r) => positive(r.modules[name] ? r.modules[name][key] : null));
        values.push(...y);
        traces.push({
          name: plotlyText(`${moduleLabel(name)} ${label}`),
          meta: { module: name, key },
          type: "scatter",
          mode: "lines",
          x,
          y,
          line: { color: SERIES_COLORS[i % SERIES_COLORS.length], width: 1.5, dash },
          text: plotlyText(moduleLabel(name)), // as text: a template would read "%{" in a name
          hovertemplate: `%{text}: ‖${label}‖ %{y:.4g}<extra></extra>`,
        });
      }
    });
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 60, r: 16, t: traces.length <= MAX_LEGEND ? 26 : 8, b: 40 },
      // Past MAX_LEGEND lines a legend would crowd the plot out: the hover names each line.
      showlegend: traces.length <= MAX_LEGEND,
      legend: { ...LEGEND_ABOVE },
      xaxis: axis({ title: { text: "step" }, ...sharedRange(this, state) }),
      yaxis: axis({ type: "log", title: { text: "‖∂L/∂output‖ (L2)" }, ...logTicks(values) }),
    });
    if (this.note)
      this.note.textContent =
        traces.length > MAX_LEGEND ? `${traces.length} lines: hover one for its module` : "";
    this.draw(traces, layout, state);
  }
}

/**
 * The newest value of each module_log hook's modules, as extra "effects" the
 * hook rows show ("‖grad_output‖ 0.52"; several modules: the largest and how many).
 * `matches(target)` gives the modules a target names (the server's rule, cached).
 */
export function moduleEffects(state, matches) {
  const row = state.latest;
  const out = {};
  if (!row) return out;
  for (const spec of state.hooks.values()) {
    if (spec.kind !== "module_log") continue;
    const names = matches(spec.target);
    if (!names) continue;
    const effect = {};
    for (const [key, label] of WHICH) {
      const vals = names
        .map((n) => (row.modules[n] ? positive(row.modules[n][key]) : null))
        .filter((v) => v !== null);
      if (!vals.length) continue;
      if (vals.length === 1) effect[`‖${label}‖`] = vals[0];
      else effect[`max ‖${label}‖ of ${vals.length}`] = Math.max(...vals);
    }
    out[spec.id] = effect;
  }
  return out;
}
