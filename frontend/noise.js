// The Noise scale card: the gradient noise scale B_simple = tr(Σ)/|G|² over steps, from each
// snapshot's `noise_scale` (inspector/stats/noise_scale.py): the whole model, and the groups the
// selector picks (by default the three that weigh most in the whole-model value: it is the
// |G_g|²-weighted mean of the groups' values), beside the batch in use (B_big) on the same log
// axis, and the learning rate in a strip below on the same steps. Beside the chart: what the newest estimate rests
// on (where the small and big batch come from, whether the batch size was given or inferred,
// how many sampled steps the average spans), or why there is none and how to get one; and the
// caveats. It reads the rows of state.js (the one store) and joins the shared step axis.

import { LEGEND_ABOVE } from "./modulechart.js";
import { COLORS, TIME_HOVER, axis, baseLayout, centerNote } from "./theme.js";
import { logTicks, shortName } from "./ticks.js";
import { StepChart, sharedRange } from "./timeline.js";
import { fmt, h, num, plotlyText, positive } from "./util.js";

const WHOLE = "#56d4dd";
const BATCH = "#8592a3";
const LR = "#e3b341";
const GROUP_COLORS = ["#d2a8ff", "#7ee787", "#ff9492", "#79c0ff", "#ffa657"];
const TOP = 3; // groups shown by default
const HOW_TO =
  "How to get one: split each step's batch into 2 or more micro-batches (a backward each, the loss " +
  "divided by their number) or train under DDP (2 or more ranks); the batch size is read from the " +
  "leading dimension of the model's first input, or given with attach(..., batch_size=N).";
const HOW_TO_SIZES =
  "How to get one: one forward of the model per backward pass, so that each micro-batch's size is " +
  "known, or micro-batches of one size.";

/** `text` cut to `n` characters. */
function clip(text, n) {
  return text.length > n ? `${text.slice(0, n - 1)}…` : text;
}

/** The rows (older history, then the window) that carry `noise_scale`. */
function noiseRows(state) {
  return [...(state.history ? state.history.rows : []), ...state.snapshots].filter((r) => r.noise_scale);
}

/** The learning rates of the rows: one series per optimizer param group, one when they agree. */
function lrSeries(rows) {
  const n = Math.max(0, ...rows.map((r) => (r.lr ? r.lr.length : 0)));
  const agree = rows.every((r) => !r.lr || r.lr.every((v) => v === r.lr[0]));
  const count = agree ? Math.min(1, n) : n;
  return Array.from({ length: count }, (_, j) => ({
    name: count === 1 ? "lr" : `lr (param group ${j})`,
    y: rows.map((r) => (r.lr ? positive(r.lr[j]) : null)),
  }));
}

/** The learning-rate axis: log where it spans a decade or more, else linear from 0 (with headroom). */
function lrScale(values) {
  const v = values.filter((x) => x !== null);
  if (!v.length) return { type: "linear", showticklabels: false };
  const lo = Math.min(...v);
  const hi = Math.max(...v);
  if (hi / lo < 10)
    return {
      type: "linear",
      range: [0, hi * 1.3],
      tickvals: [hi / 2, hi],
      ticktext: [hi / 2, hi].map((v) => String(Number(v.toPrecision(3)))),
    };
  return { type: "log", ...logTicks(v, 3) };
}

/** The group indices the selector stands for: "top" (by |G|² of the newest row), one, or none. */
function shownGroups(choice, latest, names) {
  if (choice === "") return [];
  if (choice !== "top") {
    const g = Number(choice);
    return Number.isInteger(g) && g >= 0 && g < names.length ? [g] : [];
  }
  const gsq = (latest && latest.noise_scale.groups && latest.noise_scale.groups.g_sq) || [];
  return names
    .map((_, g) => [g, positive(gsq[g])])
    .filter(([, v]) => v !== null)
    .sort((a, b) => b[1] - a[1])
    .slice(0, TOP)
    .map(([g]) => g);
}

