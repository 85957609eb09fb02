// Redraw scheduling. Messages mark charts dirty; drawing happens in animation
// frames, at most one chart per frame, each chart at most once per
// max(MIN_INTERVAL_MS, COST_FACTOR x its last draw time), and after any draw
// the next one waits GAP_FACTOR x its time, so drawing takes at most ~40% of
// the main thread. On a fast machine every chart keeps up with a 10 steps/s
// stream; on a slow one (a busy laptop, a CPU-only CI box) charts refresh less
// often instead of starving clicks, typing and the websocket. For a large run
// (state.large) a chart off screen is not drawn: its changes are dropped and it
// is redrawn whole when it scrolls into view (an IntersectionObserver says when); a
// smaller run's charts off screen are drawn at most every HIDDEN_INTERVAL_MS, and
// as soon as they scroll into view;
// and the charts on screen are drawn at most every LARGE_INTERVAL_MS, with a gap
// of LARGE_GAP_FACTOR x a draw's time after it (drawing at most ~1/3.5 of the
// main thread: the messages of a large run cost more to take in). A chart under a pressed
// pointer is not redrawn until the pointer is released: a redraw between press and release
// would lose the click (Plotly replaces what was pressed on). `nextDraw()` says when the next
// frame's draw is done, so what can wait (the page's other requests at start-up) comes after it.

import { MAX_LOSS_POINTS, MAX_SNAPSHOTS } from "./state.js";

const MIN_INTERVAL_MS = 100;
const COST_FACTOR = 4; // one chart spends at most ~1/4 of the time drawing
const GAP_FACTOR = 1.5; // all charts together at most 1 / (1 + 1.5) = 40%
const LARGE_INTERVAL_MS = 500;
const LARGE_GAP_FACTOR = 2.5; // at most 1 / (1 + 2.5), about 29%
const HIDDEN_INTERVAL_MS = 2000; // a smaller run's chart off screen: kept about current, cheaply

function emptyPending() {
  return { rows: [], loss: { x: [], y: [] }, markers: false, hist: false, reset: false, dirty: false };
}

class Slot {
  constructor(name, chart) {
    this.name = name;
    this.chart = chart;
    this.pending = emptyPending();
    this.nextAt = 0;
    this.lastCost = 0;
    this.visible = true; // within (or near) the viewport, as the IntersectionObserver last said
    this.stale = false; // changes were dropped while off screen: redraw whole when visible
  }
}

export class Scheduler {
  /**
   * @param {Array<[string, object]>} charts name and chart ({reset(state), update(state, pending)})
   * @param {() => object} state the DashboardState being shown
   * @param {() => void} everyFrame cheap work done on each frame (counters)
   */
  constructor(charts, state, everyFrame) {
    this.slots = charts.map(([name, chart]) => new Slot(name, chart));
    this.state = state;
    this.everyFrame = everyFrame;
    this.queued = false;
    this.globalNextAt = 0;
    this.stats = {}; // name -> {draws, ms}: visible at window.__dashboard for profiling
    this.pressed = null; // the slot a pointer is pressed on: not redrawn until released
    this.drawWaiters = []; // nextDraw()'s: resolved after the next frame that may draw
    for (const s of this.slots) {
      if (!s.chart.el || typeof s.chart.el.addEventListener !== "function") continue;
      s.chart.el.addEventListener("pointerdown", () => (this.pressed = s), true);
    }
    if (typeof window !== "undefined") {
      const release = () => {
        if (this.pressed === null) return;
        this.pressed = null;
        this.request();
      };
      window.addEventListener("pointerup", release, true);
      window.addEventListener("pointercancel", release, true);
    }
  }

  /** Watch which charts are on screen (a large run draws only those). */
  observe() {
    if (typeof IntersectionObserver !== "function") return;
    const io = new IntersectionObserver(
      (entries) => {
        for (const e of entries) {
          const s = this.slots.find((x) => x.chart.el === e.target);
          if (!s) continue;
          s.visible = e.isIntersecting;
          if (s.visible && s.pending.dirty && s.nextAt > performance.now()) {
            s.nextAt = 0; // (spaced out while off screen: drawn now)
            this.request();
          }
          if (s.visible && s.stale) {
            s.stale = false;
            s.pending = emptyPending();
            s.pending.reset = true;
            s.pending.dirty = true;
            this.request();
          }
        }
      },
      { rootMargin: "200px 0px" },
    );
    for (const s of this.slots) if (s.chart.el) io.observe(s.chart.el);
  }

