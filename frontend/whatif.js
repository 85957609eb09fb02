// What-if: the demo's shadow comparison and the checkpoints, on the loss card.
//
// - A bar under the loss card's header: "compare from here" (a shadow copy trained from now on
//   the same batches with the current hooks; demo only), the running comparison's label
//   ("shadow: without clip_norm h1"), its cost (a second training step per step), "difference"
//   (main minus shadow loss, a small chart under the loss chart) and "end comparison"; the
//   checkpoints kept in host memory ("checkpoints: N kept · size [of the budget] host memory
//   [· every N steps]"), each with a rewind button showing its step, size and time (who took it
//   and how long the copy took in its title), and why the last automatic checkpoint was not
//   taken (over the budget, refused, non-finite gradients), where it applies; "checkpoint now"
//   (POST /api/checkpoints: taken at the next step boundary; disabled with the reason where
//   the Inspector refuses checkpoints, absent where the server serves none: a replay).
// - A shadow that ended says why and at which step, and when its loss was never finite (a
//   shadow from already-ruined weights) that it has no line to draw.
// - On the loss chart: the shadow's loss and total norm (raw and final) dashed from its branch
//   step (traces after the loss chart's own), and a branch marker at every rewind.
// - A click on a hook-change marker offers "rewind to before this change": the newest
//   checkpoint taken before the change's step.
// State: `state.shadow` of the DashboardState shown (the live run's from the stream and
// GET /api/shadow; an earlier run's from its shadow branch in the history).

import { api, errorText } from "./api.js";
import { can, whyNot } from "./capabilities.js";
import { SELECTORS } from "./selectors.js";
import { COLORS, PLOT_CONFIG, axis, baseLayout } from "./theme.js";
import { h, num, plotlyText, positive } from "./util.js";

const Plotly = window.Plotly;
export const SHADOW_TRACES = 6; // loss, raw norm, final norm, branch line, branch tip, skipped batches
const MAX_POINTS = 3000;

function emptyShadow() {
  return {
    runId: null,
    branchStep: null,
    label: null,
    active: false,
    ended: null, // why it ended (the server's `ended`), and at which step (`endedStep`)
    endedStep: null,
    x: [],
    loss: [],
    raw: [],
    fin: [],
  };
}

/** The first step from the branch on where the main run went NaN/Inf (its NaN/Inf markers), or null. */
function mainNonfinite(state, sh) {
  if (sh.branchStep === null) return null;
  const xs = (state.markers || [])
    .filter((m) => m.kind === "nonfinite" && m.x >= sh.branchStep)
    .map((m) => m.x);
  return xs.length ? Math.min(...xs) : null;
}

/** Why the shadow has no line, or at which step its loss left the finite (null: nothing to say). */
function nonfiniteNote(sh) {
  if (!sh.x.length) return null;
  const firstBad = sh.loss.findIndex((v) => v === null);
  if (firstBad < 0) return null;
  if (sh.loss.every((v) => v === null))
    return `its loss was NaN/Inf from its first step (${sh.x[0]}): the weights it started from were already non-finite, so there is no line to draw`;
  return `its loss is NaN/Inf from step ${sh.x[firstBad]}: the dashed line stops there`;
}

function fmtBytes(n) {
  const v = num(n) || 0;
  if (v < 1024) return `${v} B`;
  if (v < 1024 * 1024) return `${(v / 1024).toFixed(1)} KB`;
  if (v < 1024 * 1024 * 1024) return `${(v / 1024 / 1024).toFixed(1)} MB`;
  return `${(v / 1024 / 1024 / 1024).toFixed(2)} GB`;
}

const ORIGIN = { auto: "every N steps", rule: "a rule", page: "the page", loop: "the loop" };

/** One kept checkpoint's line: step, size, wall-clock time (and, in its title, who took it and how long). */
function cpText(cp) {
  const at = num(cp.time) ? new Date(num(cp.time) * 1000).toLocaleTimeString() : "";
  return `↶ ${cp.id} · step ${cp.step} · ${fmtBytes(cp.bytes)}${at ? ` · ${at}` : ""}${cp.label ? ` · ${cp.label}` : ""}`;
}

