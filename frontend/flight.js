// The Recent steps card: the flight recorder (inspector/stats/flight.py) and the spike
// detector's settings. A dump (a spike, a NaN/Inf, or the "Read the recorder now" button: POST
// /api/flight) holds every step of the last N at full resolution, unsampled ones too: the
// chart draws its global gradient norm (raw and final) and the loss over those steps, the
// groups whose norm rose most, the non-finite steps and the spike markers, with the
// incident's step marked. Dumps arrive as `flight` websocket messages and show at once; on a
// (re)connection, and in a replay, the stored rows come from GET /api/flight. The settings
// form edits z / warm-up / cooldown (PUT /api/spikes); a refused value's reason shows beside
// its field. The card stays hidden while the run has no recorder and no stored dump.

import { api, detailList, detailText } from "./api.js";
import { COLORS, PLOT_CONFIG, TIME_HOVER, axis, baseLayout, centerNote } from "./theme.js";
import { fmt, h, num, plotlyText, plottable, positive } from "./util.js";

const Plotly = window.Plotly;
const GROUP_COLORS = ["#d2a8ff", "#56d4dd", "#ff9492", "#e3b341"];
const TOP = 4; // groups drawn: those whose norm rose most over the dump
const FIELDS = [
  ["z", "z", "a spike: z above this (sigmas)"],
  ["warmup", "warm-up", "steps a signal must have seen before it can spike"],
  ["cooldown", "cooldown", "at most one event per signal per this many steps"],
];

export class FlightCard {
  /**
   * @param {HTMLElement} card the card (data-testid card-flight)
   * @param {{spikes: () => object[], note: (text: string) => void}} hooks the view's spike
   *   markers ({x, text}), and a line for the event log
   */
  constructor(card, { spikes, note }) {
    this.dumps = 0; // flight messages received (load() keeps a newer one over its stored rows)
    this.card = card;
    this.chart = card.querySelector('[data-testid="chart-flight"]');
    this.status = card.querySelector('[data-testid="flight-status"]');
    this.button = card.querySelector('[data-testid="flight-now"]');
    this.form = card.querySelector('[data-testid="spike-form"]');
    this.spikes = spikes;
    this.note = note;
    this.rows = new Map(); // step -> row (a step dumped again keeps its newest row)
    this.groups = [];
    this.incident = null; // {step, reason}
    this.settings = null; // the detector's settings (null: no live recorder)
    this.drawn = false;
    this.fields = {};
    this.buildForm();
    this.button.addEventListener("click", () => this.requestNow());
  }

