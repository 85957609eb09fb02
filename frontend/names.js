// Tensor names as written. A long name is cut at its START (the end, the tensor's own name,
// stays in view) without reordering a character: the name's text sits in a flex box that
// overflows to the left (`.name-cut`, style.css), its characters in their own order, so
// `0.weight` reads "0.weight" and a search of the page (Ctrl-F, the name filter) finds what
// is read. Where the start is cut, an ellipsis (generated content, not part of the text)
// says so; the full name is the tooltip.

import { h } from "./util.js";

/** A name in a `tag` element (a span by default) with class `cls`, cut at its start if long. */
export function nameText(name, { tag = "span", cls = "", attrs = {} } = {}) {
  return h(
    tag,
    { ...attrs, class: `name-cut${cls ? ` ${cls}` : ""}`, title: attrs.title || name },
    h("span", { class: "name-text" }, name),
  );
}

/**
 * Mark the names under `root` whose start is cut (`data-cut`: the ellipsis shows). Read in the
 * next animation frame, once the new elements are laid out; call it after each redraw.
 */
export function markCuts(root) {
  requestAnimationFrame(() => {
    for (const el of root.querySelectorAll(".name-cut")) {
      const text = el.firstElementChild;
      const cut = Boolean(text) && text.offsetWidth > el.clientWidth + 1;
      if (el.hasAttribute("data-cut") !== cut) el.toggleAttribute("data-cut", cut);
    }
  });
}

/** Keep `root`'s names marked as it changes size (a resized window, a narrower column). */
export function watchCuts(root) {
  if (typeof ResizeObserver !== "function") return;
  new ResizeObserver(() => markCuts(root)).observe(root);
}
