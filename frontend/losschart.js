// The loss chart: loss and global gradient norm over steps, with markers at hook changes
// (a symbol per action), scenario resets, NaN/Inf, spikes and rule firings; non-finite values as markers; an EMA
// smoothing (raw kept faint); another run of the database overlaid. It draws once with
// Plotly.react (reset), then redraws what streamed in with one Plotly.update a draw (the
// traces that changed, whole: the state holds a bounded window); it shares its step axis with
// the other time charts (timeline.js).

import { COLORS, HOOK_ACTIONS, PLOT_CONFIG, TIME_HOVER, axis, baseLayout } from "./theme.js";
import { logTicks, logTicksIn } from "./ticks.js";
import { fmt, num, positive, quantileRange } from "./util.js";
import { mainLossRange, shadowTraces, shadowUpdate } from "./whatif.js";

const Plotly = window.Plotly;

const LOSS = 0;
const NORM_RAW = 1;
const NORM_FINAL = 2;
const LOSS_SMOOTH = 3;
const RAW_SMOOTH = 4;
const FINAL_SMOOTH = 5;
const NONFINITE = 6;
const NORM_BACKWARD = 7; // as backward left the gradients, where the user's loop then changed them
const CMP_LOSS = 8;
const CMP_NORM = 9;
const CMP_MARKS = 10;
const MARKS = 11; // then hook line, hook tip, NaN/Inf line, NaN/Inf tip, reset line, reset tip, spike line, spike tip,
// rule fired line, tip, rule failed line, tip
const MARK_TRACES = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22];
const LOG_AUTO_DECADES = 3; // a loss spanning more than this many decades is drawn on a log axis

/**
 * Ticks that fit the chart's height (about 30 px a label): the height Plotly drew it at, once
 * drawn (reading the element's would force the page's layout after each redraw).
 */
function maxTicks(el, fallback = 300) {
  const drawn = el && el._fullLayout && el._fullLayout.height;
  return Math.max(3, Math.floor((drawn || (el && el.clientHeight) || fallback) / 30));
}

/**
 * TensorBoard's smoothing: an exponential moving average with weight `w` in [0, 1), debiased
 * so the start is not pulled to 0; on a log axis it averages log10 values (a geometric mean,
 * so one spike of 1e30 does not flatten every later point). Non-finite and missing values
 * are skipped (null in the output).
 */
export function smooth(ys, w, log = false) {
  const out = new Array(ys.length);
  let last = 0;
  let n = 0;
  for (let i = 0; i < ys.length; i++) {
    const raw = ys[i];
    const v = raw === null || raw === undefined ? NaN : log ? (raw > 0 ? Math.log10(raw) : NaN) : raw;
    if (!Number.isFinite(v)) {
      out[i] = null;
      continue;
    }
    last = last * w + (1 - w) * v;
    n += 1;
    const s = last / (1 - w ** n);
    out[i] = log ? 10 ** s : s;
  }
  return out;
}

/** A row's norm as backward left the gradients, where it differs from the step's (else null). */
function backwardNorm(r) {
  const bw = num(r.total_norm_backward);
  const raw = num(r.total_norm_raw);
  if (bw === null || raw === null || !(bw > 0)) return null;
  return Math.abs(bw - raw) > 1e-3 * Math.max(Math.abs(bw), Math.abs(raw)) ? bw : null;
}

export class LossChart {
  constructor(el) {
    this.el = el;
    this.lossScale = "auto"; // "auto" (log when the loss spans > 3 decades), "linear" or "log"
    this.smoothing = 0; // EMA weight, 0 (off) to 0.99
    // A run that records no loss: the chart says how to record one (shown once steps arrive
    // without a loss, gone with the first loss).
    this.hint = document.createElement("div");
    this.hint.className = "small muted loss-hint";
    this.hint.dataset.testid = "loss-hint";
    this.hint.hidden = true;
    this.hint.textContent =
      "No loss recorded: call insp.record(loss=loss) after optimizer.step() in your loop " +
      "(the Lightning and Hugging Face callbacks record it for you).";
    el.before(this.hint);
    // The user's loop changed the gradients between backward() and step() (a clip of its own):
    // both norms, what backward produced and what the step saw (the charts show the latter).
    this.changed = document.createElement("div");
    this.changed.className = "small loss-hint changed-note";
    this.changed.dataset.testid = "changed-note";
    this.changed.hidden = true;
    el.before(this.changed);
  }

