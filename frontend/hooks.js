// The hook panel: one row per hook (its parameters editable in place, enable
// toggle, remove), the add-hook form and presets. Mutations go over HTTP; the
// rows are redrawn from the store, which the `hooks` messages keep current.
// A hook shows "pending" until the server reports its applied_step.

import { api, detailList } from "./api.js";
import {
  constraintHint,
  labelledField,
  locKey,
  makeInput,
  readInput,
  schemaFields,
  setFieldError,
} from "./fields.js";
import { SELECTORS } from "./selectors.js";
import { debounce, fmt, fmtParam, h } from "./util.js";

const ADDABLE_EXCLUDED = new Set(["python"]); // added from Python only

export class HookPanel {
  /**
   * @param {object} ctx {store, list, form, presets, dialog, log(kind, text), refresh()}
   */
  constructor(ctx) {
    this.ctx = ctx;
    this.store = ctx.store;
    this.rows = new Map(); // id -> HookRow
    this.readOnly = false;
    this.form = new AddHookForm(ctx.form, this);
    this.presets = new Presets(ctx.presets, ctx.dialog, this);
  }

  /** A new session: kinds may differ; every row is rebuilt. */
  resetSession() {
    for (const row of this.rows.values()) row.el.remove();
    this.rows.clear();
    this.form.setKinds(this.store.hookKinds);
    this.render();
  }

  /** `historical`: an earlier run is shown, whose hooks the export routes do not serve. */
  setReadOnly(on, historical = false) {
    this.readOnly = on;
    this.form.setDisabled(on);
    this.presets.setDisabled(on, historical);
    for (const row of this.rows.values()) row.setDisabled(on);
  }

  /** Bring the rows in line with store.hooks (kept in place while being edited). */
  render() {
    const list = this.ctx.list;
    const seen = new Set();
    let prev = null;
    for (const spec of this.store.hooks.values()) {
      seen.add(spec.id);
      let row = this.rows.get(spec.id);
      if (!row) {
        row = new HookRow(spec, this);
        this.rows.set(spec.id, row);
      } else {
        row.update(spec);
      }
      row.setDisabled(this.readOnly);
      const want = prev ? prev.el.nextSibling : list.firstChild;
      if (want !== row.el) list.insertBefore(row.el, want);
      prev = row;
    }
    for (const [id, row] of this.rows) {
      if (!seen.has(id)) {
        row.el.remove();
        this.rows.delete(id);
      }
    }
    list.classList.toggle("empty", this.rows.size === 0);
  }

  /** Per-hook effects of the newest snapshot ({changed, norm_ratio}). */
  showEffects(effects) {
    for (const [id, row] of this.rows) row.showEffect(effects ? effects[id] : null);
  }

  kindSchema(kind) {
    return this.store.hookKinds[kind] || { properties: {} };
  }

  /** A mutation's reply: update the store and the rows, or return the detail. */
  async mutate(promise, { removeId } = {}) {
    const res = await promise;
    if (res.ok) {
      if (removeId !== undefined) this.store.removeHook(removeId);
      else if (res.data && res.data.id) this.store.upsertHook(res.data);
      this.render();
      return null;
    }
    if (res.status === 404 && removeId !== undefined) {
      this.store.removeHook(removeId); // already gone
      this.render();
      return null;
    }
    return detailList(res.data);
  }
}

class HookRow {
  constructor(spec, panel) {
    this.panel = panel;
    this.spec = spec;
    this.fields = new Map(); // "params.x" | "target" -> field
    this.toggle = h("input", {
      type: "checkbox",
      class: "switch",
      title: "enabled",
      dataset: { testid: SELECTORS.hookToggle },
      onchange: () => this.setEnabled(this.toggle.checked),
    });
    this.removeBtn = h(
      "button",
      {
        class: "icon-btn danger",
        title: "remove this hook",
        "aria-label": "remove hook",
        dataset: { testid: SELECTORS.hookRemove },
        onclick: () => this.remove(),
      },
      "✕",
    );
    this.status = h("span", { class: "hook-status", dataset: { testid: SELECTORS.hookStatus } });
    this.effect = h("span", { class: "hook-effect" });
    this.error = h("div", { class: "row-error", dataset: { testid: SELECTORS.hookError }, role: "alert" });
    this.kindEl = h("span", { class: "kind-badge" });
    this.pointEl = h("span", { class: "point-tag" });
    this.paramBox = h("div", { class: "hook-params" });
    this.el = h(
      "li",
      { class: "hook-row", dataset: { testid: SELECTORS.hookRow } },
      h(
        "div",
        { class: "hook-head" },
        this.kindEl,
        this.pointEl,
        this.status,
        h("span", { class: "grow" }),
        this.toggle,
        this.removeBtn,
      ),
      this.paramBox,
      h("div", { class: "hook-foot" }, this.effect),
      this.error,
    );
    this.build(spec);
    this.update(spec);
  }

