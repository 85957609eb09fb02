// The Rules panel (inspector/rules.py; docs/rules-and-agents.md): one row per rule (its
// condition, action and cooldown, whether it is enabled, how often it fired and what its last
// firing did, its failures and why), an enable toggle and a remove button, the shipped presets
// as one-click buttons with a line each, and a small add form (signal, op, threshold, for K
// steps, cooldown, an action with the fields it needs). The server validates: a 422's reason is
// shown beside the field it names, and nothing is added. The list is GET /api/rules, fetched
// again on every rule_* event of the live run; an earlier run (or a replay, whose server lists
// no rules) is shown from its history's rule_* events, read-only: no editing controls then.

import { api, detailList, detailText } from "./api.js";
import { labelledField, setFieldError } from "./fields.js";
import { actionText, conditionText, resultText } from "./ruletext.js";
import { SELECTORS } from "./selectors.js";
import { debounce, fmt, h, num } from "./util.js";

/** The shipped presets (inspector/rules.py PRESETS), each in one line. */
export const RULE_PRESETS = {
  "safe overnight": "NaN/Inf → rewind to the newest checkpoint, skipping the batches since it (none: pause)",
  "clip on spike": "a spike of ‖g‖ → clip_norm at the p99 of the recent sampled ‖g‖",
};

const OPS = [">", ">=", "<", "<=", "==", "!=", "is_nonfinite"];
const ACTIONS = [
  ["alert", "alert (an event)"],
  ["pause", "pause training"],
  ["checkpoint", "take a checkpoint"],
  ["rewind_skip", "rewind & skip"],
  ["clip_norm", "clip_norm at a quantile"],
  ["add_hook", "add a hook"],
  ["update_hook", "update a hook"],
  ["enable_hook", "enable a hook"],
  ["disable_hook", "disable a hook"],
  ["end_shadow", "end the comparison (demo)"],
];
// What each action needs (its `args`): text, a number, a select, a hook, a hook kind, JSON.
const ARGS = {
  checkpoint: [{ name: "label", type: "text", placeholder: "rule" }],
  rewind_skip: [
    { name: "min_steps", label: "min steps back", type: "number", value: "0" },
    {
      name: "fallback",
      label: "no checkpoint",
      type: "select",
      options: [
        ["pause", "pause"],
        ["", "fail"],
      ],
    },
  ],
  clip_norm: [
    { name: "quantile", type: "number", value: "0.99" },
    { name: "target", type: "text", value: "*" },
  ],
  add_hook: [
    { name: "kind", type: "hookkind" },
    { name: "target", type: "text", value: "*" },
    { name: "params", type: "json", value: "{}", placeholder: '{"max_norm": 1.0}', wide: true },
  ],
  update_hook: [
    { name: "hook_id", label: "hook", type: "hook" },
    { name: "params", type: "json", value: "{}", placeholder: '{"max_norm": 1.0}', wide: true },
  ],
  enable_hook: [{ name: "hook_id", label: "hook", type: "hook" }],
  disable_hook: [{ name: "hook_id", label: "hook", type: "hook" }],
};
const SIGNALS = [
  "loss",
  "total_norm",
  "total_norm_raw",
  "nonfinite",
  "spike",
  "spike:loss",
  "spike:grad_norm",
  "update_ratio",
  "noise_scale",
  "step",
];
const NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/;

/** A typed number as a number; anything else as typed, for the server to refuse by name. */
function numberOrText(text) {
  const t = text.trim();
  if (NUMBER.test(t) && Number.isFinite(Number(t))) return Number(t);
  return t;
}

/** The fields that define a rule (`POST /api/rules` takes them): all but its id and state. */
export function ruleDefinition(rule) {
  const { id: _id, state: _state, ...definition } = rule;
  return definition;
}

/**
 * The rules an earlier run had, from its rule_* events (in order): definitions from
 * rule_added/rule_updated/rule_removed, counts and the last firing from rule_fired/rule_failed.
 */
