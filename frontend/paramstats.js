// Per-parameter statistics: any of the statistics the core
// takes for every parameter (mean, std, abs-max raw/final, norm raw/final,
// NaN/Inf counts, update ratio) as time series of the picked parameters, one
// row of the chart per statistic, and a sortable table of the newest sampled
// step. Parameters are picked by clicking a chart (the heatmap, the flow or the
// ratio chart, a table row) or by a name filter: a glob matched by the server
// with the targets' rule (GET /api/targets), never re-implemented here. A large
// run's table lists the tensors the page has detail of (picked, pinned, expanded,
// drilled into, worst now), not every tensor; each row can be pinned.

import { api, errorText } from "./api.js";
import { STATS, hasStats, statOf } from "./state.js";
import { SERIES_COLORS } from "./modulechart.js";
import { logTicks } from "./ticks.js";
import { COLORS, TIME_HOVER, axis, baseLayout, centerNote } from "./theme.js";
import { StepChart, sharedRange } from "./timeline.js";
import { debounce, fmt, h, num, plotlyText, plottable, positive } from "./util.js";

export const MAX_PICKED = 8; // lines per statistic
const DEFAULT_STATS = ["grad_mean", "grad_std"];

export class ParamStats extends StepChart {
  /**
   * Args: el: the chart; controls: {stats (toggle buttons' group), filter (input),
   * status (the filter's message), picked (the chips), table}.
   */
  constructor(el, controls) {
    super();
    this.el = el;
    this.c = controls;
    this.picked = []; // parameter names, in pick order
    this.stats = [...DEFAULT_STATS];
    this.sort = { key: "grad_norm_raw", desc: true };
    this.shown = null;
    this.tableShown = null;
    this.state = null;
    this.onChange = () => {}; // set by app.js: redraw now
    this.onPicked = () => {}; // set by app.js: the picks changed (subscribe to their detail)
    this.onOpen = () => {}; // set by app.js: a row clicked (the tensor panel opens it)
    this.pinButton = null; // set by app.js: (name) => a pin toggle for a table row
    this.buildStatToggles();
    const filter = debounce(() => this.applyFilter(), 300);
    this.c.filter.addEventListener("input", filter);
    this.c.filter.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") this.applyFilter();
    });
  }

  buildStatToggles() {
    this.c.stats.replaceChildren(
      ...STATS.map((s) =>
        h(
          "button",
          {
            type: "button",
            dataset: { value: s.key },
            "aria-pressed": this.stats.includes(s.key) ? "true" : "false",
            onclick: (ev) => this.toggleStat(s.key, ev.currentTarget),
          },
          s.label,
        ),
      ),
    );
  }

  toggleStat(key, btn) {
    if (this.stats.includes(key)) {
      if (this.stats.length === 1) return; // one statistic at least
      this.stats = this.stats.filter((k) => k !== key);
    } else this.stats = STATS.map((s) => s.key).filter((k) => k === key || this.stats.includes(k));
    btn.setAttribute("aria-pressed", this.stats.includes(key) ? "true" : "false");
    this.onChange();
  }

  /** Add a parameter to the picked ones (a click on a chart); the oldest goes past MAX_PICKED. */
  pick(name) {
    if (!name) return;
    this.picked = [...this.picked.filter((p) => p !== name), name].slice(-MAX_PICKED);
    this.showPicked();
    this.onPicked();
    this.onChange();
  }

  unpick(name) {
    this.picked = this.picked.filter((p) => p !== name);
    this.showPicked();
    this.onPicked();
    this.onChange();
  }

  /** A new run or view: keep the picks its parameters have. */
  setParams(params) {
    this.picked = this.picked.filter((p) => params.includes(p));
    this.showPicked();
  }

  async applyFilter() {
    const glob = this.c.filter.value.trim();
    const status = this.c.status;
    if (!glob) {
      status.textContent = "";
      delete status.dataset.state;
      return;
    }
    const res = await api.targets(glob, "pre_step");
    if (glob !== this.c.filter.value.trim()) return; // typed on since
    if (!res.ok) {
      status.textContent = errorText(res);
      status.dataset.state = "error";
      return;
    }
    const matches = (res.data && res.data.matches) || [];
    status.dataset.state = matches.length ? "ok" : "error";
    status.textContent = matches.length
      ? `${matches.length} match${matches.length === 1 ? "" : "es"}${matches.length > MAX_PICKED ? `: the first ${MAX_PICKED} shown` : ""}`
      : "no parameter matches";
    if (!matches.length) return;
    this.picked = matches.slice(0, MAX_PICKED);
    this.showPicked();
    this.onPicked();
    this.onChange();
  }

  showPicked() {
    this.c.picked.replaceChildren(
      ...this.picked.map((p, i) =>
        h(
          "span",
          { class: "chip mono", dataset: { testid: "param-chip", param: p } },
          h("span", { class: "chip-dot", style: { background: SERIES_COLORS[i % SERIES_COLORS.length] } }),
          p,
          h(
            "button",
            { type: "button", class: "chip-x", title: `remove ${p}`, onclick: () => this.unpick(p) },
            "×",
          ),
        ),
      ),
    );
  }

  render(state, force) {
    this.state = state;
    const key = `${state.version}|${this.picked.join(",")}|${this.stats.join(",")}`;
    if (force || key !== this.shown) {
      this.shown = key;
      this.drawChart(state);
    }
    const tkey = `${state.version}|${this.sort.key}|${this.sort.desc}`;
    if (force || tkey !== this.tableShown) {
      this.tableShown = tkey;
      this.drawTable(state);
    }
  }

  drawChart(state) {
    const rows = state.snapshots;
    const x = rows.map((r) => r.step);
    const stats = STATS.filter((s) => this.stats.includes(s.key));
    const n = stats.length;
    const gap = 0.06;
    const hgt = (1 - gap * (n - 1)) / n;
    const traces = [];
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 64, r: 16, t: 8, b: 40 },
      showlegend: false, // the chips say which colour is which
      height: 60 + n * 130,
    });
    stats.forEach((s, si) => {
      const ax = si === 0 ? "" : String(si + 1);
      const values = [];
      this.picked.forEach((p, pi) => {
        const i = state.params.indexOf(p);
        if (i < 0) return;
        const conv = s.scale === "log" ? positive : plottable;
        const y = rows.map((r) => conv(statOf(r, s.key, i)));
        values.push(...y);
        traces.push({
          name: plotlyText(`${p} ${s.label}`),
          meta: { param: p, stat: s.key },
          type: "scatter",
          mode: "lines",
          x,
          y,
          xaxis: `x${ax}`,
          yaxis: `y${ax}`,
          line: { color: SERIES_COLORS[pi % SERIES_COLORS.length], width: 1.4 },
          text: plotlyText(p), // a name goes in as text: a template would read "%{" in it
          hovertemplate: `%{text}: ${s.label} %{y:.4g}<extra></extra>`,
        });
      });
      const top = 1 - si * (hgt + gap);
      layout[`yaxis${ax}`] = axis({
        domain: [Math.max(0, top - hgt), top],
        type: s.scale,
        title: { text: s.label },
        ...(s.scale === "log" ? logTicks(values) : {}),
      });
      layout[`xaxis${ax}`] = axis({
        anchor: `y${ax}`,
        matches: si === 0 ? undefined : "x",
        showticklabels: si === n - 1,
        title: { text: si === n - 1 ? "step" : "" },
        ...(si === 0 ? sharedRange(this, state) : {}), // the others match it
      });
    });
    if (!this.picked.length)
      layout.annotations = [
        centerNote(
          "pick a parameter: click the heatmap, the flow chart or a table row, or type a name filter",
        ),
      ];
    if (this.el.style.height !== `${layout.height}px`) this.el.style.height = `${layout.height}px`;
    this.el.dataset.params = JSON.stringify(this.picked);
    this.el.dataset.stats = JSON.stringify(this.stats);
    this.draw(traces, layout, state);
  }

  drawTable(state) {
    const row = state.latest;
    const table = this.c.table;
    table.dataset.step = row ? String(row.step) : "";
    const head = h(
      "tr",
      {},
      h("th", { "aria-sort": this.ariaSort("name") }, this.sortButton("name", "parameter")),
      ...STATS.map((s) => h("th", { "aria-sort": this.ariaSort(s.key) }, this.sortButton(s.key, s.label))),
    );
    const body = [];
    if (row) {
      const order = state.large
        ? [...row.detail.keys()].filter((i) => hasStats(row, i))
        : state.params.map((p, i) => i);
      const { key, desc } = this.sort;
      const val = (i) => (key === "name" ? state.params[i] : num(statOf(row, key, i)));
      order.sort((a, b) => {
        const va = val(a);
        const vb = val(b);
        if (va === vb) return a - b;
        if (va === null || Number.isNaN(va)) return 1; // no value last, either way
        if (vb === null || Number.isNaN(vb)) return -1;
        const c = va < vb ? -1 : 1;
        return desc ? -c : c;
      });
      for (const i of order) {
        const p = state.params[i];
        body.push(
          h(
            "tr",
            {
              dataset: { testid: "param-row", param: p },
              class: this.picked.includes(p) ? "picked" : "",
              onclick: () => {
                this.pick(p);
                this.onOpen(p);
              },
              title: `show ${p}'s series and open it`,
            },
            h("td", { class: "mono name" }, this.pinButton ? this.pinButton(p) : null, p),
            ...STATS.map((s) =>
              h("td", { class: "mono num", dataset: { stat: s.key } }, fmt(statOf(row, s.key, i))),
            ),
          ),
        );
      }
    }
    table.replaceChildren(h("thead", {}, head), h("tbody", {}, ...body));
    const note = document.querySelector('[data-role="param-table-note"]');
    if (note)
      note.textContent = state.large
        ? `the newest sampled step of the ${body.length} tensors followed (picked, pinned, expanded, drilled into, worst now) of ${state.params.length}; click a column to sort, a row to plot it`
        : "the newest sampled step; click a column to sort, a row to plot it";
  }

  ariaSort(key) {
    return this.sort.key === key ? (this.sort.desc ? "descending" : "ascending") : "none";
  }

  sortButton(key, label) {
    const on = this.sort.key === key;
    return h(
      "button",
      {
        type: "button",
        class: `sort${on ? " on" : ""}`,
        dataset: { testid: "param-sort", key },
        onclick: () => {
          this.sort = { key, desc: on ? !this.sort.desc : key !== "name" };
          this.render(this.state, false);
        },
      },
      label,
      on ? (this.sort.desc ? " ▾" : " ▴") : "",
    );
  }
}
