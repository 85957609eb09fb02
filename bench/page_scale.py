"""The dashboard page under a large model: does it keep up, and what does it receive?

    .venv/bin/python bench/page_scale.py                      # deep at 1440x900, 10,000 tensors, exploding at 1024x768
    .venv/bin/python bench/page_scale.py --cases deep --seconds 10
    .venv/bin/python bench/page_scale.py --tree /tmp/old      # the same against another checkout's code
    .venv/bin/python bench/page_scale.py --json /tmp/page_scale.json

Cases (each a server on a free loopback port, this interpreter's environment; the page in
headless Chromium, Debian's, launched as the tests launch it: tests/support.py `launch_chromium`):

    deep       `gradient-inspector demo --scenario deep --steps-per-second 10 --no-wait` (993
               parameter tensors, every step sampled), at 1440x900
    wide       a user-mode script (this file with --serve-wide): a model of 10,000 tiny tensors
               (1,000 blocks ``layers.{i}`` of four 4x4 Linear layers, weight and bias, and two
               norm-like vectors), ``inspector.attach(model, opt, every=1)``, ``insp.serve()``,
               trained at most 10 steps a second; at 1440x900
    exploding  `gradient-inspector demo --scenario exploding --steps-per-second 10 --no-wait`, at 1024x768
    paced      the page at the rate asked for, at 993 tensors, where this machine cannot train `deep`
               that fast (it trains and samples about 5 steps a second on 2 CPU cores): a
               user-mode script (this file with --serve-paced) attaches to the `deep` scenario
               as the demo does (every step sampled, flight recorder on), serves, trains
               ``--warm-steps`` real steps, then publishes those steps' snapshots and losses
               again, in a cycle, as new steps (the next step numbers, fresh times) at ``--rate``
               a second through the inspector's own feed: what the server and the page receive
               is what a faster machine would send, values repeating; at 1440x900

Each server keeps a temporary history file, and trains ``--warm-steps`` steps (default 60,
polled on /api/session) before the page opens, so the page's hello carries some history.
Then the page is loaded; "load" is the time until the first Plotly chart has data drawn
(a ``.js-plotly-plot`` whose ``_fullData`` is not empty); "heatmap has rows at" is the first
animation frame, in seconds from navigation, at which the heatmap's figure has rows (below). From then on, for ``--seconds``
(default 20), the page is left alone while training streams, and we measure:

- longest task, long tasks: the PerformanceObserver ``longtask`` entries (main-thread tasks
  over 50 ms) that start after load; the count and the longest.
- busy (tasks): the main thread's busy share over the window, from Chrome's own accounting:
  the growth of ``TaskDuration`` (the summed duration of every main-thread task, short ones
  included) from the DevTools protocol's ``Performance.getMetrics``, over the wall-clock window.
  This is the figure to trust.
- busy (long): the long tasks' summed durations over the window (a lower bound: tasks under
  50 ms are not counted).
- busy (rAF): an estimate from requestAnimationFrame: a loop records every frame's timestamp;
  the usual frame interval is the median gap, and every gap longer than 1.5 times it counts
  its excess over the median as time the main thread could not draw; their sum over the
  window. It sees stalls that push frames back, not work that fits between two frames, and
  headless Chromium's frame clock is not a display's, so it is a cross-check of the two above.
- heatmap rows: read from the heatmap's Plotly figure at the end (``_fullData``: the heatmap
  trace's rows: its ``y`` labels, else its ``z`` rows, transposed or not), in the element ``[data-testid=chart-heatmap]``.
- messages: every websocket frame the page receives (Playwright's ``framereceived``), sorted
  by the JSON ``type``: the hello's size, and the snapshot messages' count, median and largest
  size in the window; all bytes per second.
- heap: ``JSHeapUsedSize`` (``Performance.getMetrics``, no forced collection) at the start and
  the end of the window.
- console errors, and the server's trained step at both ends (the steps per second trained: none
  in the paced case once its warm-up is over); the snapshot messages the page received a second.

Prints one table (a column per case). Exit status 0; this is a measurement, not a check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# The heatmap's row count: the heatmap trace of the Plotly figure in [data-testid=chart-heatmap].
HEATMAP_ROWS_FN = """() => {
  const root = document.querySelector('[data-testid="chart-heatmap"]');
  if (!root) return null;
  const plots = root.classList.contains('js-plotly-plot') ? [root] : [...root.querySelectorAll('.js-plotly-plot')];
  for (const gd of plots) {
    for (const t of gd._fullData || []) {
      if (t.type !== 'heatmap') continue;
      if (t.y && t.y.length !== undefined) return t.y.length; // the category axis: one label per row
      if (!Array.isArray(t.z)) return 0;
      return t.transpose ? (Array.isArray(t.z[0]) ? t.z[0].length : 0) : t.z.length;
    }
  }
  return 0;
}"""
# Installed before any page script runs: long tasks and frame times, kept from `window.__bench.t0` on.
INIT_SCRIPT = (
    "window.__benchHeatRows = "
    + HEATMAP_ROWS_FN
    + """;
