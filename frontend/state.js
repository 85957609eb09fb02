// The dashboard's bounded state of one run (the page holds one for the live
// run and one for an earlier run it shows): session, hooks, a window of recent
// snapshots (only the fields the charts use: the one store every chart reads,
// the measured cards' per-parameter statistics, module gradients and hook
// effects included), the loss series, markers, histograms over steps and the
// event log; for a zoomed-out view the older history fetched downsampled (at
// most 4 rows a bucket, replaced by each fetch), and a run compared with.
// Memory is capped: nothing here grows with the length of the run. (The
// server's database is server/history/storage.py.)
//
// A large run (more than DETAIL_ALL tensors) keeps its rows compact: each row has the
// groups' aggregates (`row.groups`) and the per-parameter statistics of only the tensors
// the page asked for (`row.detail`, a Map param index -> {statistic: value}: what the
// server's `detail` carries, plus what GET /api/detail backfilled), never full-length
// per-parameter lists. `statOf(row, key, i)` reads one value in either form.

import { describeEvent, describeHookChange, eventStep } from "./describe.js";
import { firingLines } from "./ruletext.js";
import { DETAIL_ALL, aggregate, groupsFor } from "./groups.js";
import { num, plotlyText } from "./util.js";

// MAX_SNAPSHOTS and MAX_EVENTS are what the server's `hello` carries (server/settings.py).
export const MAX_SNAPSHOTS = 600; // sampled steps kept for the time-series charts
export const MAX_LOSS_POINTS = 3000; // loss points (one per step when scalars stream)
export const MAX_EVENTS = 400; // event log entries
const MAX_HISTS = 240; // histograms kept per parameter
const MAX_HIST_PARAMS = 16; // parameters whose histograms are kept
const PER_PARAM = [
  "grad_norm_raw",
  "grad_norm",
  "grad_absmax_raw",
  "grad_absmax",
  "update_ratio",
  "param_norm",
  "nan_count",
  "inf_count",
];

/** The per-parameter statistics of a snapshot, in the order the measured table shows them. */
export const STATS = [
  { key: "grad_mean", label: "mean", scale: "linear" },
  { key: "grad_std", label: "std", scale: "log" },
  { key: "grad_absmax_raw", label: "abs-max raw", scale: "log" },
  { key: "grad_absmax", label: "abs-max final", scale: "log" },
  { key: "grad_norm_raw", label: "norm raw", scale: "log" },
  { key: "grad_norm", label: "norm final", scale: "log" },
  { key: "nan_count", label: "NaN", scale: "linear" },
  { key: "inf_count", label: "Inf", scale: "linear" },
  { key: "update_ratio", label: "update ratio", scale: "log" },
];
export const ROW_FIELDS = [...new Set([...PER_PARAM, ...STATS.map((s) => s.key)])]; // per parameter, in a row
const MAX_DETAIL_ROW = 320; // tensors whose detail a row of a large run keeps, at most

/** One per-parameter statistic of a row: `row[key][i]` (a small run) or from its detail. */
export function statOf(row, key, i) {
  const list = row[key];
  if (list) return list[i];
  const d = row.detail && row.detail.get(i);
  return d ? d[key] : undefined;
}

/** Whether a row has the per-parameter statistics of parameter i. */
export function hasStats(row, i) {
  return row.detail ? row.detail.has(i) : Boolean(row.grad_norm_raw && i < row.grad_norm_raw.length);
}

let changes = 0; // every state's `version` and `histVersion` come from here: never the same twice

export class DashboardState {
  constructor() {
    this.clear();
  }

