"""The dashboard page's memory over a long run: does it stay flat?

    .venv/bin/python bench/page_memory.py                          # an hour of tiny_gpt, a sample every 60 s
    .venv/bin/python bench/page_memory.py --minutes 5 --every 10   # a quick look
    .venv/bin/python bench/page_memory.py --scenario mlp --steps-per-second 50 --minutes 20 --every 30
    nohup nice -n 10 .venv/bin/python bench/page_memory.py > /tmp/page_memory.log 2>&1 &

What runs: `gradient-inspector demo --scenario tiny_gpt` (or --scenario's; this interpreter's environment) on a
free loopback port with a temporary --db, and the dashboard in headless Chromium (Debian's, as
the tests launch it: tests/support.py `launch_chromium`) at 1440x900, left alone as a user
leaves a tab open beside training.

Every --every seconds, through the Chrome DevTools Protocol: a forced garbage collection
(`HeapProfiler.collectGarbage`), then `Performance.getMetrics` (JSHeapUsedSize, the DOM node
count `Nodes`, which counts detached nodes too, and event listeners); the number of elements
in the document; the points held by every Plotly chart (the lengths of each trace's x, or of
its z for a heatmap); and the step, from the server (`/api/session`) and as the page knows it.
Prints one line per sample, then a summary: the first and last after-GC heap, the least-squares
slope per hour (over every sample, and over the second half), the largest heap, and DOM nodes and
trace points first, last and largest.

The page's stores are bounded, and fill first: the charts' 600 sampled steps, then the
histograms over steps (300 per parameter at most, one every 10 sampled steps: full by step
3,000). A flat page: once they are full the heap after GC stops rising (its slope is small
beside its run-to-run noise of a few MiB), and the DOM node and trace point counts stay within
a band. Exit status 0; this is a measurement, not a check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import launch_chromium, start_demo  # noqa: E402

# Points held by every Plotly chart on the page, and the page's own idea of the step.
PAGE_PROBE = """() => {
  let points = 0, traces = 0, charts = 0;
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    charts += 1;
    for (const t of gd.data || []) {
      traces += 1;
      if (Array.isArray(t.z) && t.z.length) {
        for (const row of t.z) points += Array.isArray(row) ? row.length : 1;
      } else if (t.x && t.x.length !== undefined) {
        points += t.x.length;
      } else if (t.y && t.y.length !== undefined) {
        points += t.y.length;
      }
    }
  }
  const d = window.__dashboard;
  return {
    points, traces, charts,
    elements: document.getElementsByTagName("*").length,
    page_step: d && d.live ? d.live.step : null,
  };
}"""


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against ts (seconds), per hour; 0 for fewer than two samples."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var * 3600.0


def summarize(samples: list[dict]) -> dict:
    ts = [s["t"] for s in samples]
    heap = [s["heap"] for s in samples]
    half = samples[len(samples) // 2 :]
    out = {
        "samples": len(samples),
        "seconds": ts[-1] - ts[0] if ts else 0.0,
        "steps": [samples[0]["step"], samples[-1]["step"]] if samples else None,
        "heap_first": heap[0],
        "heap_last": heap[-1],
        "heap_max": max(heap),
        "heap_min": min(heap),
        "slope_per_hour": slope_per_hour(ts, heap),
        "slope_per_hour_second_half": slope_per_hour([s["t"] for s in half], [s["heap"] for s in half]),
    }
    for key in ("nodes", "elements", "points", "listeners"):
        values = [s[key] for s in samples]
        out[f"{key}_first"], out[f"{key}_last"], out[f"{key}_max"] = values[0], values[-1], max(values)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="how long to watch (default 60)")
    p.add_argument(
        "--every", type=float, default=60.0, metavar="SECONDS", help="sampling interval (default 60)"
    )
    p.add_argument(
        "--steps-per-second",
        type=float,
        default=10.0,
        metavar="X",
        help="the demo's cap (default 10, the demo's own)",
    )
    p.add_argument("--scenario", default="tiny_gpt", help="the demo scenario (default tiny_gpt)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the samples and the summary here")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.every <= 0:
        p.error("--minutes and --every must be positive")

    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="gi-page-memory-"))
    server = start_demo(
        tmp, scenario=args.scenario, rate=args.steps_per_second, db=tmp / "history.sqlite", wait=True
    )
    console_errors: list[str] = []
    samples: list[dict] = []
    print(
        f"page memory: {args.scenario} at <= {args.steps_per_second:g} steps/s for {args.minutes:g} min, "
        f"a sample every {args.every:g} s; server {server.url}, files in {tmp}",
        flush=True,
    )
    try:
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
                page.on("pageerror", lambda e: console_errors.append(str(e)))
                page.goto(server.url)
                page.wait_for_function(
                    "() => window.__dashboard && window.__dashboard.live.step > 0", timeout=120_000
                )
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                print(
                    f"{'min':>6} {'step':>7} {'page step':>9} {'heap (GC)':>11} {'heap before':>11} "
                    f"{'CDP nodes':>9} {'elements':>8} {'listeners':>9} {'points':>7} {'traces':>6}",
                    flush=True,
                )
                t0 = time.monotonic()
                end = t0 + args.minutes * 60.0
                next_at = t0
                while True:
                    before = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
                    cdp.send("HeapProfiler.collectGarbage")
                    after = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
                    probe = page.evaluate(PAGE_PROBE)
                    training = server.get("/api/session").get("training", {})
                    s = {
                        "t": time.monotonic() - t0,
                        "step": training.get("step"),
                        "page_step": probe["page_step"],
                        "heap": after["JSHeapUsedSize"],
                        "heap_before_gc": before["JSHeapUsedSize"],
                        "heap_total": after["JSHeapTotalSize"],
                        "nodes": int(after["Nodes"]),
                        "listeners": int(after["JSEventListeners"]),
                        "elements": probe["elements"],
                        "points": probe["points"],
                        "traces": probe["traces"],
                        "charts": probe["charts"],
                    }
                    samples.append(s)
                    print(
                        f"{s['t'] / 60:6.1f} {s['step']:7} {s['page_step']:9} {mib(s['heap']):>11} "
                        f"{mib(s['heap_before_gc']):>11} {s['nodes']:9} {s['elements']:8} "
                        f"{s['listeners']:9} {s['points']:7} {s['traces']:6}",
                        flush=True,
                    )
                    next_at += args.every
                    if next_at > end:
                        break
                    # the sampling interval: the page runs on its own meanwhile
                    page.wait_for_timeout(max(0.0, next_at - time.monotonic()) * 1000.0)
            finally:
                browser.close()
    finally:
        server.stop()

    summary = summarize(samples)
    steps = summary["steps"]
    rate = (steps[1] - steps[0]) / summary["seconds"] if summary["seconds"] and steps else 0.0
    print(
        f"\n{summary['samples']} samples over {summary['seconds'] / 60:.1f} min, steps {steps[0]} -> {steps[1]} "
        f"({rate:.2f} steps/s)"
    )
    print(
        f"JS heap after GC: first {mib(summary['heap_first'])}, last {mib(summary['heap_last'])}, "
        f"min {mib(summary['heap_min'])}, max {mib(summary['heap_max'])}"
    )
    print(
        f"slope: {mib(summary['slope_per_hour'])}/h over every sample, "
        f"{mib(summary['slope_per_hour_second_half'])}/h over the second half"
    )
    for key, what in (
        ("nodes", "DOM nodes (CDP, detached included)"),
        ("elements", "document elements"),
        ("listeners", "event listeners"),
        ("points", "Plotly trace points"),
    ):
        print(
            f"{what}: first {summary[key + '_first']}, last {summary[key + '_last']}, max {summary[key + '_max']}"
        )
    print(
        f"console errors: {len(console_errors)}"
        + (f" (first: {console_errors[0]})" if console_errors else "")
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "samples": samples, "summary": summary, "console_errors": console_errors}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
