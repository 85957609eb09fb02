// One line of text for each event kind (server/PROTOCOL.md lists them), used by the event
// log and by the hover text of the loss chart's markers.

import { describeRuleEvent } from "./ruletext.js";
import { fmt, num } from "./util.js";

/** A target or module name as shown: the root module's name is "", shown as "(root)". */
export function targetName(name) {
  return name === "" ? "(root)" : name;
}

/** What a `hook_applied` event changed. */
export function describeHookChange(ev) {
  const spec = (Array.isArray(ev.after) ? null : ev.after) || ev.before || {};
  const id = ev.hook_id ? ` ${ev.hook_id}` : "";
  const target = spec.target === undefined || spec.target === null ? "?" : targetName(spec.target);
  const head = `${spec.kind || "hook"}${id} on ${target === "(root)" ? target : `'${target}'`}`;
  switch (ev.action) {
    case "add":
      return `added ${head} ${paramText(spec.params)}`.trim();
    case "remove":
      return `removed ${head}`;
    case "enable":
      return `enabled ${head}`;
    case "disable":
      return `disabled ${head}`;
    case "import": {
      const n = Array.isArray(ev.after) ? ev.after.length : null;
      return `imported a preset${n === null ? "" : ` (${n} hook${n === 1 ? "" : "s"})`}`;
    }
    case "rewind": {
      const n = Array.isArray(ev.after) ? ev.after.length : null;
      return `hooks back to the checkpoint's${n === null ? "" : ` (${n} hook${n === 1 ? "" : "s"})`}`;
    }
    case "update": {
      const changes = diff(ev.before || {}, ev.after || {});
      return `updated ${head}: ${changes || "no visible change"}`;
    }
    default:
      return `${ev.action || "changed"} ${head}`;
  }
}

export function describeNonfinite(ev) {
  const rank = ev.rank !== null && ev.rank !== undefined && ev.rank !== 0 ? ` on rank ${ev.rank}` : "";
  if (ev.param === null && ev.module !== undefined)
    return `non-finite grad_output of module ${ev.module}${rank}`;
  let counts = [ev.nan ? `${ev.nan} NaN` : "", ev.inf ? `${ev.inf} Inf` : ""].filter(Boolean).join(" + ");
  if (!counts && ev.inf === null) {
    // an unsampled step without a guard: told by the norm, not counted (docs/instruments.md#telemetry)
    counts = ev.nan === 0 ? "Inf (or a float32 overflow; not counted)" : "NaN (not counted)";
  }
  const more = num(ev.n_params) > 1 ? ` and ${num(ev.n_params) - 1} more` : "";
  const action = !ev.action_taken || ev.action_taken === "none" ? "no guard" : ev.action_taken;
  return `${counts || "non-finite norm"} in ${ev.param}${more}${rank} · ${action}`;
}

/** Any event, in one line (without its step). */
export function describeEvent(ev) {
  switch (ev.kind) {
    case "hook_applied":
      return describeHookChange(ev);
    case "nonfinite":
      return describeNonfinite(ev);
    case "hook_error":
      return `${ev.hook_id} failed on ${ev.param}: ${ev.message} (hook disabled)`;
    case "step_skipped":
      return `step skipped (${ev.reason})`;
    case "spike":
      return describeSpike(ev);
    case "history_paused":
      return `history recording paused: ${ev.reason}`;
    case "history_resumed":
      return `history recording resumed: ${ev.reason}`;
    case "command":
      return describeCommand(ev);
    case "rule_fired":
    case "rule_failed":
    case "rule_capped":
    case "rule_added":
    case "rule_updated":
    case "rule_removed":
      return describeRuleEvent(ev); // ruletext.js
    default: {
      const text = ev.message ?? ev.reason ?? ev.text;
      if (text !== undefined) return String(text);
      const rest = Object.entries(ev).filter(([k]) => !["seq", "kind", "time", "step"].includes(k));
      return rest.map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ");
    }
  }
}

/** An agent's command (a `command` event from /mcp): the tool, its arguments, its result. */
export function describeCommand(ev) {
  const args = Object.entries(ev.args || {})
    .filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(", ");
  const head = `${ev.what || "command"}${args ? ` (${args})` : ""}`;
  if (ev.result === "ok") return head;
  const detail = Array.isArray(ev.detail)
    ? ev.detail.map((d) => d.msg).join("; ")
    : typeof ev.detail === "string"
      ? ev.detail
      : "";
  return `${head} refused (${ev.status ?? "error"})${detail ? `: ${detail}` : ""}`;
}

/** The step an event belongs to (a hook change: its applied_step). */
export function eventStep(ev) {
  return num(ev.kind === "hook_applied" ? ev.applied_step : ev.step);
}

function paramText(params) {
  const entries = Object.entries(params || {});
  return entries.length ? `(${entries.map(([k, v]) => `${k}=${v}`).join(", ")})` : "";
}

function diff(before, after) {
  const out = [];
  const bp = before.params || {};
  const ap = after.params || {};
  for (const k of new Set([...Object.keys(bp), ...Object.keys(ap)])) {
    if (JSON.stringify(bp[k]) !== JSON.stringify(ap[k])) out.push(`${k} ${bp[k]} → ${ap[k]}`);
  }
  for (const k of ["target", "point", "enabled", "position"]) {
    if (before[k] !== undefined && after[k] !== undefined && before[k] !== after[k]) {
      out.push(`${k} ${before[k]} → ${after[k]}`);
    }
  }
  return out.join(", ");
}

/** A spike event: which signal, how many sigmas, its value against its running mean. */
export function describeSpike(ev) {
  const what = ev.signal === "group" ? `group ${ev.group}` : ev.signal === "grad_norm" ? "‖g‖" : "loss";
  const z = Number(ev.z);
  const sig = Number.isFinite(z) ? `${z.toFixed(1)}σ` : `${ev.z}σ`;
  return `spike: ${what} ${sig} (${fmt(ev.value)}, mean ${fmt(ev.mean)}; threshold ${ev.threshold}σ)`;
}
