// Axis ticks and tick labels, shared by the dashboard (charts.js, theme.js) and the
// HTML report (report/report.js, which server/history/report_assets.py inlines with this
// module into the report's one-file page). So this module imports nothing and
// declares its exports as `export function` / `export const` statements, the
// forms the inlining turns back into plain declarations.

/** A short form of a long dotted parameter name for axis ticks: the last parts. */
export function shortName(name, maxLen = 22) {
  if (name.length <= maxLen) return name;
  const parts = name.split(".");
  let out = parts.pop();
  while (parts.length && out.length + parts[parts.length - 1].length + 1 <= maxLen - 1) {
    out = `${parts.pop()}.${out}`;
  }
  return `…${out}`;
}

/**
 * User text (a parameter, module or hook name, a target, a message) as Plotly text:
 * Plotly draws a few HTML tags (`<b>`, `<br>`, `<a href>`, `<span style>`) and
 * entities in trace names, hover text, tick labels, annotations and titles, so `&`,
 * `<` and `>` become entities, which it draws back as the literal characters.
 * Exactly once, and only for Plotly: text set as textContent is never escaped.
 * The dashboard and the HTML report both use this one.
 */
export function plotlyText(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

/**
 * Every k-th name as a tick, so labels `perLabel` px apart fit in `pixels`
 * (hover always names the parameter). `names` are the raw names; the ticks are
 * Plotly text (`plotlyText`): the axis's categories must be `names.map(plotlyText)`.
 */
export function sparseTicks(names, pixels, perLabel, maxLen) {
  const k = Math.max(1, Math.ceil((names.length * perLabel) / Math.max(pixels, 50)));
  const vals = names.filter((_, i) => i % k === 0);
  return {
    tickvals: vals.map(plotlyText),
    ticktext: vals.map((n) => plotlyText(shortName(n, maxLen))),
  };
}

/** The label of 10^e: 0.01 ... 1000 written out, 1e-5 beyond (`sci`: 1e-2 ... 1e3 too). */
function decadeLabel(e, sci = false) {
  return !sci && e >= -2 && e <= 3 ? String(10 ** e) : `1e${e}`;
}

/**
 * Tick values and labels of a log10-valued axis or colour bar: 1e-3, 0.01, ...
 * Across a decade or more, the powers of ten (every k-th, at most about nine).
 * Within less than a decade, where no power of ten or only one may fall inside,
 * the multiples 2, 3, ... 9 of it too (0.02, 3e-4), and the midpoint when even
 * those miss. The dashboard's colour range always spans a decade at least.
 */
export function decadeTicks(lo, hi) {
  const vals = [];
  const text = [];
  const a = Math.floor(lo);
  const b = Math.ceil(hi);
  // A decade give or take rounding: (hi + 0.5) - (lo - 0.5) can come out a hair under 1.
  if (hi - lo >= 1 - 1e-9) {
    const step = Math.max(1, Math.ceil((b - a) / 8));
    for (let e = a; e <= b; e += step) vals.push(e);
    // one format along the bar: all written out, or all 1eN
    const sci = vals.some((e) => e < -2 || e > 3);
    for (const e of vals) text.push(decadeLabel(e, sci));
    return { vals, text };
  }
  for (let e = a; e <= b; e++) {
    for (let m = 1; m <= 9; m++) {
      const v = e + Math.log10(m);
      if (v < lo - 1e-9 || v > hi + 1e-9) continue;
      vals.push(v);
      text.push(
        m === 1
          ? decadeLabel(e)
          : e >= -2 && e <= 3
            ? String(Number((m * 10 ** e).toPrecision(1)))
            : `${m}e${e}`,
      );
    }
  }
  if (vals.length === 0) {
    vals.push((lo + hi) / 2);
    text.push((10 ** ((lo + hi) / 2)).toPrecision(2));
  }
  return { vals, text };
}

/**
 * Ticks of a log axis over these values, at round values only, as Plotly's
 * `tickmode: "array"` keys: powers of ten (every k-th, so at most `maxTicks`)
 * across wide spans; 1, 2, 5 times them within a few decades; within less than
 * a decade, multiples of a round step (1, 2 or 5 times a power of ten: 0.4, 0.6,
 * 0.8). Never one label per decade stacked on top of each other, never a label
 * such as 1.43408. `maxTicks` follows the axis length (about 30 px a label).
 */
export function logTicks(values, maxTicks = 8) {
  const [lo, hi] = positiveRange(values);
  if (!Number.isFinite(lo)) return {};
  return logTicksIn(Math.log10(lo), Math.log10(hi), maxTicks);
}

/** The same over a log10 range [a, b] (an axis's visible range after a zoom). */
export function logTicksIn(a, b, maxTicks = 8) {
  const m = Math.max(2, maxTicks);
  const vals = [];
  const first = Math.ceil(a - 1e-9);
  const last = Math.floor(b + 1e-9);
  const decades = last - first + 1;
  // At least MIN_TICKS labels where the axis has room for them: powers of ten across
  // wide spans, else 1, 5 (then 1, 2, 5) times them, else a round linear step.
  const want = Math.min(MIN_TICKS, m);
  if (decades >= Math.max(3, want)) {
    const k = Math.max(1, Math.ceil(decades / m));
    for (let e = Math.ceil(first / k) * k; e <= last; e += k) vals.push(Number(`1e${e}`));
  } else {
    for (const mult of [[1], [1, 5], [1, 2, 5]]) {
      const cand = [];
      for (let e = first - 1; e <= last; e++) {
        for (const c of mult) {
          const v = Number(`${c}e${e}`); // exact: 10 ** -5 is 9.999999999999999e-6
          const lv = Math.log10(v);
          if (lv >= a - 1e-9 && lv <= b + 1e-9) cand.push(v);
        }
      }
      if (cand.length > m) break;
      vals.length = 0;
      vals.push(...cand);
      if (cand.length >= want) break;
    }
    if (vals.length < want && b - a < 1.5) {
      // Little more than a decade and too few 1-2-5 values inside: a round linear step.
      const lo = 10 ** a;
      const hi = 10 ** b;
      for (let n = want; n <= Math.max(want, m); n++) {
        const step = niceStep((hi - lo) / n);
        const lin = [];
        for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi * (1 + 1e-9); v += step) {
          if (v > 0) lin.push(Number(v.toPrecision(12)));
        }
        if (lin.length > vals.length) {
          vals.length = 0;
          vals.push(...lin);
        }
        if (vals.length >= want) break;
      }
    }
  }
  return { tickmode: "array", tickvals: vals, ticktext: tickLabels(vals) };
}

