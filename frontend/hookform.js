// The add-hook form: kind and point, each described in one line from the kinds'
// schema (its `description` and `point_descriptions`), the target (with the
// matches the server finds for the glob as you type; the root module shows as
// "(root)"), the kind's parameters built from its JSON Schema, and enabled.
// Everything is checked against the schema before it is sent; a target that
// matches nothing is refused here too; a hook identical to an existing one is
// warned about and needs a second click. It posts through the hook panel,
// which updates the list.

import { can, whyNot } from "./capabilities.js";
import { api, errorText } from "./api.js";
import {
  clearDetail,
  constraintHint,
  labelledField,
  makeInput,
  readInput,
  schemaFields,
  setFieldError,
  showDetail,
} from "./fields.js";
import { targetName } from "./describe.js";
import { SELECTORS } from "./selectors.js";
import { debounce, h } from "./util.js";

const ADDABLE_EXCLUDED = new Set(["python"]); // added from Python only
const MAX_TARGET = 256; // the core's MAX_TARGET_LEN (inspector/hooks/targets.py)

export class AddHookForm {
  /**
   * @param {HTMLFormElement} el the form, filled here
   * @param {object} panel the HookPanel (mutate(), readOnly)
   */
  constructor(el, panel) {
    this.el = el;
    this.panel = panel;
    this.kinds = {};
    this.fields = new Map();
    this.kind = h("select", {
      dataset: { testid: SELECTORS.addHookKind },
      name: "kind",
      onchange: () => this.onKind(),
    });
    this.target = h("input", {
      type: "text",
      class: "mono",
      name: "target",
      value: "*",
      spellcheck: false,
      autocomplete: "off",
      placeholder: "glob, e.g. blocks.*.weight",
      dataset: { testid: SELECTORS.addHookTarget },
      oninput: () => this.lookupTargets(),
    });
    this.target.value = "*";
    this.point = h("select", {
      dataset: { testid: SELECTORS.addHookPoint },
      name: "point",
      onchange: () => {
        this.showPointInfo();
        this.lookupTargets();
      },
    });
    this.enabled = h("input", {
      type: "checkbox",
      class: "switch",
      checked: true,
      dataset: { testid: SELECTORS.addHookEnabled },
    });
    this.matches = h("div", { class: "matches", dataset: { testid: SELECTORS.addHookMatches } });
    this.kindInfo = h("div", { class: "field-hint", dataset: { testid: SELECTORS.addHookKindInfo } });
    this.pointInfo = h("div", { class: "field-hint", dataset: { testid: SELECTORS.addHookPointInfo } });
    this.found = null; // {glob, point, matches} of the newest target lookup
    this.confirmed = null; // the spec a duplicate warning was shown for: a second click adds it
    this.paramBox = h("div", { class: "hook-params" });
    this.error = h("div", { class: "row-error", role: "alert", dataset: { testid: SELECTORS.addHookError } });
    this.submit = h(
      "button",
      { type: "submit", class: "btn primary", dataset: { testid: SELECTORS.addHookSubmit } },
      "Add hook",
    );
    const kf = labelledField("kind", this.kind);
    const tf = labelledField("target", this.target);
    tf.wrap.classList.add("wide");
    tf.wrap.append(this.matches);
    const pf = labelledField("point", this.point);
    this.fields.set("kind", kf);
    this.fields.set("target", tf);
    this.fields.set("point", pf);
    el.replaceChildren(
      h("div", { class: "form-grid" }, kf.wrap, pf.wrap),
      h("div", { class: "form-info" }, this.kindInfo, this.pointInfo),
      h("div", { class: "form-grid" }, tf.wrap),
      this.paramBox,
      h(
        "div",
        { class: "form-actions" },
        h("label", { class: "inline" }, this.enabled, " enabled"),
        h("span", { class: "grow" }),
        this.submit,
      ),
      this.error,
    );
    el.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.add();
    });
    this.lookupTargets = debounce(() => this.showMatches(), 150);
  }

  setKinds(kinds) {
    this.kinds = kinds || {};
    const names = Object.keys(this.kinds).filter(
      (k) => !ADDABLE_EXCLUDED.has(k) && !this.kinds[k].python_only,
    );
    const current = this.kind.value;
    this.kind.replaceChildren(...names.map((k) => h("option", { value: k }, k)));
    if (names.includes(current)) this.kind.value = current;
    else if (names.includes("clip_value")) this.kind.value = "clip_value";
    this.onKind();
  }

  setDisabled(on) {
    for (const el of this.el.querySelectorAll("input, select, button")) el.disabled = on;
  }

  onKind() {
    const schema = this.kinds[this.kind.value] || { properties: {} };
    const points = schema.points || ["pre_step"];
    const prevPoint = this.point.value;
    this.point.replaceChildren(...points.map((p) => h("option", { value: p }, p)));
    if (points.includes(prevPoint)) this.point.value = prevPoint;
    this.kindInfo.textContent = schema.description || "";
    this.showPointInfo();
    this.paramBox.replaceChildren();
    for (const key of [...this.fields.keys()]) if (key.startsWith("params.")) this.fields.delete(key);
    const required = new Set(schema.required || []);
    for (const [name, prop] of schemaFields(schema)) {
      const input = makeInput(name, prop, prop.default);
      const f = labelledField(required.has(name) ? `${name} *` : name, input, null);
      f.wrap.title = [prop.description, constraintHint(prop)].filter(Boolean).join(" · ");
      f.required = required.has(name);
      f.prop = prop;
      this.fields.set(`params.${name}`, f);
      this.paramBox.append(f.wrap);
    }
    if (!schemaFields(schema).length)
      this.paramBox.append(h("span", { class: "muted small" }, "no parameters"));
    this.clearErrors();
    if (this.panel.readOnly) this.setDisabled(true);
    this.lookupTargets();
  }

  showPointInfo() {
    const schema = this.kinds[this.kind.value] || {};
    const info = schema.point_descriptions || {};
    this.pointInfo.textContent = info[this.point.value] || "";
  }

  async showMatches() {
    const glob = this.target.value;
    const point = this.point.value;
    this.found = null;
    if (!glob || !can("targets")) {
      // (a replay has no live model to match a glob against: nothing is asked)
      this.matches.className = "matches";
      this.matches.textContent = glob ? whyNot("targets") : "";
      return;
    }
    const res = await api.targets(glob, point);
    if (glob !== this.target.value || point !== this.point.value) return; // a newer lookup is on its way
    if (!res.ok) {
      this.matches.className = "matches none";
      this.matches.textContent = errorText(res);
      return;
    }
    const m = res.data.matches || [];
    this.found = { glob, point, matches: m };
    this.matches.className = m.length ? "matches" : "matches none";
    this.matches.title = m.map(targetName).join("\n");
    if (!m.length) {
      this.matches.textContent = "matches nothing";
      return;
    }
    const shown = m.slice(0, 4).map(targetName).join(", ");
    this.matches.textContent = `${m.length} match${m.length === 1 ? "" : "es"}: ${shown}${m.length > 4 ? ", …" : ""}`;
  }

  clearErrors() {
    clearDetail(this.fields, this.error);
    this.error.classList.remove("warn");
  }

  /** The server's matches for a glob at a point (the newest lookup when it is that one); null when unknown. */
  async matchesOf(glob, point) {
    if (this.found && this.found.glob === glob && this.found.point === point) return this.found.matches;
    if (!can("targets")) return null;
    const res = await api.targets(glob, point);
    return res.ok ? res.data.matches || [] : null;
  }

  /** An existing hook with the same kind, point, target and parameters (defaults filled in), or null. */
  identical(spec) {
    const schema = this.kinds[spec.kind] || {};
    const withDefaults = (params) => {
      const out = {};
      for (const [name, prop] of schemaFields(schema))
        out[name] = params && params[name] !== undefined ? params[name] : prop.default;
      return JSON.stringify(out);
    };
    const want = withDefaults(spec.params);
    for (const hook of this.panel.state.hooks.values()) {
      if (hook.kind === spec.kind && hook.point === spec.point && hook.target === spec.target)
        if (withDefaults(hook.params) === want) return hook;
    }
    return null;
  }

  async add() {
    this.clearErrors();
    const params = {};
    let bad = false;
    for (const [key, f] of this.fields) {
      if (!key.startsWith("params.")) continue;
      const r = readInput(f.prop, f.input, f.required);
      if (r.error) {
        setFieldError(f, r.error);
        bad = true;
      } else if (!r.skip) params[key.slice(7)] = r.value;
    }
    const spec = {
      kind: this.kind.value,
      target: this.target.value.trim(),
      point: this.point.value,
      params,
      enabled: this.enabled.checked,
    };
    const tf = this.fields.get("target");
    if (!spec.target) {
      setFieldError(tf, "required");
      bad = true;
    } else if (spec.target.length > MAX_TARGET) {
      setFieldError(tf, `at most ${MAX_TARGET} characters`);
      bad = true;
    } else {
      const m = await this.matchesOf(spec.target, spec.point);
      if (m !== null && !m.length) {
        setFieldError(tf, `'${spec.target}' matches nothing at ${spec.point}`);
        bad = true;
      }
    }
    if (bad) return;
    const same = this.identical(spec);
    const key = JSON.stringify(spec);
    if (same && this.confirmed !== key) {
      this.confirmed = key;
      this.error.classList.add("warn");
      this.error.textContent = `identical to ${same.id} (same kind, point, target and parameters): press "Add hook" again to add it anyway`;
      return;
    }
    this.confirmed = null;
    this.submit.disabled = true;
    const detail = await this.panel.mutate(api.addHook(spec));
    this.submit.disabled = this.panel.readOnly;
    if (detail) showDetail(this.fields, this.error, detail);
  }
}
