// What a large run's detail backfill (GET /api/detail) asks for, and the holes it leaves:
// every step the page holds (the fetched older history and the streamed window), not only the
// newest MAX_SNAPSHOTS; and the steps that streamed in, without the tensor's detail, after the
// server read its answer (before the subscription took effect), asked for once more.

import { MAX_SNAPSHOTS } from "./state.js";

const DETAIL_LIMIT = 5000; // the server's most steps an answer holds
const DETAIL_CELLS = 256 * 600; // ... and (parameter, step) pairs

/** `since` and `limit` of a request for `count` tensors covering the held steps after `after`. */
export function detailWindow(v, count, after = null) {
  const rows = [...v.history.rows, ...v.snapshots];
  const first = after === null ? rows[0] : rows.find((r) => r.step > after);
  const newest = rows.length ? rows[rows.length - 1].step : 0;
  const since = after !== null ? after : first ? first.step - 1 : undefined;
  // the held span, and room for the steps stored since (the answer is the newest `limit`)
  const span = Math.max(0, newest - (since ?? 0));
  const cap = Math.min(DETAIL_LIMIT, Math.floor(DETAIL_CELLS / Math.max(1, count)));
  return { since, limit: Math.max(1, Math.min(cap, span + MAX_SNAPSHOTS)) };
}

/**
 * The tensors (of `indices`) a held row newer than the answer's newest step lacks: the
 * server had not stored those steps when it answered. Map index -> that newest step.
 */
export function holesAfter(v, indices, steps) {
  const last = steps.length ? Number(steps[steps.length - 1]) : -Infinity;
  const out = new Map();
  for (const row of v.snapshots) {
    if (row.step <= last || !row.detail) continue;
    for (const i of indices)
      if (!row.detail.has(i) && !out.has(i)) out.set(i, Number.isFinite(last) ? last : row.step - 1);
  }
  return out;
}
