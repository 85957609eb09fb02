// The time charts' shared step axis. Every chart over steps joins
// it (`timeline.join(chart)`, a chart being {el, reset(state)}): they show one x range,
// and a zoom or pan on one moves all of them. By default the range follows the run: from
// the first step the page holds to the newest. Zooming out past the streamed window
// fetches the older history from the server, downsampled with each bucket's extremes
// kept (`buckets` about the chart's width in pixels, so a spike survives); zooming into
// an older range fetches it again, now at full resolution (a range with no more steps
// than buckets comes back whole; the loss is drawn as soon as it comes, before the tensors' snapshots). A zoomed range whose right edge is at the newest step
// keeps following it as training streams. A double click shows the whole run.

import { api } from "./api.js";
import { COLORS, HOOK_ACTIONS, PLOT_CONFIG } from "./theme.js";
import { niceStep } from "./ticks.js";

const Plotly = window.Plotly;

/** Step range of what a chart holds: [first, newest]; null before any data. */
export function stepExtent(state) {
  const h = state.history;
  const lo = Math.min(
    h.rows.length ? h.rows[0].step : Infinity,
    h.loss.x.length ? h.loss.x[0] : Infinity,
    h.range ? h.range[0] : Infinity,
    state.windowStart(),
  );
  const hi = Math.max(state.step, state.latest ? state.latest.step : -Infinity);
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return null;
  return hi > lo ? [lo, hi] : [lo - 1, lo + 1];
}

/**
 * What the charts over steps share: a subclass has `el`, may have `timeline` (set when it joins) and
 * implements `render(state, full)`, which builds its traces and layout and calls `draw`.
 */
