// Rules (inspector/rules.py) as text: a rule's condition and action, and each rule_* event
// (server/PROTOCOL.md) as a sentence with rounded numbers, for the event log, the loss chart's
// markers and the Rules panel (rules.js).

import { fmt, num } from "./util.js";

/** A rule's name as shown: its id, and its name when it has one. */
export function ruleName(r) {
  const id = r.rule ?? r.id ?? "?";
  return r.name ? `${id} “${r.name}”` : String(id);
}

/** "nonfinite > 0", "loss is non-finite" (a definition or a firing: signal, op, threshold). */
export function conditionText(r) {
  if (r.op === "is_nonfinite") return `${r.signal} is NaN/Inf`;
  return `${r.signal} ${r.op} ${fmt(r.threshold)}`;
}

/** An action with its arguments in short: "rewind_skip (min 0 steps back, else pause)". */
export function actionText(action, args) {
  const a = args || {};
  switch (action) {
    case "rewind_skip": {
      const back = num(a.min_steps) ? `≥ ${a.min_steps} steps back` : "newest checkpoint";
      return `rewind & skip (${back}${a.fallback === "pause" ? ", else pause" : ""})`;
    }
    case "clip_norm":
      return `clip_norm at p${fmt((num(a.quantile) ?? 0.99) * 100)} of ‖g‖${a.target && a.target !== "*" ? ` on '${a.target}'` : ""}`;
    case "add_hook":
      return `add ${a.kind || "hook"} on '${a.target ?? "*"}'${paramsText(a.params)}`;
    case "update_hook":
      return `update ${a.hook_id ?? "?"}${paramsText(a.params)}`;
    case "enable_hook":
    case "disable_hook":
      return `${action === "enable_hook" ? "enable" : "disable"} ${a.hook_id ?? "?"}`;
    case "checkpoint":
      return a.label ? `checkpoint “${a.label}”` : "checkpoint";
    case "end_shadow":
      return "end the comparison";
    default:
      return String(action);
  }
}

function paramsText(params) {
  const e = Object.entries(params || {});
  return e.length ? ` (${e.map(([k, v]) => `${k}=${typeof v === "number" ? fmt(v) : v}`).join(", ")})` : "";
}

/** What a fired rule's action did (`result` of a rule_fired event). */
export function resultText(ev) {
  const r = ev.result;
  const a = ev.args || {};
  switch (ev.action) {
    case "alert":
      return "alert";
    case "pause":
      return "paused training";
    case "checkpoint":
      return r && r.checkpoint ? `checkpoint ${r.checkpoint} requested` : "checkpoint requested";
    case "add_hook":
      return r && r.hook_id ? `added hook ${r.hook_id}` : "added a hook";
    case "update_hook":
      return `updated hook ${a.hook_id ?? "?"}`;
    case "enable_hook":
    case "disable_hook":
      return `${ev.action === "enable_hook" ? "enabled" : "disabled"} hook ${a.hook_id ?? "?"}`;
    case "clip_norm": {
      if (!r) return "clip_norm";
      const q = num(a.quantile);
      const from = q !== null && num(a.window) ? ` (p${fmt(q * 100)} of ${a.window} sampled ‖g‖)` : "";
      return `${r.updated ? "updated" : "added"} clip_norm ${r.hook_id ?? ""} at max_norm ${fmt(r.max_norm)}${from}`;
    }
    case "rewind_skip":
      if (r && r.rewound)
        return `rewound to checkpoint ${r.checkpoint} (step ${r.step}), the batches since it skipped`;
      if (r && r.paused) return `paused: ${r.reason || "no checkpoint to rewind to"}`;
      return "rewind";
    case "end_shadow":
      return "ended the comparison";
    default:
      return r === null || r === undefined ? String(ev.action) : `${ev.action}: ${JSON.stringify(r)}`;
  }
}

/** The value that fired a rule against its condition: "nonfinite 6 (> 0)". */
export function firedByText(ev) {
  const cond = ev.op === "is_nonfinite" ? "NaN/Inf" : `${ev.op} ${fmt(ev.threshold)}`;
  return `${ev.signal} ${fmt(ev.value)} (${cond})`;
}

/** A rule_* event in one line (without its step). */
export function describeRuleEvent(ev) {
  switch (ev.kind) {
    case "rule_fired":
      return `rule ${ruleName(ev)} fired on ${firedByText(ev)} → ${resultText(ev)}`;
    case "rule_failed":
      return (
        `rule ${ruleName(ev)} failed on ${firedByText(ev)}: ${actionText(ev.action, ev.args)} refused: ` +
        `${ev.reason}${ev.disabled ? " (the rule disabled itself)" : ""}`
      );
    case "rule_capped":
      return `rule ${ev.rule}: ${ev.message}`;
    case "rule_added":
    case "rule_updated": {
      const d = ev.rule || {};
      const verb = ev.kind === "rule_added" ? "added" : "updated";
      const k = num(d.for_steps) > 1 ? ` for ${d.for_steps} steps` : "";
      const off = d.enabled === false ? " (disabled)" : "";
      return `rule ${ruleName(d)} ${verb}: when ${conditionText(d)}${k} → ${actionText(d.action, d.args)}${off}`;
    }
    case "rule_removed":
      return `rule ${ruleName(ev.rule || {})} removed`;
    default:
      return null;
  }
}

/** A firing's hover on the loss chart: the rule, the values that fired it, the action, its result. */
export function firingLines(ev) {
  const at = num(ev.at) !== null && num(ev.at) !== num(ev.step) ? ` (acted at ${ev.at})` : "";
  const lines = [
    `rule ${ruleName(ev)} ${ev.kind === "rule_failed" ? "failed" : "fired"} at step ${ev.step}${at}`,
    `when ${firedByText(ev)}`,
    `action: ${actionText(ev.action, ev.args)}`,
  ];
  if (ev.kind === "rule_failed")
    lines.push(`refused: ${ev.reason}${ev.disabled ? " · the rule disabled itself" : ""}`);
  else lines.push(`result: ${resultText(ev)}`);
  return lines;
}
