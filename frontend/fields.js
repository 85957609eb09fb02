// Parameter fields built from a hook kind's JSON Schema, parsed in the page
// before anything is sent (types, required); ranges are the server's to judge,
// and its `detail` is shown beside the field it names.

import { detailText } from "./api.js";
import { SELECTORS, paramTestId } from "./selectors.js";
import { fmtParam, h } from "./util.js";

/** The schema's properties as [name, propertySchema] pairs, in schema order. */
export function schemaFields(schema) {
  return Object.entries((schema && schema.properties) || {});
}

function types(prop) {
  const t = prop.type;
  return Array.isArray(t) ? t : t ? [t] : [];
}

/** A short hint of the constraint, shown as placeholder and tooltip. */
export function constraintHint(prop) {
  const parts = [];
  if (prop.exclusiveMinimum !== undefined) parts.push(`> ${prop.exclusiveMinimum}`);
  if (prop.minimum !== undefined) parts.push(`≥ ${prop.minimum}`);
  if (prop.exclusiveMaximum !== undefined) parts.push(`< ${prop.exclusiveMaximum}`);
  if (prop.maximum !== undefined) parts.push(`≤ ${prop.maximum}`);
  const t = types(prop).filter((x) => x !== "null");
  if (!parts.length && t.length) parts.push(t.join(" or "));
  return parts.join(", ");
}

/**
 * One parameter input: a <select> for enums, a checkbox for booleans, text for
 * numbers (so "inf" can be typed where the schema allows it).
 */
export function makeInput(name, prop, value, { onCommit } = {}) {
  const t = types(prop);
  const testid = paramTestId(name);
  let input;
  if (Array.isArray(prop.enum)) {
    input = h(
      "select",
      { dataset: { testid }, name },
      prop.enum.map((v) => h("option", { value: String(v) }, String(v))),
    );
    input.value = value === undefined || value === null ? String(prop.enum[0]) : String(value);
  } else if (t.includes("boolean")) {
    input = h("input", { type: "checkbox", dataset: { testid }, name });
    input.checked = Boolean(value);
  } else {
    input = h("input", {
      type: "text",
      inputmode: t.includes("number") || t.includes("integer") ? "decimal" : "text",
      autocomplete: "off",
      spellcheck: false,
      dataset: { testid },
      name,
      placeholder: constraintHint(prop) || name,
      title: prop.description || constraintHint(prop),
    });
    input.value = fmtParam(value);
  }
  if (onCommit) {
    input.addEventListener("change", () => onCommit(name, input));
    if (input.tagName === "INPUT" && input.type === "text") {
      input.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter") input.blur();
      });
    }
  }
  return input;
}

/**
 * The value of a field as JSON, or {error}. Numbers accept "inf", "-inf" and
 * "nan" (sent as those strings, the wire's spelling of non-finite numbers).
 */
export function readInput(prop, input, required) {
  const t = types(prop);
  if (Array.isArray(prop.enum)) {
    const hit = prop.enum.find((v) => String(v) === input.value);
    return { value: hit === undefined ? input.value : hit };
  }
  if (t.includes("boolean")) return { value: input.checked };
  const text = input.value.trim();
  if (text === "") {
    if (t.includes("null")) return { value: null };
    return required ? { error: "required" } : { skip: true };
  }
  if (t.includes("number") || t.includes("integer")) {
    const lower = text.toLowerCase();
    if (["inf", "+inf", "infinity", "-inf", "-infinity", "nan"].includes(lower)) {
      return { value: lower === "nan" ? "nan" : lower.startsWith("-") ? "-inf" : "inf" };
    }
    const n = Number(text);
    if (!Number.isFinite(n)) return { error: "not a number" };
    if (t.includes("integer") && !t.includes("number") && !Number.isInteger(n)) {
      return { error: "must be an integer" };
    }
    return { value: n };
  }
  return { value: text };
}

/** A labelled field with its error slot: {wrap, input, error}. */
export function labelledField(label, input, hint) {
  const error = h("span", { class: "field-error", dataset: { testid: SELECTORS.fieldError }, role: "alert" });
  const wrap = h(
    "label",
    { class: "field" },
    h("span", { class: "field-label" }, label),
    input,
    hint ? h("span", { class: "field-hint" }, hint) : null,
    error,
  );
  return { wrap, input, error };
}

export function setFieldError(field, msg) {
  field.error.textContent = msg || "";
  field.wrap.classList.toggle("invalid", Boolean(msg));
  if (field.input) field.input.setAttribute("aria-invalid", msg ? "true" : "false");
}

/**
 * Where a server detail points: "params.<name>", "target", ... (a leading
 * "body" from request validation is dropped).
 */
export function locKey(loc) {
  const parts = (loc || []).map(String);
  if (parts[0] === "body") parts.shift();
  if (parts[0] === "params" && parts.length > 1) return `params.${parts[1]}`;
  return parts[0] || "";
}

/**
 * Show a server detail: each entry beside the field it names (`fields`: locKey
 * -> field), an entry that names no field in `errorEl`.
 */
export function showDetail(fields, errorEl, detail) {
  for (const d of detail) {
    const f = fields.get(locKey(d.loc));
    if (f) setFieldError(f, d.msg);
    else errorEl.textContent = detailText(d);
  }
}

/** Clear what showDetail showed. */
export function clearDetail(fields, errorEl) {
  for (const f of fields.values()) setFieldError(f, "");
  errorEl.textContent = "";
}
