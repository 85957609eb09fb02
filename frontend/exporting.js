// Export from the page: every chart can save its data as
// CSV and its picture as PNG. A card calls addExport(head, chart element, opts)
// once; the two buttons read the chart as drawn at the moment of the click.
//
// Data: by default the figure's own traces (what is on screen), one row per
// point in long form: `series,x,y` (a heatmap adds `z`, one row per cell). A
// chart whose data is better as columns passes `rows: () => ({header, rows})`.

import { h } from "./util.js";

const Plotly = window.Plotly;
const PAGE_BG = "#0a0e14"; // style.css's --bg

/** One CSV field: numbers as they are, text quoted when it must be. */
function csvField(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number")
    return Number.isFinite(v) ? String(v) : Number.isNaN(v) ? "nan" : v > 0 ? "inf" : "-inf";
  let s = String(v);
  // A spreadsheet runs a cell that starts with = + - @ as a formula: a name never should.
  if (/^[=+\-@\t\r]/.test(s) && !/^[-+]?(\d|\.\d|inf|nan)/i.test(s)) s = `'${s}`;
  return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
}

/** CSV text (RFC 4180, CRLF line ends) of a header and rows of values. */
export function csvText(header, rows) {
  return [header, ...rows].map((r) => r.map(csvField).join(",")).join("\r\n") + "\r\n";
}

const ENTITIES = { "&amp;": "&", "&lt;": "<", "&gt;": ">" };
/** Plotly text back to the user's text (the inverse of plotlyText): a CSV holds the names as they are. */
const plain = (v) => (typeof v === "string" ? v.replace(/&(?:amp|lt|gt);/g, (e) => ENTITIES[e]) : v);

/**
 * A Plotly figure's traces as rows `series, x, y[, z]` (markers and helper lines included);
 * names and categories as the user wrote them, not as the Plotly text the figure holds.
 */
export function figureRows(gd) {
  const data = (gd && gd.data) || [];
  const heat = data.some((t) => t.type === "heatmap");
  const header = heat ? ["series", "x", "y", "z"] : ["series", "x", "y"];
  const rows = [];
  data.forEach((t, i) => {
    const name = plain(t.name || `trace ${i}`);
    if (t.type === "heatmap") {
      const z = t.z || [];
      // transpose: z[i] is the column for x[i]; otherwise z[j] is the row for y[j].
      const x = t.x || [];
      const y = t.y || [];
      z.forEach((line, a) =>
        (line || []).forEach((v, b) => {
          const [xi, yi] = t.transpose ? [a, b] : [b, a];
          rows.push([name, plain(x[xi] ?? xi), plain(y[yi] ?? yi), v]);
        }),
      );
      return;
    }
    const x = t.x || [];
    const y = t.y || [];
    const n = Math.max(x.length, y.length);
    for (let k = 0; k < n; k++) {
      if ((x[k] === null || x[k] === undefined) && (y[k] === null || y[k] === undefined)) continue; // a line break
      rows.push(heat ? [name, plain(x[k]), plain(y[k]), null] : [name, plain(x[k]), plain(y[k])]);
    }
  });
  return { header, rows };
}

/** Save what a URL (blob: or data:) holds as a file, through a temporary link. */
function downloadUrl(filename, url) {
  const a = h("a", { href: url, download: filename, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
}

/** Save a Blob as a file (no popup, no network). */
export function downloadBlob(filename, blob) {
  const url = URL.createObjectURL(blob);
  downloadUrl(filename, url);
  setTimeout(() => URL.revokeObjectURL(url), 0);
}

/** A file name from a chart name: letters, digits and dashes only. */
export function exportName(name, ext) {
  const base =
    String(name)
      .replace(/[^A-Za-z0-9._-]+/g, "-")
      .replace(/^-+|-+$/g, "") || "chart";
  return `gradient-inspector-${base}.${ext}`;
}

/**
 * Two small buttons, CSV and PNG, appended to `container` (a card header).
 *
 * Args:
 *   container: where the buttons go.
 *   gd: the chart's element (a Plotly graph div).
 *   opts.name: the file name's stem ("loss", "module-grads"), or a function returning it.
 *   opts.rows: optional () => {header, rows}; default figureRows(gd).
 * Returns the wrapping element (data-testid "export").
 */
export function addExport(container, gd, { name, rows } = {}) {
  const stem = () => (typeof name === "function" ? name() : name || gd.dataset.testid || "chart");
  const csv = h(
    "button",
    {
      type: "button",
      class: "btn tiny",
      dataset: { testid: "export-csv" },
      title: "save this chart's data as CSV",
      onclick: () => {
        const { header, rows: body } = rows ? rows() : figureRows(gd);
        downloadBlob(exportName(stem(), "csv"), new Blob([csvText(header, body)], { type: "text/csv" }));
      },
    },
    "CSV",
  );
  const png = h(
    "button",
    {
      type: "button",
      class: "btn tiny",
      dataset: { testid: "export-png" },
      title: "save this chart as a PNG image",
      onclick: async () => {
        if (!gd.data) return; // not drawn yet
        const width = Math.max(320, gd.clientWidth || 800);
        const height = Math.max(200, gd.clientHeight || 400);
        // The page's background goes into the picture (the paper is transparent on screen).
        const layout = { ...gd.layout, paper_bgcolor: PAGE_BG, width, height };
        const url = await Plotly.toImage(
          { data: gd.data, layout },
          { format: "png", width, height, scale: 2 },
        );
        downloadUrl(exportName(stem(), "png"), url);
      },
    },
    "PNG",
  );
  const wrap = h("span", { class: "export", dataset: { testid: "export" } }, csv, png);
  container.append(wrap);
  return wrap;
}
