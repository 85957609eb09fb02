"""The measured cards on the time charts' shared step axis.

The module, per-parameter statistics, histogram-over-steps and hook-effect charts show the same
step range as the loss chart and the heatmap. A mouse zoom (a drag, as a user zooms) on the loss
chart holds while training streams; it moves every card to that range and keeps it there; a zoom
on a card moves the time charts; a double click on a card shows the whole run everywhere.
A real `gradient-inspector demo` (mlp) and Debian's Chromium, in a window tall enough for every chart
to be on screen; every wait is on a condition.
"""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

TIME_CHARTS = ["chart-loss", "chart-heatmap"]
CARDS = ["chart-modules", "chart-param-stats", "chart-hist-time", "chart-effects"]

# Each chart's x range as drawn (null before its first draw), and the newest step a card holds.
RANGES = """(ids) => { const out = {};
  for (const id of ids) {
    const gd = document.querySelector(`[data-testid="${id}"]`);
    const ax = gd && gd._fullLayout && gd._fullLayout.xaxis;
    out[id] = ax && ax.range ? ax.range.map(Number) : null;
  }
  return out; }"""
OFF_SCREEN = """(ids) => ids.filter((id) => {
    const r = document.querySelector(`[data-testid="${id}"]`).getBoundingClientRect();
    return !(r.height > 0 && r.top >= 0 && r.bottom <= window.innerHeight); })"""
TALL = 5000  # pixels: the page with every card open is about 4,600 tall at 1440 wide
NEWEST = """(id) => { const gd = document.querySelector(`[data-testid="${id}"]`);
  const xs = gd && gd.data && gd.data.length ? Array.from(gd.data[0].x || []) : [];
  return xs.length ? xs[xs.length - 1] : null; }"""


def wait_until(pred: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    return support.wait_until(pred, timeout, what, interval=0.05)


def ranges(page: Any) -> dict[str, list[float] | None]:
    return page.evaluate(RANGES, TIME_CHARTS + CARDS)


def all_at(page: Any, target: list[float]) -> bool:
    """Every time chart and card shows `target` (to a millionth of a step)."""
    return all(
        r is not None and abs(r[0] - target[0]) < 1e-6 and abs(r[1] - target[1]) < 1e-6
        for r in ranges(page).values()
    )


def same_everywhere(page: Any) -> list[float] | None:
    """The loss chart's range when every chart shows it, else None."""
    r = ranges(page)
    loss = r["chart-loss"]
    return loss if loss is not None and all_at(page, loss) else None


def drag_x(page: Any, testid: str, frm: float, to: float) -> None:
    """A horizontal mouse drag over a chart's plot area, from `frm` to `to` of its width: a zoom."""
    box = page.locator(f'[data-testid="{testid}"] .nsewdrag').first.bounding_box()
    assert box is not None, f"{testid} has no plot area"
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + frm * box["width"], y)
    page.mouse.down()
    page.mouse.move(box["x"] + (frm + to) / 2 * box["width"], y, steps=4)
    page.mouse.move(box["x"] + to * box["width"], y, steps=4)
    page.mouse.up()