  /**
   * Say so when the loop changed the gradients between backward() and step() (more than 0.1 %) at
   * any step shown, not only the newest (a clip to 1.0 acts only where the norm is above it): at
   * how many of the steps shown, and the latest such step's two norms.
   */
  showChanged(rows) {
    let last = null;
    let count = 0;
    let taken = 0;
    for (const r of rows) {
      if (num(r.total_norm_backward) === null) continue;
      taken += 1;
      if (backwardNorm(r) !== null) {
        count += 1;
        last = r;
      }
    }
    const differ = last !== null;
    if (differ) {
      const newest = last === rows[rows.length - 1];
      this.changed.textContent =
        `Your loop changed the gradients between backward() and optimizer.step() at ${count} of the ` +
        `${taken} sampled step${taken === 1 ? "" : "s"} shown (your own clip_grad_norm_?); ` +
        `at step ${last.step}${newest ? ", the newest" : ", the latest of them"}: global norm ` +
        `${fmt(num(last.total_norm_backward))} as backward left it, ${fmt(num(last.total_norm_raw))} at the step. ` +
        "The charts show what the step saw; the dotted blue line, what backward produced.";
    }
    if (this.changed.hidden !== !differ) this.changed.hidden = !differ;
  }

  /** The hint shows while steps arrive and no loss has. */
  showHint(hasRows, hasLoss) {
    const hidden = !hasRows || hasLoss;
    if (this.hint.hidden !== hidden) this.hint.hidden = hidden;
  }

  /** The scale toggle: the user's choice holds from then on. */
  set lossLog(v) {
    this.lossScale = v ? "log" : "linear";
  }

  get lossLog() {
    return this.isLog(this.lossValues ?? []);
  }

  isLog(ys) {
    if (this.lossScale !== "auto") return this.lossScale === "log";
    let lo = Infinity;
    let hi = -Infinity;
    for (const v of ys) {
      if (v === null || !Number.isFinite(v)) continue;
      if (v <= 0) return false; // not drawable on a log axis: the view is clipped instead
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    return Number.isFinite(lo) && Math.log10(hi / lo) > LOG_AUTO_DECADES;
  }

  /** Rows and loss points drawn: the fetched older history, then the streamed window. */
  data(state) {
    const rows = [...state.history.rows, ...state.window()];
    const lossX = [...state.history.loss.x, ...state.loss.x];
    const lossY = [...state.history.loss.y, ...state.loss.y];
    return { rows, lossX, lossY };
  }

  lossAxis(state, ys) {
    const log = this.isLog(ys);
    const ax = { title: { text: "loss" }, type: log ? "log" : "linear" };
    this.clipNote = null;
    if (log) Object.assign(ax, logTicks(ys, maxTicks(this.el)));
    else {
      // A linear loss with a few huge values (which a log axis cannot show: zero or negative
      // ones too): the view is clipped to the 1st-99th percentile, with a note.
      const q = quantileRange(ys, 0.01);
      const all = quantileRange(ys, 0);
      if (q && all && all[1] - all[0] > 100 * Math.max(q[1] - q[0], 1e-12)) {
        const pad = (q[1] - q[0]) * 0.1 || Math.abs(q[0]) * 0.1 || 1;
        ax.range = [q[0] - pad, q[1] + pad];
        ax.autorange = false;
        const out = ys.filter((v) => v !== null && (v < ax.range[0] || v > ax.range[1])).length;
        this.clipNote = `loss axis clipped to the 1st–99th percentile: ${out} value${out === 1 ? "" : "s"} outside`;
      }
    }
    this.el.dataset.lossScale = log ? "log" : "linear";
    this.showScale(log);
    return ax;
  }

  /** In "auto", the scale toggle shows the scale chosen. */
  showScale(log) {
    const seg =
      this.el.closest(".card") && this.el.closest(".card").querySelector('[data-testid="loss-scale"]');
    if (!seg || this.lossScale !== "auto") return;
    for (const b of seg.querySelectorAll("button[data-value]"))
      b.setAttribute("aria-pressed", String((b.dataset.value === "log") === log));
  }

  normValues(rows) {
    const v = [];
    for (const r of rows) v.push(positive(r.total_norm_raw), positive(r.total_norm), backwardNorm(r));
    return v;
  }

  layout(state, d) {
    this.ticks = logTicks(this.normValues(d.rows), maxTicks(this.el));
    const range = this.timeline ? this.timeline.range(state) : null;
    const annotations = [];
    const lossAxis = this.lossAxis(state, d.lossY);
    mainLossRange(lossAxis, d.lossY, state); // what-if: a diverging shadow leaves the main loss readable
    if (this.clipNote) {
      annotations.push({
        text: this.clipNote,
        xref: "paper",
        yref: "paper",
        x: 0.01,
        y: 0.99,
        xanchor: "left",
        yanchor: "top",
        showarrow: false,
        font: { size: 10, color: COLORS.muted },
      });
    }
    return baseLayout({
      ...TIME_HOVER,
      margin: { l: 60, r: 84, t: 8, b: 40 },
      xaxis: axis({ title: { text: "step" }, ...(range ? { range, autorange: false } : {}) }),
      yaxis: axis(lossAxis),
      yaxis2: axis({
        title: { text: "global grad norm (L2)" },
        ...this.ticks,
        type: "log",
        overlaying: "y",
        side: "right",
        showgrid: false,
      }),
      yaxis3: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true },
      showlegend: false, // the card header has the legend
      annotations,
    });
  }