  buildForm() {
    const err = h("span", { class: "field-error", role: "alert", dataset: { testid: "spike-error" } });
    const items = FIELDS.map(([key, label, title]) => {
      const input = h("input", {
        type: "number",
        step: "any",
        name: key,
        title,
        class: "mono",
        dataset: { testid: `spike-${key}` },
      });
      const error = h("span", { class: "field-error", dataset: { testid: `spike-${key}-error` } });
      this.fields[key] = { input, error };
      return h("label", { class: "field spike-field" }, h("span", {}, label), input, error);
    });
    const apply = h("button", { type: "submit", dataset: { testid: "spike-apply" } }, "Apply");
    this.formError = err;
    this.form.append(...items, apply, err);
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.save();
    });
  }

  /** A new connection or run: the detector's settings (live only) and the stored dumps. */
  async load(runId, { live, stored }) {
    const none = Promise.resolve(null);
    const gen = this.dumps; // a dump that arrives while these requests are out is newer than them
    const [s, f] = await Promise.all([
      live ? api.spikes() : none,
      stored ? api.flight({ run: runId ?? undefined }) : none, // (no database: nothing stored)
    ]);
    this.settings = s && s.ok && s.data ? s.data.settings : null;
    if (this.dumps !== gen) {
      this.showSettings();
      return;
    }
    this.rows = new Map();
    this.incident = null;
    for (const r of f && f.ok && f.data ? f.data.rows || [] : []) this.rows.set(num(r.step), r);
    const bad = [...this.rows.values()].filter((r) => r.nonfinite);
    if (bad.length) this.incident = { step: num(bad[0].step), reason: "nonfinite" };
    this.showSettings();
    this.card.hidden = !this.settings && !this.rows.size;
    this.draw();
  }

  /** The run's group names (the session's partition), for stored rows. */
  setGroups(names) {
    if (!this.groups.length) this.groups = names || [];
  }

  /** A `flight` websocket message: a dump; it replaces what was shown. */
  onMessage(msg) {
    this.dumps += 1;
    this.groups = msg.groups || this.groups;
    this.rows = new Map((msg.rows || []).map((r) => [num(r.step), r]));
    this.incident = msg.reason === "request" ? null : { step: num(msg.step), reason: msg.reason };
    this.bytes = num(msg.bytes);
    this.card.hidden = false;
    this.draw();
  }

  /** A rewind to `step`: the steps after it belong to the abandoned branch (the server drops them
   * too), and so does an incident among them. */
  onRewind(step) {
    let dropped = false;
    for (const s of [...this.rows.keys()]) {
      if (s > step) {
        this.rows.delete(s);
        dropped = true;
      }
    }
    if (this.incident && this.incident.step > step) this.incident = null;
    if (dropped) this.draw();
  }

  /** A spike marker came: redraw if it falls inside the dump. */
  onSpike(step) {
    const steps = [...this.rows.keys()];
    if (steps.length && step >= steps[0] && step <= steps[steps.length - 1]) this.draw();
  }

  async requestNow() {
    this.button.disabled = true;
    const res = await api.flightNow();
    this.button.disabled = false;
    if (!res.ok) {
      this.status.textContent = `Recent steps: ${detailList(res.data).map(detailText).join("; ")}`;
      return;
    }
    this.onMessage(res.data); // (the same dump also comes as a flight message)
  }

  showSettings() {
    const on = Boolean(this.settings);
    this.form.hidden = !on;
    this.button.hidden = !on;
    if (!on) return;
    for (const [key] of FIELDS) {
      const f = this.fields[key];
      f.input.value = String(this.settings[key]);
      f.error.textContent = "";
      f.input.closest(".field").classList.remove("invalid");
    }
    this.formError.textContent = "";
  }

  async save() {
    const body = {};
    for (const [key] of FIELDS) {
      const raw = this.fields[key].input.value.trim();
      if (raw !== "") body[key] = Number(raw);
    }
    const res = await api.setSpikes(body);
    if (res.ok) {
      this.settings = res.data.settings;
      this.showSettings();
      this.note(
        `spike detection: z ${this.settings.z}, warm-up ${this.settings.warmup}, cooldown ${this.settings.cooldown}`,
      );
      return;
    }
    for (const [key] of FIELDS) {
      this.fields[key].error.textContent = "";
      this.fields[key].input.closest(".field").classList.remove("invalid");
    }
    this.formError.textContent = "";
    for (const d of detailList(res.data)) {
      const key = d.loc.find((k) => k in this.fields);
      if (key) {
        this.fields[key].error.textContent = d.msg;
        this.fields[key].input.closest(".field").classList.add("invalid");
      } else this.formError.textContent = detailText(d);
    }
  }

  /** The steps shown: [row], oldest first. */
  shownRows() {
    return [...this.rows.values()].sort((a, b) => num(a.step) - num(b.step));
  }

  draw() {
    if (!Plotly || this.card.hidden) return;
    const rows = this.shownRows();
    const x = rows.map((r) => num(r.step));
    const traces = [];
    const line = (name, y, color, width, extra = {}) => ({
      name,
      x,
      y,
      type: "scatter",
      mode: "lines",
      line: { color, width },
      connectgaps: false,
      ...extra,
    });
    traces.push(
      line(
        "‖g‖ raw",
        rows.map((r) => positive(r.norm_raw)),
        COLORS.raw,
        2,
        {
          hovertemplate: "‖g‖ raw %{y:.4g}<extra></extra>",
        },
      ),
    );
    traces.push(
      line(
        "‖g‖ final",
        rows.map((r) => positive(r.norm)),
        COLORS.final,
        1.2,
        {
          line: { color: COLORS.final, width: 1.2, dash: "dot" },
          hovertemplate: "‖g‖ final %{y:.4g}<extra></extra>",
        },
      ),
    );
    traces.push(
      line(
        "loss",
        rows.map((r) => plottable(r.loss)),
        COLORS.loss,
        1.4,
        {
          yaxis: "y2",
          hovertemplate: "loss %{y:.4g}<extra></extra>",
        },
      ),
    );
    for (const [k, g] of this.topGroups(rows).entries()) {
      const color = GROUP_COLORS[k % GROUP_COLORS.length];
      const name = this.groups[g] ?? `group ${g}`;
      traces.push(
        line(
          plotlyText(name),
          rows.map((r) => positive((r.groups_raw || [])[g])),
          color,
          1,
          {
            hovertemplate: `${plotlyText(name)} ‖g‖ %{y:.4g}<extra></extra>`,
          },
        ),
      );
    }
    const bad = rows.filter((r) => r.nonfinite);
    traces.push({
      name: "NaN/Inf",
      x: bad.map((r) => num(r.step)),
      y: bad.map(() => 0.04),
      yaxis: "y3",
      type: "scatter",
      mode: "markers",
      marker: { color: COLORS.nonfinite, size: 9, symbol: "x" },
      hovertemplate: "a non-finite gradient norm or loss<extra></extra>",
    });
    const lo = x.length ? x[0] : 0;
    const hi = x.length ? x[x.length - 1] : 0;
    const sp = x.length ? this.spikes().filter((m) => m.x >= lo && m.x <= hi) : [];
    traces.push({
      name: "spike",
      x: sp.map((m) => m.x),
      y: sp.map(() => 0.96),
      hovertext: sp.map((m) => m.text),
      yaxis: "y3",
      type: "scatter",
      mode: "markers",
      marker: { color: COLORS.spike, size: 11, symbol: "triangle-down" },
      hovertemplate: "%{hovertext}<extra></extra>",
    });
    const shapes = [];
    const annotations = [];
    if (!rows.length) annotations.push(centerNote('no steps recorded yet: press "Read the recorder now"'));
    if (this.incident && this.incident.step !== null && x.length) {
      const s = this.incident.step;
      const color = this.incident.reason === "spike" ? COLORS.spike : COLORS.nonfinite;
      shapes.push({
        type: "line",
        xref: "x",
        yref: "paper",
        x0: s,
        x1: s,
        y0: 0,
        y1: 1,
        line: { color, width: 1.5, dash: "dash" },
      });
      annotations.push({
        x: s,
        xref: "x",
        y: 1,
        yref: "paper",
        yanchor: "bottom",
        text: `${this.incident.reason === "spike" ? "spike" : "NaN/Inf"} at step ${s}`,
        showarrow: false,
        font: { size: 11, color },
      });
    }
    const layout = baseLayout({
      ...TIME_HOVER,
      margin: { l: 56, r: 56, t: 22, b: 40 },
      xaxis: axis({ title: { text: "step (every step)" } }),
      yaxis: axis({ type: "log", title: { text: "‖g‖" } }),
      yaxis2: axis({ overlaying: "y", side: "right", showgrid: false, title: { text: "loss" } }),
      yaxis3: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true },
      shapes,
      annotations,
      showlegend: true,
    });
    Plotly.react(this.chart, traces, layout, PLOT_CONFIG);
    this.drawn = true;
    this.chart.dataset.steps = String(x.length);
    this.chart.dataset.incident = this.incident ? String(this.incident.step) : "";
    this.showStatus(rows);
  }

  /** The groups whose norm rose most (largest over smallest, present values) in the dump. */
  topGroups(rows) {
    const n = Math.max(0, ...rows.map((r) => (r.groups_raw || []).length));
    if (n <= 1) return [];
    const rise = [];
    for (let g = 0; g < n; g++) {
      const vals = rows.map((r) => positive((r.groups_raw || [])[g])).filter((v) => v !== null);
      if (vals.length) rise.push([Math.max(...vals) / Math.min(...vals), g]);
    }
    rise.sort((a, b) => b[0] - a[0]);
    return rise.slice(0, TOP).map(([, g]) => g);
  }

  showStatus(rows) {
    if (!rows.length) {
      this.status.textContent = this.settings ? "the recorder keeps the last steps on the device" : "";
      return;
    }
    const first = num(rows[0].step);
    const last = num(rows[rows.length - 1].step);
    const parts = [`steps ${first}–${last} (${rows.length})`];
    if (this.incident)
      parts.push(`${this.incident.reason === "spike" ? "spike" : "NaN/Inf"} at ${this.incident.step}`);
    if (this.bytes) parts.push(`ring ${fmt(this.bytes / 2 ** 20)} MiB on the device`);
    this.status.textContent = parts.join(" · ");
  }
}