/** The fewest tick labels a numeric axis gets where it has the room. */
export const MIN_TICKS = 4;

/**
 * Labels of one axis's round tick values in ONE format: all written out (0.002, 50) when
 * every value reads well so, else all in scientific notation (2e-5, 1e0, 5e3).
 */
export function tickLabels(vals) {
  const plain = vals.every((v) => v === 0 || (Math.abs(v) >= 1e-3 && Math.abs(v) < 1e5));
  return vals.map((v) => (plain ? tickLabel(v) : sciLabel(v)));
}

/** A value in scientific notation, trimmed: 2e-5, 1e0, 1.5e3. */
export function sciLabel(v) {
  if (v === 0) return "0";
  const [mant, exp] = v.toExponential().split("e");
  return `${String(Number(Number(mant).toPrecision(6)))}e${Number(exp)}`;
}

/** 1, 2 or 5 times a power of ten: the round step nearest above `raw`. */
export function niceStep(raw) {
  if (!(raw > 0) || !Number.isFinite(raw)) return 1;
  const e = Math.floor(Math.log10(raw));
  const f = raw / 10 ** e;
  const c = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return c * 10 ** e;
}

/** A round tick value as a short label: 0.002, 50, 2e-5, 1e34. */
export function tickLabel(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e-3 && a < 1e5) return String(Number(v.toPrecision(6)));
  const [mant, exp] = v.toExponential().split("e");
  const m = String(Number(Number(mant).toPrecision(6)));
  return `${m === "1" ? "1" : m}e${Number(exp)}`;
}

/** [min, max] of the positive finite values ([Infinity, -Infinity] for none). */
export function positiveRange(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v === null || !(v > 0) || !Number.isFinite(v)) continue;
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  return [lo, hi];
}