  clear() {
    this.session = null;
    this.runId = null;
    this.params = [];
    this.index = new Map(); // parameter name -> index
    this.lower = []; // the names in lower case (the search)
    this.large = false; // more than DETAIL_ALL tensors: group views, compact rows
    this.groups = null; // the partition (groups.js): {names, members, stacks}
    this.groupOf = []; // parameter index -> group index
    this.want = new Set(); // parameter indices whose detail the page asked for (large runs)
    this.hooks = new Map(); // id -> spec, in server order: what the page shows (showHooks)
    this.appliedHooks = []; // the list at configVersion
    this.requested = null; // {list, version}: a change accepted, not applied yet
    this.configVersion = 0;
    this.training = { state: "running", step: 0, scenario: null, steps_per_second: null };
    this.readOnly = false;
    this.snapshots = []; // compact rows, ascending step
    this.loss = { x: [], y: [], bad: [] }; // bad: {x, v} of non-finite losses (a gap in y, a marker)
    this.markers = []; // {x, kind: "hook"|"nonfinite"|"reset", action (of a hook change), text}
    // Older history fetched from the server for a zoomed-out view (the whole run, downsampled with
    // each bucket's extremes kept; a zoomed-in range at full resolution): rows and loss points
    // before the window, shown ahead of it on the time charts. Replaced by each fetch: bounded.
    this.history = { rows: [], loss: { x: [], y: [] }, range: null };
    this.compare = null; // another run overlaid on the loss chart: {runId, loss, norm, normRaw, markers}
    this.events = []; // newest last
    this.seenSeq = new Set();
    this.lastSeq = -1;
    this.hists = new Map(); // param -> [{step, edges, raw, final}], ascending step; least recently fed first
    this.latest = null; // newest compact row
    this.step = 0; // newest step known from any message
    this.version = ++changes; // moves when rows change: the charts that read them redraw
    this.histVersion = ++changes; // likewise for the histograms
  }

  /** Start over for a session (a run); keeps nothing of the previous one. */
  setSession(session) {
    this.clear();
    this.session = session;
    this.runId = session.run_id;
    this.params = (session.params || []).map((p) => (typeof p === "string" ? p : p.name));
    this.index = new Map(this.params.map((p, i) => [p, i]));
    this.lower = this.params.map((p) => p.toLowerCase());
    this.large = this.params.length > DETAIL_ALL;
    this.groups = groupsFor(session, this.params);
    this.groupOf = new Array(this.params.length).fill(-1);
    this.groups.members.forEach((list, g) => list.forEach((i) => (this.groupOf[i] = g)));
    this.hookKinds = session.hook_kinds || {};
    this.setHooks(session.hooks || [], session.config_version || 0);
    this.training = { ...this.training, ...(session.training || {}) };
    this.readOnly = Boolean(session.read_only);
    this.step = num(this.training.step) || 0;
  }

  // ----- hooks -----
  // The hook list comes from the server only, each list with a `config_version`: the session (in
  // `hello`, or of an earlier run), `hooks` messages (a change applied: the list it leaves) and
  // `requested` messages (a page's change accepted: the list it asks for, pending hooks with
  // `applied_step` null, at the version it has once applied). `hooks` shows the requested list
  // while its version is ahead of the applied one, else the applied list: whichever message
  // arrives first, the newer fact wins. Replies to the page's own changes (HTTP) say only
  // whether a change was accepted.

  /** The full list of a session, at its `config_version`. */
  setHooks(list, configVersion) {
    this.appliedHooks = list;
    if (configVersion !== undefined && configVersion !== null) this.configVersion = configVersion;
    this.showHooks();
  }

  /**
   * A `hooks` message: the list after the change of `configVersion`; false (and nothing
   * changes) when the state already has that version or a newer one (the hello's session).
   */
  applyHooks(list, configVersion) {
    const v = num(configVersion);
    if (v === null || v <= this.configVersion) return false;
    this.setHooks(list, v);
    return true;
  }

  /**
   * A `requested` message: the list a change asked for, at the `configVersion` it has once
   * applied; false when that version is applied already or an equal or newer request is shown.
   */
  applyRequested(list, configVersion) {
    const v = num(configVersion);
    if (v === null || v <= this.configVersion || (this.requested && v <= this.requested.version))
      return false;
    this.requested = { list, version: v };
    this.showHooks();
    return true;
  }

  /** `hooks`: the requested list while it is ahead of the applied one, else the applied list. */
  showHooks() {
    if (this.requested && this.requested.version <= this.configVersion) this.requested = null;
    const list = this.requested ? this.requested.list : this.appliedHooks;
    this.hooks = new Map(list.map((spec) => [spec.id, spec]));
  }

  // ----- snapshots -----