/** Where the newest estimate's two batch sizes come from, in words. */
function sourceText(ns) {
  const small = num(ns.b_small);
  const big = num(ns.b_big);
  const k = num(ns.k);
  const given =
    ns.batch_source === "attach"
      ? "the batch size given with attach(batch_size=…)"
      : "the batch size inferred from the leading dimension of the model's first input";
  if (small === null || big === null) return `batch size: ${ns.batch_source ? given : "not known yet"}`;
  const split =
    ns.mode === "ddp" || ns.mode === "fsdp"
      ? `one rank's micro-batch of ${fmt(small)} against the reduced gradient of ${fmt(big / small)} × it (${ns.mode === "ddp" ? "DDP" : "FSDP2"} ranks${k && k > 1 ? ` × ${k} micro-batches` : ""})`
      : `one micro-batch of ${fmt(small)} against the step's ${k} accumulated micro-batches (${fmt(big)} examples)`;
  const sizes = Array.isArray(ns.sizes) && ns.sizes.length ? ns.sizes : null;
  const uneven = sizes
    ? `; micro-batches of uneven sizes (${sizes.join(", ")}), each weighed alike by loss / K: ` +
      `the small batch is their harmonic mean (${fmt(small)}), the big one ${k} × it`
    : "";
  return `${split}${uneven}; ${given}`;
}

export class NoiseChart extends StepChart {
  /**
   * @param {HTMLElement} el the chart
   * @param {{status: HTMLElement, caveats: HTMLElement, select: HTMLSelectElement, redraw: () => void}} parts
   */
  constructor(el, parts) {
    super();
    this.el = el;
    this.status = parts.status;
    this.caveats = parts.caveats;
    this.select = parts.select;
    this.shown = -1;
    this.names = null; // the group names the selector lists
    this.select.addEventListener("change", () => parts.redraw());
  }

  /** The selector's options for the state's groups (kept while the groups stay the same). */
  fillSelect(state) {
    const names = (state.groups && state.groups.names) || [];
    if (this.names && this.names.length === names.length && this.names.every((n, i) => n === names[i]))
      return;
    this.names = names;
    const keep = this.select.value || "top";
    const opts = [
      h("option", { value: "" }, "whole model only"),
      h("option", { value: "top" }, `+ top ${TOP} groups (by |G|²)`),
      ...names.map((n, g) => h("option", { value: String(g) }, `+ ${n === "" ? "(root)" : n}`)),
    ];
    this.select.replaceChildren(...opts);
    this.select.value = [...this.select.options].some((o) => o.value === keep) ? keep : "top";
    this.select.hidden = names.length < 2; // one group is the whole model
  }