(() => {
  const b = (window.__bench = { t0: null, long: [], frames: [] });
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) b.long.push([e.startTime, e.duration]);
    }).observe({ type: "longtask", buffered: true });
  } catch (e) {
    b.noLongtask = String(e);
  }
  const frame = (t) => {
    if (b.t0 !== null && b.frames.length < 100000) b.frames.push(t);
    if (b.heatAt === undefined && window.__benchHeatRows() > 0) b.heatAt = t;
    requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
})();
"""
)

FIRST_CHART = """() => [...document.querySelectorAll('.js-plotly-plot')].some(
  (gd) => Array.isArray(gd._fullData) && gd._fullData.length > 0)"""

HEATMAP_ROWS = "() => window.__benchHeatRows()"

WINDOW = """(t0) => {
  const b = window.__bench;
  const long = b.long.filter(([s]) => s >= t0);
  const frames = b.frames.filter((t) => t >= t0);
  return { now: performance.now(), long, frames, heatAt: b.heatAt ?? null, noLongtask: b.noLongtask || null };
}"""


# ----------------------------------------------------------------------------- the servers
class Pacer:
    """Keeps a loop at ``rate`` iterations a second, as the demo's --steps-per-second does (0: as
    fast as it goes)."""

    def __init__(self, rate: float) -> None:
        self.period = 1.0 / rate if rate > 0 else 0.0
        self.next_at = time.monotonic()

    def wait(self) -> None:
        if not self.period:
            return
        self.next_at += self.period
        delay = self.next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            self.next_at = time.monotonic()


# ----------------------------------------------------------------------------- the 10,000-tensor server
def serve_wide(tensors: int, port: int, rate: float, db: str) -> None:
    """The user-mode case: attach to a model of ``tensors`` tiny tensors, serve, train until killed."""
    import torch
    from torch import nn

    import inspector

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(4, 4) for _ in range(4))
            self.norm1 = nn.Parameter(torch.ones(4))
            self.norm2 = nn.Parameter(torch.ones(4))

    class Wide(nn.Module):
        """``tensors // 10`` blocks of 10 tensors; the forward pass is one linear regression over
        all their elements concatenated (one ``cat`` rather than 10,000 small kernels)."""

        def __init__(self, n_blocks: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(n_blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = torch.cat([p.reshape(-1) for p in self.parameters()])
            return x @ flat

    torch.manual_seed(0)
    model = Wide(tensors // 10)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01 / n**0.5)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(n, generator=gen) / n**0.5
    insp = inspector.attach(model, opt, every=1)
    print("dashboard:", insp.serve(port=port, db=db), flush=True)
    pace = Pacer(rate)
    while True:
        x = torch.randn(16, n, generator=gen)
        loss = ((model(x) - x @ teacher) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        insp.record(loss=loss)
        pace.wait()


# ----------------------------------------------------------------------------- the paced 993-tensor server
def serve_paced(port: int, rate: float, db: str, warm: int) -> None:
    """The paced case: attach to the `deep` scenario, serve, train ``warm`` steps, then publish
    those steps' snapshots and losses again as new steps, ``rate`` a second, until killed."""
    import dataclasses

    import torch

    import inspector
    from inspector.scenarios import make

    torch.set_num_threads(1)
    sc = make("deep", seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=1, flight=256)
    print("dashboard:", insp.serve(port=port, db=db), flush=True)
    losses = []
    for _ in range(warm):
        losses.append(float(sc.step()))
        insp.record(loss=losses[-1])
    feed = insp._feed  # (the inspector's own feed: the server's subscription reads it)
    taken = list(feed.snapshots)  # (every step's: published at its boundary)
    step = taken[-1].step
    pace = Pacer(rate)
    for k in itertools.count():
        snap = taken[k % len(taken)]
        step += 1
        feed.publish("snapshot", dataclasses.replace(snap, step=step, time=time.time()))
        feed.publish("scalars", {"step": step, "loss": losses[(snap.step - 1) % len(losses)], "scalars": {}})
        pace.wait()