  /** Compact a wire snapshot; returns the row, or null when it is not newer. */
  addSnapshot(s) {
    const step = num(s.step);
    if (this.latest !== null && step <= this.latest.step) return null;
    const row = { step, time: s.time, loss: num(s.loss), configVersion: s.config_version };
    this.perParam(row, s, ROW_FIELDS);
    row.worst = Array.isArray(s.worst) ? s.worst : null;
    row.total_norm_raw = s.total_norm_raw;
    row.total_norm = s.total_norm;
    row.total_norm_backward = s.total_norm_backward;
    row.overhead = s.overhead;
    row.sampled_every = s.sampled_every;
    row.hook_effects = s.hook_effects || {};
    row.ranks = s.ranks || null; // under torch.distributed: the per-rank values (ranks.js)
    row.modules = s.modules || {};
    row.optim = s.optim || null; // the optimizer's state and update geometry (optim.js)
    row.noise_scale = s.noise_scale || null; // the gradient noise scale (noise.js)
    row.lr = Array.isArray(s.lr) ? s.lr : null; // per optimizer param group (noise.js)
    this.snapshots.push(row);
    if (this.snapshots.length > MAX_SNAPSHOTS * 1.25) {
      this.snapshots.splice(0, this.snapshots.length - MAX_SNAPSHOTS);
    }
    this.latest = row;
    this.step = Math.max(this.step, step);
    this.version = ++changes;
    for (const [name, hg] of Object.entries(s.hist || {})) this.addHist(name, step, hg);
    row.lossAdded = row.loss !== null && this.addLoss(step, row.loss);
    return row;
  }

  /**
   * A row's per-parameter part: a small run's full lists as sent; a large run's group
   * aggregates (computed here from full lists when the server sends none) and the detail of
   * the tensors asked for (the wire's `detail`, or those tensors out of full lists).
   */
  perParam(row, s, keys) {
    if (!this.large) {
      for (const k of keys) row[k] = s[k] || [];
      row.groups = s.groups || null;
      return;
    }
    const full = Array.isArray(s.grad_norm_raw);
    row.groups = s.groups || (full && this.groups ? aggregate(s, this.groups) : null);
    const detail = new Map();
    if (s.detail && Array.isArray(s.detail.index)) {
      s.detail.index.forEach((i, pos) => {
        const d = {};
        for (const k of ROW_FIELDS) d[k] = s.detail[k] ? s.detail[k][pos] : undefined;
        detail.set(i, d);
      });
    } else if (full) {
      const keep = new Set(this.want);
      for (const w of s.worst || []) keep.add(w.param);
      for (const i of keep) {
        const d = {};
        for (const k of ROW_FIELDS) d[k] = (s[k] || [])[i];
        detail.set(i, d);
      }
    }
    row.detail = detail;
  }

  /**
   * GET /api/detail's answer ({steps, params, stats}) into the rows held: values a row lacks
   * are filled in (a row's own live detail stays). Returns how many rows gained any.
   */
  mergeDetail(data) {
    if (!this.large || !data || !Array.isArray(data.steps)) return 0;
    const idx = (data.params || []).map((p) => this.index.get(p));
    const at = new Map(data.steps.map((st, j) => [num(st), j]));
    let changed = 0;
    for (const row of [...this.history.rows, ...this.snapshots]) {
      const j = at.get(row.step);
      if (j === undefined || !row.detail) continue;
      let any = false;
      idx.forEach((i, p) => {
        if (i === undefined || row.detail.has(i)) return;
        const d = {};
        let some = false;
        for (const k of ROW_FIELDS) {
          const col = data.stats && data.stats[k] && data.stats[k][p];
          const v = col ? col[j] : undefined;
          d[k] = v;
          if (v !== null && v !== undefined) some = true;
        }
        if (!some) return; // a thinned step: nothing to show
        row.detail.set(i, d);
        any = true;
      });
      if (row.detail.size > MAX_DETAIL_ROW) {
        for (const i of row.detail.keys()) if (!this.want.has(i)) row.detail.delete(i);
      }
      if (any) changed++;
    }
    if (changed) this.version = ++changes;
    return changed;
  }

  addHist(name, step, hg) {
    let list = this.hists.get(name);
    if (!list) {
      if (this.hists.size >= MAX_HIST_PARAMS) this.hists.delete(this.hists.keys().next().value);
      list = [];
    } else this.hists.delete(name); // re-inserted: the map's order is least recently fed first
    this.hists.set(name, list);
    list.push({ step, edges: hg.edges || [], raw: hg.raw || null, final: hg.final || null });
    if (list.length > MAX_HISTS * 1.25) list.splice(0, list.length - MAX_HISTS);
    this.histVersion = ++changes;
  }

  /** The newest histogram of a parameter ({step, edges, raw, final}), or null. */
  latestHist(name) {
    const list = this.hists.get(name);
    return list && list.length ? list[list.length - 1] : null;
  }

  /** Module names with a logged gradient in the kept rows, in first-seen order. */
  moduleNames() {
    const names = new Set();
    for (const r of this.snapshots) for (const m of Object.keys(r.modules)) names.add(m);
    return [...names];
  }

