"""Time to the first chart: the page opened on a live run and on a replay of a 1,000-step run,
and where that time goes.

    .venv/bin/python bench/first_chart.py                       # deep (993 tensors), 1,000 steps; 3 loads each
    .venv/bin/python bench/first_chart.py --scenario mlp --loads 5
    .venv/bin/python bench/first_chart.py --tree /tmp/old       # the servers run another checkout's code
    .venv/bin/python bench/first_chart.py --db /tmp/deep.sqlite # reuse a recorded run (made when missing)

The run is recorded once (`gradient-inspector demo --scenario S --steps-per-second 0 --no-wait
--no-shadow --db FILE` until its step reaches ``--steps``); then, alternately, ``--loads`` times:

- replay: `gradient-inspector replay FILE` started, the page opened on it;
- live: `gradient-inspector demo --scenario S --steps-per-second 0 --no-shadow --db COPY`
  with COPY a copy of the recorded file (so the live run's history holds the recorded run
  before its own, as a second start would), trained ``--steps`` steps before the page opens.

Each load is a fresh browser context (nothing cached) in headless Chromium at 1440x900.
"first chart" is the first animation frame at which the loss chart (the first the page draws
from the hello; other cards may draw an empty frame or a placeholder earlier) has data drawn:
``[data-testid=chart-loss]`` drawn by Plotly with a trace of at least one point, in ms from
navigation. The split, from
the page's own clocks (a script installed before any of the page's runs):

- html: the document's response end (Navigation Timing);
- plotly: the vendored Plotly's response end and the moment its script has run (``window.Plotly``
  set), and the page's modules' last response end;
- app: the moment the page's start-up has run (``window.__dashboard`` set);
- ws open, hello: the websocket's open and its first message (``hello``: the session and the
  newest history), the hello's size;
- requests (the last load's, listed): every HTTP request the page made in its first seconds: its
  start, its time to the first byte (the server's time, on an idle server) and its end (the order
  of the first chart and these requests is checked by tests/e2e/test_first_load.py, on a clock
  more exact than this script's frame polling);
- CPU: from the DevTools protocol's ``Performance.getMetrics`` at the first chart, in thread time
  (``timeDomain: threadTicks``: CPU time, not stretched by other processes): the page's main
  thread's whole CPU time (``ThreadTime``), of it compiling and running JavaScript
  (``ScriptDuration``, ``V8CompileDuration``); and the server process's CPU time from navigation
  to the first chart (``/proc/PID/stat``: serving the files, building the hello, the other
  requests; the live server is paused, so training takes none of it).

And, without a browser, the replay's hello built in this process from the file (`ReplaySource.hello`
as the websocket asks for it) and encoded: its wall and CPU time. A shared machine stretches the
wall times; the CPU times, the byte counts and the order of the phases do not depend on the load.
On a quiet machine of two cores or more, the page's main thread and the server run side by side:
the first chart comes about when the longer of the two CPU paths ends.

Prints the medians per phase for each mode. Exit status 0; this is a measurement, not a check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Installed before any page script runs: when Plotly and the page's start-up have run, the
# websocket's open and first message, and the first frame with a chart drawn.
INIT_SCRIPT = """
(() => {
  const b = (window.__fc = { ws: [], first: null });
  let plotly, dash;
  Object.defineProperty(window, "Plotly", {
    configurable: true,
    get: () => plotly,
    set: (v) => { if (b.plotly === undefined) b.plotly = performance.now(); plotly = v; },
  });
  Object.defineProperty(window, "__dashboard", {
    configurable: true,
    get: () => dash,
    set: (v) => { if (b.app === undefined) b.app = performance.now(); dash = v; },
  });
  const WS = window.WebSocket;
  window.WebSocket = function (url, protocols) {
    const ws = protocols === undefined ? new WS(url) : new WS(url, protocols);
    const rec = { url: String(url), at: performance.now(), open: null, first: null, bytes: 0 };
    b.ws.push(rec);
    ws.addEventListener("open", () => (rec.open = performance.now()));
    ws.addEventListener("message", (ev) => {
      if (rec.first !== null) return;
      rec.first = performance.now();
      rec.bytes = typeof ev.data === "string" ? ev.data.length : 0;
    });
    return ws;
  };
  window.WebSocket.prototype = WS.prototype;
  Object.assign(window.WebSocket, { CONNECTING: 0, OPEN: 1, CLOSING: 2, CLOSED: 3 });
  const frame = (t) => {
    if (b.first === null) {
      for (const gd of document.querySelectorAll('[data-testid="chart-loss"].js-plotly-plot')) {
        const drawn = Array.isArray(gd._fullData) && gd._fullData.length > 0;
        if (drawn && (gd.data || []).some((t) => (t.x && t.x.length > 0) || (t.z && t.z.length > 0))) {
          b.first = performance.now();
          b.firstChart = gd.dataset.testid || gd.id || gd.className;
          break;
        }
      }
    }
    if (b.first === null) requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
})();
"""

COLLECT = """() => {
  const b = window.__fc;
  const nav = performance.getEntriesByType("navigation")[0];
  const res = performance.getEntriesByType("resource").map((r) => ({
    name: new URL(r.name).pathname + new URL(r.name).search,
    type: r.initiatorType,
    start: r.startTime,
    ttfb: r.responseStart > 0 ? r.responseStart - r.requestStart : null,
    end: r.responseEnd,
    bytes: r.transferSize,
  }));
  return { first: b.first, firstChart: b.firstChart || null, plotly: b.plotly ?? null, app: b.app ?? null,
           ws: b.ws, html: nav ? nav.responseEnd : null, res };
}"""


# ----------------------------------------------------------------------------- the recorded run
def step_of(server: Any) -> int:
    return int((server.get("/api/session").get("training") or {}).get("step") or 0)


def train(server: Any, steps: int) -> None:
    from tests.support import wait_until

    wait_until(lambda: step_of(server) >= steps, timeout=3600, interval=0.5, what=f"{steps} steps")


def record(args: argparse.Namespace, db: Path, tmp: Path, env: dict[str, str]) -> None:
    from tests.support import start_demo

    t0 = time.monotonic()
    with start_demo(
        tmp, scenario=args.scenario, rate=0, db=db, extra=["--no-shadow"], env=env, timeout=300
    ) as server:
        train(server, args.steps)
    print(
        f"recorded {args.steps} steps of {args.scenario} in {time.monotonic() - t0:.0f} s: {db}",
        file=sys.stderr,
    )


# ----------------------------------------------------------------------------- one page load
def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux's /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(browser: Any, url: str, server_pid: int) -> dict[str, Any]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(300_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(INIT_SCRIPT)
    cdp = ctx.new_cdp_session(page)
    cdp.send("Performance.enable", {"timeDomain": "threadTicks"})
    server0 = cpu_seconds(server_pid)
    page.goto(url)
    page.wait_for_function("() => window.__fc && window.__fc.first !== null", polling=20)
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    server_cpu = cpu_seconds(server_pid) - server0
    page.wait_for_timeout(3000)  # the requests the page makes next (backfills), for the table
    out = page.evaluate(COLLECT)
    ctx.close()
    out["thread_ms"] = 1000 * metrics.get("ThreadTime", 0.0)
    out["script_ms"] = 1000 * metrics.get("ScriptDuration", 0.0)
    out["compile_ms"] = 1000 * metrics.get("V8CompileDuration", 0.0)
    out["server_ms"] = 1000 * server_cpu
    out["errors"] = errors
    return out


def phases(r: dict[str, Any]) -> dict[str, float | None]:
    """One load's figures, in ms from navigation (bytes for the hello)."""
    ws = r["ws"][0] if r["ws"] else {}
    mods = [x["end"] for x in r["res"] if x["name"].startswith("/static/") and x["name"].endswith(".js")]
    plotly = [x for x in r["res"] if "plotly" in x["name"]]
    return {
        "html": r["html"],
        "plotly loaded": plotly[0]["end"] if plotly else None,
        "plotly run": r["plotly"],
        "modules loaded": max(mods, default=None),
        "app started": r["app"],
        "ws open": ws.get("open"),
        "hello in": ws.get("first"),
        "hello wait (open to hello)": (ws["first"] - ws["open"])
        if ws.get("first") and ws.get("open")
        else None,
        "first chart": r["first"],
        "CPU: page main thread": r["thread_ms"],
        "CPU: of it JS run": r["script_ms"],
        "CPU: of it JS compile": r["compile_ms"],
        "CPU: server process": r["server_ms"],
        "hello, kB": ws.get("bytes", 0) / 1000,
    }


# ----------------------------------------------------------------------------- the hello without a browser
def hello_cost(db: Path, tree: Path | None, reps: int = 3) -> dict[str, float]:
    """The replay's hello built from the file in this process, as the websocket builds it."""
    if tree is not None:
        sys.path.insert(0, str(tree))
    from server.history.storage import HistoryStore
    from server.protocol import dumps
    from server.settings import Settings
    from server.sources import ReplaySource

    settings = Settings()
    walls, cpus, sizes = [], [], []
    for _ in range(reps):
        store = HistoryStore(str(db), read_only=True)
        try:
            src = ReplaySource(store)
            w, c = time.perf_counter(), time.process_time()
            text = dumps({"type": "hello", **src.hello(settings.hello_history, settings.hello_events)})
            walls.append(1000 * (time.perf_counter() - w))
            cpus.append(1000 * (time.process_time() - c))
            sizes.append(len(text) / 1000)
        finally:
            store.close()
    return {"wall ms": statistics.median(walls), "cpu ms": statistics.median(cpus), "kB": sizes[-1]}


# ----------------------------------------------------------------------------- main
def fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="deep", help="the demo scenario recorded (default deep)")
    p.add_argument("--steps", type=int, default=1000, help="steps recorded and trained live (default 1000)")
    p.add_argument("--loads", type=int, default=3, help="page loads per mode, alternated (default 3)")
    p.add_argument("--modes", default="replay,live", help="comma-separated subset of replay,live")
    p.add_argument("--db", type=Path, default=None, help="the recorded run's file (recorded when missing)")
    p.add_argument("--tree", type=Path, default=None, help="run the servers from this checkout's code")
    p.add_argument("--json", default=None, metavar="OUT", help="also write every load's figures here")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from playwright.sync_api import sync_playwright

    from tests.support import launch_chromium, repo_env, start_cli, start_demo

    env = repo_env()
    if args.tree is not None:
        env["PYTHONPATH"] = str(args.tree) + os.pathsep + env["PYTHONPATH"]
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="first-chart-") as tmp_:
        tmp = Path(tmp_)
        db = args.db or tmp / f"{args.scenario}-{args.steps}.sqlite"
        if not db.exists():
            record(args, db, tmp, env)
        hello = hello_cost(db, args.tree)
        live = None
        if "live" in modes:
            copy = tmp / "live.sqlite"
            shutil.copy(db, copy)
            live = start_demo(
                tmp, scenario=args.scenario, rate=0, db=copy, extra=["--no-shadow"], env=env, timeout=300
            )
        try:
            if live is not None:
                train(live, args.steps)
                live.client.post("/api/training/pause")  # the same history at every load
            with sync_playwright() as pw:
                browser = launch_chromium(pw)
                try:
                    for i in range(args.loads):
                        for mode in modes:
                            if mode == "live":
                                r = load(browser, live.url, live.proc.pid)
                            else:
                                with start_cli(["replay", str(db)], log_dir=tmp, env=env, timeout=300) as s:
                                    r = load(browser, s.url, s.proc.pid)
                            results[mode].append(r)
                            print(
                                f"{mode} #{i + 1}: first chart at {r['first']:.0f} ms"
                                f" ({len(r['errors'])} console errors)",
                                file=sys.stderr,
                            )
                finally:
                    browser.close()
        finally:
            if live is not None:
                live.stop()

    print(f"code: {args.tree or REPO}; {args.scenario}, {args.steps} steps; medians of {args.loads} loads")
    table = {m: [phases(r) for r in rs] for m, rs in results.items()}
    keys = list(next(iter(table.values()))[0]) if table and any(table.values()) else []
    width = max((len(k) for k in keys), default=10) + 2
    print("ms from navigation (CPU: ms)".ljust(width) + "".join(m.rjust(10) for m in modes))
    for k in keys:
        cells = []
        for m in modes:
            vals = [ph[k] for ph in table[m] if ph[k] is not None]
            cells.append(fmt(statistics.median(vals)) if vals else "-")
        print(k.ljust(width) + "".join(c.rjust(10) for c in cells))
    for m in modes:
        print(f"{m}: first chart per load, ms: " + ", ".join(fmt(r["first"]) for r in results[m]))
        last = results[m][-1] if results[m] else None
        if last:
            reqs = sorted(
                (x for x in last["res"] if x["type"] in ("fetch", "xmlhttprequest")), key=lambda x: x["start"]
            )
            for x in reqs:
                print(
                    f"  {m} request {x['name'][:70]:70s} start {fmt(x['start']):>6}"
                    f" ttfb {fmt(x['ttfb']):>6} end {fmt(x['end']):>6} {x['bytes'] / 1000:,.0f} kB"
                )
    print(
        f"replay hello built from the file, no browser: {hello['wall ms']:,.0f} ms wall,"
        f" {hello['cpu ms']:,.0f} ms CPU, {hello['kB']:,.0f} kB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "hello": hello}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
