// Views: the page's cards in named views instead of one long scroll, a nav bar that stays in
// view under the top bar, and cards that collapse.
//
// - Each card says which views show it (`data-views="overview tensors"`); the nav bar's links
//   are the views' URL fragments (#overview, #tensors, ...), so a view survives a reload, can be
//   shared, and the browser's back and forward move between views. No fragment, or an unknown
//   one, shows the overview. "All" shows every card, as one scroll.
// - A view's cards that are off are `display: none`: the scheduler's IntersectionObserver then
//   sees their charts off screen and draws them at its off-screen rate; when a view is shown its
//   Plotly charts are resized to their new boxes (Plotly.Plots.resize).
// - The side column (hooks, rules, events) goes when the view shows none of its cards.
// - Each card's head gets a collapse button; collapsed cards are kept in localStorage.
// - A chart with nothing to draw shrinks to a short box with its note (no empty axes).
// - The top bar, the health line under it (where there is one) and the nav bar stick, stacked:
//   each one's `top` is the height of those above it, and `--stack-h` on the root is the
//   stack's height (the side column sticks under it).

const VIEWS = [
  ["overview", "Overview"],
  ["tensors", "Tensors"],
  ["optimizer", "Optimizer"],
  ["noise", "Noise scale"],
  ["whatif", "What-if"],
  ["events", "Events"],
  ["ranks", "Ranks"],
  ["all", "All"],
];
const STACK = "body > .topbar, body > [data-testid=health], body > .viewnav";
const DEFAULT_VIEW = "overview";
const COLLAPSED_KEY = "gi.collapsed"; // JSON list of the collapsed cards' data-help keys

function viewFromHash() {
  // (the first part: "#all&token=..." or "#all=" after the token is taken out of the address)
  const first = window.location.hash.replace(/^#/, "").split("&")[0].replace(/=$/, "");
  const name = decodeURIComponent(first);
  return VIEWS.some(([id]) => id === name) ? name : DEFAULT_VIEW;
}

function cardsOf(view) {
  return [...document.querySelectorAll(".layout [data-views]")].filter(
    (el) => view === "all" || el.dataset.views.split(/\s+/).includes(view),
  );
}

/** Resize the Plotly charts under `root` to their boxes (after a view or a card is shown). */
export function resizeCharts(root) {
  const Plotly = window.Plotly;
  if (!Plotly || !Plotly.Plots) return;
  for (const gd of root.querySelectorAll(".js-plotly-plot")) {
    if (gd.offsetParent === null) continue; // still not displayed
    try {
      Plotly.Plots.resize(gd);
    } catch {
      // (a chart being replaced at this moment is resized by its own draw)
    }
  }
}

function readCollapsed() {
  try {
    const v = JSON.parse(window.localStorage.getItem(COLLAPSED_KEY) || "[]");
    return new Set(Array.isArray(v) ? v : []);
  } catch {
    return new Set();
  }
}

function writeCollapsed(set) {
  try {
    window.localStorage.setItem(COLLAPSED_KEY, JSON.stringify([...set]));
  } catch {
    // (storage refused: collapsing still works for this page)
  }
}

function installCollapse() {
  const collapsed = readCollapsed();
  for (const card of document.querySelectorAll(".layout .card[data-help]")) {
    const key = card.dataset.help;
    const head = card.querySelector(".card-head");
    if (!head || head.querySelector(".collapse-btn")) continue;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "collapse-btn";
    button.dataset.testid = `collapse-${key}`;
    const set = (on) => {
      card.classList.toggle("collapsed", on);
      button.setAttribute("aria-expanded", String(!on));
      button.title = on ? "expand this card" : "collapse this card";
      button.setAttribute("aria-label", button.title);
      button.textContent = on ? "▸" : "▾";
    };
    set(collapsed.has(key));
    button.addEventListener("click", () => {
      const on = !card.classList.contains("collapsed");
      set(on);
      if (on) collapsed.add(key);
      else collapsed.delete(key);
      writeCollapsed(collapsed);
      if (!on) requestAnimationFrame(() => resizeCharts(card));
    });
    head.prepend(button);
  }
}

function buildNav() {
  const nav = document.querySelector("[data-testid=view-nav]");
  if (!nav) return null;
  for (const [id, label] of VIEWS) {
    const a = document.createElement("a");
    a.href = `#${id}`;
    a.textContent = label;
    a.dataset.testid = `view-tab-${id}`;
    a.dataset.viewTab = id;
    nav.append(a);
  }
  return nav;
}

/** A nav link whose view has no card to show (Ranks without torch.distributed) is hidden. */
function syncTabs(nav) {
  for (const a of nav.querySelectorAll("a[data-view-tab]")) {
    const id = a.dataset.viewTab;
    if (id === "all" || id === "overview") continue;
    a.hidden = !cardsOf(id).some((el) => !el.hidden);
  }
}

const drawable = (v) => v !== null && v !== undefined && !(typeof v === "number" && !Number.isFinite(v));
const anyDrawable = (a) =>
  Boolean(a) &&
  Array.prototype.some.call(a, (v) =>
    Array.isArray(v) || ArrayBuffer.isView(v) ? Array.prototype.some.call(v, drawable) : drawable(v),
  );

/** Whether a trace has a point to draw: a finite z or value, or an x and a y both there at one index. */
function hasPoint(t) {
  if (t.z) return anyDrawable(t.z);
  if (t.values) return anyDrawable(t.values);
  const { x, y } = t;
  if (!x || !y) return anyDrawable(x || y);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) if (drawable(x[i]) && drawable(y[i])) return true;
  return false;
}

