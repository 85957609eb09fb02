// Small helpers shared by the modules: wire numbers, formatting, DOM building.

/**
 * A wire number as a JS number: the strings "nan", "inf", "-inf" become NaN and
 * +-Infinity; null and undefined stay null.
 */
export function num(v) {
  if (v === null || v === undefined) return null;
  if (typeof v === "number") return v;
  if (v === "nan") return NaN;
  if (v === "inf") return Infinity;
  if (v === "-inf") return -Infinity;
  const n = Number(v);
  return Number.isNaN(n) ? null : n;
}

/** A plottable value: finite numbers pass, anything else becomes null (a gap). */
export function plottable(v) {
  const n = num(v);
  return n !== null && Number.isFinite(n) ? n : null;
}

/** A value for a log axis: finite and > 0, else null. */
export function positive(v) {
  const n = plottable(v);
  return n !== null && n > 0 ? n : null;
}

/** log10 of a positive finite value, else null (heatmap cells). */
export function log10OrNull(v) {
  const n = positive(v);
  return n === null ? null : Math.log10(n);
}

/** Compact number formatting: 3 significant digits, exponent form off [1e-3, 1e5). */
export function fmt(v, digits = 3) {
  const n = num(v);
  if (n === null) return "–";
  if (Number.isNaN(n)) return "NaN";
  if (!Number.isFinite(n)) return n > 0 ? "+Inf" : "-Inf";
  if (n === 0) return "0";
  const a = Math.abs(n);
  if (a >= 1e5 || a < 1e-3) return n.toExponential(digits - 1).replace("e+", "e");
  return String(Number(n.toPrecision(digits)));
}

/** A parameter value as the user would type it back. */
export function fmtParam(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "boolean") return v ? "true" : "false";
  return String(v);
}

export function fmtPercent(v) {
  const n = plottable(v);
  return n === null ? "–" : `${(n * 100).toFixed(n < 0.1 ? 1 : 0)}%`;
}

export function fmtTime(t) {
  const n = plottable(t);
  if (n === null) return "";
  return new Date(n * 1000).toLocaleTimeString([], { hour12: false });
}

/** "11-30 06:58": a run's start, short enough for the run picker. */
export function fmtShortDate(t) {
  const n = plottable(t);
  if (n === null) return "";
  const d = new Date(n * 1000);
  const p2 = (x) => String(x).padStart(2, "0");
  return `${p2(d.getMonth() + 1)}-${p2(d.getDate())} ${p2(d.getHours())}:${p2(d.getMinutes())}`;
}

/**
 * Build an element: h("div", {class: "x", dataset: {testid: "y"}, onclick}, child...).
 * Children are nodes or strings (as text: data never reaches innerHTML).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (v === false) {
      if (k in el && typeof el[k] === "boolean") el[k] = false;
      continue;
    }
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** Call fn at most once per `ms`, with the latest arguments (trailing call kept). */
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

let requestCounter = 0;
export const nextRequestId = () => `r${++requestCounter}`;

// Text for Plotly (trace names, hover text, ticks, annotations): defined in ticks.js,
// which the HTML report shares.
/** [q, 1 - q] quantiles of the finite values (robust limits, not the one outlier). */
export function quantileRange(values, q) {
  const v = values.filter((x) => x !== null && Number.isFinite(x)).sort((a, b) => a - b);
  if (!v.length) return null;
  const at = (p) => v[Math.min(v.length - 1, Math.max(0, Math.round(p * (v.length - 1))))];
  return [at(q), at(1 - q)];
}

export { plotlyText } from "./ticks.js";
