// The distributed card: under DDP or FSDP2 the newest snapshot's `ranks` (PROTOCOL.md) holds,
// per rank, the norm of its local (pre-all-reduce; under FSDP2 its shards') gradients
// (`rank_norm`) and the first parameter it found not finite (`rank_nonfinite`). The card
// shows the world size, each rank's norm with its spread (max / min, and the coefficient of
// variation), a rank whose norm stands out from the others' (a straggler's stale batch, a bad
// shard: a robust z of its norm against the other ranks' median and MAD, flagged past
// FLAG_Z; from three ranks on, two cannot tell which one is off), and a rank that found a
// NaN or Inf; and per group (`group_norm_min`/`group_norm_max` with their ranks), the groups
// whose local norms differ the most across the ranks (max / min), GROUPS_SHOWN of them, so that a
// straggler or a bad shard is named down to the part of the model it shows in. Hidden when the
// snapshot has no per-rank values (one process, or per_rank_stats=False).

import { fmt, h } from "./util.js";

export const FLAG_Z = 3.5; // |robust z| past this flags a rank (Iglewicz and Hoaglin's cut-off)
export const GROUPS_SHOWN = 8; // the groups that differ the most across the ranks, listed

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/**
 * Each rank's robust z against the OTHER ranks: 0.6745 (x - median) / MAD, the MAD floored at
 * 1% of the median (ranks that agree to the last digit would make any difference infinite).
 * null for a rank without a norm, and for every rank below three ranks with a norm.
 */
export function robustZ(norms) {
  const have = norms.filter((v) => typeof v === "number" && Number.isFinite(v));
  return norms.map((x, r) => {
    if (have.length < 3 || typeof x !== "number" || !Number.isFinite(x)) return null;
    const others = norms.filter((v, i) => i !== r && typeof v === "number" && Number.isFinite(v));
    const med = median(others);
    const mad = Math.max(median(others.map((v) => Math.abs(v - med))), 0.01 * Math.abs(med), 1e-30);
    return (0.6745 * (x - med)) / mad;
  });
}

export class RanksCard {
  /** @param {HTMLElement} card the card (hidden until a snapshot has per-rank values) */
  constructor(card) {
    this.card = card;
    this.summary = card.querySelector('[data-testid="ranks-summary"]');
    this.table = card.querySelector('[data-testid="ranks-table"]');
    this.groupsTable = card.querySelector('[data-testid="ranks-groups"]');
    this.shown = null;
  }

  /** Draw the newest row's `ranks` (`params`: the parameter names, for a NaN's name; `groups`:
   * the group names the per-group lists are aligned with). */
  show(row, params, groups = []) {
    const ranks = row && row.ranks;
    const norms = ranks && Array.isArray(ranks.rank_norm) ? ranks.rank_norm : null;
    this.card.hidden = !norms;
    if (!norms || this.shown === row) return;
    this.shown = row;
    const bad = Array.isArray(ranks.rank_nonfinite) ? ranks.rank_nonfinite : [];
    const z = robustZ(norms);
    const vals = norms.filter((v) => typeof v === "number" && Number.isFinite(v));
    const parts = [`world size ${norms.length}`, `step ${row.step}`];
    if (vals.length >= 2) {
      const lo = Math.min(...vals);
      const hi = Math.max(...vals);
      const mean = vals.reduce((a, b) => a + b, 0) / vals.length;
      const sd = Math.sqrt(vals.reduce((a, b) => a + (b - mean) ** 2, 0) / vals.length);
      parts.push(`max / min ${lo > 0 ? fmt(hi / lo) : "∞"}`, `CV ${mean > 0 ? fmt(sd / mean) : "–"}`);
    }
    const flagged = z
      .map((v, r) => (v !== null && Math.abs(v) > FLAG_Z ? r : null))
      .filter((r) => r !== null);
    const nanRanks = bad.map((v, r) => (v === null || v === undefined ? null : r)).filter((r) => r !== null);
    if (flagged.length) parts.push(`rank ${flagged.join(", ")} differs`);
    if (nanRanks.length) parts.push(`NaN/Inf on rank ${nanRanks.join(", ")}`);
    this.summary.textContent = parts.join(" · ");
    const head = h("tr", {}, ...["rank", "‖g‖ local", "robust z", ""].map((t) => h("th", {}, t)));
    const body = norms.map((v, r) => {
      const notes = [];
      if (flagged.includes(r)) notes.push("differs from the other ranks");
      if (nanRanks.includes(r)) notes.push(`NaN/Inf in ${params[bad[r]] ?? `parameter ${bad[r]}`}`);
      return h(
        "tr",
        {
          dataset: {
            rank: String(r),
            flagged: String(flagged.includes(r)),
            nan: String(nanRanks.includes(r)),
          },
          class: notes.length ? "rank-flagged" : null,
        },
        h("td", { class: "name" }, String(r)),
        h("td", {}, v === null || v === undefined ? "–" : fmt(v)),
        h("td", {}, z[r] === null ? "–" : fmt(z[r])),
        h("td", { class: "name" }, notes.join("; ")),
      );
    });
    this.table.replaceChildren(h("thead", {}, head), h("tbody", {}, ...body));
    this.showGroups(ranks, groups);
  }

  /** The groups whose ranks' local norms differ the most (max / min), most first. */
  showGroups(ranks, groups) {
    const lo = Array.isArray(ranks.group_norm_min) ? ranks.group_norm_min : null;
    const hi = Array.isArray(ranks.group_norm_max) ? ranks.group_norm_max : null;
    this.groupsTable.hidden = !lo || !hi || !lo.length;
    if (this.groupsTable.hidden) {
      this.groupsTable.replaceChildren();
      return;
    }
    const ratio = (g) => (lo[g] > 0 ? hi[g] / lo[g] : hi[g] > 0 ? Infinity : 1);
    const order = lo
      .map((_, g) => g)
      .filter((g) => typeof lo[g] === "number" && typeof hi[g] === "number")
      .sort((a, b) => ratio(b) - ratio(a))
      .slice(0, GROUPS_SHOWN);
    const cap =
      lo.length > order.length
        ? `the ${order.length} of ${lo.length} groups whose local norms differ the most across the ranks`
        : "each group's local norm across the ranks";
    const head = h(
      "tr",
      {},
      ...["group", "‖g‖ min (rank)", "‖g‖ max (rank)", "max / min"].map((t) => h("th", {}, t)),
    );
    const body = order.map((g) =>
      h(
        "tr",
        { dataset: { group: String(g) } },
        h("td", { class: "name" }, groups[g] ?? `group ${g}`),
        h("td", {}, `${fmt(lo[g])} (${ranks.group_argmin[g]})`),
        h("td", {}, `${fmt(hi[g])} (${ranks.group_argmax[g]})`),
        h("td", {}, Number.isFinite(ratio(g)) ? fmt(ratio(g)) : "∞"),
      ),
    );
    this.groupsTable.replaceChildren(h("caption", {}, cap), h("thead", {}, head), h("tbody", {}, ...body));
  }
}
