// Light and dark: the page follows the system's prefers-color-scheme until the top bar's toggle
// is used; the toggle's choice is kept in localStorage ("gi.theme"). The choice is written as
// <html data-theme="light|dark"> (style.css's variables follow it; without it, its media query
// follows the system) and the charts follow (theme.js's setChartTheme restyles them, no reload).

import { setChartTheme } from "./theme.js";

const KEY = "gi.theme";

function stored() {
  try {
    const v = window.localStorage.getItem(KEY);
    return v === "light" || v === "dark" ? v : null;
  } catch {
    return null;
  }
}

function system() {
  return window.matchMedia && window.matchMedia("(prefers-color-scheme: light)").matches ? "light" : "dark";
}

export function installThemeToggle() {
  const button = document.querySelector("[data-testid=theme-toggle]");
  const apply = (name) => {
    document.documentElement.dataset.theme = name;
    setChartTheme(name);
    if (button) {
      const other = name === "light" ? "dark" : "light";
      button.textContent = name === "light" ? "☾" : "☀";
      button.title = `switch to the ${other} theme`;
      button.setAttribute("aria-label", button.title);
      button.setAttribute("aria-pressed", String(name === "light"));
    }
  };
  apply(stored() || system());
  if (window.matchMedia) {
    window.matchMedia("(prefers-color-scheme: light)").addEventListener("change", () => {
      if (!stored()) apply(system());
    });
  }
  if (button) {
    button.addEventListener("click", () => {
      const next = document.documentElement.dataset.theme === "light" ? "dark" : "light";
      try {
        window.localStorage.setItem(KEY, next);
      } catch {
        // (storage refused: the theme changes for this page only)
      }
      apply(next);
    });
  }
}