function addPoint(sh, p) {
  const step = num(p.step);
  if (step === null || (sh.x.length && step <= sh.x[sh.x.length - 1])) return false;
  const loss = num(p.loss);
  sh.x.push(step);
  sh.loss.push(loss !== null && Number.isFinite(loss) ? loss : null);
  sh.raw.push(positive(p.total_norm_raw));
  sh.fin.push(positive(p.total_norm));
  if (sh.x.length > MAX_POINTS)
    for (const k of ["x", "loss", "raw", "fin"]) sh[k].splice(0, sh.x.length - MAX_POINTS);
  return true;
}

/** The loss chart's what-if traces (appended after its own): shadow loss, norms, branch markers. */
export function shadowTraces(state) {
  const sh = state.shadow || emptyShadow();
  const name = plotlyText(sh.label || "shadow");
  const line = (what, ys, color, extra = {}) => ({
    name: `${name} ${what}`,
    x: sh.x,
    y: ys,
    type: "scatter",
    mode: "lines",
    line: { color, width: 1.4, dash: "dash" },
    hovertemplate: `${name}<br>step %{x}<br>${what} %{y:.4g}<extra></extra>`,
    ...extra,
  });
  const branches = (state.markers || []).filter((m) => m.kind === "branch");
  const skips = (state.markers || []).filter((m) => m.kind === "skip");
  return [
    line("loss", sh.loss, COLORS.compareLoss),
    line("raw norm", sh.raw, COLORS.raw, { yaxis: "y2", opacity: 0.7 }),
    line("final norm", sh.fin, COLORS.compareNorm, { yaxis: "y2" }),
    {
      name: "branch",
      showlegend: false,
      x: branches.flatMap((m) => [m.x, m.x, null]),
      y: branches.flatMap(() => [0, 0.96, null]),
      yaxis: "y3",
      type: "scatter",
      mode: "lines",
      line: { color: COLORS.branch, width: 1.5, dash: "dot" },
      hoverinfo: "skip",
    },
    {
      name: "branch",
      x: branches.map((m) => m.x),
      y: branches.map(() => 0.96),
      hovertext: branches.map((m) => m.text),
      yaxis: "y3",
      type: "scatter",
      mode: "markers",
      marker: { color: COLORS.branch, size: 11, symbol: "y-down-open", line: { width: 2 } },
      hovertemplate: "%{hovertext}<extra></extra>",
    },
    {
      // a rewind that skipped batches: under its branch marker, the window in the hover
      name: "batches skipped",
      x: skips.map((m) => m.x),
      y: skips.map(() => 0.86),
      hovertext: skips.map((m) => m.text),
      yaxis: "y3",
      type: "scatter",
      mode: "markers",
      marker: { color: COLORS.branch, size: 10, symbol: "arrow-bar-right", line: { width: 1.5 } },
      hovertemplate: "%{hovertext}<extra></extra>",
    },
  ];
}

/**
 * The loss axis keeps the main run's range when the shadow's loss leaves it far behind (a
 * diverging shadow would otherwise flatten the main loss to a line at 0): the dashed line then
 * runs off the top of the chart, and its hover and the difference chart still give its values.
 */
export function mainLossRange(ax, ys, state) {
  const sh = state.shadow;
  if (!sh || !sh.x.length || ax.range) return;
  const log = ax.type === "log";
  const f = (v) => (v === null || !Number.isFinite(v) || (log && v <= 0) ? null : log ? Math.log10(v) : v);
  const main = ys.map(f).filter((v) => v !== null);
  const theirs = sh.loss.map(f).filter((v) => v !== null);
  if (!main.length || !theirs.length) return;
  const lo = Math.min(...main);
  const hi = Math.max(...main);
  const span = Math.max(hi - lo, log ? 0.5 : Math.abs(hi) * 0.1 || 1e-3);
  if (Math.max(...theirs) <= hi + span && Math.min(...theirs) >= lo - span) return; // both fit
  ax.range = [lo - 0.1 * span, hi + 0.6 * span];
  ax.autorange = false;
}

/**
 * The what-if traces' new values (`[trace index, {x, y, hovertext, name}]`) and the loss axis
 * range they call for (`layout`, a relayout's keys; empty when the user set the range), for a
 * chart that draws them last; `lossY` the main loss as it is to be drawn. Null when the chart
 * has no such traces yet.
 */
