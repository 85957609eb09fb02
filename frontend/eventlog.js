// The event log: hook changes, NaN/Inf, hook errors, skipped steps, server
// errors and the page's own connection changes, newest first, capped.

import { describeEvent, eventStep } from "./describe.js";
import { SELECTORS } from "./selectors.js";
import { fmtTime, h } from "./util.js";

const MAX_ITEMS = 300;

const LABELS = {
  hook_applied: ["hook", "hook"],
  nonfinite: ["NaN/Inf", "bad"],
  hook_error: ["hook error", "bad"],
  telemetry_error: ["telemetry", "bad"],
  step_skipped: ["skipped", "warn"],
  spike: ["spike", "warn"],
  history_paused: ["history", "warn"],
  history_resumed: ["history", "info"],
  server_error: ["server", "bad"],
  scenario_reset: ["reset", "warn"],
  training_error: ["training", "bad"],
  connection: ["connection", "info"],
  training: ["training", "info"],
  run: ["run", "info"],
  command: ["agent", "agent"], // an agent's command through /mcp (its `who`)
  rule_fired: ["rule fired", "rule"],
  rule_failed: ["rule failed", "bad"],
  rule_capped: ["rule", "warn"],
  rule_added: ["rule", "info"],
  rule_updated: ["rule", "info"],
  rule_removed: ["rule", "info"],
};

export class EventLog {
  constructor(el) {
    this.el = el;
    this.counts = { bad: 0 };
  }

  clear() {
    this.el.replaceChildren();
  }

  /** A server event ({seq, kind, time, ...}). */
  addServerEvent(ev) {
    this.add(
      ev.kind,
      describeEvent(ev),
      ev.time,
      eventStep(ev),
      typeof ev.param === "string" ? ev.param : null,
    );
  }

  /** A line from the page itself (connection changes and the like). */
  addLocal(kind, text) {
    this.add(kind, text, Date.now() / 1000, null);
  }

  /** A line; `tensor`: the tensor it names (a click opens it: `data-tensor`, tensorpanel.js). */
  add(kind, text, time, step, tensor = null) {
    const [label, tone] = LABELS[kind] || [kind, "info"];
    const item = h(
      "li",
      { class: `event ${tone}`, dataset: { testid: SELECTORS.eventItem, kind } },
      h("span", { class: "event-time" }, fmtTime(time)),
      h("span", { class: `event-badge ${tone}` }, label),
      h(
        "span",
        { class: "event-text" },
        step !== null && step !== undefined ? h("span", { class: "event-step" }, `step ${step}`) : null,
        text,
      ),
    );
    if (tensor) {
      item.dataset.tensor = tensor;
      item.title = `click to open ${tensor}`;
    }
    // Newest first by time: backfilled history lands below what is already shown.
    item.dataset.time = String(time ?? 0);
    let before = this.el.firstElementChild;
    while (before && Number(before.dataset.time) > (time ?? 0)) before = before.nextElementSibling;
    this.el.insertBefore(item, before);
    while (this.el.childElementCount > MAX_ITEMS) this.el.lastElementChild.remove();
  }
}
