#!/usr/bin/env python3
"""Screenshots of the dashboard, per demo scenario at 1440x900 and 1024x768, into docs/.

    .venv/bin/python scripts/screenshots.py [--scenario NAME ...] [--out docs]

For each scenario it starts `gradient-inspector demo` on a free loopback port (no history
database; tests/support.py's `start_demo`, which waits until /api/health answers), opens the
dashboard in Debian's Chromium (Python Playwright, launched by tests/support.py's
`launch_chromium`), drives training through the HTTP API the way the scenario's "try this"
suggests (a hook added part-way, so its marker and effect show), pauses, waits until the page
has drawn the last step, and saves `docs/dashboard-<scenario>.png` (1440x900) and, from the same
paused run in a second page, `docs/dashboard-<scenario>-1024.png` (1024x768): the scenario's view
(its URL fragment; the Overview unless the plan names another) in the dark theme, as the
viewport shows it (top bar, health line and view bar included), not the whole page. Training is driven step by step near each
hook, so the pictures are the same from run to run up to timing noise. The scenario pictures are
taken with `--no-shadow`; `exploding-whatif` is the `exploding` run with its shadow comparison
(the run without the clip, dashed) and the difference chart open, in the What-if view; `deep` (a
large model, shown by groups) also gets `docs/dashboard-deep-drill.png`, the Overview after a
click on the worst-now list's first tensor, its tensor panel open; `tiny_gpt` also gets
`docs/dashboard-tiny_gpt-optimizer.png`, the Optimizer view (the update ratio of the frozen
block); `nan-rules` (the "safe overnight" rule rewinding past the NaN) also gets the Rules card
alone and the loss card with the firing's marker hovered.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import launch_chromium, start_demo  # noqa: E402

SIZES = [(1440, 900), (1024, 768)]  # a laptop, and a small one: dashboard-<scenario>.png, -1024.png

# What each picture shows: hooks added at given steps (the scenario's "try this"), the step
# to stop at, and the view shown ("view", the Overview unless named; "more": further views, one
# picture each, dashboard-<scenario>-<view>.png at 1440x900).
PLANS: dict[str, dict[str, Any]] = {
    "mlp": {
        "actions": [
            (40, "add", {"kind": "noise", "target": "*", "params": {"std": 3.0}}),
            (80, "disable", None),
        ],
        "stop": 130,
    },
    "exploding": {
        "actions": [(30, "add", {"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})],
        "stop": 140,
    },
    # zclip from the start, no threshold chosen: its warm-up, then the norm held near its
    # warm-up level while the raw norm climbs (the hook row shows its threshold)
    "exploding-zclip": {
        "scenario": "exploding",
        "actions": [(1, "add", {"kind": "zclip", "target": "*", "params": {}})],
        "stop": 140,
    },
    # what-if: the same run with its shadow, the run without the clip, dashed; the
    # difference chart open. The other pictures are taken with --no-shadow.
    "exploding-whatif": {
        "scenario": "exploding",
        "extra": [],
        "diff": True,
        "view": "whatif",
        "actions": [(30, "add", {"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})],
        "stop": 110,
    },
    "nan": {
        "actions": [(10, "add", {"kind": "nan_guard", "target": "*", "params": {"action": "skip"}})],
        "stop": 90,
    },
    # rules: a checkpoint at step 10 and the "safe overnight" preset; the NaN at step 30 fires it,
    # rewinding to the checkpoint and skipping the batches since it. Also
    # "dashboard-nan-rules-card-rules.png" (the Rules card) and "...-loss-hover.png" (the loss card,
    # the firing's marker hovered)
    "nan-rules": {
        "scenario": "nan",
        "actions": [(10, "checkpoint", None), (10, "rules", {"preset": "safe overnight"})],
        "stop": 60,
        "cards": ["card-rules"],
        "hover": "rule fired",
    },
    "tiny_gpt": {
        "actions": [(15, "add", {"kind": "freeze", "target": "blocks.0.*", "params": {}})],
        "stop": 45,
        "more": ["optimizer"],
    },
    # a large model, shown by groups: stopped a few steps after layers.71 went wrong, before any
    # hook; "deep.png" is the overview, "deep-drill.png" the same page after a click on the
    # worst-now list's first tensor: its tensor panel open, its group expanded in the heatmap
    "deep": {
        "actions": [],
        "stop": 64,
        "open_worst": True,
    },
}


class Api:
    def __init__(self, base: str) -> None:
        self.base = base

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return json.loads(text) if text else None

    def step(self) -> int:
        return int(self.call("GET", "/api/session")["training"]["step"])

    def run_to(self, target: int, rate: float = 20.0, timeout: float = 600.0) -> None:
        """Train up to exactly `target` steps, then stay paused."""
        deadline = time.monotonic() + timeout
        if self.step() < target - 2:
            self.call("POST", "/api/training/rate", {"steps_per_second": rate})
            self.call("POST", "/api/training/resume")
            while self.step() < target - 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training did not reach step {target}")
                time.sleep(0.05)
        self.call("POST", "/api/training/pause")
        self.wait_held(deadline)  # the step under way finishes, then training holds at its boundary
        while self.step() < target:
            before = self.step()
            self.call("POST", "/api/training/step")
            while self.step() == before:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"single step at {before} did not complete")
                time.sleep(0.02)
            self.wait_held(deadline)

    def wait_held(self, deadline: float) -> None:
        """Until the training thread holds at a boundary (the pause has taken hold)."""
        while not self.call("GET", "/api/session")["training"].get("held"):
            if time.monotonic() > deadline:
                raise TimeoutError("the pause did not take hold")
            time.sleep(0.02)


def shoot(browser: Any, scenario: str, out: Path) -> list[Path]:
    plan = PLANS[scenario]
    with (
        tempfile.TemporaryDirectory() as log_dir,
        start_demo(
            Path(log_dir),
            scenario=plan.get("scenario", scenario),
            rate=10,
            cwd=REPO,
            timeout=120,
            extra=plan.get("extra", ["--no-shadow"]),
        ) as server,
    ):
        api = Api(server.base)
        api.call("POST", "/api/training/pause")
        page = browser.new_page(viewport={"width": SIZES[0][0], "height": SIZES[0][1]}, color_scheme="dark")
        errors: list[str] = []
        watch(page, errors)
        view = plan.get("view", "overview")
        page.goto(f"{api.base}/#{view}")
        page.get_by_test_id("connection-status").filter(has_text="live").wait_for()
        for at, action, spec in plan["actions"]:
            api.run_to(at)
            if action == "add":
                hook = api.call("POST", "/api/hooks", spec)
                added = hook["id"]
            elif action == "disable":
                api.call("PATCH", f"/api/hooks/{added}", {"enabled": False})
            elif action == "checkpoint":  # taken at the held boundary
                api.call("POST", "/api/checkpoints", {})
            elif action == "rules":
                api.call("POST", "/api/rules", spec)
        api.run_to(plan["stop"])
        last = api.step()
        sampled = api.call("GET", "/api/snapshots?limit=1")["snapshots"][-1]["step"]  # the newest snapshot
        show_diff(page, plan)
        paths = [settle_and_shoot(page, last, sampled, out / f"dashboard-{scenario}.png")]
        if plan.get("open_worst"):
            paths.append(open_worst(page, last, sampled, out / f"dashboard-{scenario}-drill.png"))
        for more in plan.get("more", []):
            show_view(page, more)
            paths.append(settle_and_shoot(page, last, sampled, out / f"dashboard-{scenario}-{more}.png"))
        show_view(page, view)
        for card in plan.get("cards", []):  # one card alone, as the 1440x900 page shows it
            el = page.get_by_test_id(card)
            el.scroll_into_view_if_needed()
            paths.append(out / f"dashboard-{scenario}-{card}.png")
            el.screenshot(path=str(paths[-1]))
        if plan.get("hover"):
            paths.append(hover_marker(page, plan["hover"], out / f"dashboard-{scenario}-loss-hover.png"))
        page.close()
        for width, height in SIZES[1:]:  # the same paused run, seen on a smaller screen
            small = browser.new_page(viewport={"width": width, "height": height}, color_scheme="dark")
            watch(small, errors)
            small.goto(f"{api.base}/#{view}")
            small.get_by_test_id("connection-status").filter(has_text="live").wait_for()
            show_diff(small, plan)
            paths.append(settle_and_shoot(small, last, sampled, out / f"dashboard-{scenario}-{width}.png"))
            small.close()
        if errors:
            print(f"{scenario}: console errors: {errors}", file=sys.stderr)
        return paths


def watch(page: Any, errors: list[str]) -> None:
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))


def show_view(page: Any, view: str) -> None:
    """Show `view` (its URL fragment, as the view bar's link sets it) and wait until it is shown."""
    page.evaluate("(v) => { window.location.hash = v; }", view)
    page.wait_for_function("(v) => document.body.dataset.shownView === v", arg=view, timeout=10_000)


def show_diff(page: Any, plan: dict[str, Any]) -> None:
    """What-if pictures: the shadow drawn, and its difference chart open."""
    if not plan.get("diff"):
        return
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-loss"]');
          return (gd.data || []).some((t) => String(t.name).startsWith("shadow") && t.x.length > 10); }""",
        timeout=60_000,
    )
    page.get_by_test_id("shadow-diff").click()
    page.wait_for_function(
        "() => Number(document.querySelector('[data-testid=\"chart-shadow-diff\"]').dataset.points) > 10",
        timeout=60_000,
    )


def open_worst(page: Any, last: int, sampled: int, path: Path) -> Path:
    """Click the worst-now list's first tensor, wait until its tensor panel has drawn its norm over
    the run and the heatmap shows it (its group expanded down to it), and shoot, the panel open."""
    item = page.get_by_test_id("worst-item").first
    name = item.get_attribute("data-param")
    item.click()
    panel = page.get_by_test_id("tensor-panel")
    panel.wait_for(state="visible", timeout=30_000)
    page.wait_for_function(
        """(name) => { const p = document.querySelector('[data-testid="tensor-panel"]');
          const gd = document.querySelector('[data-testid="tensor-panel-norm"]');
          return p.dataset.param === name && Number(gd.dataset.points) > 0; }""",
        arg=name,
        timeout=30_000,
    )
    page.wait_for_function(
        """(name) => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
          return ((gd._fullData || [])[0]?.y || []).some((y) => String(y).includes(name.split(".").pop())); }""",
        arg=name,
        timeout=30_000,
    )
    return settle_and_shoot(page, last, sampled, path)


def hover_marker(page: Any, trace: str, path: Path) -> Path:
    """Hover the first marker of the loss chart's `trace` (its hover shown) and shoot the loss card."""
    card = page.get_by_test_id("chart-loss").locator("xpath=ancestor::article[1]")
    card.scroll_into_view_if_needed()
    page.evaluate("window.scrollTo(0, 0)")
    xy = page.evaluate(
        """(name) => { const gd = document.querySelector('[data-testid="chart-loss"]');
          const t = gd.data.find((d) => d.name === name && d.mode === "markers");
          const fl = gd._fullLayout, box = gd.getBoundingClientRect();
          return [box.left + fl.margin.l + fl.xaxis.l2p(t.x[0]), box.top + fl.margin.t + fl.yaxis3.l2p(t.y[0])]; }""",
        trace,
    )
    page.mouse.move(xy[0], xy[1])
    # (a hover box; "x unified" hover draws its box as the hover layer's legend)
    page.locator(
        '[data-testid="chart-loss"] .hoverlayer .hovertext, [data-testid="chart-loss"] .hoverlayer .legend'
    ).first.wait_for(timeout=10_000)
    card.screenshot(path=str(path))
    return path


