// Colours and the Plotly layout shared by every chart. One meaning, one colour:
// raw (before pre_step edits) is blue, final (what the optimizer sees) orange.

import { positiveRange } from "./ticks.js";

// The dark palette and the light one: the same meanings, colours dark enough to read on white.
const DARK = {
  raw: "#6ea8fe",
  final: "#ffa657",
  loss: "#7ee787",
  hook: "#d2a8ff",
  nonfinite: "#ff6b81",
  ratioIn: "#56d4dd",
  ratioOut: "#f0b849",
  band: "rgba(86, 212, 221, 0.08)",
  grid: "#232c39",
  zero: "#3a4656",
  text: "#c9d3df",
  muted: "#8592a3",
  plotBg: "#0e131a",
  reset: "#f0883e",
  compareLoss: "#c3f0c8",
  compareNorm: "#ffd8b0",
  branch: "#f778ba",
  spike: "#f2cc60",
  rule: "#39d0c5", // a rule's firing (rules.js)
  ruleFailed: "#ff6b81",
  hoverBg: "#1b2330",
  hoverBorder: "#3a4656",
  legendBg: "rgba(14,19,26,0.75)",
};
const LIGHT = {
  raw: "#2f6fd6",
  final: "#d4670f",
  loss: "#1a8f36",
  hook: "#8250df",
  nonfinite: "#d1243f",
  ratioIn: "#0e8a96",
  ratioOut: "#b7791f",
  band: "rgba(14, 138, 150, 0.10)",
  grid: "#e1e6ed",
  zero: "#b9c3cf",
  text: "#1f2733",
  muted: "#5a6677",
  plotBg: "#ffffff",
  reset: "#c4561a",
  compareLoss: "#6cc07f",
  compareNorm: "#e3a263",
  branch: "#bf3989",
  spike: "#a87b00",
  rule: "#0b857b",
  ruleFailed: "#d1243f",
  hoverBg: "#ffffff",
  hoverBorder: "#b9c3cf",
  legendBg: "rgba(255,255,255,0.8)",
};

/** The current theme's colours: updated in place by setChartTheme, read at every draw. */
export const COLORS = { ...DARK };

// A hook change's marker on the time charts, by action: [symbol, colour] (the hover names
// the action and the values too, so colour is never the only cue).
export const HOOK_ACTIONS = {
  add: ["triangle-down", "#d2a8ff"],
  update: ["diamond", "#79c0ff"],
  enable: ["circle", "#56d4dd"],
  disable: ["circle-open", "#b1bac4"],
  remove: ["triangle-down-open", "#ff9492"],
  import: ["square", "#e3b341"],
};

// A perceptually even scale that reads on both backgrounds (its ends are dark blue and yellow).
export const HEAT_SCALE = [
  [0.0, "#0d0887"],
  [0.15, "#46039f"],
  [0.3, "#7201a8"],
  [0.45, "#9c179e"],
  [0.6, "#bd3786"],
  [0.72, "#d8576b"],
  [0.84, "#ed7953"],
  [0.93, "#fb9f3a"],
  [1.0, "#f0f921"],
];

const FAMILY = 'Inter, "Segoe UI", system-ui, -apple-system, sans-serif';
const font = () => ({ family: FAMILY, size: 11, color: COLORS.text });

/** A muted note in the middle of a chart (what it waits for, why it is empty); `y` in paper units. */
export function centerNote(text, y = 0.5) {
  return {
    text,
    xref: "paper",
    yref: "paper",
    x: 0.5,
    y,
    showarrow: false,
    font: { size: 12, color: COLORS.muted },
  };
}

export function axis(extra = {}) {
  return {
    gridcolor: COLORS.grid,
    zerolinecolor: COLORS.zero,
    linecolor: COLORS.zero,
    tickfont: { size: 10, color: COLORS.muted },
    title: { font: { size: 11, color: COLORS.muted }, standoff: 6 },
    // Fixed margins: automargin makes every streamed redraw measure text and,
    // when a label changes width, draw again.
    automargin: false,
    // Plotly's own labels (axes without round ticks of ours) in scientific notation, never
    // SI prefixes: "5p" would sit beside "1.2e-4" in a hover or another chart.
    exponentformat: "e",
    ...extra,
  };
}

export function baseLayout(extra = {}) {
  return {
    paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: COLORS.plotBg,
    font: font(),
    margin: { l: 56, r: 16, t: 8, b: 40 },
    hoverlabel: { bgcolor: COLORS.hoverBg, bordercolor: COLORS.hoverBorder, font: { ...font(), size: 12 } },
    legend: { ...LEGEND_OUTSIDE, font: { size: 11, color: COLORS.text } },
    uirevision: "keep", // user zoom survives updates
    ...extra,
  };
}