export class StepChart {
  /** Show `traces` on `layout` (the joined x range kept by `STEP_CONFIG`) and tell the timeline. */
  draw(traces, layout, state) {
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

/**
 * The Plotly config of a chart that joins: a double click is an autorange, which `onRelayout`
 * turns into the whole run. (Plotly's default, "reset+autosize", would first go back to the
 * range of the chart's first draw, and that is where a chart drawn with `sharedRange` stays.)
 */
export const STEP_CONFIG = { ...PLOT_CONFIG, doubleClick: "autosize" };

/**
 * The x-axis settings for a Plotly.react of a chart that joined the shared axis: its range,
 * fixed; none (Plotly's autorange) before it joined or while the state holds no step.
 */
export function sharedRange(chart, state) {
  const r = chart.timeline ? chart.timeline.range(state) : null;
  return r ? { range: r, autorange: false } : {};
}

/** A right edge past `hi`: the next multiple of a round stride of about 2 % of [lo, hi]. */
function ahead(lo, hi) {
  const stride = niceStep(Math.max(1, (hi - lo) / 50));
  return Math.ceil((hi + 0.5) / stride) * stride + 0.5;
}

export class Timeline {
  /**
   * @param {() => object} state the DashboardState shown
   * @param {(charts: object[]) => void} redraw redraw these charts from the state (new history)
   */
  constructor(state, redraw) {
    this.state = state;
    this.redraw = redraw;
    this.charts = [];
    this.user = null; // the range the user zoomed to ([a, b], b following the newest step when `follow`)
    this.follow = false;
    this.fetchId = 0;
    this.fetching = null; // the promise of the history fetch in flight (tests and scripts wait on it)
  }

  /**
   * A chart over steps joins the shared axis. The chart draws with `timeline.range(state)` as
   * its x range (`sharedRange`), calls `timeline.bind(chart)` after each Plotly.react, and
   * `timeline.sync(chart, state)` after streaming into it (`drawn` does both after a react).
   */
  join(chart) {
    this.charts.push(chart);
    chart.timeline = this;
  }

  /** After a chart's Plotly.react: listen to it (`bind`) and show the shared range (`sync`). */
  drawn(chart, state) {
    this.bind(chart);
    this.sync(chart, state);
  }

  /** Listen to the chart's zooms and pans (once per element: listeners survive Plotly.react). */
  bind(chart) {
    const el = chart.el;
    if (el.dataset.timeline || typeof el.on !== "function") return;
    el.dataset.timeline = "1";
    el.on("plotly_relayout", (ev) => this.onRelayout(chart, ev || {}));
  }

  /**
   * The x range every time chart shows now: the user's, or the run's extent. A right edge
   * that follows the newest step moves ahead in round strides (about 2 % of the range), so
   * streaming relayouts the charts once a stride, not once a step.
   */
  range(state) {
    if (this.user) {
      const [a, b] = this.user;
      return this.follow ? [a, Math.max(b, ahead(a, state.step))] : [a, b];
    }
    const ext = stepExtent(state);
    if (!ext) return null;
    const lo = ext[0] - 0.5;
    return [lo, ahead(lo, ext[1])];
  }

  /** Apply the shared range to a chart after it streamed (one relayout when it moved). */
  sync(chart, state) {
    const upd = this.rangeUpdate(chart, state);
    if (upd) Plotly.relayout(chart.el, upd);
  }

  /**
   * The relayout keys that bring a chart to the shared range (null when it is there), for a
   * chart that folds them into a draw of its own; fetches the history the window moved past.
   */
  rangeUpdate(chart, state) {
    const held = state.history.range;
    const start = state.windowStart();
    if (this.user && held && this.fetching === null && start - held[1] > 0.05 * (state.step - held[0])) {
      // The window moved on past the fetched history: fetch the steps between them too.
      this.fetchFor(this.range(state), true);
    }
    const r = this.range(state);
    if (!r || !chart.el._fullLayout) return null;
    const cur = chart.el._fullLayout.xaxis && chart.el._fullLayout.xaxis.range;
    if (cur && Math.abs(cur[0] - r[0]) < 1e-6 && Math.abs(cur[1] - r[1]) < 1e-6) return null;
    chart.el._giRange = r;
    // A copy to Plotly: a mouse zoom writes the new range into the layout's array in place,
    // and on `r` itself it would read as our own relayout and be ignored.
    return { "xaxis.range": [...r], "xaxis.autorange": false };
  }

  onRelayout(chart, ev) {
    let r = null;
    if (ev["xaxis.range[0]"] !== undefined) r = [Number(ev["xaxis.range[0]"]), Number(ev["xaxis.range[1]"])];
    else if (Array.isArray(ev["xaxis.range"])) r = ev["xaxis.range"].map(Number);
    const auto = ev["xaxis.autorange"] === true;
    if (chart.retick) chart.retick(); // the y ticks follow the visible range
    if (!r && !auto) return;
    const mine = chart.el._giRange;
    if (r && mine && Math.abs(mine[0] - r[0]) < 1e-6 && Math.abs(mine[1] - r[1]) < 1e-6) return; // ours
    if (auto) {
      this.wholeRun();
      return;
    }
    this.setRange(r, chart);
  }

  /** Show steps [a, b] on every time chart (fetching older history when needed). */
  setRange(r, from = null) {
    const state = this.state();
    this.user = r;
    this.follow = r[1] >= state.step - 0.5;
    for (const c of this.charts) if (c !== from) this.sync(c, state);
    this.fetchFor(r);
  }

  /** Everything from step 1 to the newest, downsampled. */
  async wholeRun() {
    const state = this.state();
    this.user = null;
    this.follow = false;
    await this.fetchFor([0, state.step], true);
    const s = this.state();
    const ext = stepExtent(s);
    if (!ext) return;
    this.user = [Math.min(ext[0], 1) - 0.5, ext[1] + 0.5];
    this.follow = true;
    for (const c of this.charts) this.sync(c, s);
  }

  /** Fetch the history of [a, b] when part of it lies before the window and is not held. */
  fetchFor([a, b], force = false) {
    const state = this.state();
    const start = state.windowStart();
    if (!force && !(a < start)) return Promise.resolve();
    const to = Math.min(Math.ceil(b), Number.isFinite(start) ? start : Math.ceil(b));
    const from = Math.max(0, Math.floor(a));
    const held = state.history.range;
    // Held at this resolution or better: covers [from, to] and spans at most twice as much.
    if (!force && held && held[0] <= from && held[1] >= to && held[1] - held[0] <= 2 * (to - from)) {
      return Promise.resolve();
    }
    const width = Math.max(...this.charts.map((c) => c.el.clientWidth || 0), 400);
    const buckets = Math.max(50, Math.min(2000, Math.round(width / 2)));
    const id = ++this.fetchId;
    const run = state.runId;
    const q = { run, since: from > 0 ? from - 1 : undefined, until: to, buckets };
    const current = () => id === this.fetchId && this.state() === state; // not a newer fetch, not another run
    // The loss (a light answer) is drawn as soon as it comes: the snapshots, with each tensor's
    // values, can take seconds on a long run, and the loss chart would show nothing older meanwhile.
    const scalars = api.scalars(q).then((scal) => {
      if (!current() || !scal.ok) return null;
      const rows = scal.data.scalars || [];
      state.setHistoryLoss(rows);
      state.pruneMarkers();
      this.redraw(this.charts);
      return rows;
    });
    this.fetching = Promise.all([api.snapshots(q), scalars]).then(([snaps, rows]) => {
      if (!current() || !snaps.ok || rows === null) return;
      state.setHistory(snaps.data.snapshots || [], rows, [from, to]);
      state.pruneMarkers();
      this.redraw(this.charts);
    });
    const done = this.fetching.finally(() => {
      if (this.fetchId === id) this.fetching = null;
    });
    return done;
  }

  /** A new run or view: back to following the run, nothing fetched. */
  reset() {
    this.user = null;
    this.follow = false;
    this.fetchId++;
  }
}

/**
 * Vertical lines at the markers (hook changes, NaN/Inf, resets) as layout shapes, for a time
 * chart that shows them without hover tips (the heatmap; any chart over steps).
 */
export function markerShapes(markers) {
  return markers.map((m) => ({
    type: "line",
    xref: "x",
    yref: "paper",
    x0: m.x,
    x1: m.x,
    y0: 0,
    y1: 1,
    line: {
      color:
        m.kind === "hook"
          ? (HOOK_ACTIONS[m.action] || HOOK_ACTIONS.update)[1]
          : m.kind === "reset"
            ? COLORS.reset
            : m.kind === "branch" || m.kind === "skip"
              ? COLORS.branch
              : COLORS.nonfinite,
      width: 1,
      dash: "dash",
    },
    layer: "above",
  }));
}