def settle_and_shoot(page: Any, last: int, sampled: int, path: Path) -> Path:
    """Wait until the page has drawn step `last` and its newest snapshot, step `sampled` (paused, no hook
    pending, no chart in view with a redraw due), then screenshot the viewport, scrolled to the top.
    A large run's page draws only the charts on screen, so those in view are waited for."""
    page.mouse.move(0, 0)
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_function(
        """([last, sampled]) => {
          const flow = document.querySelector('[data-testid="chart-flow"]');
          const counter = document.querySelector('[data-testid="step-counter"]');
          // (the flow chart, where the view shows it, names the snapshot it drew)
          return (flow.offsetParent === null || Number(flow.dataset.step) === sampled)
            && Number(counter.textContent) === last
            && document.querySelectorAll('[data-testid="hook-row"][data-pending="true"]').length === 0;
        }""",
        arg=[last, sampled],
        timeout=60_000,
    )
    page.get_by_test_id("training-state").filter(has_text="paused").wait_for(timeout=20_000)
    # Let the charts in view finish their last redraws (the observer has seen the scroll by then).
    for _ in range(2):
        page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
        page.wait_for_function(
            """() => window.__dashboard.scheduler.slots.every((s) => !s.chart.el
              || s.chart.el.offsetParent === null || !s.visible || (!s.pending.dirty && !s.stale))""",
            timeout=30_000,
        )
    page.screenshot(path=str(path))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(PLANS), help="default: every scenario")
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        try:
            browser = launch_chromium(p)
        except FileNotFoundError as e:
            sys.exit(str(e))
        try:
            for name in args.scenario or list(PLANS):
                t0 = time.monotonic()
                paths = shoot(browser, name, args.out)
                shown = [str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for p in paths]
                print(f"{name}: {', '.join(shown)} ({time.monotonic() - t0:.0f} s)")
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