def open_cards(demo: support.ServerProcess, new_page: Any) -> tuple[Any, Any]:
    """The page with every card drawn with data: a module_log hook (the module chart), a clip
    hook (an effect), 0.weight picked (its statistics); once 30 steps are on the module chart."""
    for hook in demo.get("/api/hooks"):
        demo.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    demo.client.post("/api/hooks", json={"kind": "module_log", "target": "0"}).raise_for_status()
    demo.client.post(
        "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 0.01}}
    ).raise_for_status()
    page, log = new_page()
    # A window tall enough for every chart to be on screen: a smaller run's chart off screen is
    # drawn at most every 2 s (test_timecharts), so while the run is followed its range lags
    # the charts on screen by design; what is compared here is what a user sees.
    page.set_viewport_size({"width": 1440, "height": TALL})
    page.goto(demo.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    page.get_by_test_id("param-filter").fill("0.weight")
    expect(page.get_by_test_id("param-picked").get_by_test_id("param-chip")).to_have_count(1)
    expect(page.get_by_test_id("card-modules")).to_be_visible()
    offscreen = page.evaluate(OFF_SCREEN, TIME_CHARTS + CARDS)
    assert offscreen == [], f"charts below a {TALL}-pixel window: {offscreen}"
    first = page.evaluate(NEWEST, "chart-modules") or 0
    wait_until(
        lambda: (page.evaluate(NEWEST, "chart-modules") or 0) >= first + 30,
        60,
        "30 more steps on the module chart",
    )
    return page, log


def zoom_loss(page: Any) -> list[float]:
    """A mouse zoom on the loss chart, to about a third of what it shows; its new range."""
    page.get_by_test_id("chart-loss").scroll_into_view_if_needed()
    before = ranges(page)["chart-loss"]
    drag_x(page, "chart-loss", 0.25, 0.6)
    return wait_until(
        lambda: (r := ranges(page)["chart-loss"]) and r[1] - r[0] < 0.5 * (before[1] - before[0]) and r,
        what="the loss chart zoomed",
    )


def test_a_mouse_zoom_on_the_loss_chart_holds_while_training_streams(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_cards(demo, new_page)
    zoomed = zoom_loss(page)
    # Every chart at the zoomed range, still there once more rows have streamed in (before the
    # fix, the chart's next streamed draw put its range back: the zoom read as the page's own).
    wait_until(lambda: ranges(page)["chart-heatmap"] == zoomed, what=f"the heatmap at {zoomed}")
    step = page.evaluate("() => window.__dashboard.live.step")
    wait_until(
        lambda: page.evaluate("() => window.__dashboard.live.step") >= step + 5, what="five more steps"
    )
    assert ranges(page)["chart-loss"] == zoomed
    assert ranges(page)["chart-heatmap"] == zoomed
    assert log.errors == []


def test_the_measured_cards_follow_a_zoom_of_the_time_charts_and_lead_one(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_cards(demo, new_page)
    # Following the run: one range on every chart (Plotly's own autorange on a card would differ).
    wait_until(lambda: same_everywhere(page), what="every chart on the shared range")

    # A zoom of the loss chart: every card shows its range, and keeps it as rows stream in.
    zoomed = zoom_loss(page)
    wait_until(lambda: all_at(page, zoomed), what=f"every card at the loss chart's {zoomed}")
    newest = page.evaluate(NEWEST, "chart-modules")
    wait_until(lambda: page.evaluate(NEWEST, "chart-modules") >= newest + 5, what="five more rows on a card")
    assert all_at(page, zoomed), ranges(page)

    # A zoom on a card leads: the time charts and the other cards follow it.
    page.get_by_test_id("chart-effects").scroll_into_view_if_needed()
    drag_x(page, "chart-effects", 0.3, 0.7)
    led = wait_until(
        lambda: (r := ranges(page)["chart-effects"]) and r[1] - r[0] < 0.9 * (zoomed[1] - zoomed[0]) and r,
        what="the effects chart zoomed",
    )
    wait_until(lambda: all_at(page, led), what=f"every chart at the effects chart's {led}")
    assert log.errors == []


def test_a_double_click_on_a_card_shows_the_whole_run_on_every_chart(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_cards(demo, new_page)
    zoom_loss(page)
    page.get_by_test_id("chart-modules").scroll_into_view_if_needed()
    box = page.locator('[data-testid="chart-modules"] .nsewdrag').first.bounding_box()
    page.mouse.dblclick(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    # The whole run: from step 1 (or before) to the newest step, on every chart, following on.
    newest = page.evaluate(NEWEST, "chart-modules")
    whole = wait_until(
        lambda: (r := same_everywhere(page)) and r[0] <= 1 and r[1] >= newest and r,
        what="the whole run on every chart",
    )
    wait_until(
        lambda: (r := same_everywhere(page)) and r[0] == whole[0] and r[1] > whole[1],
        what="the whole run's right edge following the stream",
    )
    assert log.errors == []