export function shadowUpdate(gd, state, lossY) {
  if (!gd.data || gd.data.length < SHADOW_TRACES) return null;
  const t = shadowTraces(state);
  const first = gd.data.length - SHADOW_TRACES;
  const traces = t.map((d, i) => [
    first + i,
    { x: d.x.slice(), y: d.y.slice(), hovertext: d.hovertext ?? null, name: d.name },
  ]);
  const layout = {};
  const fl = gd._fullLayout;
  const user = gd.layout && gd.layout.yaxis && gd.layout.yaxis.autorange === false;
  if (fl && fl.yaxis && !user) {
    const ax = { type: fl.yaxis.type };
    mainLossRange(ax, lossY, state);
    if (ax.range) Object.assign(layout, { "yaxis.range": ax.range, "yaxis.autorange": false });
  }
  return { traces, layout };
}

export class WhatIf {
  /**
   * @param {object} o
   * @param {HTMLElement} o.card the loss chart's card
   * @param {object} o.loss the LossChart
   * @param {() => object} o.view the DashboardState shown
   * @param {() => object} o.live the live run's DashboardState
   * @param {(fn: Function) => void} o.mark mark charts dirty (the scheduler's mark)
   * @param {(text: string) => void} o.note a line for the event log
   */
  constructor({ card, loss, view, live, mark, note }) {
    this.loss = loss;
    this.view = view;
    this.live = live;
    this.mark = mark;
    this.note = note;
    this.checkpoints = { checkpoints: [], bytes: 0, keep: 0, refused: null };
    const b = (testid, text, title, onclick) =>
      h("button", { class: "btn tiny", type: "button", dataset: { testid }, title, onclick }, text);
    this.compareBtn = b(
      SELECTORS.compareHere,
      "compare from here",
      "train a shadow copy from now on the same batches with the current hooks; later hook changes apply to the main run only (a second training step per step)",
      () => this.compareHere(),
    );
    this.status = h("span", { class: "small shadow-status", dataset: { testid: SELECTORS.shadowStatus } });
    this.diffBtn = b(SELECTORS.shadowDiff, "difference", "main minus shadow loss, step by step", () =>
      this.toggleDiff(),
    );
    this.endBtn = b(
      SELECTORS.shadowEnd,
      "end comparison",
      "stop training the shadow (its history stays)",
      () => this.end(),
    );
    // a checkpoint now, at the next step boundary (listed below once taken)
    this.cpNowBtn = b(
      SELECTORS.checkpointNow,
      "checkpoint now",
      "save the model, optimizer and inspector state at the next step boundary (in host memory; listed under checkpoints)",
      () => this.checkpointNow(),
    );
    this.endedNote = h("span", { class: "small shadow-ended", dataset: { testid: SELECTORS.shadowEnded } });
    this.cpList = h("span", { class: "cp-list" });
    // why the last automatic checkpoint was not taken (GET /api/checkpoints' auto_refused)
    this.cpNote = h("span", { class: "small cp-note", dataset: { testid: SELECTORS.checkpointsNote } });
    // a rewind from here may skip the batches received since the checkpoint (inspector/whatif/skip.py)
    this.skipBox = h("input", { type: "checkbox", dataset: { testid: SELECTORS.rewindSkip } });
    this.skipLabel = h(
      "label",
      {
        class: "small cp-skip",
        title:
          "rewind and skip the batches received since the checkpoint: the steps that led here do not " +
          "see them again (recorded as a batches_skipped event)",
      },
      this.skipBox,
      " skip the batches since the checkpoint",
    );
    this.cpSummary = h(
      "summary",
      { class: "small", dataset: { testid: SELECTORS.checkpoints } },
      "checkpoints",
    );
    const cps = h(
      "details",
      { class: "checkpoints" },
      this.cpSummary,
      this.cpNote,
      this.skipLabel,
      this.cpList,
    );
    this.bar = h(
      "div",
      { class: "whatif-bar", dataset: { testid: SELECTORS.whatifBar } },
      this.compareBtn,
      this.status,
      this.diffBtn,
      this.endBtn,
      this.endedNote,
      h("span", { class: "grow" }),
      this.cpNowBtn,
      cps,
    );
    card.querySelector(".card-head").after(this.bar);
    this.diffEl = h("div", {
      class: "diff-chart",
      dataset: { testid: SELECTORS.chartShadowDiff },
      hidden: true,
    });
    loss.el.after(this.diffEl);
    this.pop = h("div", { class: "marker-pop", dataset: { testid: SELECTORS.markerPop }, hidden: true });
    card.style.position = "relative";
    card.append(this.pop);
    this.bound = false;
    this.show();
  }

  // ----- data -----