  /** Hook ids with an effect in the kept rows, in first-seen order. */
  effectIds() {
    const ids = new Set();
    for (const r of this.snapshots) for (const id of Object.keys(r.hook_effects)) ids.add(id);
    return [...ids];
  }

  /** The run went back to step `k` (a rewind): what is held past it is the abandoned branch's. */
  rewindTo(k) {
    this.snapshots = this.snapshots.filter((r) => r.step <= k);
    this.latest = this.snapshots.length ? this.snapshots[this.snapshots.length - 1] : null;
    const keep = this.loss.x.findIndex((x) => x > k);
    if (keep >= 0) {
      this.loss.x.splice(keep);
      this.loss.y.splice(keep);
    }
    this.loss.bad = this.loss.bad.filter((b) => b.x <= k);
    this.markers = this.markers.filter((m) => m.x <= k);
    for (const [name, list] of this.hists) {
      const kept = list.filter((hg) => hg.step <= k);
      if (kept.length) this.hists.set(name, kept);
      else this.hists.delete(name);
    }
    this.step = k;
    this.training = { ...this.training, step: k };
    this.version = ++changes;
    this.histVersion = ++changes;
  }

  /** The snapshots the charts show: the newest MAX_SNAPSHOTS. */
  window() {
    const n = this.snapshots.length;
    return n > MAX_SNAPSHOTS ? this.snapshots.slice(n - MAX_SNAPSHOTS) : this.snapshots;
  }

  windowStart() {
    const w = this.window();
    const first = w.length ? w[0].step : Infinity;
    const firstLoss = this.loss.x.length ? this.loss.x[0] : Infinity;
    return Math.min(first, firstLoss);
  }

  /**
   * A loss value for a step (from a snapshot or a late `scalars`); true when
   * added. null (not recorded yet) adds nothing; a non-finite loss adds a gap.
   */
  addLoss(step, value) {
    const x = this.loss.x;
    if (value === null || value === undefined || (x.length && step <= x[x.length - 1])) return false;
    x.push(step);
    this.loss.y.push(Number.isFinite(value) ? value : null);
    if (!Number.isFinite(value)) this.loss.bad.push({ x: step, v: value });
    // Keep loss within the snapshot window too, so both share the x range.
    const w = this.window();
    const from = w.length > 1 ? w[0].step : -Infinity;
    let cut = 0;
    while (cut < x.length && (x.length - cut > MAX_LOSS_POINTS || x[cut] < from)) cut++;
    if (cut > 0) {
      x.splice(0, cut);
      this.loss.y.splice(0, cut);
      const first = x.length ? x[0] : Infinity;
      this.loss.bad = this.loss.bad.filter((b) => b.x >= first);
    }
    this.step = Math.max(this.step, step);
    return true;
  }

  // ----- events and markers -----

  /** An event; false for one already held (a guard: the server sends each event once). */
  addEvent(ev) {
    if (ev.seq !== undefined && ev.seq !== null) {
      if (this.seenSeq.has(ev.seq)) return false;
      this.seenSeq.add(ev.seq);
      this.lastSeq = Math.max(this.lastSeq, ev.seq);
    }
    this.events.push(ev);
    if (this.events.length > MAX_EVENTS) {
      for (const old of this.events.splice(0, this.events.length - MAX_EVENTS)) this.seenSeq.delete(old.seq);
    }
    const marker = markerFor(ev);
    // one spike marker a step: the signals that spiked at it, one line each
    const same =
      marker && marker.kind === "spike" && this.markers.find((m) => m.kind === "spike" && m.x === marker.x);
    if (same) same.text += `<br>${marker.text.replace(/^step \d+: /, "")}`;
    else if (marker) this.markers.push(marker);
    return true;
  }

  /**
   * Older history for the time charts (rows and loss of `/api/snapshots` and `/api/scalars`
   * over `range`, [from, to]); only what lies before the window is kept.
   */
  setHistory(snapshots, scalars, range) {
    const start = this.windowStart();
    const rows = [];
    for (const s of snapshots) {
      const step = num(s.step);
      if (!(step < start)) continue;
      rows.push(this.historyRow(s, step));
    }
    this.history = { rows, loss: this.historyLoss(scalars, start), range };
  }

  /**
   * The loss of older history, come before its snapshots: drawn at once on the loss chart
   * (the rows held stay until the snapshots replace them; `range` is set with them).
   */
  setHistoryLoss(scalars) {
    const loss = this.historyLoss(scalars, this.windowStart());
    this.history = { rows: this.history.rows, loss, range: this.history.range };
  }

