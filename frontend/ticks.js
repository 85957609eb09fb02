// Axis ticks and tick labels, shared by the dashboard (charts.js, theme.js) and the
// HTML report (report/report.js, which server/report_assets.py inlines with this
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
 * Every k-th name as a tick, so labels `perLabel` px apart fit in `pixels`
 * (hover always names the parameter).
 */
export function sparseTicks(names, pixels, perLabel, maxLen) {
  const k = Math.max(1, Math.ceil((names.length * perLabel) / Math.max(pixels, 50)));
  const vals = names.filter((_, i) => i % k === 0);
  return { tickvals: vals, ticktext: vals.map((n) => shortName(n, maxLen)) };
}

/** The label of 10^e: 0.01 ... 1000 written out, 1e-5 beyond. */
function decadeLabel(e) {
  return e >= -2 && e <= 3 ? String(10 ** e) : `1e${e}`;
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
    for (let e = a; e <= b; e += step) {
      vals.push(e);
      text.push(decadeLabel(e));
    }
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
 * Tick labels for a log axis over these values: plain numbers (0.2, 0.5, 1, 2)
 * within about a decade and a half, where Plotly would otherwise label the 2s and 5s
 * with a bare digit; powers of ten across wider spans.
 */
export function logTicks(values) {
  const [lo, hi] = positiveRange(values);
  const span = Number.isFinite(lo) ? Math.log10(hi / lo) : 0;
  // Powers of ten: every decade up to six of them, beyond that Plotly's choice.
  if (span > 1.6) return { tickformat: "", exponentformat: "power", dtick: span > 6 ? null : 1 };
  // 1-2-5 ticks; under half a decade Plotly's own (linear-looking) ticks read fine.
  return { tickformat: "~g", exponentformat: "none", dtick: span > 0.5 ? "D2" : null };
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
