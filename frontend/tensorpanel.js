// The tensor panel: one tensor's story beside the page, in view without scrolling (fixed to the
// viewport's right edge; over the page on a narrow window). Whatever picks a tensor opens it:
// app.js's `pickParam` (a click on the heatmap, the bars, worst now, the search, a pin), a row of
// the statistics table, and any element with `data-tensor` (an event that names a tensor). A
// second click on the same name, Escape or the close button closes it; another name switches.
// It shows the tensor's raw and final gradient norm and its update ratio over the whole run
// (GET /api/detail from the first recorded step, at most MAX_STEPS sampled steps, then the rows
// the page streams), its gradient's histogram over steps (quantile bands, from the histograms
// the page holds), the optimizer's state for it, the hooks that target it with their newest
// effect, and its shape, dtype, module and group. Its charts take their colours from theme.js
// when drawn, and redraw when the page's theme changes.

import { api, errorText } from "./api.js";
import { HistTimeChart } from "./histtime.js";
import { globRegExp } from "./groups.js";
import { nameText } from "./names.js";
import { hasStats, statOf } from "./state.js";
import { COLORS, PLOT_CONFIG, axis, baseLayout, centerNote } from "./theme.js";
import { logTicks } from "./ticks.js";
import { fmt, h, num, plotlyText, positive } from "./util.js";

const Plotly = window.Plotly;
export const MAX_STEPS = 5000; // sampled steps one GET /api/detail answer holds, at most
const REDRAW_MS = 400; // streamed rows redraw the panel at most this often

/** The session's record of a parameter ({name, shape, dtype, numel, module}), or {name}. */
function paramInfo(state, name) {
  const list = (state.session && state.session.params) || [];
  const i = state.index.get(name);
  const p = i === undefined ? null : list[i];
  return p && typeof p === "object" ? p : { name };
}

/**
 * A positive series' axis: log with round ticks where it spans values, else linear; at most 5
 * ticks, which the panel's short charts have room for (6, say 0.01 0.05 ... 5, overlap).
 */
export function yAxisFor(values, title) {
  const v = values.filter((x) => x !== null);
  if (!v.length) return axis({ title: { text: title }, visible: false });
  return axis({ title: { text: title }, type: "log", ...logTicks(v, 5) });
}