  build(spec) {
    this.paramBox.replaceChildren();
    this.fields.clear();
    const target = h("input", {
      type: "text",
      class: "mono",
      spellcheck: false,
      autocomplete: "off",
      name: "target",
      dataset: { testid: "hook-target" },
      onchange: () => this.commitTarget(),
      onkeydown: (ev) => ev.key === "Enter" && target.blur(),
    });
    target.value = spec.target;
    const tf = labelledField("target", target);
    tf.wrap.classList.add("wide");
    this.fields.set("target", tf);
    this.paramBox.append(tf.wrap);
    const schema = this.panel.kindSchema(spec.kind);
    const required = new Set(schema.required || []);
    for (const [name, prop] of schemaFields(schema)) {
      const input = makeInput(name, prop, (spec.params || {})[name], {
        onCommit: (n, el) => this.commitParam(n, prop, el, required.has(n)),
      });
      const f = labelledField(name, input, null);
      f.wrap.title = constraintHint(prop);
      this.fields.set(`params.${name}`, f);
      this.paramBox.append(f.wrap);
    }
    this.builtKind = spec.kind;
  }

  update(spec) {
    if (spec.kind !== this.builtKind) this.build(spec);
    const old = this.spec;
    this.spec = spec;
    this.el.dataset.hookId = spec.id;
    this.el.dataset.kind = spec.kind;
    this.kindEl.textContent = spec.kind;
    this.pointEl.textContent = spec.point;
    this.toggle.checked = Boolean(spec.enabled);
    this.el.classList.toggle("disabled", !spec.enabled);
    const pending = spec.applied_step === null || spec.applied_step === undefined;
    this.el.classList.toggle("pending", pending);
    this.el.dataset.pending = pending ? "true" : "false";
    this.status.textContent = pending ? "pending" : `since step ${spec.applied_step}`;
    this.status.title = pending
      ? "accepted by the server; applied at the next step boundary"
      : `first applied to the gradients of step ${spec.applied_step}`;
    // Field values follow the server unless the user is editing that field or
    // it holds a value the server refused (kept so it can be corrected).
    for (const [key, f] of this.fields) {
      const value = key === "target" ? spec.target : (spec.params || {})[key.slice(7)];
      const before = key === "target" ? old.target : (old.params || {})[key.slice(7)];
      if (document.activeElement === f.input) continue;
      if (f.wrap.classList.contains("invalid") && value === before) continue;
      if (f.input.type === "checkbox") f.input.checked = Boolean(value);
      else f.input.value = fmtParam(value);
    }
  }

  setDisabled(on) {
    for (const f of this.fields.values()) f.input.disabled = on || this.spec.kind === "python";
    this.toggle.disabled = on;
    this.removeBtn.disabled = on;
  }

  showEffect(effect) {
    if (!effect || !this.spec.enabled) {
      this.effect.textContent = "";
      return;
    }
    const parts = [];
    if (effect.changed !== undefined && effect.changed !== null) parts.push(`changed ${fmt(effect.changed)}`);
    if (effect.norm_ratio !== undefined && effect.norm_ratio !== null)
      parts.push(`‖g‖ × ${fmt(effect.norm_ratio)}`);
    for (const [k, v] of Object.entries(effect)) {
      if (k !== "changed" && k !== "norm_ratio" && (typeof v === "number" || typeof v === "string"))
        parts.push(`${k} ${fmt(v)}`);
    }
    this.effect.textContent = parts.length ? `last step: ${parts.join(" · ")}` : "";
  }

