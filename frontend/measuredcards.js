// The cards that show what the core measures beyond the main charts: module
// gradients, per-parameter statistics, histograms over steps and hook
// effects, read from the DashboardState shown (state.js: the rows
// every chart reads). app.js makes one MeasuredCards, adds its charts to the
// scheduler, tells it which parameter was picked on another chart (pick), and
// joins its charts to the time charts' shared step axis (join: timeline.js).

import { api } from "./api.js";
import { EffectsChart } from "./effectschart.js";
import { HistTimeChart } from "./histtime.js";
import { ModuleChart, moduleEffects } from "./modulechart.js";
import { ParamStats } from "./paramstats.js";
import { byTestId } from "./selectors.js";

export class MeasuredCards {
  /** @param {() => object} scheduler the page's Scheduler (built after these charts) */
  constructor(scheduler) {
    this.scheduler = scheduler;
    this.modules = new ModuleChart(byTestId("chart-modules"));
    this.params = new ParamStats(byTestId("chart-param-stats"), {
      stats: byTestId("param-stats-toggle"),
      filter: byTestId("param-filter"),
      status: byTestId("param-filter-status"),
      picked: byTestId("param-picked"),
      table: byTestId("param-table"),
    });
    this.params.onChange = () => this.scheduler().resetNow("paramStats");
    this.histTime = new HistTimeChart(byTestId("chart-hist-time"));
    this.effects = new EffectsChart(byTestId("chart-effects"));
    this.targets = new Map(); // module_log target -> matching module names (null while asked)
    const seg = byTestId("hist-time-source");
    seg.addEventListener("click", (ev) => {
      const btn = ev.target.closest("button[data-value]");
      if (!btn || btn.getAttribute("aria-pressed") === "true") return;
      for (const b of seg.querySelectorAll("button")) b.setAttribute("aria-pressed", String(b === btn));
      this.histTime.source = btn.dataset.value;
      this.scheduler().resetNow("histTime");
    });
  }

  /** The scheduler's entries: [name, chart]. */
  charts() {
    return [
      ["modules", this.modules],
      ["paramStats", this.params],
      ["histTime", this.histTime],
      ["effects", this.effects],
    ];
  }

  /** Every card's chart joins the time charts' shared step axis (zoom and pan linked). */
  join(timeline) {
    for (const [, chart] of this.charts()) timeline.join(chart);
  }

  /** A parameter picked on another chart (or the histogram's list); `stats` false: the histogram
   * over steps follows it, the parameter statistics keep their picks. */
  pick(name, { stats = true } = {}) {
    if (stats) this.params.pick(name);
    this.histTime.param = name;
    this.scheduler().resetNow("histTime");
  }

  /** The page shows another state (a new run, an earlier one): keep the picks it has. */
  setParams(params) {
    this.params.setParams(params);
  }

  /** Each module_log hook's newest module values, shown in its row like an effect. */
  moduleEffects(state) {
    return moduleEffects(state, (target) => this.matches(target));
  }

  matches(target) {
    if (this.targets.has(target)) return this.targets.get(target);
    this.targets.set(target, null);
    api.targets(target, "module").then((res) => {
      if (res.ok) this.targets.set(target, (res.data && res.data.matches) || []);
      else this.targets.delete(target); // asked again next time
    });
    return null;
  }
}