  render(state, force) {
    if (!force && state.version === this.shown) return;
    this.shown = state.version;
    this.fillSelect(state);
    const rows = noiseRows(state);
    const latest = rows.length ? rows[rows.length - 1] : null;
    const x = rows.map((r) => r.step);
    const whole = rows.map((r) => positive(r.noise_scale.b_simple));
    const names = this.names || [];
    const groups = names.length < 2 ? [] : shownGroups(this.select.value, latest, names);
    const line = (name, y, color, extra = {}) => ({
      name,
      type: "scatter",
      mode: rows.length > 60 ? "lines" : "lines+markers",
      marker: { size: 3 },
      x,
      y,
      connectgaps: false,
      line: { color, width: 1.5 },
      hovertemplate: `${name} %{y:.3g}<extra></extra>`,
      ...extra,
    });
    const traces = [
      line("B_simple (whole model)", whole, WHOLE, { line: { color: WHOLE, width: 2.2 } }),
      ...groups.map((g, j) => {
        const full = plotlyText(names[g] === "" ? "(root)" : names[g]);
        const color = GROUP_COLORS[j % GROUP_COLORS.length];
        return line(
          plotlyText(shortName(names[g] === "" ? "(root)" : names[g], 28)),
          rows.map((r) => positive(((r.noise_scale.groups || {}).b_simple || [])[g])),
          color,
          {
            line: { color, width: 1.2, dash: "dot" },
            hovertemplate: `${full}: B_simple %{y:.3g}<extra></extra>`,
          },
        );
      }),
      {
        ...line(
          "B_big (the batch in use)",
          rows.map((r) => positive(r.noise_scale.b_big)),
          BATCH,
        ),
        mode: "lines",
        line: { color: BATCH, width: 1.5, dash: "dash", shape: "hv" },
        customdata: rows.map((r) => [fmt(r.noise_scale.b_small), num(r.noise_scale.k) ?? "–"]),
        hovertemplate:
          "B_big %{y:.4g} (B_small %{customdata[0]}, %{customdata[1]} backward passes)<extra></extra>",
      },
    ];
    const lrs = lrSeries(rows);
    for (const s of lrs)
      traces.push({
        ...line(s.name, s.y, LR, { yaxis: "y2" }),
        showlegend: false, // the strip's axis says it
        mode: "lines",
        line: { color: LR, width: 1.2 },
        hovertemplate: `${s.name} %{y:.3g}<extra></extra>`,
      });
    const left = traces.filter((t) => t.yaxis !== "y2").flatMap((t) => t.y.filter((v) => v !== null));
    const anyEstimate = whole.some((v) => v !== null);
    const note = !rows.length
      ? "no noise scale in this run<br>(off: attach(..., noise_scale=False); or recorded before it was measured)"
      : anyEstimate
        ? null
        : `no estimate yet<br>${plotlyText(clip(latest.noise_scale.reason || "the averages are not positive yet", 80))}`;
    // two strips on one step axis: the batch sizes (log) above, the learning rate below
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 60, r: 12, t: 26, b: 38 },
      showlegend: true,
      legend: { ...LEGEND_ABOVE, font: { size: 10, color: COLORS.text } },
      xaxis: axis({ title: { text: "step" }, anchor: "y2", ...sharedRange(this, state) }),
      yaxis: axis({
        title: { text: "examples (log)" },
        type: "log",
        domain: [0.3, 1],
        ...logTicks(left, 5),
      }),
      yaxis2: axis({
        title: { text: "lr", font: { size: 11, color: LR } },
        domain: [0, 0.22],
        tickfont: { size: 9, color: LR },
        ...lrScale(lrs.flatMap((s) => s.y)),
      }),
      annotations: note ? [centerNote(note, 0.65)] : [],
    });
    const last = [...whole].reverse().find((v) => v !== null);
    this.el.dataset.points = String(whole.filter((v) => v !== null).length);
    this.el.dataset.bsimple = last === undefined ? "" : String(last);
    this.el.dataset.state = !rows.length ? "off" : anyEstimate ? "estimate" : "none";
    this.el.dataset.groups = groups.map((g) => names[g]).join(",");
    this.draw(traces, layout, state);
    this.describe(latest);
  }

  /** The status line and the caveats (the EMA's span from the newest row). */
  describe(latest) {
    const ns = latest ? latest.noise_scale : null;
    const ema = ns ? num(ns.ema) : null;
    const span = ema !== null && ema < 1 ? Math.round(1 / (1 - ema)) : null;
    let text;
    // why the newest step added nothing to the averages (e.g. uneven micro-batch sizes it cannot tell apart)
    const left =
      ns && ns.step_reason && !ns.reason ? ` Step ${latest.step} added none: ${ns.step_reason}.` : "";
    if (!ns) text = "Not measured in this run: on by default; attach(..., noise_scale=False) turns it off.";
    else if (positive(ns.b_simple) !== null)
      text =
        `Step ${latest.step}: B_simple ≈ ${fmt(ns.b_simple)} examples (tr Σ ${fmt(ns.trace_sigma)}, ` +
        `|G|² ${fmt(ns.g_sq)}, averaged over ${ns.samples} sampled step${ns.samples === 1 ? "" : "s"}); ` +
        `${sourceText(ns)}.${left}`;
    else if (ns.reason)
      text = `No estimate: ${ns.reason}. ${ns.sizes && !ns.b_small ? HOW_TO_SIZES : HOW_TO}`;
    else
      text =
        `No estimate at step ${latest.step}: after ${ns.samples} sampled step${ns.samples === 1 ? "" : "s"} ` +
        `an average (|G|² or tr Σ) is not positive yet: too few or too noisy samples; it settles as they accumulate.${left}`;
    this.status.textContent = text;
    this.status.dataset.state = !ns ? "off" : positive(ns.b_simple) !== null ? "estimate" : "none";
    const items = [
      [
        "Critical batch size.",
        " B_simple estimates it: below it a larger batch lets each step go about proportionally further; " +
          "well above it more examples per step stop paying off (compare it with B_big, the batch in use).",
      ],
      [
        "Depends on the learning rate",
        " and the point in training (it usually grows as the loss falls). It is derived for SGD at a " +
          "well-tuned step; under Adam it is a heuristic: read its trend and order of magnitude.",
      ],
      [
        "Smoothed.",
        ` Each point is the ratio of two exponential averages (of |G|² and tr Σ), smoothing ${ema === null ? "β" : fmt(ema)} per sampled step: they span about ${span === null ? "1/(1−β)" : span} sampled steps, so it lags a change of the learning rate.`,
      ],
      [
        "Two batch sizes.",
        " The small batch is one micro-batch (gradient accumulation) or one rank's batch (DDP), the big one " +
          "the step's accumulated or all-reduced gradient; without either there is no estimate.",
      ],
    ];
    this.caveats.replaceChildren(...items.map(([b, t]) => h("li", {}, h("b", {}, b), t)));
  }
}
