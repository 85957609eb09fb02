// The "worst now" card: the tensors whose newest value is furthest from their own recent
// history (the snapshot's `worst`, computed by the server), a name search over every
// parameter, and the pinned watchlist, kept in localStorage per model (the signature of its
// parameter names, groups.js), with a "representative layers" preset (for each stack of
// blocks: the first, second, middle, second to last and last). A click on a name opens that
// tensor everywhere (app.js `openTensor`); what is pinned is subscribed to (its detail).

import { representative, searchNames, signature } from "./groups.js";
import { markCuts, nameText, watchCuts } from "./names.js";
import { byTestId } from "./selectors.js";
import { fmt, h, num } from "./util.js";

const PIN_KEY = "gradient-inspector.pins.";
export const MAX_PINS = 200; // the subscription carries at most 256 tensors: room for the rest
const SHOWN_RESULTS = 20;
const STAT_WORDS = { grad_norm_raw: "norm", update_ratio: "ratio" };

function readPins(key) {
  try {
    const v = JSON.parse(window.localStorage.getItem(key) || "[]");
    return Array.isArray(v) ? v.filter((x) => typeof x === "string") : [];
  } catch {
    return []; // storage disabled or unreadable: no pins
  }
}

export class Watch {
  /**
   * @param {{open: (name) => void, changed: () => void}} hooks open a tensor everywhere; the
   *   pins changed (subscribe again)
   */
  constructor({ open, changed }) {
    this.open = open;
    this.changed = changed;
    this.worstEl = byTestId("worst-list");
    this.worstNote = byTestId("worst-note");
    this.search = byTestId("name-search");
    this.results = byTestId("search-results");
    this.pinsEl = byTestId("pin-list");
    this.presetBtn = byTestId("pin-representative");
    this.state = null;
    this.pins = []; // names, in pin order
    this.key = null;
    this.worstShown = null;
    // The list re-ranks with every sampled step; while the pointer is over it, it holds still so
    // that a click opens the tensor that was under the pointer (redrawn once the pointer leaves).
    this.worstHeld = false;
    this.worstRow = null;
    this.worstEl.addEventListener("pointerenter", () => {
      this.worstHeld = true;
    });
    this.worstEl.addEventListener("pointerleave", () => {
      this.worstHeld = false;
      this.showWorst();
    });
    this.search.addEventListener("input", () => this.runSearch());
    this.search.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") {
        const first = this.results.querySelector('[data-testid="search-result"]');
        if (first) this.open(first.dataset.param);
      }
    });
    this.presetBtn.addEventListener("click", () => this.pinRepresentative());
    for (const el of [this.worstEl, this.results, this.pinsEl]) watchCuts(el);
  }

  /** The state shown (a new run or view): its model's pins, its worst list. */
  setState(state) {
    this.state = state;
    this.key = PIN_KEY + signature(state.params);
    this.pins = readPins(this.key).filter((p) => state.index.has(p));
    const stacks = state.groups ? state.groups.stacks || [] : [];
    this.presetBtn.hidden = !stacks.length;
    this.worstShown = null;
    this.worstRow = null;
    this.showPins();
    this.runSearch();
    this.showWorst();
  }

  save() {
    try {
      window.localStorage.setItem(this.key, JSON.stringify(this.pins));
    } catch {
      // storage full or disabled: the pins last as long as the page
    }
  }

  isPinned(name) {
    return this.pins.includes(name);
  }

  togglePin(name) {
    if (this.isPinned(name)) this.pins = this.pins.filter((p) => p !== name);
    else this.pins = [...this.pins, name].slice(-MAX_PINS);
    this.afterPins();
  }

  pinRepresentative() {
    const st = this.state;
    if (!st || !st.groups) return;
    const names = representative(st.groups).map((i) => st.params[i]);
    this.pins = [...new Set([...this.pins, ...names])].slice(-MAX_PINS);
    this.afterPins();
  }

  afterPins() {
    this.save();
    this.showPins();
    this.runSearch();
    this.worstShown = null;
    this.showWorst();
    this.changed();
  }

  /** The pinned tensors' indices (for the subscription). */
  pinnedIndices() {
    const st = this.state;
    return st ? this.pins.map((p) => st.index.get(p)).filter((i) => i !== undefined) : [];
  }

  pinButton(name, testid) {
    const on = this.isPinned(name);
    return h(
      "button",
      {
        type: "button",
        class: `pin${on ? " on" : ""}`,
        dataset: { testid, param: name },
        title: on ? `unpin ${name}` : `pin ${name} (kept for this model)`,
        "aria-pressed": on ? "true" : "false",
        onclick: (ev) => {
          ev.stopPropagation();
          this.togglePin(name);
        },
      },
      on ? "★" : "☆",
    );
  }

  showPins() {
    if (!this.pins.length) {
      this.pinsEl.replaceChildren(h("span", { class: "muted small" }, "no pins: ☆ a tensor to keep it here"));
      return;
    }
    this.pinsEl.replaceChildren(
      ...this.pins.map((p) =>
        h(
          "span",
          { class: "chip mono", dataset: { testid: "pin-chip", param: p }, title: p },
          nameText(p, {
            tag: "button",
            cls: "chip-name",
            attrs: { type: "button", onclick: () => this.open(p) },
          }),
          h(
            "button",
            { type: "button", class: "chip-x", title: `unpin ${p}`, onclick: () => this.togglePin(p) },
            "×",
          ),
        ),
      ),
    );
    markCuts(this.pinsEl);
  }

  runSearch() {
    const st = this.state;
    const q = this.search.value;
    if (!st || !q.trim()) {
      this.results.replaceChildren();
      this.results.hidden = true;
      return;
    }
    const { indices, total } = searchNames(st.lower, st.params, q, SHOWN_RESULTS);
    const items = indices.map((i) => {
      const name = st.params[i];
      return h(
        "li",
        { dataset: { testid: "search-result", param: name } },
        this.pinButton(name, "search-pin"),
        nameText(name, {
          tag: "button",
          cls: "link mono",
          attrs: { type: "button", onclick: () => this.open(name) },
        }),
      );
    });
    const more = total > indices.length ? `${total} matches: the first ${indices.length} shown` : "";
    this.results.replaceChildren(
      ...items,
      h(
        "li",
        { class: "muted small", dataset: { testid: "search-count" } },
        total ? more || `${total} match${total === 1 ? "" : "es"}` : "no parameter matches",
      ),
    );
    this.results.hidden = false;
    markCuts(this.results);
  }

  /** The newest row's `worst` list, redrawn when a newer row brings one; while the pointer is
   * over the list, the row shown stays (a pin changed there redraws that same row). */
  showWorst() {
    const st = this.state;
    const newest = st ? st.latest : null;
    const held = this.worstHeld && this.worstRow && newest && this.worstRow.step !== newest.step;
    const row = held ? this.worstRow : newest;
    const key = row ? `${row.step}|${this.pins.length}` : "";
    const heldNote = () =>
      `step ${row.step}, held while the pointer is over the list (newest: step ${newest.step})`;
    if (key === this.worstShown) {
      // the same row: its elements stay (a click under way lands on them); only the note says
      // that newer steps are waiting
      if (held) {
        this.worstNote.dataset.held = "true";
        this.worstNote.textContent = heldNote();
      }
      return;
    }
    this.worstShown = key;
    this.worstRow = row;
    const list = row && row.worst;
    if (!list) {
      this.worstEl.replaceChildren();
      this.worstNote.textContent = row ? "no ranking from this server" : "waiting for the first sampled step";
      return;
    }
    this.worstNote.dataset.held = String(held);
    this.worstNote.textContent = held
      ? heldNote()
      : list.length && list[0].since !== undefined
        ? `step ${row.step}: non-finite, by origin (the first to go, then what rose most before it)`
        : list.length
          ? `step ${row.step}: furthest from their own last 32 sampled values (robust z of log₁₀)`
          : `step ${row.step}: nothing ranked yet (a tensor needs 8 sampled values)`;
    this.worstEl.replaceChildren(
      ...list
        .slice(0, 10)
        .filter((w) => st.params[w.param] !== undefined) // a tensor this page does not know: left out
        .map((w) => {
          const name = st.params[w.param];
          const z = num(w.z);
          const zText = z === null ? "–" : Number.isFinite(z) ? fmt(z, 2) : "∞";
          return h(
            "li",
            {
              dataset: { testid: "worst-item", param: name, stat: w.stat },
              title: `${name}: ${w.stat} ${fmt(w.value)} against its median ${fmt(w.median)} (z ${zText}); click to open it`,
              onclick: () => this.open(name),
            },
            this.pinButton(name, "worst-pin"),
            nameText(name, { cls: "w-name mono" }),
            h("span", { class: "w-stat" }, STAT_WORDS[w.stat] || w.stat),
            h(
              "span",
              { class: "w-val mono" },
              w.since !== undefined
                ? `${fmt(w.value)} since ${w.since}`
                : `${fmt(w.value)} vs ${fmt(w.median)}`,
            ),
            h("span", { class: `w-z mono${z !== null && Math.abs(z) >= 5 ? " hot" : ""}` }, `z ${zText}`),
          );
        }),
    );
    markCuts(this.worstEl);
  }
}