  clearErrors() {
    for (const f of this.fields.values()) setFieldError(f, "");
    this.error.textContent = "";
  }

  showDetail(detail) {
    for (const d of detail) {
      const f = this.fields.get(locKey(d.loc));
      if (f) setFieldError(f, d.msg);
      else this.error.textContent = d.loc.length ? `${d.loc.join(".")}: ${d.msg}` : d.msg;
    }
  }

  async send(patch) {
    this.clearErrors();
    const detail = await this.panel.mutate(api.updateHook(this.spec.id, patch));
    if (detail) this.showDetail(detail);
    return detail;
  }

  async commitParam(name, prop, input, required) {
    const f = this.fields.get(`params.${name}`);
    const r = readInput(prop, input, required);
    if (r.error) {
      setFieldError(f, r.error);
      return;
    }
    if (r.skip) return;
    await this.send({ params: { [name]: r.value } });
  }

  async commitTarget() {
    const f = this.fields.get("target");
    const value = f.input.value.trim();
    if (!value) {
      setFieldError(f, "required");
      return;
    }
    if (value === this.spec.target) return;
    await this.send({ target: value });
  }

  async setEnabled(on) {
    const detail = await this.send({ enabled: on });
    if (detail) this.toggle.checked = Boolean(this.spec.enabled);
  }

  async remove() {
    this.clearErrors();
    this.removeBtn.disabled = true;
    const detail = await this.panel.mutate(api.removeHook(this.spec.id), { removeId: this.spec.id });
    if (detail) {
      this.removeBtn.disabled = this.panel.readOnly;
      this.showDetail(detail);
    }
  }
}

class AddHookForm {
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
      onchange: () => this.lookupTargets(),
    });
    this.enabled = h("input", {
      type: "checkbox",
      class: "switch",
      checked: true,
      dataset: { testid: SELECTORS.addHookEnabled },
    });
    this.matches = h("div", { class: "matches", dataset: { testid: SELECTORS.addHookMatches } });
    this.paramBox = h("div", { class: "hook-params" });
    this.error = h("div", { class: "row-error", role: "alert", dataset: { testid: "add-hook-error" } });
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
      h("div", { class: "form-grid" }, kf.wrap, pf.wrap, tf.wrap),
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

  async showMatches() {
    const glob = this.target.value;
    if (!glob) {
      this.matches.textContent = "";
      return;
    }
    const res = await api.targets(glob, this.point.value);
    if (glob !== this.target.value) return; // a newer lookup is on its way
    if (!res.ok) {
      this.matches.className = "matches none";
      this.matches.textContent = detailList(res.data)
        .map((d) => d.msg)
        .join("; ");
      return;
    }
    const m = res.data.matches || [];
    this.matches.className = m.length ? "matches" : "matches none";
    this.matches.title = m.join("\n");
    if (!m.length) {
      this.matches.textContent = "matches nothing";
      return;
    }
    const shown = m.slice(0, 4).join(", ");
    this.matches.textContent = `${m.length} match${m.length === 1 ? "" : "es"}: ${shown}${m.length > 4 ? ", …" : ""}`;
  }

  clearErrors() {
    for (const f of this.fields.values()) setFieldError(f, "");
    this.error.textContent = "";
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
    if (bad) return;
    const spec = {
      kind: this.kind.value,
      target: this.target.value.trim(),
      point: this.point.value,
      params,
      enabled: this.enabled.checked,
    };
    this.submit.disabled = true;
    const detail = await this.panel.mutate(api.addHook(spec));
    this.submit.disabled = this.panel.readOnly;
    if (!detail) return;
    for (const d of detail) {
      const f = this.fields.get(locKey(d.loc));
      if (f) setFieldError(f, d.msg);
      else this.error.textContent = d.loc.length ? `${d.loc.join(".")}: ${d.msg}` : d.msg;
    }
  }
}