  traces(state, d) {
    const { rows, lossX, lossY } = d;
    const x = rows.map((r) => r.step);
    const smoothOn = this.smoothing > 0;
    const faint = smoothOn ? 0.3 : 1;
    const lossLog = this.isLog(lossY);
    const raw = rows.map((r) => positive(r.total_norm_raw));
    const fin = rows.map((r) => positive(r.total_norm));
    const line = (name, xs, ys, color, width, extra = {}) => ({
      name,
      x: xs,
      y: ys,
      type: "scatter",
      mode: "lines",
      line: { color, width },
      ...extra,
    });
    return [
      line("loss", lossX, lossY, COLORS.loss, 1.6, {
        opacity: faint,
        hovertemplate: "loss %{y:.4g}<extra></extra>",
      }),
      // Wide and faint under the final line: where a hook changes nothing the two coincide
      // and read as an orange line with a blue halo.
      line("grad norm raw", x.slice(), raw, COLORS.raw, 3.5, {
        yaxis: "y2",
        opacity: smoothOn ? 0.25 : 0.55,
        hovertemplate: "raw norm %{y:.4g}<extra></extra>",
      }),
      line("grad norm final", x, fin, COLORS.final, 1.5, {
        yaxis: "y2",
        opacity: faint,
        hovertemplate: "final norm %{y:.4g}<extra></extra>",
      }),
      line(
        "loss smoothed",
        smoothOn ? lossX.slice() : [],
        smoothOn ? smooth(lossY, this.smoothing, lossLog) : [],
        COLORS.loss,
        2,
        {
          hovertemplate: "loss (smoothed) %{y:.4g}<extra></extra>",
        },
      ),
      line(
        "grad norm raw smoothed",
        smoothOn ? x.slice() : [],
        smoothOn ? smooth(raw, this.smoothing, true) : [],
        COLORS.raw,
        2,
        {
          yaxis: "y2",
          hovertemplate: "raw norm (smoothed) %{y:.4g}<extra></extra>",
        },
      ),
      line(
        "grad norm final smoothed",
        smoothOn ? x.slice() : [],
        smoothOn ? smooth(fin, this.smoothing, true) : [],
        COLORS.final,
        2,
        {
          yaxis: "y2",
          hovertemplate: "final norm (smoothed) %{y:.4g}<extra></extra>",
        },
      ),
      this.nonfiniteTrace(state, rows),
      // dotted, on the norm axis: only the steps where it differs from what the step saw
      line("grad norm as backward left it", x.slice(), rows.map(backwardNorm), COLORS.raw, 1.4, {
        yaxis: "y2",
        line: { color: COLORS.raw, width: 1.4, dash: "dot" },
        connectgaps: false,
        hovertemplate: "norm as backward left it %{y:.4g} (your loop changed it)<extra></extra>",
      }),
      ...this.compareTraces(state.compare),
      ...this.markerTraces(state.markers),
      ...shadowTraces(state), // what-if (whatif.js): last, so the indices above stay
    ];
  }

  /**
   * Non-finite values (loss, raw or final global norm) as markers along the bottom: a line
   * cannot draw NaN or Inf, and a silent gap hides the very step that matters.
   */
  nonfiniteTrace(state, rows) {
    const pts = new Map(); // step -> text
    const add = (step, what, v) => {
      const t = `${what} ${Number.isNaN(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf"}`;
      pts.set(step, pts.has(step) ? `${pts.get(step)}, ${t}` : t);
    };
    for (const r of rows) {
      for (const [k, what] of [
        ["total_norm_raw", "raw norm"],
        ["total_norm", "final norm"],
      ]) {
        const v = num(r[k]);
        if (v !== null && !Number.isFinite(v)) add(r.step, what, v);
      }
    }
    for (const b of [...(state.history.loss.bad || []), ...state.loss.bad]) add(b.x, "loss", b.v);
    const xs = [...pts.keys()].sort((a, b) => a - b);
    return {
      name: "non-finite value",
      x: xs,
      y: xs.map(() => 0.03),
      hovertext: xs.map((s) => `step ${s}: ${pts.get(s)}`),
      yaxis: "y3",
      type: "scatter",
      mode: "markers",
      marker: { color: COLORS.nonfinite, size: 8, symbol: "circle-x" },
      hovertemplate: "%{hovertext}<extra></extra>",
    };
  }

