"""Charts a person can read, in a real Chromium.

Zooming out past what the page holds backfills from the history on every time chart (the loss
as soon as its light answer comes, the tensors' charts with the snapshots); the hover lists
every series at the step; legends sit outside the plot area; axes carry at least four ticks in
one number format; an axis whose series spans more than three decades is logarithmic; a frozen
tensor's update ratio reads 0 (frozen) at the axis floor; the drill-down heatmap's row of a
just-clicked tensor has no holes where the history has values.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

FIRST_X = """(id) => { const gd = document.querySelector(`[data-testid="${id}"]`);
  return gd && gd.data && gd.data.length && gd.data[0].x && gd.data[0].x.length ? gd.data[0].x[0] : null; }"""


def wait_until(pred: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    return support.wait_until(pred, timeout, what, interval=0.05)


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    """An mlp demo at 400 steps/s with a history database: past 2,000 steps within seconds."""
    tmp = tmp_path_factory.mktemp("fast")
    with support.start_demo(tmp, rate=400, db=tmp / "h.sqlite") as server:
        yield server


def open_page(new_page: Any, server: support.ServerProcess, size: tuple[int, int] = (1440, 900)) -> tuple:
    page, log = new_page()
    page.set_viewport_size({"width": size[0], "height": size[1]})
    page.goto(server.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    wait_until(lambda: page.evaluate(FIRST_X, "chart-loss") is not None, what="loss drawn")
    return page, log


def test_zooming_out_past_the_held_steps_backfills_the_loss_at_once_and_every_time_chart(fast, new_page):
    wait_until(lambda: fast.get("/api/session")["training"]["step"] > 2000, 120, "2,000 steps")
    page, log = open_page(new_page, fast)
    assert page.evaluate(FIRST_X, "chart-loss") > 1000, (
        "before zooming out the chart holds the streamed window"
    )
    # The history's snapshots (each tensor's values: seconds on a long run) are held back until
    # the loss chart shows step 1: the loss must not wait for them.
    held: list[Any] = []
    released = False

    def hold(route: Any) -> None:
        if released:
            route.continue_()
        else:
            held.append(route)

    page.route("**/api/snapshots?*until=*", hold)
    page.evaluate(
        """() => Plotly.relayout(document.querySelector('[data-testid="chart-loss"]'),
                                 {"xaxis.range[0]": 0, "xaxis.range[1]": 2500})"""
    )
    # (a sync Playwright route handler runs only while a Playwright call is in progress: each poll
    # makes one, or a request made after the relayout returned would never reach `hold`)
    wait_until(lambda: page.evaluate("0") == 0 and held, what="the history's snapshots asked for")
    wait_until(lambda: page.evaluate(FIRST_X, "chart-loss") <= 1, what="step 1 on the loss chart")
    released = True
    for route in held:
        route.continue_()
    wait_until(
        lambda: (page.evaluate(FIRST_X, "chart-heatmap") or 1e9) <= 2, what="the oldest steps on the heatmap"
    )
    assert log.errors == []


def test_zooming_out_the_optimizer_chart_past_the_held_steps_asks_the_history(fast, new_page):
    wait_until(lambda: fast.get("/api/session")["training"]["step"] > 2000, 120, "2,000 steps")
    page, log = open_page(new_page, fast)
    page.get_by_test_id("chart-optim-time").scroll_into_view_if_needed()
    wait_until(lambda: page.evaluate(FIRST_X, "chart-optim-time") is not None, what="optimizer chart drawn")
    assert page.evaluate(FIRST_X, "chart-optim-time") > 1000
    with page.expect_request(lambda r: "/api/snapshots?" in r.url and "until=" in r.url):
        page.evaluate(
            """() => Plotly.relayout(document.querySelector('[data-testid="chart-optim-time"]'),
                                     {"xaxis.range[0]": 0, "xaxis.range[1]": 2500})"""
        )
    wait_until(lambda: page.evaluate(FIRST_X, "chart-optim-time") <= 2, what="step 1 on the optimizer chart")
    wait_until(lambda: page.evaluate(FIRST_X, "chart-loss") <= 1, what="and on the loss chart")
    assert log.errors == []


def test_time_charts_hover_every_series_at_the_step_with_legends_outside_and_round_ticks(fast, new_page):
    page, log = open_page(new_page, fast)
    wait_until(
        lambda: page.evaluate(
            """() => document.querySelectorAll('[data-testid="chart-loss"] .y2tick text').length"""
        ),
        what="the norm axis's ticks",
    )
    for chart in ["chart-optim-time", "chart-param-stats", "chart-loss"]:
        page.get_by_test_id(chart).scroll_into_view_if_needed()
        mode = wait_until(
            lambda chart=chart: page.evaluate(
                """(id) => { const gd = document.querySelector(`[data-testid="${id}"]`);
                             return gd && gd._fullLayout ? gd._fullLayout.hovermode : null; }""",
                chart,
            ),
            what=f"{chart} drawn",
        )
        assert mode == "x unified", (chart, mode)
    # the hover at one step lists the loss and both norms in one label
    page.get_by_test_id("chart-loss").scroll_into_view_if_needed()
    box = page.locator('[data-testid="chart-loss"] .nsewdrag').first.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)
    label = wait_until(
        lambda: page.evaluate(
            """() => { const l = document.querySelector('[data-testid="chart-loss"] .hoverlayer .legend');
                       return l ? l.textContent : null; }"""
        ),
        what="the unified hover label",
    )
    assert "loss" in label and "raw norm" in label and "final norm" in label, label
    # the norm axis: at least four labels, in one number format
    ticks = page.evaluate(
        """() => Array.from(document.querySelectorAll('[data-testid="chart-loss"] .y2tick text'))
                   .map((t) => t.textContent)"""
    )
    assert len(ticks) >= 4, ticks
    sci = [bool(re.fullmatch(r"-?\d+(\.\d+)?e-?\d+", t)) for t in ticks]
    assert all(sci) or not any(sci), f"one format per axis: {ticks}"
    assert not any(re.search(r"[pnµμmkMG]$", t) for t in ticks), ticks
    # the update ratio's legend (in band, out of band) sits above its plot area, off the bars
    page.get_by_test_id("chart-ratio").scroll_into_view_if_needed()
    boxes = wait_until(
        lambda: page.evaluate(
            """() => { const gd = document.querySelector('[data-testid="chart-ratio"]');
                       const leg = gd.querySelector('.legend'), plot = gd.querySelector('.nsewdrag');
                       if (!leg || !plot) return null;
                       const a = leg.getBoundingClientRect(), b = plot.getBoundingClientRect();
                       return { legend: [a.top, a.bottom], plot: [b.top, b.bottom],
                                names: Array.from(leg.querySelectorAll('.legendtext')).map((t) => t.textContent) }; }"""
        ),
        what="the update ratio's legend",
    )
    assert boxes["legend"][1] <= boxes["plot"][0] + 1, boxes
    assert any("out of band" in n for n in boxes["names"]), boxes
    assert log.errors == []


def test_a_frozen_tensors_update_ratio_reads_zero_frozen_at_the_axis_floor(fast, new_page):
    params = [p["name"] for p in fast.get("/api/session")["params"]]
    frozen = params[0]
    hook = fast.client.post("/api/hooks", json={"kind": "freeze", "target": frozen})
    hook.raise_for_status()
    try:
        page, log = open_page(new_page, fast)
        page.get_by_test_id("chart-ratio").scroll_into_view_if_needed()
        shown = wait_until(
            lambda: page.evaluate(
                """() => { const gd = document.querySelector('[data-testid="chart-ratio"]');
                           const t = gd && gd.data ? gd.data.find((d) => d.name === "0 (frozen)") : null;
                           if (!t) return null;
                           const j = t.y.findIndex((v) => v !== null);
                           return j < 0 ? null : { x: t.x[j], y: t.y[j], floor: gd._fullLayout.yaxis.range[0],
                                                   hover: t.hovertemplate }; }"""
            ),
            what="the frozen tensor's ratio drawn",
        )
        assert shown["x"] == frozen, shown
        assert abs(math.log10(shown["y"]) - shown["floor"]) < 0.5, "at the axis floor"
        assert "0 (frozen)" in shown["hover"], shown
        assert log.errors == []
    finally:
        for h in fast.get("/api/hooks"):
            fast.client.delete(f"/api/hooks/{h['id']}")


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    """A stack of 30 tiny Llama-shaped blocks (273 tensors: a large run, shown by groups)."""
    tmp = tmp_path_factory.mktemp("large")
    port = support.free_port()
    code = f"from tests.e2e.test_scale import serve_large; serve_large({port})"
    with support.ServerProcess(
        [sys.executable, "-c", code], port=port, log_dir=tmp, cwd=support.REPO, timeout=120
    ) as server:
        yield server


HEAT_ROW = """(name) => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
  if (!gd || !gd.data || !gd.data[0]) return null;
  const t = gd.data[0], r = Array.from(t.y).indexOf(name);
  if (r < 0) return null;
  return Array.from(t.x, (_, c) => [t.text[0][c], t.z[c][r]]); }"""


def test_a_just_opened_tensors_heatmap_row_has_no_holes_where_the_history_has_values(large, new_page):
    page, log = new_page()
    page.goto(large.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live", timeout=60_000)
    wait_until(
        lambda: page.evaluate(
            """() => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
                       return gd && gd.data && gd.data[0] && gd.data[0].x.length >= 8; }"""
        ),
        120,
        "8 steps on the heatmap",
    )
    name = "layers.17.input_layernorm.weight"
    # The first answer as read a moment before the newest steps were stored (the race between
    # the backfill's read and the subscription): its newest 3 steps left out.
    answered: list[int] = []

    def late(route: Any) -> None:
        url = route.request.url
        body = large.get(url[url.index("/api/") :])
        if not answered and len(body["steps"]) > 3:
            body["steps"] = body["steps"][:-3]
            body["stats"] = {k: [col[:-3] for col in cols] for k, cols in body["stats"].items()}
        answered.append(len(body["steps"]))
        route.fulfill(json=body)

    page.route("**/api/detail?*", late)
    page.evaluate("(name) => window.__dashboard.openTensor(name)", name)
    wait_until(lambda: page.evaluate(HEAT_ROW, name), 60, "the tensor's heatmap row")

    def holes() -> list[int]:
        row = page.evaluate(HEAT_ROW, name)
        served = large.get(f"/api/detail?params={name}&limit=600")
        has = {
            s
            for s, v in zip(served["steps"], served["stats"]["grad_norm_raw"][0], strict=True)
            if v is not None
        }
        return [s for s, z in row if z is None and s in has]

    wait_until(lambda: answered and not holes(), 60, "no holes in the tensor's row")
    assert log.errors == []
