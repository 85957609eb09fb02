// The heatmap and the per-parameter charts (the loss chart is losschart.js). Each draws
// once with Plotly.newPlot / Plotly.react (reset) and then streams: the heatmap takes
// its new columns with one Plotly.update (one redraw, its shared x range and marker lines
// in the same call), the per-parameter charts are redrawn from the newest snapshot. The
// time charts (loss, heatmap) share a step axis (timeline.js), the fetched older history
// ahead of the window. The caller batches messages and calls update() at most once per
// animation frame.
//
// A large run (state.large: more than DETAIL_ALL tensors) is shown by groups (groups.js):
// the heatmap has one row per group, a click expands a group in place into its modules and
// tensors (a breadcrumb says which); the bar charts show one bar per group, a click drills
// into the group's tensors, and "by depth" shows one kind of tensor (or whole blocks) of a
// stack over its block index. Per-tensor values come from the rows' detail (the tensors the
// page subscribed to: `wanted()` says which each chart needs).

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
import { decadeTicks, logTicks, shortName, sparseTicks, tickLabels } from "./ticks.js";
import { childrenOf, commonPrefix } from "./groups.js";
import { MAX_SNAPSHOTS, statOf } from "./state.js";
import { markerShapes } from "./timeline.js";
import { drawsNothing, markNote, nonfiniteNote } from "./health.js";
import { h, log10OrNull, num, plotlyText, plottable, positive, quantileRange } from "./util.js";

const Plotly = window.Plotly;

/** Bottom margin for the rotated parameter names under a bar chart. */
function paramMargin(names, display = null) {
  const longest = display
    ? Math.max(4, ...display.map((n) => cutStart(n, DISPLAY_CHARS).length))
    : Math.max(4, ...names.map((n) => shortName(n).length));
  return names.length > 12 ? Math.ceil(longest * 5.6 * 0.77) + 18 : 34;
}

const DISPLAY_CHARS = 28; // a bar's own label (`display`), at most