  compareTraces(cmp) {
    const c = cmp || { loss: { x: [], y: [] }, norm: { x: [], y: [] }, markers: [], runId: null };
    const label = `run ${c.runId}`;
    return [
      {
        name: `${label} loss`,
        x: c.loss.x,
        y: c.loss.y,
        type: "scatter",
        mode: "lines",
        line: { color: COLORS.compareLoss, width: 1.2, dash: "dot" },
        hovertemplate: `${label}: loss %{y:.4g}<extra></extra>`,
      },
      {
        name: `${label} final norm`,
        x: c.norm.x,
        y: c.norm.y,
        yaxis: "y2",
        type: "scatter",
        mode: "lines",
        line: { color: COLORS.compareNorm, width: 1.2, dash: "dot" },
        hovertemplate: `${label}: final norm %{y:.4g}<extra></extra>`,
      },
      {
        name: `${label} hook change`,
        x: c.markers.map((m) => m.x),
        y: c.markers.map(() => 0.9),
        hovertext: c.markers.map((m) => `${label}, ${m.text}`),
        yaxis: "y3",
        type: "scatter",
        mode: "markers",
        marker: {
          color: c.markers.map((m) =>
            m.kind === "hook" ? (HOOK_ACTIONS[m.action] || HOOK_ACTIONS.update)[1] : COLORS.reset,
          ),
          size: 8,
          symbol: c.markers.map((m) =>
            m.kind === "hook"
              ? `${(HOOK_ACTIONS[m.action] || HOOK_ACTIONS.update)[0].replace("-open", "")}-open`
              : "star-open",
          ),
        },
        hovertemplate: "%{hovertext}<extra></extra>",
      },
    ];
  }

  markerTraces(markers) {
    const mk = (kind, name, style, lineColor, tipY = 0.96) => {
      const ms = markers.filter((m) => m.kind === kind);
      const color = (m) => style(m)[1];
      const line = {
        name,
        showlegend: false,
        x: ms.flatMap((m) => [m.x, m.x, null]),
        y: ms.flatMap(() => [0, tipY, null]),
        yaxis: "y3",
        type: "scatter",
        mode: "lines",
        line: { color: lineColor, width: 1, dash: "dash" },
        hoverinfo: "skip",
      };
      const tip = {
        name,
        x: ms.map((m) => m.x),
        y: ms.map(() => tipY),
        hovertext: ms.map((m) => m.text),
        customdata: ms.map((m) => m.action || kind),
        yaxis: "y3",
        type: "scatter",
        mode: "markers",
        marker: { color: ms.map(color), size: 10, symbol: ms.map((m) => style(m)[0]) },
        hovertemplate: "%{hovertext}<extra></extra>",
      };
      return [line, tip];
    };
    return [
      ...mk("hook", "hook change", (m) => HOOK_ACTIONS[m.action] || HOOK_ACTIONS.update, COLORS.hook),
      ...mk("nonfinite", "NaN/Inf", () => ["x", COLORS.nonfinite], COLORS.nonfinite),
      ...mk("reset", "scenario reset", () => ["star", COLORS.reset], COLORS.reset),
      ...mk("spike", "spike", () => ["triangle-down", COLORS.spike], COLORS.spike),
      // a rule's firing: below the tips above (a rewind's branch marker shares its step)
      ...mk("rule", "rule fired", () => ["diamond", COLORS.rule], COLORS.rule, 0.76),
      ...mk("rule_failed", "rule failed", () => ["diamond-open", COLORS.ruleFailed], COLORS.ruleFailed, 0.76),
    ];
  }

  reset(state) {
    const d = this.data(state);
    this.lossValues = d.lossY;
    this.logShown = this.isLog(d.lossY);
    this.showHint(
      d.rows.length > 0,
      d.lossY.some((v) => v !== null && v !== undefined),
    );
    this.showChanged(d.rows);
    Plotly.react(this.el, this.traces(state, d), this.layout(state, d), PLOT_CONFIG);
    this.shownTicks = {};
    this.retick();
    if (this.timeline) {
      this.timeline.bind(this);
      this.timeline.sync(this, state);
    }
  }