# ----------------------------------------------------------------------------- measuring one page
def tree_env(tree: Path | None) -> dict[str, str]:
    from tests.support import repo_env

    env = repo_env()
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env["PYTHONPATH"]
    return env


def start_case(name: str, args: argparse.Namespace, tmp: Path) -> Any:
    from tests.support import ServerProcess, free_port, start_demo

    env = tree_env(args.tree)
    db = tmp / f"{name}.sqlite"
    if name in ("deep", "exploding"):
        return start_demo(tmp, scenario=name, rate=args.rate, db=db, env=env, timeout=120)
    port = free_port()
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        *(("--serve-paced", "--warm-steps", str(args.warm_steps)) if name == "paced" else ()),
        *(("--serve-wide", str(args.tensors)) if name == "wide" else ()),
        "--port",
        str(port),
        "--rate",
        str(args.rate),
        "--db",
        str(db),
    ]
    return ServerProcess(argv, port=port, log_dir=tmp, env=env, timeout=300)


def server_step(server: Any) -> int:
    session = server.get("/api/session")
    training = session.get("training") or {}
    return int(training.get("step") or 0)


def measure(browser: Any, name: str, server: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support import wait_until

    wait_until(lambda: server_step(server) >= args.warm_steps, timeout=600, what=f"{args.warm_steps} steps")
    size = (1024, 768) if name == "exploding" else (1440, 900)
    ctx = browser.new_context(viewport={"width": size[0], "height": size[1]})
    page = ctx.new_page()
    page.set_default_timeout(300_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    frames: list[tuple[float, str, int]] = []  # (time, type, bytes)

    def on_frame(payload: Any) -> None:
        size_ = len(payload.encode() if isinstance(payload, str) else payload)
        kind = "?"
        try:
            kind = json.loads(payload).get("type", "?")
        except (ValueError, AttributeError):
            pass
        frames.append((time.monotonic(), kind, size_))

    page.on("websocket", lambda ws: ws.on("framereceived", on_frame))
    page.add_init_script(INIT_SCRIPT)
    cdp = ctx.new_cdp_session(page)
    cdp.send("Performance.enable", {"timeDomain": "timeTicks"})

    def metrics() -> dict[str, float]:
        return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}

    t_open = time.monotonic()
    page.goto(server.url)
    page.wait_for_function(FIRST_CHART, polling=50)
    load_s = time.monotonic() - t_open
    t0 = page.evaluate("() => (window.__bench.t0 = performance.now())")
    m0, w0, step0 = metrics(), time.monotonic(), server_step(server)
    page.wait_for_timeout(args.seconds * 1000)  # the measured window: the page left alone
    m1, w1, step1 = metrics(), time.monotonic(), server_step(server)
    win = page.evaluate(WINDOW, t0)
    rows = page.evaluate(HEATMAP_ROWS)
    ctx.close()

    wall = w1 - w0
    span_ms = win["now"] - t0
    long = win["long"]
    gaps = [b - a for a, b in zip(win["frames"], win["frames"][1:], strict=False)]
    usual = statistics.median(gaps) if gaps else 0.0
    stall = sum(g - usual for g in gaps if g > 1.5 * usual) if gaps else float("nan")
    snaps = [s for t, k, s in frames if k == "snapshot" and t >= w0]
    hello = [s for _, k, s in frames if k == "hello"]
    in_window = [s for t, _, s in frames if t >= w0]
    return {
        "case": name,
        "viewport": f"{size[0]}x{size[1]}",
        "load_s": load_s,
        "heatmap_s": win["heatAt"] / 1000 if win["heatAt"] is not None else float("nan"),
        "long_tasks": len(long),
        "longest_ms": max((d for _, d in long), default=0.0),
        "busy_tasks": (m1.get("TaskDuration", 0.0) - m0.get("TaskDuration", 0.0)) / wall,
        "busy_long": sum(d for _, d in long) / span_ms,
        "busy_raf": stall / span_ms,
        "frames": len(win["frames"]),
        "heatmap_rows": rows,
        "hello_bytes": max(hello, default=0),
        "snapshots": len(snaps),
        "snapshots_per_s": len(snaps) / wall,
        "snapshot_median": statistics.median(snaps) if snaps else 0,
        "snapshot_max": max(snaps, default=0),
        "bytes_per_s": sum(in_window) / wall,
        "heap_start": m0.get("JSHeapUsedSize", 0.0),
        "heap_end": m1.get("JSHeapUsedSize", 0.0),
        "steps_per_s": (step1 - step0) / wall,
        "console_errors": len(errors),
        "first_error": errors[0][:200] if errors else "",
        "no_longtask": win["noLongtask"],
    }


ROWS: list[tuple[str, str, Any]] = [
    ("viewport", "viewport", str),
    ("load (first chart), s", "load_s", lambda v: f"{v:.1f}"),
    ("heatmap has rows at, s", "heatmap_s", lambda v: f"{v:.1f}"),
    ("long tasks after load", "long_tasks", str),
    ("longest task, ms", "longest_ms", lambda v: f"{v:.0f}"),
    ("busy: TaskDuration", "busy_tasks", lambda v: f"{100 * v:.0f} %"),
    ("busy: long tasks", "busy_long", lambda v: f"{100 * v:.0f} %"),
    ("busy: rAF stalls", "busy_raf", lambda v: f"{100 * v:.0f} %"),
    ("frames drawn", "frames", str),
    ("heatmap rows", "heatmap_rows", str),
    ("hello, bytes", "hello_bytes", lambda v: f"{v:,}"),
    ("snapshot msgs in window", "snapshots", str),
    ("snapshot msgs/s", "snapshots_per_s", lambda v: f"{v:.1f}"),
    ("snapshot msg median, bytes", "snapshot_median", lambda v: f"{v:,.0f}"),
    ("snapshot msg max, bytes", "snapshot_max", lambda v: f"{v:,}"),
    ("ws bytes/s", "bytes_per_s", lambda v: f"{v:,.0f}"),
    ("JS heap start, MiB", "heap_start", lambda v: f"{v / 2**20:.1f}"),
    ("JS heap end, MiB", "heap_end", lambda v: f"{v / 2**20:.1f}"),
    ("server steps/s (trained)", "steps_per_s", lambda v: f"{v:.1f}"),
    ("console errors", "console_errors", str),
]


def table(results: list[dict[str, Any]], seconds: float) -> str:
    head = [f"window {seconds:g} s"] + [r["case"] for r in results]
    lines = [head] + [[label] + [fmt(r[key]) for r in results] for label, key, fmt in ROWS]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases", default="deep,wide,exploding", help="comma-separated subset of deep,wide,exploding,paced"
    )
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window after load (default 20)")
    p.add_argument("--rate", type=float, default=10.0, help="training steps a second (default 10)")
    p.add_argument("--tensors", type=int, default=10_000, help="the wide case's tensor count (default 10000)")
    p.add_argument(
        "--warm-steps", type=int, default=60, help="steps trained before the page opens (default 60)"
    )
    p.add_argument("--tree", type=Path, default=None, help="run the servers from this checkout's code")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
    p.add_argument("--serve-wide", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve-paced", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_wide is not None:
        serve_wide(args.serve_wide, args.port, args.rate, args.db)
        return 0
    if args.serve_paced:
        serve_paced(args.port, args.rate, args.db, args.warm_steps)
        return 0

    sys.path.insert(0, str(REPO))
    from playwright.sync_api import sync_playwright

    from tests.support import launch_chromium

    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - {"deep", "wide", "exploding", "paced"}
    if unknown:
        p.error(f"unknown cases: {', '.join(sorted(unknown))}")
    results = []
    with tempfile.TemporaryDirectory(prefix="page-scale-") as tmp, sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            for name in cases:
                with start_case(name, args, Path(tmp)) as server:
                    r = measure(browser, name, server, args)
                results.append(r)
                print(
                    f"{name}: done ({r['console_errors']} console errors {r['first_error']!r})",
                    file=sys.stderr,
                )
        finally:
            browser.close()
    print(f"code: {args.tree or REPO}")
    print(table(results, args.seconds))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