export class TensorPanel {
  /**
   * @param {{view: () => object, open: (name: string) => void}} opts the state shown; open a
   *   tensor through the page's selection path (which toggles this panel)
   */
  constructor({ view, open }) {
    this.view = view;
    this.el = document.querySelector('[data-testid="tensor-panel"]');
    this.name = null;
    this.state = null;
    this.runId = null;
    this.fetched = null; // {steps, stats} of GET /api/detail, or null while asked
    this.fetchNote = "";
    this.fetchId = 0;
    this.shownVersion = null;
    this.shownHist = null;
    this.lastDraw = 0;
    this.timer = null;
    this.build();
    document.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && this.name !== null && !ev.defaultPrevented) this.close();
    });
    // a name anywhere on the page that says which tensor it is
    document.addEventListener("click", (ev) => {
      const el = ev.target instanceof Element ? ev.target.closest("[data-tensor]") : null;
      if (el && !this.el.contains(el)) open(el.dataset.tensor);
    });
    const redraw = () => this.name !== null && this.draw(true);
    const attrs = { attributes: true, attributeFilter: ["class", "data-theme", "data-color-scheme"] };
    new MutationObserver(redraw).observe(document.documentElement, attrs);
    new MutationObserver(redraw).observe(document.body, attrs);
    if (window.matchMedia)
      window.matchMedia("(prefers-color-scheme: light)").addEventListener("change", redraw);
  }

  build() {
    const el = this.el;
    el.hidden = true;
    el.setAttribute("aria-label", "tensor");
    this.title = h("h2", { class: "tp-title mono", dataset: { testid: "tensor-panel-name" } });
    this.closeBtn = h(
      "button",
      {
        type: "button",
        class: "icon-btn tp-close",
        title: "close (Esc)",
        "aria-label": "close the tensor panel",
        dataset: { testid: "tensor-panel-close" },
        onclick: () => this.close(),
      },
      "×",
    );
    this.facts = h("dl", { class: "tp-facts", dataset: { testid: "tensor-panel-facts" } });
    this.status = h("p", { class: "muted small tp-status", dataset: { testid: "tensor-panel-status" } });
    this.normEl = h("div", { class: "tp-chart", dataset: { testid: "tensor-panel-norm" } });
    this.ratioEl = h("div", { class: "tp-chart", dataset: { testid: "tensor-panel-ratio" } });
    this.histEl = h("div", { class: "tp-chart", dataset: { testid: "tensor-panel-hist" } });
    this.hist = new HistTimeChart(this.histEl);
    this.optim = h("dl", { class: "tp-facts", dataset: { testid: "tensor-panel-optim" } });
    this.hooks = h("ul", { class: "tp-hooks", dataset: { testid: "tensor-panel-hooks" } });
    const section = (title, ...body) => h("section", { class: "tp-section" }, h("h3", {}, title), ...body);
    el.replaceChildren(
      h("header", { class: "tp-head" }, this.title, this.closeBtn),
      this.facts,
      this.status,
      section("Gradient norm over the run", this.normEl),
      section("Update ratio ‖Δθ‖/‖θ‖", this.ratioEl),
      section("Gradient histogram over steps", this.histEl),
      section("Optimizer state", this.optim),
      section("Hooks on it", this.hooks),
    );
  }

  /** Open `name`, or close the panel when it shows `name` already. */
  toggle(name) {
    if (this.name === name && !this.el.hidden) this.close();
    else this.open(name);
  }

  open(name) {
    const state = this.view();
    if (!state || !state.index.has(name)) return;
    const same = this.name === name && this.state === state && this.runId === state.runId;
    this.name = name;
    this.state = state;
    this.runId = state.runId;
    this.el.dataset.param = name;
    this.el.hidden = false;
    this.title.replaceChildren(nameText(name, { cls: "tp-name" }));
    if (!same) {
      this.fetched = null;
      this.fetchNote = "";
      this.fetchHistory(state, name);
    }
    this.draw(true);
  }

  close() {
    if (this.name === null) return;
    this.name = null;
    this.fetchId++;
    this.el.hidden = true;
    delete this.el.dataset.param;
    for (const c of [this.normEl, this.ratioEl, this.histEl]) Plotly.purge(c);
  }

  /** The whole run's statistics of the tensor, from the server's history. */
  async fetchHistory(state, name) {
    const id = ++this.fetchId;
    const res = await api.detail({ params: [name], run: state.runId ?? undefined, limit: MAX_STEPS });
    if (id !== this.fetchId) return;
    if (!res.ok || !res.data || !Array.isArray(res.data.steps)) {
      this.fetched = { steps: [], stats: {} };
      this.fetchNote = `the run's history could not be read (${errorText(res)}): the steps the page holds only`;
    } else {
      const stats = {};
      for (const [k, cols] of Object.entries(res.data.stats || {})) stats[k] = (cols && cols[0]) || [];
      this.fetched = { steps: res.data.steps.map(num), stats };
      this.fetchNote = res.data.steps.length >= MAX_STEPS ? `the newest ${MAX_STEPS} sampled steps` : "";
    }
    this.draw(true);
  }

  /** On every frame: redraw when the page's rows or histograms moved (at most every REDRAW_MS). */
  update() {
    if (this.name === null) return;
    const state = this.view();
    if (state !== this.state || state.runId !== this.runId || !state.index.has(this.name)) {
      this.close(); // another run shown, or a new session
      return;
    }
    if (state.version === this.shownVersion && state.histVersion === this.shownHist) return;
    const wait = this.lastDraw + REDRAW_MS - performance.now();
    if (wait > 0) {
      if (this.timer === null)
        this.timer = setTimeout(() => {
          this.timer = null;
          this.update();
        }, wait);
      return;
    }
    this.draw(false);
  }

  /** The series over steps: the fetched history, then the streamed rows past its last step. */
  series() {
    const state = this.state;
    const i = state.index.get(this.name);
    const keys = ["grad_norm_raw", "grad_norm", "update_ratio", "nan_count", "inf_count", "param_norm"];
    const out = { steps: [] };
    for (const k of keys) out[k] = [];
    const f = this.fetched;
    let last = -Infinity;
    if (f) {
      f.steps.forEach((step, j) => {
        if (step > state.step) return; // past a rewind: another branch's
        out.steps.push(step);
        for (const k of keys) out[k].push(num((f.stats[k] || [])[j]));
        last = step;
      });
    }
    for (const row of state.snapshots) {
      if (row.step <= last || !hasStats(row, i)) continue;
      out.steps.push(row.step);
      for (const k of keys) out[k].push(num(statOf(row, k, i)));
    }
    return out;
  }

  draw(force) {
    if (this.name === null) return;
    const state = this.state;
    this.lastDraw = performance.now();
    this.shownVersion = state.version;
    const histMoved = state.histVersion !== this.shownHist;
    this.shownHist = state.histVersion;
    const s = this.series();
    this.showFacts(s);
    this.drawNorm(s);
    this.drawRatio(s);
    if (force || histMoved) {
      this.hist.param = this.name;
      this.hist.render(state, true);
    }
    this.showOptim();
    this.showHooks();
  }

  showFacts(s) {
    const state = this.state;
    const p = paramInfo(state, this.name);
    const i = state.index.get(this.name);
    const g = state.groupOf[i];
    const group = g !== undefined && g >= 0 && state.groups ? state.groups.names[g] : null;
    const n = s.steps.length;
    const lastOf = (k) => (n ? s[k][n - 1] : null);
    let bad = null;
    for (let j = 0; j < n; j++) {
      const raw = s.grad_norm_raw[j];
      if (num(s.nan_count[j]) > 0 || num(s.inf_count[j]) > 0 || (raw !== null && !Number.isFinite(raw))) {
        bad = s.steps[j];
        break;
      }
    }
    const items = [
      ["shape", Array.isArray(p.shape) ? `[${p.shape.join(", ")}]` : "–"],
      ["dtype", p.dtype || "–"],
      ["values", p.numel !== undefined ? fmt(p.numel) : "–"],
      ["module", p.module !== undefined ? p.module || "(root)" : "–"],
      ["group", group ?? "–"],
      [
        n ? `step ${s.steps[n - 1]}` : "newest",
        `‖g‖ raw ${fmt(lastOf("grad_norm_raw"))} · final ${fmt(lastOf("grad_norm"))}`,
      ],
      ["update ratio", fmt(lastOf("update_ratio"))],
      ["‖θ‖", fmt(lastOf("param_norm"))],
      ["non-finite", bad === null ? "none in these steps" : `first at step ${bad}`],
    ];
    this.facts.replaceChildren(...items.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { class: "mono" }, v)]));
    this.facts.querySelector("dd:last-of-type").classList.toggle("bad", bad !== null);
    const span = n ? `steps ${s.steps[0]}–${s.steps[n - 1]}, ${n} sampled` : "no sampled step yet";
    this.status.textContent = this.fetched
      ? `${this.fetchNote || "the whole run"}: ${span}`
      : `reading the run's history… (${span} held by the page)`;
  }

  drawNorm(s) {
    const raw = s.grad_norm_raw.map(positive);
    const fin = s.grad_norm.map(positive);
    const badX = [];
    s.steps.forEach((x, j) => {
      const r = s.grad_norm_raw[j];
      if (num(s.nan_count[j]) > 0 || num(s.inf_count[j]) > 0 || (r !== null && !Number.isFinite(r)))
        badX.push(x);
    });
    const top = Math.max(...raw.filter((v) => v !== null), ...fin.filter((v) => v !== null), 1e-30);
    const traces = [
      line("raw", s.steps, raw, COLORS.raw),
      line("final", s.steps, fin, COLORS.final, { dash: "dot" }),
    ];
    if (badX.length)
      traces.push({
        name: "NaN/Inf",
        type: "scatter",
        mode: "markers",
        x: badX,
        y: badX.map(() => top),
        marker: { color: COLORS.nonfinite, symbol: "x", size: 7 },
        hovertemplate: "step %{x}: non-finite<extra></extra>",
      });
    const any = raw.some((v) => v !== null) || fin.some((v) => v !== null);
    this.normEl.dataset.points = String(s.steps.length);
    this.normEl.dataset.firstStep = s.steps.length ? String(s.steps[0]) : "";
    this.plot(this.normEl, traces, yAxisFor([...raw, ...fin], "‖g‖"), any ? null : this.emptyNote(s, "norm"));
  }

  drawRatio(s) {
    const y = s.update_ratio.map(positive);
    const any = y.some((v) => v !== null);
    this.ratioEl.dataset.points = String(y.filter((v) => v !== null).length);
    this.plot(
      this.ratioEl,
      [line("update ratio", s.steps, y, COLORS.ratioIn)],
      yAxisFor(y, "ratio"),
      any ? null : this.emptyNote(s, "update ratio"),
    );
  }

  emptyNote(s, what) {
    if (!this.fetched && !s.steps.length) return "reading the run's history…";
    if (!s.steps.length) return `no sampled step of ${this.name} yet`;
    return `no finite ${what} in these steps`;
  }

  plot(el, traces, yaxis, note) {
    const layout = baseLayout({
      margin: { l: 52, r: 10, t: 22, b: 30 },
      hovermode: "x unified",
      showlegend: traces.length > 1,
      legend: {
        orientation: "h",
        x: 0,
        y: 1.02,
        xanchor: "left",
        yanchor: "bottom",
        bgcolor: "rgba(0,0,0,0)",
        font: { size: 10, color: COLORS.text },
      },
      xaxis: axis({ title: { text: "step" }, nticks: 6 }),
      yaxis,
      annotations: note ? [centerNote(plotlyText(note))] : [],
      uirevision: this.name,
    });
    Plotly.react(el, traces, layout, { ...PLOT_CONFIG, displayModeBar: false });
  }

  showOptim() {
    const state = this.state;
    const i = state.index.get(this.name);
    let row = null;
    for (let k = state.snapshots.length - 1; k >= 0 && !row; k--)
      if (state.snapshots[k].optim) row = state.snapshots[k];
    if (!row) {
      this.optim.replaceChildren(
        h("dd", { class: "muted" }, "no optimizer measurement (off with optim_state=False)"),
      );
      return;
    }
    const o = row.optim;
    const pos = Array.isArray(o.index) ? o.index.indexOf(i) : i;
    const get = (k) => (pos >= 0 && Array.isArray(o[k]) ? o[k][pos] : undefined);
    if (get("step_ratio") === undefined && get("cos_update_grad") === undefined) {
      this.optim.replaceChildren(
        h("dd", { class: "muted" }, `step ${row.step}: not measured for this tensor`),
      );
      return;
    }
    const items = [
      ["step", String(row.step)],
      ["‖Δθ‖/‖g‖", fmt(get("step_ratio"))],
      ["cos(Δθ, −g)", fmt(get("cos_update_grad"))],
      ["cos(g, g_prev)", fmt(get("cos_grad_prev"))],
    ];
    if (o.kind === "adam")
      items.push(
        ["Adam ‖m‖", fmt(get("exp_avg_norm"))],
        ["Adam ‖√v‖", fmt(get("exp_avg_sq_sqrt_norm"))],
        ["v below eps²", fmt(get("below_eps_frac"))],
      );
    this.optim.replaceChildren(...items.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { class: "mono" }, v)]));
  }

  showHooks() {
    const state = this.state;
    const effects = (state.latest && state.latest.hook_effects) || {};
    const mine = [...state.hooks.values()].filter((spec) => {
      if (spec.point === "module" || typeof spec.target !== "string") return false;
      try {
        return globRegExp(spec.target).test(this.name);
      } catch {
        return false;
      }
    });
    if (!mine.length) {
      this.hooks.replaceChildren(h("li", { class: "muted" }, "no hook targets this tensor"));
      return;
    }
    this.hooks.replaceChildren(
      ...mine.map((spec) => {
        const re = globRegExp(spec.target);
        const targets = state.params.filter((p) => re.test(p)).length;
        const params = Object.entries(spec.params || {})
          .map(([k, v]) => `${k}=${v}`)
          .join(", ");
        const e = effects[spec.id];
        const parts = [];
        if (e && e.changed !== undefined && e.changed !== null) parts.push(`changed ${fmt(e.changed)}`);
        if (e && e.norm_ratio !== undefined && e.norm_ratio !== null)
          parts.push(`‖g‖ × ${fmt(e.norm_ratio)}`);
        const status = spec.applied_step === null ? "pending" : spec.enabled ? "on" : "off";
        return h(
          "li",
          { dataset: { testid: "tensor-panel-hook", hook: spec.id } },
          h("span", { class: "mono" }, `${spec.id} ${spec.kind} @${spec.point}`),
          ` on ${spec.target} (${targets} tensor${targets === 1 ? "" : "s"}) · ${status}`,
          params ? h("div", { class: "muted small mono" }, params) : null,
          h(
            "div",
            { class: "small" },
            parts.length && spec.enabled
              ? `last step, over its targets: ${parts.join(" · ")}`
              : "no effect measured on the newest step",
          ),
        );
      }),
    );
  }
}

function line(name, x, y, color, extra = {}) {
  return {
    name,
    type: "scatter",
    mode: "lines",
    x,
    y,
    connectgaps: false,
    line: { color, width: 1.5, ...extra },
    hovertemplate: `${name} %{y:.3g}<extra></extra>`,
  };
}
