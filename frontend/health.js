// The health line under the top bar: in words, what the run is doing and where, with the
// tensor or group it names one click away (the same opening as a click in Worst now).
// Read from the shown state each frame, redrawn only when what it says changed:
//   - NaN/Inf: the newest row's worst-now list leads with the origin (server/live/worst.py:
//     the tensor that went non-finite first, `since`, and what rose before it, `before`);
//   - paused, and by which rule where a pausing rule fired at the step it holds at;
//   - a spike event (the flight recorder's detector) in the last SPIKE_RECENT steps;
//   - the loss rising: its moving average, above its recent minimum by RISE, for K steps;
//   - a tensor far from its own recent values (worst now, |z| >= FAR);
//   - else healthy, saying what was checked.
// Also the note a chart shows when the newest step has nothing it can draw (nonfiniteNote).

import { eventStep } from "./describe.js";
import { fmt, h, num, plotlyText } from "./util.js";

const SPIKE_RECENT = 20; // steps a spike event is told for
const FAR = 8; // a worst-now |z| at least this: "far from its recent values"
const RISE = 1.25; // the loss's moving average this much above its recent minimum: rising
const RISE_STEPS = 5; // ... for at least this many steps
const LOSS_WINDOW = 300; // loss points looked at
const EMA = 0.1; // the moving average's weight of each new point
const STAT_WORDS = { grad_norm_raw: "norm", update_ratio: "update ratio" };

/** The origin of a non-finite row: {param (name), since, before, value} or null (all finite). */
export function nonfiniteOrigin(state, row = state.latest) {
  const list = (row && row.worst) || [];
  const w = list.find((e) => e.z === "inf" && state.params[e.param] !== undefined);
  if (!w) return null;
  return {
    param: state.params[w.param],
    index: w.param,
    since: num(w.since) ?? row.step,
    before: w.before,
    value: w.value,
  };
}

/** The newest row before `row` whose values `ok(row)` says are drawable: its step, or null. */
function lastFinite(state, ok) {
  const rows = state.snapshots;
  for (let k = rows.length - 2; k >= 0; k--) if (ok(rows[k])) return rows[k].step;
  return null;
}

/**
 * The in-chart note of a chart with nothing to draw at a non-finite step, as a Plotly
 * annotation, or null (something to draw, or the step is finite). `drawable`: whether the
 * chart has any value to draw now; `ok(row)`: whether an older row would have had one.
 */
export function nonfiniteNote(state, drawable, ok) {
  const row = state.latest;
  if (drawable || !row) return null;
  const o = nonfiniteOrigin(state, row);
  if (!o) return null;
  const m = lastFinite(state, ok);
  const lines = [
    `step ${row.step} is non-finite: nothing to draw`,
    `first in ${o.param} since step ${o.since}${m === null ? "" : `; last finite step ${m}`}`,
  ];
  return {
    text: lines.map(plotlyText).join("<br>"),
    xref: "paper",
    yref: "paper",
    x: 0.5,
    y: 0.5,
    showarrow: false,
    font: { size: 12, color: "#ff6b81" },
    bgcolor: "rgba(0,0,0,0)",
    name: "nonfinite-note",
  };
}

/** Whether Plotly traces have no point to draw (every y null, or no trace). */
export function drawsNothing(traces) {
  return !traces.some((t) => (t.y || []).some((v) => v !== null && v !== undefined && Number.isFinite(v)));
}

/** Mark a chart element with the note's text (tests and screenshots wait on it), or clear it. */
export function markNote(el, note) {
  const text = note ? note.text.split("<br>").join("; ") : "";
  if ((el.dataset.nonfiniteNote || "") !== text) el.dataset.nonfiniteNote = text;
}

/** The loss rising: {steps, from, to} or null. */
function lossRising(state) {
  const { x, y } = state.loss;
  const start = Math.max(0, x.length - LOSS_WINDOW);
  let ema = null;
  let min = Infinity;
  let minStep = null;
  for (let k = start; k < x.length; k++) {
    const v = y[k];
    if (v === null || !Number.isFinite(v)) continue;
    ema = ema === null ? v : ema + EMA * (v - ema);
    if (ema < min) {
      min = ema;
      minStep = x[k];
    }
  }
  if (ema === null || minStep === null || !(min > 0)) return null;
  const steps = x[x.length - 1] - minStep;
  return ema >= RISE * min && steps >= RISE_STEPS ? { steps, from: min, to: ema } : null;
}

/** The newest spike event of the last SPIKE_RECENT steps in a group (it says where), else the
 * newest one in the loss or the global norm, or null. */
function recentSpike(state) {
  let other = null;
  for (let k = state.events.length - 1; k >= 0; k--) {
    const ev = state.events[k];
    if (ev.kind !== "spike") continue;
    const s = eventStep(ev);
    if (s === null || state.step - s > SPIKE_RECENT) break;
    if (ev.signal === "group" && ev.group) return ev;
    other = other || ev;
  }
  return other;
}