export function rulesFromEvents(events) {
  const rules = new Map();
  for (const ev of events || []) {
    if (!ev.kind || !ev.kind.startsWith("rule_")) continue;
    if (ev.kind === "rule_added" || ev.kind === "rule_updated") {
      const d = ev.rule || {};
      const before = rules.get(d.id);
      rules.set(d.id, { ...d, state: before ? before.state : { fired: 0, failures: 0 } });
    } else if (ev.kind === "rule_removed") {
      rules.delete((ev.rule || {}).id);
    } else if (ev.kind === "rule_fired" || ev.kind === "rule_failed") {
      // a rule added on a branch a rewind abandoned: its firing says what it was
      if (!rules.has(ev.rule)) {
        const { signal, op, threshold, action, args, name } = ev;
        rules.set(ev.rule, {
          id: ev.rule,
          ...{ name, signal, op, threshold, action, args },
          enabled: true,
          state: { fired: 0, failures: 0 },
        });
      }
      const r = rules.get(ev.rule);
      if (ev.kind === "rule_fired") {
        r.state = { ...r.state, fired: r.state.fired + 1, failures: 0, last_fired: ev.step, last_firing: ev };
      } else {
        r.state = { ...r.state, failures: r.state.failures + 1 };
        if (ev.disabled) r.enabled = false;
      }
    }
  }
  return [...rules.values()];
}

const STATE_REFRESH_MS = 3000; // the live rules' evaluation state: fetched at most this often

/** The newest rule_failed event of each rule in `events`: rule id -> event. */
function lastFailures(events) {
  const out = new Map();
  for (const ev of events || []) if (ev.kind === "rule_failed") out.set(ev.rule, ev);
  return out;
}

export class RulesPanel {
  /**
   * @param {HTMLElement} card the Rules card (filled here)
   * @param {object} ctx {view, live}: the DashboardState shown, the live run's
   */
  constructor(card, ctx) {
    this.card = card;
    this.ctx = ctx;
    this.rules = [];
    this.readOnly = false;
    this.gen = 0; // the newest load: an older answer is dropped
    this.rows = new Map(); // id -> RuleRow
    this.list = h("ul", { class: "rule-list empty", dataset: { testid: SELECTORS.ruleList } });
    this.presetBox = h("div", { class: "rule-presets" });
    this.presetError = h("div", {
      class: "row-error",
      role: "alert",
      dataset: { testid: SELECTORS.rulePresetError },
    });
    this.form = new AddRuleForm(this);
    this.details = h("details", { class: "add-rule" }, h("summary", {}, "Add a rule"), this.form.el);
    this.roNote = h("p", { class: "muted small rule-ro", hidden: true });
    this.showPresets(Object.keys(RULE_PRESETS));
    card.append(this.list, this.roNote, this.presetBox, this.presetError, this.details);
    this.reload = debounce(() => this.load(), 120);
    this.stepLoad = 0; // when a step last had the list fetched again (onStep)
  }

  /**
   * A step of the live run went by: the rules are fetched again (at most every few seconds,
   * while there are some), for each one's evaluation state: the last step evaluated, its value
   * and streak, or why none was yet.
   */
  onStep() {
    if (!this.rules.length || this.ctx.view() !== this.ctx.live()) return;
    const now = Date.now();
    if (now - this.stepLoad < STATE_REFRESH_MS) return;
    this.stepLoad = now;
    this.reload();
  }

  /** The live run's rules (GET /api/rules), or those the shown run's events record. */
  async load() {
    const v = this.ctx.view();
    const live = this.ctx.live();
    const gen = ++this.gen;
    let rules = null;
    if (v === live) {
      const res = await api.rules();
      if (gen !== this.gen) return;
      if (res.ok && res.data) {
        rules = res.data.rules || [];
        const names = Object.keys(res.data.presets || {});
        if (names.length) this.showPresets(names);
      }
      // a replay's server holds no rules: its history's events tell what they were
      if (rules === null || (!rules.length && live.readOnly)) rules = rulesFromEvents(v.events);
    } else {
      rules = rulesFromEvents(v.events);
    }
    this.rules = rules;
    this.render();
  }

