// What the core measures beyond the main charts' fields (issue 14, part J):
// per-parameter statistics (mean, std, abs-max, norms, NaN/Inf counts, update
// ratio), module gradients, hook effects, and histograms over steps. One
// bounded store per DashboardState (the live run, or an earlier one shown),
// fed by app.js with every wire snapshot the state gets; nothing here grows
// with the length of the run.

import { num } from "./util.js";

export const MAX_ROWS = 600; // sampled steps kept (as state.js's MAX_SNAPSHOTS)
const MAX_HISTS = 240; // histograms kept per parameter
const MAX_HIST_PARAMS = 16; // parameters whose histograms are kept

/** The per-parameter statistics of a snapshot, in the order the table shows them. */
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

export class Measured {
  constructor(runId) {
    this.runId = runId;
    this.rows = []; // {step, <stat key>: [...per parameter], modules, effects}, ascending step
    this.hists = new Map(); // param -> [{step, edges, raw, final}], ascending step
    this.version = 0; // counts rows added: charts redraw when it moves
    this.histVersion = 0;
  }

  /**
   * A wire snapshot; false when it is not newer than the newest row. `stateStep`
   * is the newest step of the DashboardState that got it: when that went back
   * below ours, the state started over (a restarted process on the same run id,
   * without a database), and so does this store; otherwise an older step is a
   * stream message the backfill already had.
   */
  add(s, stateStep = null) {
    const step = num(s.step);
    if (step === null) return false;
    const last = this.rows.length ? this.rows[this.rows.length - 1].step : null;
    if (last !== null && step <= last) {
      if (!(stateStep !== null && stateStep < last)) return false;
      this.rows = [];
      this.hists = new Map();
    }
    const row = { step, modules: s.modules || {}, effects: s.hook_effects || {} };
    for (const { key } of STATS) row[key] = s[key] || [];
    this.rows.push(row);
    if (this.rows.length > MAX_ROWS * 1.25) this.rows.splice(0, this.rows.length - MAX_ROWS);
    for (const [name, hg] of Object.entries(s.hist || {})) this.addHist(name, step, hg);
    this.version += 1;
    return true;
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
    this.histVersion += 1;
  }

  latest() {
    return this.rows.length ? this.rows[this.rows.length - 1] : null;
  }

  /** Module names with a logged gradient in the kept rows, in first-seen order. */
  moduleNames() {
    const names = new Set();
    for (const r of this.rows) for (const m of Object.keys(r.modules)) names.add(m);
    return [...names];
  }

  /** Hook ids with an effect in the kept rows, in first-seen order. */
  effectIds() {
    const ids = new Set();
    for (const r of this.rows) for (const id of Object.keys(r.effects)) ids.add(id);
    return [...ids];
  }
}

const stores = new WeakMap();

/** The store of a DashboardState (a new one when its run changed). */
export function measuredOf(state) {
  let m = stores.get(state);
  if (!m || m.runId !== state.runId) {
    m = new Measured(state.runId);
    stores.set(state, m);
  }
  return m;
}