/** The category axis of bars `names`; `display` (one per bar) replaces the tick labels. */
function paramAxis(names, el, extra = {}, display = null) {
  const width = (el.clientWidth || 600) - 80;
  // Rotated labels need about 18 px each along the axis to stay apart (a 9 px font at -50°):
  // thinned to every k-th, the hover names every bar; each cut from the left (its own end kept).
  const rotated = names.length > 12;
  const ticks = sparseTicks(names, width, rotated ? 18 : 11, 22);
  if (display) {
    const at = new Map(names.map((n, j) => [plotlyText(n), display[j]]));
    ticks.ticktext = ticks.tickvals.map((v) => plotlyText(cutStart(at.get(v), DISPLAY_CHARS)));
  }
  return axis({
    type: "category",
    tickmode: "array",
    ...ticks,
    tickangle: rotated ? -50 : 0,
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
// z holds one row per snapshot and `transpose` turns rows into columns; each row's
// column is computed once. The fetched older history (zoomed out) comes first, then
// the streamed window.

// Streamed steps shown: the whole window, so the heatmap covers the loss chart's shared range
// (every redraw paints columns x parameters cells; the scheduler spaces costly draws out).
const HEATMAP_COLUMNS = MAX_SNAPSHOTS;
const HEAT_QUANTILE = 0.02; // the colour range: the 2nd to the 98th percentile of log10 |g|
// ... of the newest RECENT_COLUMNS columns: a warm-up's large gradients do not set the colours
// (they show at the top colour, clipped), the steps around now do. The colour bar says so
// ("clip: newest 100 steps").
const RECENT_COLUMNS = 100;
// While streaming the range widens at once; it narrows only by more than this (log10), so the
// colours stay comparable from frame to frame and the warm-up leaves the range once past.
const NARROW_BY = 0.5;
const HEAT_ROWS = 160; // a large run's rows, at most, while groups are expanded (older ones collapse)
const MAX_CHILDREN = 128; // rows an expanded node shows, at most (a stack of 110 blocks fits)
const ROW_PX = 13; // a large run's row height up to TALL_ROWS rows: every label readable
const TALL_ROWS = 64; // past this many rows the heatmap stops growing; labels are thinned
const LABEL_CHARS = 30; // a large run's heatmap labels, at most (the full name is in the hover)

const GRID_MAX = 1200; // columns of the evenly spaced step grid, at most (about a plot's width in pixels)

/**
 * The heatmap's columns on an evenly spaced step grid. Plotly draws an evenly spaced heatmap as
 * one image of a pixel a cell, scaled up (its "fast" path); unevenly spaced columns (a run
 * sampled every k-th step with k growing, fetched history before the streamed window) are
 * painted cell by cell into an image of the plot's size, then encoded as a PNG: at 60 rows and
 * 600 columns that was most of a 75 ms redraw. The grid runs from the oldest step to the newest;
 * its spacing is the smallest gap between two columns, or wider so that there are at most
 * GRID_MAX points; each point shows the column nearest to it (as the cells of uneven columns
 * reach halfway to their neighbours). Evenly spaced steps are kept as they are. Returns {x, z,
 * steps}: the grid, its columns (shared, not copied) and the step each one shows.
 */
export function evenColumns(steps, cols) {
  const n = steps.length;
  let gap = Infinity;
  let even = true;
  for (let i = 1; i < n; i++) {
    const g = steps[i] - steps[i - 1];
    if (g < gap) gap = g;
    if (g !== steps[1] - steps[0]) even = false;
  }
  if (n < 3 || even || !(gap > 0)) return { x: steps, z: cols, steps };
  const span = steps[n - 1] - steps[0];
  const count = Math.min(GRID_MAX, Math.floor(span / gap + 1e-9) + 1);
  const d = span / (count - 1);
  const x = new Array(count);
  const z = new Array(count);
  const shown = new Array(count);
  let i = 0;
  for (let j = 0; j < count; j++) {
    const at = j === count - 1 ? steps[n - 1] : steps[0] + j * d;
    while (i + 1 < n && Math.abs(steps[i + 1] - at) <= Math.abs(steps[i] - at)) i++;
    x[j] = at;
    z[j] = cols[i];
    shown[j] = steps[i];
  }
  return { x, z, steps: shown };
}

/** A label of at most n characters: its end kept (the tensor's own name), an ellipsis before. */
function cutStart(label, n) {
  return label.length <= n ? label : `…${label.slice(label.length - n + 1)}`;
}

/** A group's aggregate under a per-parameter statistic's key, from a row's `groups`. */
const GROUP_KEY = {
  grad_norm_raw: "norm_raw",
  grad_norm: "norm",
  grad_absmax_raw: "absmax_raw",
  grad_absmax: "absmax",
  update_ratio: "ratio_median",
};

// A large run's message leaves out a final aggregate equal to its raw one (server/hub.py)
const RAW_OF = { norm: "norm_raw", absmax: "absmax_raw" };

function groupValue(row, key, g) {
  const groups = row && row.groups;
  const name = GROUP_KEY[key] || key;
  const list = groups ? (groups[name] ?? groups[RAW_OF[name]]) : null;
  return list && g !== null && g !== undefined ? list[g] : null;
}

/** sqrt(sum of squares) of the members' values a row has (NaN/Inf carry through); null if none. */
function normOf(row, key, members) {
  let sum = 0;
  let any = false;
  for (const i of members) {
    const v = num(statOf(row, key, i));
    if (v === null || v === undefined) continue;
    any = true;
    sum += v * v;
  }
  return any ? Math.sqrt(sum) : null;
}

export class HeatmapChart {
  constructor(el, onPick) {
    this.el = el;
    this.source = "raw"; // or "final"
    this.pickParam = onPick;
    this.onPick = (cat) => this.clicked(cat);
    this.bound = false;
    this.range = null;
    // A large run: the rows shown ({key, cat, label, kind, members, g, ancestors}), the expanded
    // nodes (key -> their ancestors' keys, in the order expanded) and the breadcrumb element.
    this.entries = null;
    this.byCat = new Map();
    this.expanded = new Map();
    this.state = null;
    this.onExpand = () => {}; // set by app.js: subscribe to the members shown, redraw
    this.crumbs = h("nav", { class: "crumbs", dataset: { testid: "heatmap-crumbs" }, hidden: true });
    el.before(this.crumbs);
  }

  key() {
    return this.source === "raw" ? "grad_norm_raw" : "grad_norm";
  }

  rowOf(r) {
    if (this.entries) return this.entries.map((e) => log10OrNull(this.valueOf(r, e)));
    return (r[this.key()] || []).map(log10OrNull);
  }

  valueOf(r, e) {
    if (e.kind === "group") return groupValue(r, this.key(), e.g);
    if (e.kind === "tensor") return statOf(r, this.key(), e.members[0]);
    return normOf(r, this.key(), e.members);
  }

  /** A large run's rows: every group, an expanded one followed by its modules and tensors. */
  buildEntries(state) {
    const out = [];
    const used = new Set();
    const add = (e) => {
      let cat = e.cat;
      while (used.has(cat)) cat += "\u200b"; // categories are unique
      used.add(cat);
      out.push({ ...e, cat });
    };
    const params = state.params;
    const children = (parent, depth) => {
      const kids = childrenOf(parent.members, params);
      for (const kid of kids.slice(0, MAX_CHILDREN)) {
        const ancestors = [...parent.ancestors, parent.key];
        const pad = "· ".repeat(depth); // the labels are right-aligned: the depth shows as dots
        if (kid.kind === "tensor") {
          add({
            kind: "tensor",
            key: `t${kid.members[0]}`,
            cat: kid.key,
            members: kid.members,
            ancestors,
            label: `${pad}${cutStart(kid.label, LABEL_CHARS - 2 * depth)}`,
          });
        } else {
          const key = `m${kid.key}`;
          const open = this.expanded.has(key);
          const e = {
            kind: "module",
            key,
            cat: kid.key,
            members: kid.members,
            ancestors,
            label: `${pad}${open ? "▾" : "▸"} ${cutStart(kid.label, LABEL_CHARS - 2 - 2 * depth)}`,
          };
          add(e);
          if (open) children(e, depth + 1);
        }
      }
      if (kids.length > MAX_CHILDREN)
        add({
          kind: "more",
          key: `x${parent.key}`,
          cat: `${parent.cat} (${kids.length - MAX_CHILDREN} more)`,
          members: [],
          ancestors: [],
          label: `${"· ".repeat(depth)}… ${kids.length - MAX_CHILDREN} more`,
        });
    };
    state.groups.names.forEach((name, g) => {
      const members = state.groups.members[g];
      const key = `g${g}`;
      const open = members.length > 1 && this.expanded.has(key);
      const mark = members.length > 1 ? (open ? "▾ " : "▸ ") : "";
      const e = {
        kind: "group",
        key,
        cat: name,
        members,
        g,
        ancestors: [],
        label: `${mark}${cutStart(name, LABEL_CHARS - 2)}`,
      };
      add(e);
      if (open) children(e, 1);
    });
    return out;
  }

  /** A click on a row: a tensor is picked; a group or module expands (or collapses) in place. */
  clicked(cat) {
    if (!this.entries) {
      this.pickParam(cat);
      return;
    }
    const e = this.byCat.get(cat);
    if (!e || e.kind === "more") return;
    if (e.kind === "tensor" || e.members.length === 1) {
      this.pickParam(this.state.params[e.members[0]]);
      return;
    }
    if (this.expanded.has(e.key)) this.collapse(e.key);
    else this.expand(e.key, e.ancestors);
    this.onExpand();
  }

  collapse(key) {
    for (const [k, anc] of [...this.expanded]) if (k === key || anc.includes(key)) this.expanded.delete(k);
  }

  /** Expand a node; the oldest expanded nodes off its path collapse while the rows pass HEAT_ROWS. */
  expand(key, ancestors) {
    this.expanded.delete(key);
    this.expanded.set(key, ancestors);
    const keep = new Set([...ancestors, key]);
    while (this.state && this.buildEntries(this.state).length > HEAT_ROWS) {
      const old = [...this.expanded.keys()].find((k) => !keep.has(k));
      if (old === undefined) break;
      this.collapse(old);
    }
  }

  /** Expand the group of parameter i and the modules down to it (a tensor opened elsewhere). */
  expandTo(state, i) {
    this.state = state;
    const g = state.groupOf[i];
    if (!state.large || g === undefined || g < 0) return;
    let node = { key: `g${g}`, members: state.groups.members[g], ancestors: [] };
    const path = [];
    while (node && node.members.length > 1) {
      path.push(node);
      const kid = childrenOf(node.members, state.params).find((c) => c.members.includes(i));
      if (!kid || kid.kind !== "module") break;
      node = { key: `m${kid.key}`, members: kid.members, ancestors: [...node.ancestors, node.key] };
    }
    for (const n of path) this.expand(n.key, n.ancestors);
  }

  /** The parameter indices whose detail the rows shown need (expanded groups' members). */
  wanted() {
    if (!this.entries) return [];
    const out = [];
    for (const e of this.entries) if (e.kind !== "group") out.push(...e.members);
    return out;
  }

  /** The breadcrumb: all groups › the newest expanded node's path. */
  showCrumbs(state) {
    const el = this.crumbs;
    el.hidden = !this.entries;
    if (!this.entries) return;
    const last = [...this.expanded.keys()].pop();
    const path = last === undefined ? [] : [...this.expanded.get(last), last];
    const name = (key) => {
      const e = this.entries.find((x) => x.key === key);
      return e ? e.cat : key.slice(1);
    };
    const all = h(
      "button",
      {
        type: "button",
        class: "crumb",
        dataset: { testid: "heatmap-all-groups" },
        onclick: () => {
          this.expanded.clear();
          this.onExpand();
        },
      },
      `all ${state.groups.names.length} groups`,
    );
    const parts = [all];
    path.forEach((key, k) => {
      parts.push(h("span", { class: "crumb-sep" }, "›"));
      const text = name(key);
      parts.push(
        k === path.length - 1
          ? h("span", { class: "crumb here mono", title: text }, text)
          : h(
              "button",
              {
                type: "button",
                class: "crumb mono",
                title: text,
                onclick: () => {
                  for (const below of path.slice(k + 1)) this.collapse(below);
                  this.onExpand();
                },
              },
              text,
            ),
      );
    });
    if (!path.length) parts.push(h("span", { class: "muted small" }, " · click a group's row to expand it"));
    el.replaceChildren(...parts);
  }

  /** The colour range of these columns: robust quantiles of the newest RECENT_COLUMNS. */
  zRange(rows) {
    const q = quantileRange(rows.slice(-RECENT_COLUMNS).flat(), HEAT_QUANTILE);
    if (!q) return [-4, 1];
    const [lo, hi] = q;
    if (hi - lo < 1) return [lo - 0.5, hi + 0.5];
    return [lo, hi];
  }

  colorbar(lo, hi) {
    const t = decadeTicks(lo, hi);
    return {
      title: {
        text: `${this.source} ‖g‖ · clip: newest ${RECENT_COLUMNS} steps`,
        side: "right",
        font: { size: 10, color: COLORS.muted },
      },
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
    this.state = state;
    this.entries = state.large && state.groups ? this.buildEntries(state) : null;
    this.byCat = new Map((this.entries || []).map((e) => [e.cat, e]));
    this.showCrumbs(state);
    this.el.dataset.rows = String(this.entries ? this.entries.length : state.params.length);
    const rows = [...state.history.rows, ...state.window().slice(-HEATMAP_COLUMNS)];
    // each row's column, kept for the updates (it depends on the rows and the statistic shown,
    // which change only here)
    this.columns = new WeakMap();
    const z = rows.map((r) => {
      const col = this.rowOf(r);
      this.columns.set(r, col);
      return col;
    });
    const [lo, hi] = this.zRange(z);
    this.range = [lo, hi];
    this.el.dataset.zmin = String(lo);
    this.el.dataset.zmax = String(hi);
    const names = this.entries ? this.entries.map((e) => e.cat) : state.params;
    const cats = categories(names);
    this.byLabel = cats.byLabel;
    this.rowCount = cats.labels.length;
    const grid = evenColumns(
      rows.map((r) => r.step),
      z,
    );
    const trace = {
      type: "heatmap",
      name: this.source,
      x: grid.x,
      y: cats.labels,
      z: grid.z,
      // the step each cell shows, for the hover (text is indexed row, then column)
      text: new Array(this.rowCount).fill(grid.steps),
      transpose: true,
      zmin: lo,
      zmax: hi,
      colorscale: HEAT_SCALE,
      colorbar: this.colorbar(lo, hi),
      hoverongaps: false,
      xgap: 0,
      hovertemplate: "%{y}<br>step %{text}<br>log₁₀ ‖g‖ = %{z:.2f}<extra></extra>",
    };
    const longest = this.entries
      ? Math.max(4, ...this.entries.map((e) => e.label.length))
      : Math.max(4, ...names.map((n) => shortName(n, 26).length));
    // Rows of at least 8 px, at most 640 px in all; labels thinned to fit. A large run's rows
    // (about 60 groups) get ROW_PX each, every label shown.
    const height = this.entries
      ? Math.max(260, 48 + Math.min(TALL_ROWS, names.length) * ROW_PX)
      : Math.max(260, Math.min(640, 48 + names.length * 10));
    let ticks;
    if (this.entries) {
      const k = Math.max(1, Math.ceil((names.length * 11) / (height - 48)));
      const shown = this.entries.filter((e, j) => j % k === 0 || this.expanded.has(e.key));
      ticks = {
        tickvals: shown.map((e) => plotlyText(e.cat)),
        ticktext: shown.map((e) => plotlyText(e.label)),
      };
    } else ticks = sparseTicks(names, height - 48, 11, 26);
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
        ...ticks,
        tickfont: { size: this.entries ? 10 : 9, color: COLORS.muted },
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

  /**
   * New columns or markers: one Plotly.update (one redraw) with the columns as `reset` takes
   * them (the fetched history, then the window's newest HEATMAP_COLUMNS), the colour range
   * widened where what is shown outgrew it, the marker lines and the shared x range.
   */
  update(state, news) {
    if (!this.el.data || !this.el._fullLayout) {
      this.reset(state);
      return;
    }
    const trace = {};
    const layout = {};
    if (news.markers) layout.shapes = markerShapes(state.markers);
    if (news.rows.length) {
      const rows = [...state.history.rows, ...state.window().slice(-HEATMAP_COLUMNS)];
      const z = rows.map((r) => {
        let col = this.columns.get(r);
        if (col === undefined) this.columns.set(r, (col = this.rowOf(r)));
        return col;
      });
      const grid = evenColumns(
        rows.map((r) => r.step),
        z,
      );
      trace.x = [grid.x];
      trace.z = [grid.z];
      trace.text = [new Array(this.rowCount).fill(grid.steps)];
      // Widen the colour range when the robust range of the newest columns grows; narrow it
      // only by more than NARROW_BY (colours stay comparable; a reset recomputes it).
      const [lo, hi] = this.zRange(z);
      const [a, b] = this.range;
      if (lo < a || hi > b || lo - a > NARROW_BY || b - hi > NARROW_BY) {
        this.range = [lo - a > NARROW_BY ? lo : Math.min(lo, a), b - hi > NARROW_BY ? hi : Math.max(hi, b)];
        this.el.dataset.zmin = String(this.range[0]);
        this.el.dataset.zmax = String(this.range[1]);
        trace.zmin = [this.range[0]];
        trace.zmax = [this.range[1]];
        trace.colorbar = [this.colorbar(this.range[0], this.range[1])];
      }
    }
    if (this.timeline) Object.assign(layout, this.timeline.rangeUpdate(this, state) || {});
    if (Object.keys(trace).length || Object.keys(layout).length) Plotly.update(this.el, trace, layout, [0]);
  }
}

// ---------------------------------------------------------------------------
// The per-parameter bar charts (3 and 5): one bar (or an overlaid pair) per
// parameter for the newest snapshot, on a log axis, redrawn when a newer one
// arrives; a click on a bar picks that parameter. A large run's bars are its
// groups (a click drills into the group's tensors), a group's tensors, or a
// stack's blocks by depth (`bars`). Each chart adds its own part as
// figure(row, bars, labels), given the newest row (null before any), the bars
// (`bars()`) and the x axis's categories (their names as Plotly text):
// {traces, title (of the y axis), values (the log range shows
// them), top (margin, px; 8 by default), layout (more layout keys)}.

/** Whether a row's gradients were finite (a step the bar charts and the histogram could draw). */
const finiteRow = (row) => plottable(row.total_norm_raw) !== null;

const MAX_BARS = 128; // a drilled-into group's tensors shown, at most
const BLOCK = "(block)"; // the "by depth" kind that shows whole blocks (their groups' aggregates)

class ParamBarChart {
  constructor(el, onPick) {
    this.el = el;
    this.pickParam = onPick;
    this.onPick = (j) => this.current && this.current.pick(j);
    this.bound = false;
    this.shownStep = null;
    // A large run: the group drilled into (its index) or the "by depth" view ({stack, kind}).
    this.drill = null;
    this.depth = null;
    this.current = null;
    this.onView = () => {}; // set by app.js: subscribe to what is shown now, redraw
    const id = el.dataset.testid.replace(/^chart-/, "");
    this.id = id;
    this.depthSelect = h("select", {
      class: "mono",
      dataset: { testid: `${id}-depth` },
      "aria-label": "by depth",
      onchange: () => this.setDepth(this.depthSelect.value),
    });
    this.crumb = h("span", { class: "crumb here mono", dataset: { testid: `${id}-crumb` } });
    this.nav = h(
      "nav",
      { class: "crumbs", dataset: { testid: `${id}-nav` }, hidden: true },
      h(
        "button",
        {
          type: "button",
          class: "crumb",
          dataset: { testid: `${id}-all-groups` },
          onclick: () => this.showGroups(),
        },
        "all groups",
      ),
      h("span", { class: "crumb-sep" }, "›"),
      this.crumb,
      h("span", { class: "grow" }),
      h("label", { class: "muted small" }, "by depth ", this.depthSelect),
    );
    this.groupsShown = null;
    el.before(this.nav);
  }

  showGroups() {
    this.drill = null;
    this.depth = null;
    this.depthSelect.value = "";
    this.onView();
  }

  /** Drill into group g: its tensors' bars. */
  drillTo(g) {
    this.drill = g;
    this.depth = null;
    this.depthSelect.value = "";
    this.onView();
  }

  setDepth(value) {
    if (!value) {
      this.showGroups();
      return;
    }
    const cut = value.indexOf("|");
    this.depth = { stack: Number(value.slice(0, cut)), kind: value.slice(cut + 1) };
    this.drill = null;
    this.onView();
  }

  /** The "by depth" choices: per stack, whole blocks (when blocks are groups) and each kind. */
  fillDepth(groups) {
    if (this.groupsShown === groups) return;
    this.groupsShown = groups;
    const opts = [h("option", { value: "" }, "–")];
    (groups.stacks || []).forEach((st, si) => {
      if (st.groups) opts.push(h("option", { value: `${si}|${BLOCK}` }, `${st.name}: whole blocks`));
      for (const kind of Object.keys(st.kinds || {}))
        opts.push(h("option", { value: `${si}|${kind}` }, `${st.name}.*.${kind}`));
    });
    this.depthSelect.replaceChildren(...opts);
    this.depthSelect.disabled = opts.length === 1;
  }

  /**
   * What the bars are: {names (categories), val(key, j) (a per-parameter statistic's value of
   * bar j, a group's aggregate for a group), span(j) ([min, max] of a group's members' update
   * ratios, or null), what (the axis's words), pick(j) (a click on bar j)}.
   */
  bars(state) {
    const row = state.latest;
    const params = state.params;
    if (!state.large || !state.groups) {
      return {
        mode: "params",
        names: params,
        val: (k, j) => (row ? statOf(row, k, j) : null),
        span: () => null,
        what: "parameter",
        pick: (j) => this.pickParam(params[j]),
      };
    }
    const G = state.groups;
    const groupBars = (gs, names, what, crumb) => ({
      mode: "groups",
      names,
      crumb,
      val: (k, j) => groupValue(row, k, gs[j]),
      span: (j) => [groupValue(row, "ratio_min", gs[j]), groupValue(row, "ratio_max", gs[j])],
      what,
      pick: (j) => this.drillTo(gs[j]),
    });
    const tensorBars = (idx, names, what, crumb) => ({
      mode: "tensors",
      names,
      crumb,
      val: (k, j) => (row && idx[j] !== null ? statOf(row, k, idx[j]) : null),
      span: () => null,
      what,
      pick: (j) => idx[j] !== null && this.pickParam(params[idx[j]]),
    });
    const st = this.depth ? (G.stacks || [])[this.depth.stack] : null;
    if (st && this.depth.kind === BLOCK && st.groups)
      return groupBars(st.groups, st.blocks, "block", `${st.name}: whole blocks, by depth`);
    if (st && st.kinds && st.kinds[this.depth.kind])
      return tensorBars(
        st.kinds[this.depth.kind],
        st.blocks,
        "block",
        `${st.name}.*.${this.depth.kind}, by depth`,
      );
    if (this.drill !== null && G.members[this.drill]) {
      const idx = G.members[this.drill].slice(0, MAX_BARS);
      const names = idx.map((i) => params[i]);
      const bars = tensorBars(idx, names, "tensor", G.names[this.drill]);
      const prefix = commonPrefix(names);
      bars.display = names.map((n) => (prefix ? n.slice(prefix.length + 1) : n)); // the group's own part
      return bars;
    }
    return groupBars(
      G.names.map((_, g) => g),
      G.names,
      "group",
      null,
    );
  }

  /** The parameter indices whose detail the bars shown need. */
  wanted(state) {
    if (!state.large || !state.groups) return [];
    const G = state.groups;
    const st = this.depth ? (G.stacks || [])[this.depth.stack] : null;
    if (st && st.kinds && st.kinds[this.depth.kind])
      return st.kinds[this.depth.kind].filter((i) => i !== null);
    if (this.drill !== null && G.members[this.drill]) return G.members[this.drill].slice(0, MAX_BARS);
    return [];
  }

  showNav(state, bars) {
    this.nav.hidden = !state.large;
    if (!state.large) return;
    this.fillDepth(state.groups);
    this.crumb.textContent = bars.crumb || `${state.groups.names.length} groups · click a bar`;
    this.el.dataset.view = bars.mode === "groups" && !bars.crumb ? "groups" : bars.crumb;
  }

  render(state, force) {
    const row = state.latest;
    if (!force && row && row.step === this.shownStep) return;
    this.shownStep = row ? row.step : null;
    const bars = this.bars(state);
    this.current = bars;
    this.showNav(state, bars);
    const names = bars.names;
    const labels = names.map(plotlyText);
    this.byLabel = new Map(labels.map((l, j) => [l, j]));
    const { traces, title, values, top = 8, layout = {} } = this.figure(row, bars, labels);
    this.el.dataset.bars = String(names.length);
    const note = nonfiniteNote(state, !drawsNothing(traces), finiteRow); // (health.js)
    markNote(this.el, note);
    const full = baseLayout({
      showlegend: false, // the card header says which colour is which
      margin: { l: 60, r: 12, t: top, b: paramMargin(names, bars.display) },
      xaxis: paramAxis(names, this.el, {}, bars.display),
      yaxis: axis({ type: "log", title: { text: title }, ...logAxisFor(values) }),
      ...layout,
    });
    if (note) full.annotations = [...(full.annotations || []), note];
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

  figure(row, bars, labels) {
    // What is drawn, for tests and scripts/screenshots.py to wait on.
    this.el.dataset.step = row ? String(row.step) : "";
    this.el.dataset.metric = this.metric;
    const [kr, kf] = this.keys();
    const label = this.metric === "norm" ? "‖g‖₂" : "max |g|";
    const n = bars.names.length;
    const yr = row ? Array.from({ length: n }, (_, j) => positive(bars.val(kr, j))) : [];
    const yf = row ? Array.from({ length: n }, (_, j) => positive(bars.val(kf, j))) : [];
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
    return { traces, title: `${label} per ${bars.what}`, values: [...yr, ...yf], top: 18, layout };
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
    const blank = hg ? nonfiniteNote(state, !drawsNothing(traces), finiteRow) : null; // (health.js)
    markNote(this.el, blank);
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
    if (blank) layout.annotations = [...layout.annotations, blank];
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
  figure(row, bars, labels) {
    const n = bars.names.length;
    const vals = row ? Array.from({ length: n }, (_, j) => num(bars.val("update_ratio", j))) : [];
    const y = vals.map(positive);
    const inBand = (v) => v !== null && v >= RATIO_BAND[0] && v <= RATIO_BAND[1];
    // Groups: the median of their tensors' ratios, the min-max as error bars.
    const spans = bars.mode === "groups" && row ? y.map((_, j) => bars.span(j)) : null;
    const extremes = [];
    const error = spans
      ? {
          type: "data",
          symmetric: false,
          array: spans.map(([, hi], j) => (y[j] !== null && positive(hi) !== null ? positive(hi) - y[j] : 0)),
          arrayminus: spans.map(([lo], j) =>
            y[j] !== null && positive(lo) !== null ? y[j] - positive(lo) : 0,
          ),
          color: COLORS.muted,
          thickness: 1,
          width: 2,
        }
      : undefined;
    if (spans) for (const [lo, hi] of spans) extremes.push(positive(lo), positive(hi));
    const values = [...y, ...extremes, RATIO_BAND[0] / 3, RATIO_BAND[1] * 3];
    // A frozen tensor's ratio (0, or none) has no place on a log axis: it is drawn at the axis
    // floor with its own marker and reads "0 (frozen)".
    const range = barLogRange(values);
    const floor = range ? 10 ** (range[0] + 0.04 * (range[1] - range[0])) : RATIO_BAND[0] / 3;
    // frozen: no update (0), or none measured where the optimizer saw no gradient (a freeze
    // hook, requires_grad off) though the parameter itself is there
    const isFrozen = (v, j) =>
      v === 0 ||
      (v === null && num(bars.val("param_norm", j)) !== null && num(bars.val("grad_norm", j)) === null);
    const frozen = vals.map((v, j) => (bars.mode !== "groups" && isFrozen(v, j) ? floor : null));
    const hover = spans
      ? "%{x}<br>‖Δθ‖/‖θ‖ median %{y:.3g}<extra></extra>"
      : "%{x}<br>‖Δθ‖/‖θ‖ %{y:.3g}<extra></extra>";
    const bar = (name, keep, color) => ({
      name,
      type: "bar",
      x: labels,
      y: y.map((v) => (keep(v) ? v : null)),
      marker: { color },
      ...(error ? { error_y: error } : {}),
      hovertemplate: hover,
    });
    const traces = [
      bar(`in ${tickLabels(RATIO_BAND).join("–")}`, inBand, COLORS.ratioIn),
      bar("out of band", (v) => v !== null && !inBand(v), COLORS.ratioOut),
    ];
    if (frozen.some((v) => v !== null)) {
      traces.push({
        name: "0 (frozen)",
        type: "scatter",
        mode: "markers",
        x: labels,
        y: frozen,
        marker: {
          symbol: "x-thin-open",
          size: 9,
          line: { width: 2, color: COLORS.muted },
          color: COLORS.muted,
        },
        hovertemplate: "%{x}<br>‖Δθ‖/‖θ‖ 0 (frozen)<extra></extra>",
      });
    }
    const layout = {
      barmode: "overlay",
      showlegend: true, // which colour is in the band, which out, which frozen
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
    return {
      traces,
      title: "‖Δθ‖ / ‖θ‖",
      values,
      top: 28,
      layout,
    };
  }
}
