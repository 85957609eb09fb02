// The hook panel: one row per hook (its parameters editable in place, enable
// toggle, remove), with the add-hook form (hookform.js) and the presets
// (presets.js) below the list. Mutations go over HTTP and their replies say only
// whether the server accepted them; the rows are redrawn from the dashboard
// state, which the `hooks` messages keep current (one per applied change). A
// hook that the server lists before it is applied shows "pending" until it
// reports its applied_step. An edit is checked
// against the kind's schema (and a target against the server's matches) before
// it is sent; a refused value, in the page or by the server, goes back to the
// value in force, shown beside the reason.

import { api, detailList, detailText } from "./api.js";
import {
  clearDetail,
  constraintHint,
  labelledField,
  makeInput,
  readInput,
  schemaFields,
  locKey,
  setFieldError,
} from "./fields.js";
import { AddHookForm } from "./hookform.js";
import { Presets } from "./presets.js";
import { SELECTORS } from "./selectors.js";
import { fmt, fmtParam, h } from "./util.js";

export class HookPanel {
  /**
   * @param {object} ctx {state, list, form, presets, dialog}: the DashboardState
   *   shown, the hook list's <ul>, the add-hook <form>, the presets' container
   *   and the PresetDialog
   */
  constructor(ctx) {
    this.ctx = ctx;
    this.state = ctx.state;
    this.rows = new Map(); // id -> HookRow
    this.readOnly = false;
    this.form = new AddHookForm(ctx.form, this);
    this.presets = new Presets(ctx.presets, ctx.dialog);
  }

  /** A new session: kinds may differ; every row is rebuilt. */
  resetSession() {
    for (const row of this.rows.values()) row.el.remove();
    this.rows.clear();
    this.form.setKinds(this.state.hookKinds);
    this.render();
  }

  /** `historical`: an earlier run is shown, whose hooks the export routes do not serve. */
  setReadOnly(on, historical = false) {
    this.readOnly = on;
    this.form.setDisabled(on);
    this.presets.setDisabled(on, historical);
    for (const row of this.rows.values()) row.setDisabled(on);
  }

  /** Bring the rows in line with state.hooks (kept in place while being edited). */
  render() {
    const list = this.ctx.list;
    const seen = new Set();
    let prev = null;
    for (const spec of this.state.hooks.values()) {
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
    return this.state.hookKinds[kind] || { properties: {} };
  }

  /**
   * A mutation's reply: null when accepted (what it changes arrives as a `hooks`
   * message), else the detail. Removing a hook that is gone already is no error.
   */
  async mutate(promise, { removeId } = {}) {
    const res = await promise;
    if (res.ok || (res.status === 404 && removeId !== undefined)) return null;
    return detailList(res.data);
  }
}

/** A zclip hook's own effect: warming up (steps left), or its threshold and whether it clipped. */
function zclipParts(effect, params) {
  if (effect.warmup) return [`warming up: ${effect.warmup} of ${params.warmup} steps left`];
  const parts = [];
  if (effect.threshold !== undefined && effect.threshold !== null)
    parts.push(`threshold ${fmt(effect.threshold)}`);
  if (params.mode === "group")
    parts.push(`${effect.clipped || 0} group${effect.clipped === 1 ? "" : "s"} clipped`);
  else parts.push(effect.clipped ? "clipped" : "not clipped");
  return parts;
}

/** One row of the list: kind, point, status, the target and parameters editable in place, toggle, remove. */
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
      dataset: { testid: SELECTORS.hookTarget },
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
    // Field values follow the server unless the user is editing that field.
    for (const [key, f] of this.fields) {
      if (document.activeElement === f.input) continue;
      this.showInForce(key, f);
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
    const zclip = this.spec.kind === "zclip";
    if (zclip) parts.push(...zclipParts(effect, this.spec.params));
    for (const [k, v] of Object.entries(effect)) {
      if (zclip && ["threshold", "clipped", "warmup"].includes(k)) continue;
      if (k !== "changed" && k !== "norm_ratio" && (typeof v === "number" || typeof v === "string"))
        parts.push(`${k} ${fmt(v)}`);
    }
    this.effect.textContent = parts.length ? `last step: ${parts.join(" · ")}` : "";
  }

  clearErrors() {
    clearDetail(this.fields, this.error);
  }

  /** The value in force for a field ("target" or "params.<name>"), as the server last reported it. */
  inForce(key) {
    return key === "target" ? this.spec.target : (this.spec.params || {})[key.slice(7)];
  }

  showInForce(key, f) {
    const value = this.inForce(key);
    if (f.input.type === "checkbox") f.input.checked = Boolean(value);
    else f.input.value = fmtParam(value);
  }

  /** A refused value: the field goes back to the value in force, the reason beside it. */
  refuse(key, reason) {
    const f = this.fields.get(key);
    if (!f) {
      this.error.textContent = reason;
      return;
    }
    this.showInForce(key, f);
    const value = fmtParam(this.inForce(key));
    setFieldError(f, `${reason}; in force: ${value === "" ? "(none)" : value}`);
  }

  showDetail(detail) {
    for (const d of detail) {
      const key = locKey(d.loc);
      if (this.fields.has(key)) this.refuse(key, d.msg);
      else this.error.textContent = detailText(d);
    }
  }

  async send(patch) {
    this.clearErrors();
    const detail = await this.panel.mutate(api.updateHook(this.spec.id, patch));
    if (detail) this.showDetail(detail);
    return detail;
  }

  async commitParam(name, prop, input, required) {
    const r = readInput(prop, input, required);
    this.clearErrors();
    if (r.error) {
      this.refuse(`params.${name}`, r.error);
      return;
    }
    if (r.skip) return;
    await this.send({ params: { [name]: r.value } });
  }

  async commitTarget() {
    const f = this.fields.get("target");
    const value = f.input.value.trim();
    this.clearErrors();
    if (!value) {
      this.refuse("target", "required");
      return;
    }
    if (value === this.spec.target) return;
    if (value.length > 256) {
      this.refuse("target", "at most 256 characters");
      return;
    }
    const res = await api.targets(value, this.spec.point);
    if (res.ok && !(res.data.matches || []).length) {
      this.refuse("target", `'${value}' matches nothing at ${this.spec.point}`);
      return;
    }
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