  /** A new session or view: the shadow (live: the server's; earlier run: its history) and checkpoints. */
  async load() {
    const state = this.view();
    state.shadow = emptyShadow();
    if (state === this.live()) {
      const res = await api.shadow();
      if (res.ok && res.data && (res.data.active || (res.data.points || []).length)) {
        this.setState(state, res.data);
        for (const p of res.data.points || []) addPoint(state.shadow, p);
      } else await this.fromHistory(state);
      if (can("checkpoints")) await this.refreshCheckpoints();
    } else {
      await this.fromHistory(state);
    }
    if (this.view() === state) this.redraw();
  }

  /** A run's newest shadow branch, read back from the history. */
  async fromHistory(state) {
    const branches = ((state.session && state.session.branches) || []).filter((b) => b.branch === "shadow");
    const last = branches[branches.length - 1];
    if (!last) return;
    const [scal, snaps] = await Promise.all([
      api.scalars({ run: last.id, buckets: 1000 }),
      api.snapshots({ run: last.id, buckets: 1000 }),
    ]);
    if (!scal.ok || !snaps.ok) return;
    const byStep = new Map();
    for (const s of snaps.data.snapshots || [])
      byStep.set(num(s.step), {
        step: s.step,
        loss: s.loss,
        total_norm_raw: s.total_norm_raw,
        total_norm: s.total_norm,
      });
    for (const r of scal.data.scalars || [])
      byStep.set(num(r.step), { ...(byStep.get(num(r.step)) || { step: r.step }), loss: r.loss });
    state.shadow = {
      ...emptyShadow(),
      runId: last.id,
      branchStep: num(last.branch_step),
      label: last.label,
      active: false,
    };
    for (const step of [...byStep.keys()].sort((a, b) => a - b)) addPoint(state.shadow, byStep.get(step));
  }

  setState(state, s) {
    const sh = state.shadow || emptyShadow();
    const fresh = s.run !== sh.runId || num(s.branch_step) !== sh.branchStep;
    state.shadow = fresh ? emptyShadow() : sh;
    Object.assign(state.shadow, {
      runId: s.run,
      branchStep: num(s.branch_step),
      label: s.label,
      active: Boolean(s.active),
      ended: s.active ? null : (s.ended ?? null),
      endedStep: s.active ? null : num(s.ended_step),
    });
  }

  async refreshCheckpoints() {
    if (!can("checkpoints")) return; // (a replay keeps none: nothing to ask)
    const res = await api.checkpoints();
    if (res.ok && res.data) this.checkpoints = res.data;
    this.show();
  }

  /** `shadow` and `shadow_state` messages of the live run. */
  onMessage(msg) {
    const live = this.live();
    if (msg.type === "shadow_state") {
      this.setState(live, msg);
      if (this.view() === live) this.redraw();
      return;
    }
    if (!live.shadow || (msg.run !== live.shadow.runId && live.shadow.runId !== null)) return;
    if (addPoint(live.shadow, msg) && this.view() === live) {
      this.mark((p, name) => name === "loss" && (p.shadow = true));
      if (!this.diffEl.hidden) this.drawDiff();
      this.show();
    }
  }

  /** An event of the live run: checkpoints change with these. */
  onEvent(ev) {
    if (["checkpoint", "rewind", "shadow_started", "shadow_ended"].includes(ev.kind))
      this.refreshCheckpoints();
    if (ev.kind === "rewind") this.onRewind(ev);
  }

  /** The live run went back to `ev.step`: what the page holds past it is the abandoned branch's. */
  onRewind(ev) {
    const k = num(ev.step);
    if (k === null) return;
    this.live().rewindTo(k);
    this.onRewound && this.onRewound();
  }

  // ----- commands -----

  async checkpointNow() {
    const res = await api.checkpoint();
    if (!res.ok) this.note(`checkpoint now: ${errorText(res)}`);
    else this.note(`checkpoint ${res.data.id} requested: taken at the next step boundary`);
  }

  async compareHere() {
    const res = await api.startShadow();
    if (!res.ok) this.note(`compare from here: ${errorText(res)}`);
    else this.note(`comparison requested: a shadow from checkpoint ${res.data.checkpoint}`);
  }

  async end() {
    const res = await api.stopShadow();
    if (!res.ok) this.note(`end comparison: ${errorText(res)}`);
  }

  async rewind(cp) {
    this.pop.hidden = true;
    const skip = this.skipBox.checked ? "since_checkpoint" : null;
    const res = await api.rewind(cp.id, skip);
    const what = skip ? "rewind and skip" : "rewind";
    if (!res.ok) this.note(`${what} to ${cp.id}: ${errorText(res)}`);
    else this.note(`${what} to ${cp.id} (step ${cp.step}) requested: at the next step boundary`);
  }

