// Parameter fields built from a hook kind's JSON Schema, checked in the page
// against that schema before anything is sent (types, required, enums, bounds),
// so a value the server would refuse is not sent at all; rules the schema does
// not carry stay the server's to judge, and its `detail` is shown beside the
// field it names.

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

// Integers a browser holds exactly (Number.MAX_SAFE_INTEGER); past them JSON.parse rounds.
const SAFE_INT = 2 ** 53 - 1;

/**
 * A bound in words: 9223372036854775807 (int64's largest, which JSON.parse
 * reads as 2^63) is "2^63-1", other powers of two past 2^53 are "2^k", and
 * anything else its plain number.
 */
export function fmtLimit(n) {
  if (typeof n !== "number" || !Number.isInteger(n) || Math.abs(n) <= SAFE_INT) return String(n);
  const k = Math.round(Math.log2(Math.abs(n)));
  if (2 ** k !== Math.abs(n)) return n.toExponential(3).replace("e+", "e");
  if (n === 2 ** 63) return "2^63-1";
  return `${n < 0 ? "-" : ""}2^${k}`;
}

/** A short hint of the constraint, shown as placeholder and tooltip. */
export function constraintHint(prop) {
  const parts = [];
  if (prop.exclusiveMinimum !== undefined) parts.push(`> ${fmtLimit(prop.exclusiveMinimum)}`);
  if (prop.minimum !== undefined) parts.push(`≥ ${fmtLimit(prop.minimum)}`);
  if (prop.exclusiveMaximum !== undefined) parts.push(`< ${fmtLimit(prop.exclusiveMaximum)}`);
  if (prop.maximum !== undefined) parts.push(`≤ ${fmtLimit(prop.maximum)}`);
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
 * The value of a field as JSON, or {error} (the reason, in the server's words
 * where it has them), checked against the field's schema: enum, type, and the
 * bounds. A number field whose type also allows a string (norm_type) takes
 * "inf", sent as that string (the wire's spelling); NaN and other infinities
 * are refused, as the server refuses them.
 */
export function readInput(prop, input, required) {
  const t = types(prop);
  if (Array.isArray(prop.enum)) {
    const hit = prop.enum.find((v) => String(v) === input.value);
    if (hit === undefined) return { error: `must be one of ${prop.enum.join(", ")}` };
    return { value: hit };
  }
  if (t.includes("boolean")) return { value: input.checked };
  const text = input.value.trim();
  if (text === "") {
    if (t.includes("null")) return { value: null };
    return required ? { error: "required" } : { skip: true };
  }
  if (t.includes("number") || t.includes("integer")) {
    const lower = text.toLowerCase();
    if (["inf", "+inf", "infinity"].includes(lower) && t.includes("string")) return { value: "inf" };
    if (["inf", "+inf", "infinity", "-inf", "-infinity", "nan"].includes(lower))
      return { error: `must be finite (got ${text})` };
    const n = Number(text);
    if (!Number.isFinite(n)) return { error: `must be a number (got '${text}')` };
    const integer = t.includes("integer") && !t.includes("number");
    if (integer) {
      if (!Number.isInteger(n)) return { error: `must be an integer (got ${text})` };
      if (Math.abs(n) > SAFE_INT)
        return { error: `at most 2^53-1 in magnitude from the page (a browser rounds past it)` };
    }
    const bound = outOfBounds(prop, n);
    // "(got -1.0)": the value as the server shows it (a number parameter is a Python float)
    if (bound) return { error: `${bound} (got ${integer ? String(n) : pyFloat(n)})` };
    return { value: n };
  }
  return { value: text };
}

/** The schema bound `n` breaks, in the server's words ("must be >= 0"), or null. */
function outOfBounds(prop, n) {
  if (prop.exclusiveMinimum !== undefined && !(n > prop.exclusiveMinimum))
    return `must be > ${fmtLimit(prop.exclusiveMinimum)}`;
  if (prop.minimum !== undefined && !(n >= prop.minimum)) return `must be >= ${fmtLimit(prop.minimum)}`;
  if (prop.exclusiveMaximum !== undefined && !(n < prop.exclusiveMaximum))
    return `must be < ${fmtLimit(prop.exclusiveMaximum)}`;
  if (prop.maximum !== undefined && !(n <= prop.maximum)) return `must be <= ${fmtLimit(prop.maximum)}`;
  return null;
}

/** A number as Python's repr of a float shows it: -1 is "-1.0" (1e-05 and the like may differ). */
function pyFloat(n) {
  return Number.isInteger(n) && Math.abs(n) < 1e16 ? n.toFixed(1) : String(n);
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
