// The loss chart's own controls, built into its card header:
// "whole run" (the shared step axis from step 1, downsampled), an EMA smoothing slider
// (TensorBoard's; the raw lines stay, faint), and a run to compare with (its loss, its
// final global norm and its hook-change markers overlaid, from the same database).

import { api, errorText } from "./api.js";
import { SELECTORS } from "./selectors.js";
import { markerFor } from "./state.js";
import { fmtShortDate, h, num, positive } from "./util.js";

/**
 * @param {object} o
 * @param {HTMLElement} o.header the loss card's header
 * @param {object} o.loss the LossChart
 * @param {object} o.timeline the Timeline
 * @param {() => object} o.view the DashboardState shown
 * @param {() => void} o.redraw redraw the loss chart now
 * @param {(text: string) => void} o.note a line for the event log
 */
export function timeControls({ header, loss, timeline, view, redraw, note }) {
  const whole = h(
    "button",
    {
      class: "btn tiny whole-run",
      type: "button",
      dataset: { testid: SELECTORS.wholeRun },
      title:
        "show the whole run on every time chart (downsampled; zoom in for full resolution; double-click a chart does the same)",
      onclick: () => timeline.wholeRun(),
    },
    "whole run",
  );
  const value = h("span", { class: "mono small", dataset: { testid: SELECTORS.smoothingValue } }, "0");
  const slider = h("input", {
    type: "range",
    min: "0",
    max: "0.99",
    step: "0.01",
    value: "0",
    "aria-label": "smoothing",
    dataset: { testid: SELECTORS.smoothing },
    oninput: () => {
      loss.smoothing = Number(slider.value);
      value.textContent = slider.value;
      redraw();
    },
  });
  const smoothing = h(
    "label",
    { class: "smoothing", title: "exponential moving average of loss and norms (raw values stay, faint)" },
    h("span", { class: "muted small" }, "smooth"),
    slider,
    value,
  );
  const picker = h(
    "select",
    {
      class: "compare-run",
      "aria-label": "compare with run",
      title: "overlay another run of the database: its loss, final norm and hook changes",
      dataset: { testid: SELECTORS.compareRun },
    },
    h("option", { value: "" }, "compare: none"),
  );
  const fill = async () => {
    const res = await api.runs();
    if (!res.ok) return;
    const shown = String(view().runId);
    const chosen = picker.value;
    const runs = (res.data.runs || []).filter((r) => String(r.id) !== shown);
    picker.replaceChildren(
      h("option", { value: "" }, "compare: none"),
      ...runs.map((r) =>
        h(
          "option",
          { value: String(r.id) },
          `vs #${r.id}${r.scenario ? ` ${r.scenario}` : ""} · ${num(r.steps) ?? 0} steps · ${fmtShortDate(r.started)}`,
        ),
      ),
    );
    picker.value = runs.some((r) => String(r.id) === chosen) ? chosen : "";
  };
  picker.addEventListener("focus", fill);
  picker.addEventListener("pointerdown", fill);
  picker.addEventListener("change", async () => {
    const state = view();
    const id = picker.value;
    if (!id) {
      state.compare = null;
      redraw();
      return;
    }
    const cmp = await loadCompare(id, Math.round((loss.el.clientWidth || 800) / 2));
    if (view() !== state) return;
    if (cmp.error) {
      note(`compare with run ${id}: ${cmp.error}`);
      picker.value = "";
      return;
    }
    state.compare = cmp;
    redraw();
  });
  const anchor = header.querySelector('[data-testid="loss-scale"]');
  for (const el of [whole, smoothing, picker]) header.insertBefore(el, anchor);
  return {
    /** A new view (another run, a restart): its own comparison, none yet. */
    reset() {
      picker.value = view().compare ? String(view().compare.runId) : "";
    },
  };
}

/** Another run's loss, final global norm and hook markers, downsampled to `buckets` per series. */
async function loadCompare(run, buckets) {
  const b = Math.max(50, Math.min(2000, buckets));
  const [scal, snaps, evs] = await Promise.all([
    api.scalars({ run, buckets: b }),
    api.snapshots({ run, buckets: b }),
    api.events({ run }),
  ]);
  for (const r of [scal, snaps, evs]) if (!r.ok) return { error: errorText(r) };
  const loss = { x: [], y: [] };
  for (const r of scal.data.scalars || []) {
    const v = num(r.loss);
    if (v === null) continue;
    loss.x.push(num(r.step));
    loss.y.push(Number.isFinite(v) ? v : null);
  }
  const norm = { x: [], y: [] };
  for (const s of snaps.data.snapshots || []) {
    norm.x.push(num(s.step));
    norm.y.push(positive(s.total_norm));
  }
  const markers = (evs.data.events || []).map(markerFor).filter((m) => m && m.kind !== "nonfinite");
  return { runId: num(run), loss, norm, markers };
}