  /**
   * New rows, loss points, markers or what-if values since the last draw: one Plotly.update
   * (one redraw) with every trace that changed, given whole from the state (the fetched history
   * and the window, as `reset` draws them), and the shared x range; then new round ticks when
   * the visible range calls for them (a relayout, only then). A loss that crosses the automatic
   * log threshold redraws from scratch.
   */
  update(state, news) {
    if (news.loss.x.length) this.showHint(true, true);
    const gd = this.el;
    if (!gd.data || !gd._fullLayout) {
      this.reset(state);
      return;
    }
    const streamed = news.rows.length > 0 || news.loss.x.length > 0;
    const changes = new Map(); // trace index -> {attribute: new value}
    const put = (i, attrs) => changes.set(i, { ...(changes.get(i) || {}), ...attrs });
    let lossY = Array.from(gd.data[LOSS].y || []);
    if (streamed) {
      const d = this.data(state);
      if (this.isLog(d.lossY) !== this.logShown) {
        this.reset(state); // the loss crossed the automatic log threshold: redraw on the other scale
        return;
      }
      const { rows, lossX } = d;
      if (news.rows.length) this.showChanged(rows);
      lossY = d.lossY;
      this.lossValues = lossY;
      const x = rows.map((r) => r.step);
      const raw = rows.map((r) => positive(r.total_norm_raw));
      const fin = rows.map((r) => positive(r.total_norm));
      put(LOSS, { x: lossX, y: lossY });
      put(NORM_RAW, { x: x.slice(), y: raw });
      put(NORM_FINAL, { x, y: fin });
      put(NORM_BACKWARD, { x: x.slice(), y: rows.map(backwardNorm) });
      if (this.smoothing > 0) {
        put(LOSS_SMOOTH, { x: lossX.slice(), y: smooth(lossY, this.smoothing, this.logShown) });
        put(RAW_SMOOTH, { x: x.slice(), y: smooth(raw, this.smoothing, true) });
        put(FINAL_SMOOTH, { x: x.slice(), y: smooth(fin, this.smoothing, true) });
      }
      const t = this.nonfiniteTrace(state, rows);
      if (t.x.length || (gd.data[NONFINITE].x || []).length) {
        put(NONFINITE, { x: t.x, y: t.y, hovertext: t.hovertext });
      }
    }
    if (news.markers) {
      const t = this.markerTraces(state.markers);
      MARK_TRACES.forEach((i, k) =>
        put(i, {
          x: t[k].x,
          y: t[k].y,
          hovertext: t[k].hovertext ?? null,
          customdata: t[k].customdata ?? null,
          "marker.color": t[k].marker ? t[k].marker.color : null,
          "marker.symbol": t[k].marker ? t[k].marker.symbol : null,
        }),
      );
    }
    const layout = {};
    if (news.shadow || news.markers) {
      const u = shadowUpdate(gd, state, lossY);
      if (u) {
        for (const [i, attrs] of u.traces) put(i, attrs);
        Object.assign(layout, u.layout);
      }
    }
    if (this.timeline) Object.assign(layout, this.timeline.rangeUpdate(this, state) || {});
    if (changes.size || Object.keys(layout).length) {
      const indices = [...changes.keys()];
      const keys = new Set(indices.flatMap((i) => Object.keys(changes.get(i))));
      const traceUpdate = {};
      // (undefined: that trace keeps the attribute as it is)
      for (const k of keys) traceUpdate[k] = indices.map((i) => changes.get(i)[k]);
      Plotly.update(gd, traceUpdate, layout, indices);
    }
    if (streamed) this.retick();
  }

  /**
   * Round ticks for the visible range of each log axis (the norms', and the loss's when on
   * log): after streaming, a zoom or a pan, as the range Plotly settled on moved. One
   * relayout, only when the ticks changed.
   */
  retick() {
    const fl = this.el._fullLayout;
    if (!fl) return;
    const upd = {};
    this.shownTicks = this.shownTicks || {};
    for (const name of ["yaxis", "yaxis2"]) {
      const ax = fl[name];
      if (!ax || ax.type !== "log" || !Array.isArray(ax.range)) continue;
      const t = logTicksIn(ax.range[0], ax.range[1], maxTicks(this.el));
      const key = JSON.stringify(t.tickvals);
      if (this.shownTicks[name] === key) continue;
      this.shownTicks[name] = key;
      upd[`${name}.tickmode`] = "array";
      upd[`${name}.tickvals`] = t.tickvals;
      upd[`${name}.ticktext`] = t.ticktext;
    }
    if (Object.keys(upd).length) Plotly.relayout(this.el, upd);
  }
}