  /** The newest checkpoint taken before `step` (to undo what happened at `step`). */
  before(step) {
    const cps = (this.checkpoints.checkpoints || []).filter((c) => c.taken && num(c.step) < step);
    return cps.length ? cps[cps.length - 1] : null;
  }

  /** A click on a hook-change marker of the loss chart: offer the rewind to before it. */
  bind() {
    const gd = this.loss.el;
    if (this.bound || typeof gd.on !== "function") return;
    this.bound = true;
    gd.on("plotly_click", (ev) => {
      // the marker among the points clicked (the loss line or a change's vertical line may come first)
      const p = ((ev && ev.points) || []).find(
        (q) => q && q.data && q.data.name === "hook change" && q.data.mode === "markers",
      );
      if (!p) return;
      this.offer(num(p.x), p.hovertext || "");
    });
  }

  offer(step, text) {
    const live = this.view() === this.live() && !this.live().readOnly;
    const cp = this.before(step);
    const close = h(
      "button",
      { class: "icon-btn", type: "button", "aria-label": "close", onclick: () => (this.pop.hidden = true) },
      "✕",
    );
    const body = [
      h(
        "div",
        { class: "small" },
        text.replace(/<br>/g, " · ").replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&"),
      ),
    ];
    if (!live) body.push(h("div", { class: "small muted" }, "rewind: live run only"));
    else if (!cp)
      body.push(
        h(
          "div",
          { class: "small muted" },
          `no checkpoint before step ${step} is kept (the newest ${this.checkpoints.keep || 0} are)`,
        ),
      );
    else
      body.push(
        h(
          "button",
          {
            class: "btn tiny",
            type: "button",
            dataset: { testid: SELECTORS.markerRewind },
            onclick: () => this.rewind(cp),
          },
          `rewind to before this change (${cp.id}, step ${cp.step})`,
        ),
      );
    this.pop.replaceChildren(close, ...body);
    this.pop.hidden = false;
  }

  toggleDiff() {
    this.diffEl.hidden = !this.diffEl.hidden;
    this.diffBtn.setAttribute("aria-pressed", String(!this.diffEl.hidden));
    if (!this.diffEl.hidden) this.drawDiff();
  }