  /** A rule_* event of the live run: the list is fetched again (once for a burst). */
  onEvent(ev) {
    if (!ev.kind || !ev.kind.startsWith("rule_")) return;
    if (this.ctx.view() === this.ctx.live()) this.reload();
  }

  setReadOnly(on, historical = false) {
    this.readOnly = on;
    this.details.hidden = on;
    this.presetBox.hidden = on;
    this.presetError.hidden = on;
    this.roNote.hidden = !on;
    this.roNote.textContent = historical
      ? "an earlier run: its rules as its history recorded them"
      : this.ctx.live().readOnly
        ? "read-only: rules cannot be changed here"
        : "disconnected: rules can be changed once the page is back online";
    for (const row of this.rows.values()) row.setReadOnly(on);
  }

  showPresets(names) {
    const buttons = names.map((name) =>
      h(
        "button",
        {
          type: "button",
          class: "btn",
          dataset: { testid: SELECTORS.rulePreset, preset: name },
          title: `add the rules of the "${name}" preset`,
          onclick: (ev) => this.addPreset(name, ev.currentTarget),
        },
        `+ ${name}`,
      ),
    );
    // one line each: what the preset does
    const lines = names.map((name) =>
      h("li", {}, h("b", {}, name), ": ", RULE_PRESETS[name] || "a preset of the server's"),
    );
    this.presetBox.replaceChildren(
      h("div", { class: "preset-buttons" }, h("span", { class: "small muted" }, "presets"), ...buttons),
      h("ul", { class: "rule-preset-info" }, ...lines),
    );
  }

  async addPreset(name, button) {
    this.presetError.textContent = "";
    button.disabled = true;
    const res = await api.addRule({ preset: name });
    button.disabled = false;
    if (!res.ok) this.presetError.textContent = detailList(res.data).map(detailText).join("; ");
    this.reload();
  }

  render() {
    const failures = lastFailures(this.ctx.view().events);
    const seen = new Set();
    let prev = null;
    for (const rule of this.rules) {
      seen.add(rule.id);
      let row = this.rows.get(rule.id);
      if (!row) {
        row = new RuleRow(this);
        this.rows.set(rule.id, row);
      }
      row.update(rule, failures.get(rule.id));
      row.setReadOnly(this.readOnly);
      const want = prev ? prev.el.nextSibling : this.list.firstChild;
      if (want !== row.el) this.list.insertBefore(row.el, want);
      prev = row;
    }
    for (const [id, row] of this.rows) {
      if (!seen.has(id)) {
        row.el.remove();
        this.rows.delete(id);
      }
    }
    this.list.classList.toggle("empty", this.rows.size === 0);
    this.form.refresh();
  }
}

/** One rule: name, condition → action, cooldown; fired count and last firing; failures; toggle, remove. */
class RuleRow {
  constructor(panel) {
    this.panel = panel;
    this.rule = null;
    this.toggle = h("input", {
      type: "checkbox",
      class: "switch",
      title: "enabled",
      dataset: { testid: SELECTORS.ruleToggle },
      onchange: () => this.send({ enabled: this.toggle.checked }),
    });
    this.removeBtn = h(
      "button",
      {
        class: "icon-btn danger",
        title: "remove this rule",
        "aria-label": "remove rule",
        dataset: { testid: SELECTORS.ruleRemove },
        onclick: () => this.remove(),
      },
      "✕",
    );
    this.idEl = h("span", { class: "rule-id mono" });
    this.nameEl = h("span", { class: "rule-name" });
    this.stateEl = h("span", { class: "rule-state" });
    this.when = h("div", { class: "rule-when mono" });
    this.fired = h("div", { class: "rule-fired", dataset: { testid: SELECTORS.ruleFired } });
    this.evaluated = h("div", {
      class: "rule-evaluated small muted",
      dataset: { testid: SELECTORS.ruleEvaluated },
    });
    this.failed = h("div", { class: "rule-failed" });
    this.error = h("div", { class: "row-error", role: "alert", dataset: { testid: SELECTORS.ruleError } });
    this.el = h(
      "li",
      { class: "rule-row", dataset: { testid: SELECTORS.ruleRow } },
      h(
        "div",
        { class: "hook-head" },
        this.idEl,
        this.nameEl,
        this.stateEl,
        h("span", { class: "grow" }),
        this.toggle,
        this.removeBtn,
      ),
      this.when,
      this.fired,
      this.evaluated,
      this.failed,
      this.error,
    );
  }