/** A legend in one line above the plot area, off the data (Plotly makes room in the top margin). */
export const LEGEND_OUTSIDE = {
  orientation: "h",
  x: 0,
  y: 1.01,
  xanchor: "left",
  yanchor: "bottom",
  bgcolor: "rgba(0,0,0,0)",
};

/**
 * The hover of a chart over steps: one label at the hovered step listing every series's value
 * there (Plotly's unified hover), with a spike line down the step.
 */
export const TIME_HOVER = {
  hovermode: "x unified",
  hoverdistance: 50,
  spikedistance: -1,
};

/**
 * A log-axis range for bars: bars grow from the bottom of the axis, so the
 * bottom sits at least `decades` below the top, or the shortest bar would look
 * like nothing next to one barely taller.
 */
export function barLogRange(values, decades = 1.5) {
  const [lo, hi] = positiveRange(values);
  if (!Number.isFinite(lo)) return undefined;
  const top = Math.log10(hi) + 0.08;
  const bottom = Math.min(Math.log10(lo) - 0.15, top - decades);
  return [bottom, top];
}

/** Pixels a tick label of `chars` characters takes (10 px font). */
export function labelPixels(chars) {
  return Math.ceil(chars * 6.1) + 10;
}

export const PLOT_CONFIG = {
  responsive: true,
  displaylogo: false,
  displayModeBar: "hover",
  modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toImage"],
  scrollZoom: false,
};

/** "dark" or "light": the palette COLORS holds now. */
export function chartTheme() {
  return COLORS.plotBg === LIGHT.plotBg ? "light" : "dark";
}

/**
 * Switch the charts' palette to `name` ("dark" or "light"): COLORS is updated in place (later
 * draws use it) and every Plotly chart on the page is restyled now (backgrounds, fonts, grids,
 * and each trace, annotation and shape colour of the old palette to its counterpart).
 */
export function setChartTheme(name) {
  const from = chartTheme() === "light" ? LIGHT : DARK;
  const to = name === "light" ? LIGHT : DARK;
  if (from === to) return;
  Object.assign(COLORS, to);
  const swap = new Map();
  for (const k of Object.keys(from)) if (from[k] !== to[k]) swap.set(from[k].toLowerCase(), to[k]);
  const map = (c) => (typeof c === "string" && swap.has(c.toLowerCase()) ? swap.get(c.toLowerCase()) : c);
  const Plotly = window.Plotly;
  if (!Plotly) return;
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    if (!gd.layout || !gd.data) continue;
    const lay = {
      plot_bgcolor: COLORS.plotBg,
      "font.color": COLORS.text,
      "hoverlabel.bgcolor": COLORS.hoverBg,
      "hoverlabel.bordercolor": COLORS.hoverBorder,
      "hoverlabel.font.color": COLORS.text,
      "legend.bgcolor": COLORS.legendBg,
      "legend.font.color": COLORS.text,
    };
    for (const key of Object.keys(gd.layout)) {
      if (!/^[xy]axis\d*$/.test(key)) continue;
      Object.assign(lay, {
        [`${key}.gridcolor`]: COLORS.grid,
        [`${key}.zerolinecolor`]: COLORS.zero,
        [`${key}.linecolor`]: COLORS.zero,
        [`${key}.tickfont.color`]: COLORS.muted,
        [`${key}.title.font.color`]: COLORS.muted,
      });
    }
    (gd.layout.annotations || []).forEach((a, i) => {
      if (a.font && a.font.color) lay[`annotations[${i}].font.color`] = map(a.font.color);
      if (a.bgcolor) lay[`annotations[${i}].bgcolor`] = map(a.bgcolor);
    });
    (gd.layout.shapes || []).forEach((s, i) => {
      if (s.line && s.line.color) lay[`shapes[${i}].line.color`] = map(s.line.color);
      if (s.fillcolor) lay[`shapes[${i}].fillcolor`] = map(s.fillcolor);
    });
    const style = { "line.color": [], "marker.color": [], fillcolor: [] };
    const idx = [];
    gd.data.forEach((t, i) => {
      idx.push(i);
      style["line.color"].push(map(t.line && t.line.color));
      style["marker.color"].push(
        Array.isArray(t.marker && t.marker.color) ? t.marker.color.map(map) : map(t.marker && t.marker.color),
      );
      style.fillcolor.push(map(t.fillcolor));
    });
    try {
      Plotly.relayout(gd, lay);
      if (idx.length) Plotly.restyle(gd, style, idx);
    } catch {
      // (a chart being replaced at this moment is drawn again with COLORS by its own draw)
    }
  }
}