  historyLoss(scalars, start) {
    const loss = { x: [], y: [] };
    for (const r of scalars) {
      const step = num(r.step);
      const v = num(r.loss);
      if (!(step < start) || v === null) continue;
      loss.x.push(step);
      loss.y.push(Number.isFinite(v) ? v : null);
    }
    return loss;
  }

  /** One row of older history from a stored snapshot. */
  historyRow(s, step) {
    const row = {
      step,
      loss: num(s.loss),
      total_norm_raw: s.total_norm_raw,
      total_norm: s.total_norm,
      total_norm_backward: s.total_norm_backward,
      // the whole model's optimizer values only (optim.js's time chart)
      optim: s.optim && s.optim.model ? { kind: s.optim.kind, model: s.optim.model } : null,
      noise_scale: s.noise_scale || null, // noise.js
      lr: Array.isArray(s.lr) ? s.lr : null,
    };
    this.perParam(row, s, PER_PARAM);
    return row;
  }

  /** The marker x positions kept: markers left of the shown history or window go. */
  markersFrom() {
    const h = this.history;
    const first = Math.min(
      h.rows.length ? h.rows[0].step : Infinity,
      h.loss.x.length ? h.loss.x[0] : Infinity,
      h.range ? h.range[0] : Infinity,
    );
    return Math.min(first, this.windowStart());
  }

  /** Drop markers left of the history and window; true when any went. */
  pruneMarkers() {
    const from = this.markersFrom();
    if (!Number.isFinite(from)) return false;
    const before = this.markers.length;
    this.markers = this.markers.filter((m) => m.x >= from);
    return this.markers.length !== before;
  }
}

/** A vertical marker on the time charts for hook changes, non-finite gradients and scenario resets. */
export function markerFor(ev) {
  const x = eventStep(ev);
  if (x === null) return null;
  if (ev.kind === "hook_applied") {
    const action = ev.action || "update";
    const more = values(ev);
    const text = plotlyText(`step ${x}: ${describeHookChange(ev)}`) + (more ? `<br>${plotlyText(more)}` : "");
    return { x, kind: "hook", action, text };
  }
  if (ev.kind === "nonfinite" || ev.kind === "step_skipped") {
    return { x, kind: "nonfinite", text: plotlyText(`step ${x}: ${describeEvent(ev)}`) };
  }
  if (ev.kind === "rewind") {
    // at the checkpoint's own step a rewind abandons no step: no branch starts there
    const what = Number(ev.from_step) > Number(ev.step) ? "branch" : "rewind";
    return { x, kind: "branch", text: plotlyText(`step ${x}: ${what} · ${describeEvent(ev)}`) };
  }
  if (ev.kind === "batches_skipped") {
    // at the rewind's step: the new branch starts there without the window's batches
    return { x, kind: "skip", text: plotlyText(`step ${x}: ${describeEvent(ev)}`) };
  }
  if (ev.kind === "scenario_reset") {
    return { x, kind: "reset", text: plotlyText(`step ${x}: scenario reset · ${describeEvent(ev)}`) };
  }
  if (ev.kind === "spike") {
    return { x, kind: "spike", text: plotlyText(`step ${x}: ${describeEvent(ev)}`) };
  }
  if (ev.kind === "rule_fired" || ev.kind === "rule_failed") {
    // a rewind: the steps after the checkpoint are another branch's; the marker goes where the
    // run went on from (beside the branch marker), its hover naming the step it fired at
    const r = ev.result;
    const back = ev.kind === "rule_fired" && r && r.rewound ? num(r.step) : null;
    return {
      x: back ?? x,
      kind: ev.kind === "rule_fired" ? "rule" : "rule_failed",
      text: firingLines(ev).map(plotlyText).join("<br>"),
    };
  }
  return null;
}

/**
 * The values a hook change leaves in force, for the hover of a marker whose action does not
 * name them (an update's text has each "before → after" already, an add its params).
 */
function values(ev) {
  if (!["enable", "disable", "remove"].includes(ev.action)) return "";
  const spec = (ev.action === "remove" ? ev.before : ev.after) || ev.before || {};
  const params = Object.entries(spec.params || {});
  const text = params.map(([k, v]) => `${k}=${v}`).join(", ");
  const state = ev.action === "remove" ? "was" : "now";
  return text ? `${state}: ${text}${spec.point ? ` at ${spec.point}` : ""}` : "";
}
