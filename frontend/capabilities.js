// What this server does besides serving the history: the session's `capabilities`
// (server/sources.py: `commands`, `targets`, `checkpoints`, `checkpoint`, `shadow`, `rate`, each
// `{ok, why}`). The page asks nothing a capability says is not served: a replay gets no
// `/api/targets` and no `/api/checkpoints` request, shows no write control, no "● live" badge
// and no "Try this" hint (a replay is read, not followed). Also here: the note where a stored
// run's per-tensor detail was thinned (the history keeps it on every 8th step past its window).

import { SELECTORS } from "./selectors.js";
import { h, num } from "./util.js";

let caps = null; // the newest session's capabilities; null: none said (an older server)
let readOnly = false;
let replay = false;

/** The session from a `hello` (or `GET /api/session`): what may be asked of this server. */
export function setCapabilities(session) {
  const s = session || {};
  caps = s.capabilities && typeof s.capabilities === "object" ? s.capabilities : null;
  readOnly = Boolean(s.read_only);
  replay = s.mode === "replay";
  document.body.classList.toggle("replay", replay);
}

/** Whether `key` is served here (an older server that says nothing: whatever is not read-only). */
export function can(key) {
  if (caps === null) return !readOnly && !replay;
  const c = caps[key];
  return Boolean(c && c.ok);
}

/** Why `key` is not served here (for a tooltip), or "". */
export function whyNot(key) {
  if (can(key)) return "";
  const c = caps && caps[key];
  return (c && c.why) || "read-only";
}

/** Whether this page shows a replay of a recorded run (no live training behind it). */
export function isReplay() {
  return replay;
}

/** The connection badge's text: a replay's socket serves a finished recording, not a live run. */
export function connectionText(state) {
  if (state !== "open") return null;
  return replay ? "● replay" : "● live";
}

/**
 * Steps whose per-tensor detail the history thinned: a small run's rows with every per-tensor
 * value null while the step's totals are there, and the steps `/api/detail` answered with none
 * (`state.thinnedSteps`). Returns {count, last} (last: the newest such step) or null.
 */
export function thinnedSteps(state) {
  let count = 0;
  let last = null;
  const seen = new Set(state.thinnedSteps || []);
  for (const row of [...state.history.rows, ...state.snapshots]) {
    const list = row.grad_norm_raw;
    const thin =
      seen.has(row.step) ||
      (!state.large &&
        Array.isArray(list) &&
        list.length > 0 &&
        list.every((x) => x === null || x === undefined) &&
        num(row.total_norm_raw) !== null);
    if (thin) {
      count++;
      if (last === null || row.step > last) last = row.step;
    }
  }
  return count ? { count, last } : null;
}

/** The note under the heatmap where the stored detail was thinned (made once, kept up to date). */
export function showThinnedNote(state) {
  const chart = document.querySelector(`[data-testid="${SELECTORS.chartHeatmap}"]`);
  if (!chart) return;
  let el = document.querySelector(`[data-testid="${SELECTORS.detailThinned}"]`);
  if (!el) {
    el = h("p", { class: "small muted thinned-note", dataset: { testid: SELECTORS.detailThinned } });
    el.hidden = true;
    chart.after(el);
  }
  const t = thinnedSteps(state);
  const text = t
    ? `Per-tensor detail thinned: up to step ${t.last} the history kept each tensor's statistics ` +
      `on every 8th step only (its detail window), so ${t.count} step${t.count === 1 ? "" : "s"} ` +
      "here show no per-tensor value (the empty stripes); the totals and group aggregates are kept for every step."
    : "";
  if (el.textContent !== text) el.textContent = text;
  el.hidden = !t;
}