class Presets {
  constructor(el, dialog, panel) {
    this.panel = panel;
    this.dialog = dialog;
    this.file = h("input", {
      type: "file",
      accept: "application/json,.json",
      hidden: true,
      dataset: { testid: SELECTORS.presetImport },
      onchange: () => this.importFile(),
    });
    this.exportBtn = h(
      "button",
      { class: "btn", dataset: { testid: SELECTORS.presetExport }, onclick: () => this.exportJson() },
      "Export JSON",
    );
    this.pythonBtn = h(
      "button",
      { class: "btn", dataset: { testid: SELECTORS.presetPython }, onclick: () => this.exportPython() },
      "Copy as Python",
    );
    this.importBtn = h(
      "button",
      { class: "btn", dataset: { testid: "preset-import-button" }, onclick: () => this.file.click() },
      "Import…",
    );
    this.message = h("div", { class: "row-error", role: "alert", dataset: { testid: "preset-error" } });
    el.replaceChildren(
      h("div", { class: "preset-buttons" }, this.exportBtn, this.pythonBtn, this.importBtn, this.file),
      this.message,
    );
  }

  setDisabled(on, historical = false) {
    // Exports read (the live hooks); only import changes anything.
    this.importBtn.disabled = on;
    this.file.disabled = on;
    this.exportBtn.disabled = historical;
    this.pythonBtn.disabled = historical;
  }

  async exportJson() {
    const res = await api.exportHooks();
    if (!res.ok) return this.fail(res);
    const text = JSON.stringify(res.data, null, 2);
    this.dialog.show("Hook preset (JSON)", text, { filename: "hooks-preset.json", type: "application/json" });
  }

  async exportPython() {
    const res = await api.exportPython();
    if (!res.ok) return this.fail(res);
    const text = typeof res.data === "string" ? res.data : JSON.stringify(res.data);
    const copied = await copyText(text);
    this.dialog.show(copied ? "Copied to the clipboard" : "Hooks as Python", text, {
      filename: "hooks.py",
      type: "text/x-python",
    });
  }

  async importFile() {
    const file = this.file.files && this.file.files[0];
    this.file.value = "";
    if (!file) return;
    this.message.textContent = "";
    let preset;
    try {
      preset = JSON.parse(await file.text());
    } catch (err) {
      this.message.textContent = `${file.name}: not JSON (${err.message})`;
      return;
    }
    const res = await api.importHooks(preset);
    if (!res.ok) return this.fail(res);
    const hooks = await api.hooks();
    if (hooks.ok) {
      this.panel.store.setHooks(hooks.data);
      this.panel.render();
    }
  }

  fail(res) {
    this.message.textContent = detailList(res.data)
      .map((d) => (d.loc.length ? `${d.loc.join(".")}: ${d.msg}` : d.msg))
      .join("; ");
  }
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false; // not a secure context, or no permission: the dialog shows the text
  }
}

/** The dialog that shows an exported preset with Copy and Download. */
export class PresetDialog {
  constructor(el) {
    this.el = el;
    this.title = h("h3");
    this.text = h("textarea", {
      readonly: true,
      spellcheck: false,
      dataset: { testid: SELECTORS.presetText },
    });
    this.copyBtn = h("button", { class: "btn", onclick: () => this.copy() }, "Copy");
    this.download = h("a", { class: "btn", download: "preset.json" }, "Download");
    el.replaceChildren(
      this.title,
      this.text,
      h(
        "div",
        { class: "form-actions" },
        this.copyBtn,
        this.download,
        h("span", { class: "grow" }),
        h("button", { class: "btn primary", onclick: () => el.close() }, "Close"),
      ),
    );
    this.url = null;
  }

  show(title, text, { filename, type }) {
    this.title.textContent = title;
    this.text.value = text;
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = URL.createObjectURL(new Blob([text], { type }));
    this.download.href = this.url;
    this.download.download = filename;
    if (!this.el.open) this.el.showModal();
  }

  async copy() {
    const ok = await copyText(this.text.value);
    if (!ok) {
      this.text.select();
      document.execCommand("copy");
    }
    this.copyBtn.textContent = "Copied";
    setTimeout(() => (this.copyBtn.textContent = "Copy"), 1200);
  }
}
