// Every element a test touches (tests/, scripts/screenshots.py), by its
// data-testid. The modules find and build their elements through this object;
// index.html, static HTML, spells the ids of its own elements out, so a rename
// there is made in both.
export const SELECTORS = {
  connectionStatus: "connection-status",
  stepCounter: "step-counter",
  trainingState: "training-state",
  scenario: "scenario",
  runPicker: "run-picker",
  historyBanner: "history-banner",
  backToLive: "back-to-live",
  readOnlyBadge: "read-only-badge",
  overhead: "overhead",
  cadence: "cadence",
  pause: "pause",
  resume: "resume",
  step: "step",
  rate: "rate",
  chartLoss: "chart-loss",
  chartHeatmap: "chart-heatmap",
  chartFlow: "chart-flow",
  chartHist: "chart-hist",
  chartRatio: "chart-ratio",
  heatmapSource: "heatmap-source",
  flowMetric: "flow-metric",
  histParam: "hist-param",
  histStatus: "hist-status",
  histScale: "hist-scale",
  lossScale: "loss-scale",
  wholeRun: "whole-run",
  smoothing: "smoothing",
  smoothingValue: "smoothing-value",
  compareRun: "compare-run",
  hookList: "hook-list",
  hookRow: "hook-row",
  hookToggle: "hook-toggle",
  hookRemove: "hook-remove",
  hookStatus: "hook-status",
  hookTarget: "hook-target",
  hookError: "hook-error",
  fieldError: "field-error",
  addHookForm: "add-hook-form",
  addHookKind: "add-hook-kind",
  addHookTarget: "add-hook-target",
  addHookPoint: "add-hook-point",
  addHookMatches: "add-hook-matches",
  addHookSubmit: "add-hook-submit",
  addHookEnabled: "add-hook-enabled",
  addHookError: "add-hook-error",
  presetExport: "preset-export",
  presetPython: "preset-python",
  presetImport: "preset-import",
  presetImportButton: "preset-import-button",
  presetError: "preset-error",
  presetDialog: "preset-dialog",
  presetText: "preset-text",
  eventLog: "event-log",
  eventItem: "event-item",
  exportCsv: "export-csv",
  exportPng: "export-png",
};

/** `hook-param-<name>`: a parameter field, in a hook row and in the add-hook form. */
export const paramTestId = (name) => `hook-param-${name}`;

/** The element with this data-testid under `root` (the document by default). */
export function byTestId(id, root = document) {
  return root.querySelector(`[data-testid="${id}"]`);
}