  /**
   * Apply fn to every chart's pending changes; fn(pending, name) returns true
   * when that chart needs drawing. Then ask for a frame.
   */
  mark(fn) {
    for (const s of this.slots) {
      const p = s.pending;
      if (!fn(p, s.name)) continue;
      p.dirty = true;
      // Bounded while no frames come (a hidden tab): fall back to a full redraw.
      if (p.rows.length > MAX_SNAPSHOTS || p.loss.x.length > MAX_LOSS_POINTS) {
        s.pending = emptyPending();
        s.pending.reset = true;
        s.pending.dirty = true;
      }
    }
    this.request();
  }

  /** Redraw every chart from the state at the next frames (new run, new view). */
  resetAll() {
    for (const s of this.slots) {
      s.pending = emptyPending();
      s.pending.reset = true;
      s.pending.dirty = true;
      s.nextAt = 0;
    }
    this.request();
  }

  /** Redraw these charts from the state at the next frames (older history arrived). */
  resetSome(charts) {
    for (const s of this.slots) {
      if (!charts.includes(s.chart)) continue;
      s.pending = emptyPending();
      s.pending.reset = true;
      s.pending.dirty = true;
      s.nextAt = 0;
    }
    this.request();
  }

  /**
   * Redraw one chart from scratch now (a toggle the user just clicked); for a large run, a
   * chart off screen is redrawn when it scrolls into view instead.
   */
  resetNow(name) {
    const s = this.slots.find((x) => x.name === name);
    s.pending = emptyPending();
    const state = this.state();
    if (state && state.large && !s.visible) {
      s.stale = true;
      return;
    }
    this.draw(s, true, performance.now());
  }

  /**
   * A promise resolved after the next frame that may draw (past the gap after the last draw):
   * the chart first in line then (the loss chart, after a `resetAll`) has been drawn, or nothing
   * could be drawn yet.
   */
  nextDraw() {
    return new Promise((resolve) => {
      this.drawWaiters.push(resolve);
      this.request();
    });
  }

  request() {
    if (this.queued) return;
    this.queued = true;
    requestAnimationFrame((t) => this.frame(t));
  }

  frame() {
    this.queued = false;
    this.everyFrame();
    const now = performance.now();
    let waiting = false;
    let next = null;
    if (now < this.globalNextAt) {
      if (this.drawWaiters.length || this.slots.some((s) => s.pending.dirty)) this.request();
      return;
    }
    const state = this.state();
    const skipHidden = Boolean(state && state.large);
    for (const s of this.slots) {
      if (!s.pending.dirty) continue;
      if (skipHidden && !s.visible) {
        s.pending = emptyPending();
        s.stale = true;
        continue;
      }
      if (now < s.nextAt || s === this.pressed) {
        waiting = waiting || s !== this.pressed; // (a pressed one is asked for again on release)
        continue;
      }
      if (next === null || s.nextAt < next.nextAt) next = s;
    }
    if (next !== null) {
      const p = next.pending;
      next.pending = emptyPending();
      this.draw(next, p.reset, now, p);
      waiting = waiting || this.slots.some((s) => s.pending.dirty);
    }
    if (waiting) this.request();
    for (const resolve of this.drawWaiters.splice(0)) resolve();
  }

  draw(slot, reset, now, pending) {
    const state = this.state();
    const t0 = performance.now();
    if (reset) slot.chart.reset(state);
    else slot.chart.update(state, pending);
    const cost = performance.now() - t0;
    slot.lastCost = cost;
    const large = Boolean(state && state.large);
    const least = large ? LARGE_INTERVAL_MS : slot.visible ? MIN_INTERVAL_MS : HIDDEN_INTERVAL_MS;
    slot.nextAt = now + Math.max(least, COST_FACTOR * cost);
    this.globalNextAt = performance.now() + (large ? LARGE_GAP_FACTOR : GAP_FACTOR) * cost;
    const st = (this.stats[slot.name] ||= { draws: 0, ms: 0 });
    st.draws += 1;
    st.ms += cost;
  }
}