  update(rule, lastFailure) {
    this.rule = rule;
    const st = rule.state || {};
    this.el.dataset.ruleId = rule.id;
    this.el.dataset.fired = String(num(st.fired) ?? 0);
    this.idEl.textContent = rule.id;
    this.nameEl.textContent = rule.name || "";
    this.toggle.checked = Boolean(rule.enabled);
    this.el.classList.toggle("disabled", !rule.enabled);
    const k = num(rule.for_steps) > 1 ? ` for ${rule.for_steps} steps` : "";
    const cool = rule.cooldown === undefined ? "" : ` · cooldown ${rule.cooldown}`;
    this.when.textContent = `when ${conditionText(rule)}${k} → ${actionText(rule.action, rule.args)}${cool}`;
    this.when.title =
      rule.cooldown === undefined
        ? JSON.stringify(rule.args || {})
        : `cooldown ${rule.cooldown} steps after a firing; at most ${rule.cap} firings per ${rule.window} ` +
          `steps; disables itself after ${rule.max_failures} failures in a row\n${JSON.stringify(rule.args || {})}`;
    const fired = num(st.fired) ?? 0;
    if (!fired) this.fired.textContent = "not fired yet";
    else {
      const last = st.last_firing;
      const what = last ? ` (${last.signal} ${fmt(last.value)}): ${resultText(last)}` : "";
      this.fired.textContent = `fired ${fired}× · last at step ${st.last_fired}${what}`;
    }
    this.fired.title = this.fired.textContent;
    // the evaluation state (a live run's: an earlier run's events do not hold it)
    if (st.waiting) this.evaluated.textContent = `not evaluated yet: ${st.waiting}`;
    else if (st.last_step !== undefined && st.last_step !== null) {
      const streak =
        num(rule.for_steps) > 1 ? ` · ${st.streak ?? 0} of ${rule.for_steps} steps in a row` : "";
      this.evaluated.textContent = `last evaluated: step ${st.last_step}, ${rule.signal} ${fmt(st.last_value)}${streak}`;
    } else this.evaluated.textContent = "";
    this.evaluated.title = this.evaluated.textContent;
    const failures = num(st.failures) ?? 0;
    const selfOff = !rule.enabled && lastFailure && lastFailure.disabled;
    const why = lastFailure ? `: ${lastFailure.reason}` : "";
    this.stateEl.textContent = rule.enabled ? "" : selfOff ? "off: failed" : "off";
    if (selfOff) this.failed.textContent = `disabled itself after ${failures || "repeated"} failures${why}`;
    else if (failures) {
      const of = rule.max_failures === undefined ? "" : ` of ${rule.max_failures}`;
      this.failed.textContent = `failed ${failures}${of} in a row${why}`;
    } else this.failed.textContent = "";
  }

  setReadOnly(on) {
    this.toggle.hidden = on;
    this.removeBtn.hidden = on;
  }

  async send(patch) {
    this.error.textContent = "";
    const res = await api.updateRule(this.rule.id, patch);
    if (!res.ok) {
      this.error.textContent = detailList(res.data).map(detailText).join("; ");
      this.toggle.checked = Boolean(this.rule.enabled);
    }
    this.panel.reload();
  }

  async remove() {
    this.error.textContent = "";
    this.removeBtn.disabled = true;
    const res = await api.removeRule(this.rule.id);
    this.removeBtn.disabled = false;
    if (!res.ok && res.status !== 404)
      this.error.textContent = detailList(res.data).map(detailText).join("; ");
    this.panel.reload();
  }
}