/** The rule that paused the run at the step it holds at: its event, or null. */
function pausingRule(state) {
  const at = num(state.training.step) ?? state.step;
  for (let k = state.events.length - 1; k >= 0; k--) {
    const ev = state.events[k];
    if (ev.kind !== "rule_fired") continue;
    const r = ev.result || {};
    if (ev.action !== "pause" && !r.paused) continue;
    const s = num(ev.at) ?? eventStep(ev);
    return s !== null && Math.abs(at - s) <= 1 ? ev : null;
  }
  return null;
}

/** A tensor to open for group `name`: its member that leads worst now, else its first one. */
function groupLead(state, name) {
  const G = state.groups;
  const g = G ? G.names.indexOf(name) : -1;
  if (g < 0) return null;
  const members = new Set(G.members[g]);
  const w = ((state.latest && state.latest.worst) || []).find((e) => members.has(e.param));
  const i = w ? w.param : G.members[g][0];
  return state.params[i] ?? null;
}

export class HealthLine {
  /** @param {HTMLElement} el the line; @param {{open: (name) => void}} hooks open a tensor */
  constructor(el, { open }) {
    this.el = el;
    this.open = open;
    this.key = null;
    el.setAttribute("role", "status");
    el.setAttribute("aria-live", "polite");
  }

  link(name, label = name, testid = "health-link") {
    return h(
      "button",
      {
        type: "button",
        class: "link mono",
        title: `${name}: open it`,
        dataset: { testid, param: name },
        onclick: () => this.open(name),
      },
      label,
    );
  }

  /** What the line says: {state, parts: [node or text]}. */
  read(state, live) {
    const row = state.latest;
    if (!row) return { state: "waiting", parts: ["waiting for the first sampled step"] };
    const parts = [];
    let kind = null;
    const o = nonfiniteOrigin(state, row);
    if (o) {
      kind = "nonfinite";
      parts.push(`NaN/Inf since step ${o.since}, first in `, this.link(o.param));
      if (o.before) parts.push(` (rose to z ${fmt(o.before.z, 2)} at step ${o.before.step})`);
    }
    const t = state.training || {};
    let paused = []; // a pause no rule made: said last
    if (live && t.state === "paused") {
      const ev = pausingRule(state);
      if (ev) {
        parts.push(parts.length ? " · " : "", `paused by rule ${ev.rule}`);
        kind = kind || "paused";
      } else paused = [" · paused"];
    }
    const spike = recentSpike(state);
    if (spike && !o) {
      const s = eventStep(spike);
      const where =
        spike.signal === "group" && spike.group
          ? spike.group
          : spike.signal === "loss"
            ? "the loss"
            : "the global norm";
      const lead = spike.signal === "group" ? groupLead(state, spike.group) : null;
      parts.push(
        parts.length ? " · " : "",
        `spike at step ${s} in `,
        lead ? this.link(lead, where, "health-group") : where,
      );
      parts.push(` (z ${fmt(spike.z, 2)})`);
      kind = kind || "spike";
    }
    const rising = o ? null : lossRising(state);
    if (rising) {
      parts.push(
        parts.length ? " · " : "",
        `loss rising for ${rising.steps} steps (${fmt(rising.from)} → ${fmt(rising.to)})`,
      );
      kind = kind || "rising";
    }
    const top = !o && row.worst && row.worst.length ? row.worst[0] : null;
    const z = top ? num(top.z) : null;
    const name = top ? state.params[top.param] : undefined;
    if (z !== null && Math.abs(z) >= FAR && name !== undefined) {
      parts.push(
        parts.length ? " · " : "",
        this.link(name),
        ` ${STAT_WORDS[top.stat] || top.stat} z ${fmt(z, 2)} from its recent values`,
      );
      kind = kind || "far";
    }
    if (!kind) {
      const worst =
        z !== null && name !== undefined ? [" · worst now ", this.link(name), ` z ${fmt(z, 2)}`] : [];
      return {
        state: "healthy",
        parts: [
          `healthy at step ${row.step}: gradients finite, no spike in the last ${SPIKE_RECENT} steps, loss not rising, no tensor beyond z ${FAR}`,
          ...worst,
          ...paused,
        ],
      };
    }
    return { state: kind, parts: [`step ${row.step}: `, ...parts, ...paused] };
  }

  /** Redraw from the shown state (cheap when nothing it reads changed). */
  show(state, live) {
    const row = state.latest;
    const t = state.training || {};
    const key = [
      state.runId,
      row ? row.step : -1,
      state.lastSeq,
      state.events.length,
      state.loss.x.length,
      live ? t.state : "",
      live ? t.step : "",
    ].join("|");
    if (key === this.key) return;
    this.key = key;
    const { state: kind, parts } = this.read(state, live);
    this.el.dataset.state = kind;
    this.el.replaceChildren(
      h("span", { class: "health-dot", "aria-hidden": "true" }),
      h("span", { class: "health-text", dataset: { testid: "health-text" } }, ...parts),
    );
  }
}