  /** Main minus shadow loss at every step both have, from the branch step. */
  drawDiff() {
    const state = this.view();
    const sh = state.shadow || emptyShadow();
    const main = new Map();
    const xs = [...state.history.loss.x, ...state.loss.x];
    const ys = [...state.history.loss.y, ...state.loss.y];
    xs.forEach((x, i) => main.set(x, ys[i]));
    const x = [];
    const y = [];
    sh.x.forEach((s, i) => {
      const m = main.get(s);
      if (m !== undefined && m !== null && sh.loss[i] !== null) {
        x.push(s);
        y.push(m - sh.loss[i]);
      }
    });
    this.diffEl.dataset.points = String(x.length);
    const name = plotlyText(`main − ${sh.label || "shadow"}`);
    // past the main run's NaN/Inf there is no difference to draw: a line and a word say where
    const bad = mainNonfinite(state, sh);
    this.diffEl.dataset.mainNonfinite = bad === null ? "" : String(bad);
    const shapes =
      bad === null
        ? []
        : [
            {
              type: "line",
              xref: "x",
              yref: "paper",
              x0: bad,
              x1: bad,
              y0: 0,
              y1: 1,
              line: { color: COLORS.nonfinite, width: 1.5, dash: "dot" },
            },
          ];
    const annotations =
      bad === null
        ? []
        : [
            {
              x: bad,
              xref: "x",
              y: 1,
              yref: "paper",
              xanchor: "left",
              yanchor: "top",
              showarrow: false,
              text: plotlyText(`main run NaN/Inf from step ${bad}: no difference from here`),
              font: { size: 11, color: COLORS.nonfinite },
            },
          ];
    Plotly.react(
      this.diffEl,
      [
        {
          name,
          x,
          y,
          type: "scatter",
          mode: "lines",
          line: { color: COLORS.loss, width: 1.4 },
          hovertemplate: `${name}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
        },
      ],
      baseLayout({
        margin: { l: 60, r: 64, t: 8, b: 32 },
        xaxis: axis({ title: { text: "step" } }),
        yaxis: axis({ title: { text: "loss: main − shadow" }, zeroline: true }),
        shapes,
        annotations,
        showlegend: false,
      }),
      PLOT_CONFIG,
    );
  }

  // ----- drawing -----

  redraw() {
    this.mark((p, name) => name === "loss" && (p.shadow = true));
    if (!this.diffEl.hidden) this.drawDiff();
    this.show();
  }

  /** The bar: what runs, what it costs, the checkpoints. */
  show() {
    const state = this.view();
    const isLive = state === this.live();
    const sh = state.shadow || emptyShadow();
    const demo = Boolean(isLive && state.session && state.session.mode === "demo");
    const ro = !isLive || this.live().readOnly;
    this.compareBtn.hidden = !demo || sh.active;
    this.compareBtn.disabled = ro;
    this.endBtn.hidden = !(isLive && sh.active);
    this.endBtn.disabled = ro;
    this.skipBox.disabled = ro;
    this.diffBtn.hidden = !sh.x.length;
    this.bar.dataset.shadow = sh.active ? "active" : sh.x.length ? "ended" : "none";
    if (sh.x.length || sh.active || sh.ended) {
      const from = sh.branchStep !== null ? ` · from step ${sh.branchStep}` : "";
      const cost = sh.active ? " · costs a second training step per step" : " · ended";
      this.status.textContent = `${sh.label || "shadow"}${from} (dashed)${cost}`;
    } else this.status.textContent = "";
    // why it ended, at which step; a shadow whose loss never was finite has no line: say so
    const ended = sh.ended
      ? `ended${sh.endedStep !== null ? ` at step ${sh.endedStep}` : ""}: ${sh.ended}`
      : "";
    const bad = nonfiniteNote(sh);
    const mainBad = sh.x.length || sh.active ? mainNonfinite(state, sh) : null;
    const main =
      mainBad === null ? "" : `the main run is NaN/Inf from step ${mainBad}: no difference from there`;
    const note = [ended, bad, main].filter(Boolean).join(" · ");
    if (this.endedNote.textContent !== note) this.endedNote.textContent = note;
    this.endedNote.hidden = !note;
    // checkpoint now: absent where the server takes none (a replay, an earlier run), disabled
    // with the reason where the Inspector refuses them
    this.cpNowBtn.hidden = !isLive || !can("checkpoints");
    this.cpNowBtn.disabled = ro || !can("checkpoint");
    this.cpNowBtn.title = can("checkpoint")
      ? "save the model, optimizer and inspector state at the next step boundary (in host memory; listed under checkpoints)"
      : `checkpoint now: ${whyNot("checkpoint")}`;
    const c = this.checkpoints;
    const list = (c.checkpoints || []).filter((x) => x.taken);
    this.cpSummary.hidden = !isLive || !!c.refused || !can("checkpoints"); // (a replay keeps none)
    const every = num(c.every) ? ` · every ${num(c.every)} steps` : "";
    const budget = num(c.budget) ? ` of ${fmtBytes(c.budget)}` : "";
    this.cpSummary.textContent =
      `checkpoints: ${list.length} kept · ${fmtBytes(c.bytes)}${budget} host memory${every}` +
      (c.auto_refused ? " · ⚠ not taken" : "");
    this.cpSummary.title =
      c.refused ||
      `the newest ${num(c.keep) || 0} checkpoints, in host memory` +
        (num(c.budget) ? ` (at most ${fmtBytes(c.budget)}: the oldest are dropped to make room)` : "") +
        (num(c.every) ? `; one every ${num(c.every)} steps` : "") +
        "; one is taken before every hook change from the page";
    this.cpNote.textContent = c.auto_refused || "";
    this.cpNote.hidden = !isLive || !c.auto_refused;
    this.cpList.replaceChildren(
      ...list.map((cp) =>
        h(
          "button",
          {
            class: "btn tiny",
            type: "button",
            disabled: ro,
            dataset: { testid: SELECTORS.rewindCheckpoint, checkpoint: cp.id },
            title:
              `rewind to ${cp.id}, step ${cp.step}: state, step counter and hooks (${fmtBytes(cp.bytes)}` +
              `, taken by ${ORIGIN[cp.origin] || cp.origin || "?"}` +
              (num(cp.took) !== null ? ` in ${(num(cp.took) * 1000).toFixed(0)} ms)` : ")"),
            onclick: () => this.rewind(cp),
          },
          cpText(cp),
        ),
      ),
    );
  }
}