/** The add form: signal, op, threshold, for K, cooldown, action and its arguments, a name. */
class AddRuleForm {
  constructor(panel) {
    this.panel = panel;
    this.fields = new Map(); // "signal" | "threshold" | "args.<name>" ... -> field
    this.signals = h("datalist", { id: "rule-signals" });
    const text = (name, value, testid, extra = {}) =>
      h("input", {
        type: "text",
        name,
        value,
        autocomplete: "off",
        spellcheck: false,
        dataset: { testid },
        ...extra,
      });
    this.signal = text("signal", "loss", SELECTORS.addRuleSignal, { class: "mono", list: "rule-signals" });
    this.signal.value = "loss";
    this.op = h(
      "select",
      { name: "op", dataset: { testid: SELECTORS.addRuleOp }, onchange: () => this.onOp() },
      OPS.map((o) => h("option", { value: o }, o === "is_nonfinite" ? "is NaN/Inf" : o)),
    );
    this.threshold = text("threshold", "", SELECTORS.addRuleThreshold, { inputmode: "decimal" });
    this.forSteps = text("for_steps", "1", SELECTORS.addRuleFor, { inputmode: "numeric" });
    this.forSteps.value = "1";
    this.cooldown = text("cooldown", "10", SELECTORS.addRuleCooldown, { inputmode: "numeric" });
    this.cooldown.value = "10";
    this.action = h(
      "select",
      { name: "action", dataset: { testid: SELECTORS.addRuleAction }, onchange: () => this.onAction() },
      ACTIONS.map(([v, label]) => h("option", { value: v }, label)),
    );
    this.name = text("name", "", "add-rule-name", { placeholder: "optional" });
    this.argBox = h("div", { class: "form-grid" });
    this.error = h("div", { class: "row-error", role: "alert", dataset: { testid: SELECTORS.addRuleError } });
    this.submit = h(
      "button",
      { type: "submit", class: "btn primary", dataset: { testid: SELECTORS.addRuleSubmit } },
      "Add rule",
    );
    const field = (key, label, input, wide = false) => {
      const f = labelledField(label, input);
      if (wide) f.wrap.classList.add("wide");
      this.fields.set(key, f);
      return f.wrap;
    };
    this.el = h(
      "form",
      { dataset: { testid: SELECTORS.addRuleForm }, autocomplete: "off", novalidate: true },
      this.signals,
      h(
        "div",
        { class: "form-grid" },
        field("signal", "signal", this.signal, true),
        field("op", "op", this.op),
        field("threshold", "threshold", this.threshold),
        field("for_steps", "for K steps", this.forSteps),
        field("cooldown", "cooldown", this.cooldown),
      ),
      h("div", { class: "form-grid" }, field("action", "then", this.action, true)),
      this.argBox,
      h(
        "div",
        { class: "form-actions" },
        h("div", { class: "grow" }, field("name", "name", this.name)),
        this.submit,
      ),
      this.error,
    );
    this.el.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.add();
    });
    this.onAction();
  }

  /** The signals offered (the server takes any it knows, norm:<param> ... too) and the hooks. */
  refresh() {
    const v = this.panel.ctx.view();
    const names = [...SIGNALS, ...(v.params || []).slice(0, 8).map((p) => `norm:${p}`)];
    this.signals.replaceChildren(...names.map((s) => h("option", { value: s })));
    for (const f of this.fields.values()) if (f.refresh) f.refresh();
  }

  onOp() {
    const none = this.op.value === "is_nonfinite";
    this.threshold.disabled = none;
    if (none) this.threshold.value = "";
  }

  onAction() {
    for (const key of [...this.fields.keys()]) if (key.startsWith("args.")) this.fields.delete(key);
    this.argBox.replaceChildren();
    for (const spec of ARGS[this.action.value] || []) {
      const input = this.argInput(spec);
      const f = labelledField(spec.label || spec.name, input);
      if (spec.wide) f.wrap.classList.add("wide");
      f.spec = spec;
      if (spec.type === "hook" || spec.type === "hookkind") f.refresh = () => this.fillOptions(spec, input);
      this.fields.set(`args.${spec.name}`, f);
      this.argBox.append(f.wrap);
    }
    this.clearErrors();
  }

  argInput(spec) {
    const testid = `rule-arg-${spec.name}`;
    if (spec.type === "select")
      return h(
        "select",
        { name: spec.name, dataset: { testid } },
        spec.options.map(([v, label]) => h("option", { value: v }, label)),
      );
    if (spec.type === "hook" || spec.type === "hookkind") {
      const sel = h("select", { name: spec.name, dataset: { testid } });
      sel.addEventListener("focus", () => this.fillOptions(spec, sel)); // the hooks of now
      this.fillOptions(spec, sel);
      return sel;
    }
    const input = h("input", {
      type: "text",
      name: spec.name,
      autocomplete: "off",
      spellcheck: false,
      placeholder: spec.placeholder || "",
      class: spec.type === "json" ? "mono" : null,
      dataset: { testid },
    });
    input.value = spec.value || "";
    return input;
  }

  fillOptions(spec, sel) {
    const v = this.panel.ctx.view();
    const current = sel.value;
    let opts;
    if (spec.type === "hook")
      opts = [...v.hooks.values()].map((x) => [x.id, `${x.id} · ${x.kind} on '${x.target}'`]);
    else
      opts = Object.entries(v.hookKinds || {})
        .filter(([k, s]) => k !== "python" && !s.python_only)
        .map(([k]) => [k, k]);
    sel.replaceChildren(...opts.map(([val, label]) => h("option", { value: val }, label)));
    if (opts.some(([val]) => val === current)) sel.value = current;
    else if (spec.type === "hookkind" && opts.some(([val]) => val === "clip_norm")) sel.value = "clip_norm";
  }

  clearErrors() {
    for (const f of this.fields.values()) setFieldError(f, "");
    this.error.textContent = "";
  }

  /** The rule as typed: numbers as numbers, anything else as typed (the server names what is wrong). */
  read() {
    const rule = {
      signal: this.signal.value.trim(),
      op: this.op.value,
      action: this.action.value,
    };
    if (this.op.value !== "is_nonfinite") {
      const t = this.threshold.value.trim();
      rule.threshold = t === "" ? null : numberOrText(t);
    }
    for (const [key, input] of [
      ["for_steps", this.forSteps],
      ["cooldown", this.cooldown],
    ]) {
      if (input.value.trim() !== "") rule[key] = numberOrText(input.value);
    }
    if (this.name.value.trim()) rule.name = this.name.value.trim();
    const args = {};
    let bad = false;
    for (const [key, f] of this.fields) {
      if (!key.startsWith("args.")) continue;
      const spec = f.spec;
      const raw = f.input.value;
      if (spec.type === "json") {
        try {
          const v = JSON.parse(raw.trim() || "{}");
          if (v === null || typeof v !== "object" || Array.isArray(v)) throw new Error("an object, {…}");
          args[spec.name] = v;
        } catch (e) {
          setFieldError(f, `not a JSON object: ${e.message}`);
          bad = true;
        }
      } else if (spec.type === "number") {
        if (raw.trim() !== "") args[spec.name] = numberOrText(raw);
      } else if (spec.type === "select") {
        args[spec.name] = raw === "" ? null : raw;
      } else if (raw.trim() !== "") {
        args[spec.name] = raw.trim();
      }
    }
    rule.args = args;
    return bad ? null : rule;
  }

  /** The field a server detail names ("threshold", "args.params.max_norm" -> "args.params"), or null. */
  fieldFor(loc) {
    const parts = (loc || []).map(String);
    if (parts[0] === "body") parts.shift();
    const key = parts.join(".");
    for (let k = key; k; k = k.includes(".") ? k.slice(0, k.lastIndexOf(".")) : "") {
      if (this.fields.has(k)) return this.fields.get(k);
    }
    return null;
  }

  async add() {
    this.clearErrors();
    const rule = this.read();
    if (!rule) return;
    this.submit.disabled = true;
    const res = await api.addRule(rule);
    this.submit.disabled = false;
    if (res.ok) {
      this.panel.reload();
      return;
    }
    for (const d of detailList(res.data)) {
      const f = this.fieldFor(d.loc);
      if (f) setFieldError(f, d.msg);
      else this.error.textContent = detailText(d);
    }
  }
}
