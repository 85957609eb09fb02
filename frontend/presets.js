// Hook presets: export the live hooks as JSON or as Python, import a JSON
// preset (it replaces every hook as one change), and the dialog that shows an
// export with Copy and Download.

import { api, errorText } from "./api.js";
import { SELECTORS } from "./selectors.js";
import { h } from "./util.js";

export class Presets {
  /**
   * @param {HTMLElement} el the presets' container, filled here
   * @param {PresetDialog} dialog where exports are shown
   */
  constructor(el, dialog) {
    this.dialog = dialog;
    this.file = h("input", {
      type: "file",
      accept: "application/json,.json",
      hidden: true,
      dataset: { testid: SELECTORS.presetImport },
      onchange: () => this.importFile(),
    });
    this.exportBtn = h(
      "button",
      { class: "btn", dataset: { testid: SELECTORS.presetExport }, onclick: () => this.exportJson() },
      "Export JSON",
    );
    this.pythonBtn = h(
      "button",
      { class: "btn", dataset: { testid: SELECTORS.presetPython }, onclick: () => this.exportPython() },
      "Copy as Python",
    );
    this.importBtn = h(
      "button",
      { class: "btn", dataset: { testid: SELECTORS.presetImportButton }, onclick: () => this.file.click() },
      "Import…",
    );
    this.message = h("div", {
      class: "row-error",
      role: "alert",
      dataset: { testid: SELECTORS.presetError },
    });
    el.replaceChildren(
      h("div", { class: "preset-buttons" }, this.exportBtn, this.pythonBtn, this.importBtn, this.file),
      this.message,
    );
  }

  setDisabled(on, historical = false) {
    // Exports read (the live hooks); only import changes anything.
    this.importBtn.disabled = on;
    this.file.disabled = on;
    this.exportBtn.disabled = historical;
    this.pythonBtn.disabled = historical;
  }

  async exportJson() {
    const res = await api.exportHooks();
    if (!res.ok) return this.fail(res);
    const text = JSON.stringify(res.data, null, 2);
    this.dialog.show("Hook preset (JSON)", text, { filename: "hooks-preset.json", type: "application/json" });
  }

  async exportPython() {
    const res = await api.exportPython();
    if (!res.ok) return this.fail(res);
    const text = typeof res.data === "string" ? res.data : JSON.stringify(res.data);
    const copied = await copyText(text);
    this.dialog.show(copied ? "Copied to the clipboard" : "Hooks as Python", text, {
      filename: "hooks.py",
      type: "text/x-python",
    });
  }

  async importFile() {
    const file = this.file.files && this.file.files[0];
    this.file.value = "";
    if (!file) return;
    this.message.textContent = "";
    let preset;
    try {
      preset = JSON.parse(await file.text());
    } catch (err) {
      this.message.textContent = `${file.name}: not JSON (${err.message})`;
      return;
    }
    const res = await api.importHooks(preset);
    if (!res.ok) return this.fail(res); // accepted: the list comes as a `hooks` message
  }

  fail(res) {
    this.message.textContent = errorText(res);
  }
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false; // not a secure context, or no permission: the dialog shows the text
  }
}

/** The dialog that shows an exported preset with Copy and Download. */
export class PresetDialog {
  constructor(el) {
    this.el = el;
    this.title = h("h3");
    this.text = h("textarea", {
      readonly: true,
      spellcheck: false,
      dataset: { testid: SELECTORS.presetText },
    });
    this.copyBtn = h("button", { class: "btn", onclick: () => this.copy() }, "Copy");
    this.download = h("a", { class: "btn", download: "preset.json" }, "Download");
    el.replaceChildren(
      this.title,
      this.text,
      h(
        "div",
        { class: "form-actions" },
        this.copyBtn,
        this.download,
        h("span", { class: "grow" }),
        h("button", { class: "btn primary", onclick: () => el.close() }, "Close"),
      ),
    );
    this.url = null;
  }

  show(title, text, { filename, type }) {
    this.title.textContent = title;
    this.text.value = text;
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = URL.createObjectURL(new Blob([text], { type }));
    this.download.href = this.url;
    this.download.download = filename;
    if (!this.el.open) this.el.showModal();
  }

  async copy() {
    const ok = await copyText(this.text.value);
    if (!ok) {
      this.text.select();
      document.execCommand("copy");
    }
    this.copyBtn.textContent = "Copied";
    setTimeout(() => (this.copyBtn.textContent = "Copy"), 1200);
  }
}