/** A chart with no trace that has a point to draw (what it shows, if anything, is its note). */
function isEmpty(gd) {
  return !(gd.data || []).some(hasPoint);
}

/** Give `gd` the `chart-empty` class when it has nothing to draw, and fit it to its new box. */
function checkEmpty(gd) {
  if (!gd.data || !gd.classList.contains("chart")) return;
  const empty = isEmpty(gd);
  if (empty === gd.classList.contains("chart-empty")) return;
  gd.classList.toggle("chart-empty", empty);
  // a chart without a note of its own says so in words (style.css shows data-empty-note)
  const notes = ((gd.layout && gd.layout.annotations) || []).filter((n) => n.text && n.visible !== false);
  if (empty && !notes.length) gd.dataset.emptyNote = "no finite values to draw";
  else delete gd.dataset.emptyNote;
  if (gd.offsetParent === null) return; // (resized when its view is shown)
  // after this draw, not inside it; at once (Plots.resize waits 100 ms), so a click lands right
  Promise.resolve().then(() => {
    try {
      window.Plotly.relayout(gd, { autosize: true });
    } catch {
      // (a chart being replaced now is drawn again at its box by its own draw)
    }
  });
}

/**
 * An empty chart gets `chart-empty` (style.css: a short box with its note and no axes) after
 * each of its draws (plotly_afterplot), and a chart with points again loses it. Charts are
 * looked for every second (a card may create its chart late).
 */
function watchEmptyCharts() {
  const watched = new WeakMap(); // chart -> its `on` when hooked (a purged chart gets a new one)
  const scan = () => {
    for (const gd of document.querySelectorAll(".layout .chart.js-plotly-plot")) {
      if (typeof gd.on !== "function" || watched.get(gd) === gd.on) continue;
      watched.set(gd, gd.on);
      gd.on("plotly_afterplot", () => checkEmpty(gd));
      checkEmpty(gd);
    }
  };
  scan();
  window.setInterval(scan, 1000);
}

function stackSticky() {
  const root = document.documentElement;
  let top = 0;
  for (const el of document.querySelectorAll(STACK)) {
    if (el.hidden || el.offsetParent === null) continue;
    el.style.top = `${top}px`;
    top += el.getBoundingClientRect().height;
  }
  root.style.setProperty("--stack-h", `${Math.round(top)}px`);
}

export function installViews() {
  const nav = buildNav();
  installCollapse();
  watchEmptyCharts();
  const layout = document.querySelector(".layout");
  const side = document.querySelector(".layout > .side");
  let shown = null;
  const show = (view, scroll) => {
    document.body.dataset.shownView = view;
    const on = new Set(cardsOf(view));
    for (const el of document.querySelectorAll(".layout [data-views]")) {
      el.classList.toggle("off-view", !on.has(el));
    }
    if (side && layout) {
      const any = [...side.querySelectorAll("[data-views]")].some((el) => on.has(el));
      layout.classList.toggle("no-side", !any);
    }
    if (nav) {
      for (const a of nav.querySelectorAll("a[data-view-tab]")) {
        if (a.dataset.viewTab === view) a.setAttribute("aria-current", "page");
        else a.removeAttribute("aria-current");
      }
    }
    if (scroll && shown !== null && shown !== view) window.scrollTo(0, 0);
    shown = view;
    requestAnimationFrame(() => resizeCharts(document));
  };
  show(viewFromHash(), false);
  window.addEventListener("hashchange", () => show(viewFromHash(), true));
  if (nav) {
    syncTabs(nav);
    // cards shown or hidden by the page (ranks, modules, flight) show or hide their view's link
    const mo = new MutationObserver(() => syncTabs(nav));
    for (const el of document.querySelectorAll(".layout [data-views]")) {
      mo.observe(el, { attributes: true, attributeFilter: ["hidden"] });
    }
  }
  stackSticky();
  if (typeof ResizeObserver === "function") {
    const ro = new ResizeObserver(() => stackSticky());
    for (const el of document.querySelectorAll(STACK)) ro.observe(el);
  }
  window.addEventListener("resize", stackSticky);
  // a header element added later (the health line) joins the stack
  new MutationObserver(() => stackSticky()).observe(document.body, { childList: true });
}
