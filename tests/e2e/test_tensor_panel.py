"""One click to a tensor, in a real Chromium.

A click on a tensor's name (worst now, a chart, the statistics table, an event naming it) opens
its panel inside the viewport with no scroll, at 1440x900 and 1024x768; the panel's norm chart
starts at the run's first recorded step although the page holds only its newest window; Escape,
a second click and the close button close it, another name switches it; the tick labels of its
short log-scale charts stay apart.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

PANEL = "tensor-panel"

FIRST_HELD = "() => new Set(window.__dashboard.view.snapshots.map((r) => r.step)).size && window.__dashboard.view.snapshots[0].step"


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    """An mlp demo at 400 steps/s with a history: past the page's window within seconds."""
    tmp = tmp_path_factory.mktemp("panel")
    with support.start_demo(tmp, rate=400, db=tmp / "h.sqlite") as server:
        yield server


def open_page(new_page: Any, server: support.ServerProcess, size: tuple[int, int]) -> tuple[Any, Any]:
    page, log = new_page()
    page.set_viewport_size({"width": size[0], "height": size[1]})
    page.goto(server.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    expect(page.get_by_test_id("worst-item").first).to_be_visible(timeout=60_000)
    return page, log


def hold_worst(page: Any) -> list[str]:
    """The pointer over worst now (the list holds still); the names it shows."""
    page.get_by_test_id("worst-list").hover()
    expect(page.get_by_test_id("worst-note")).to_have_attribute("data-held", "true", timeout=30_000)
    return page.eval_on_selector_all('[data-testid="worst-item"]', "els => els.map((e) => e.dataset.param)")


def click_name(page: Any, name: str) -> None:
    page.locator(f'[data-testid="worst-item"][data-param="{name}"] .w-name').click()


def in_viewport(page: Any, size: tuple[int, int]) -> None:
    box = page.get_by_test_id(PANEL).bounding_box()
    assert box is not None
    assert box["x"] >= 0 and box["y"] >= 0, box
    assert box["x"] + box["width"] <= size[0] and box["y"] + box["height"] <= size[1], (box, size)
    assert box["width"] >= 300 and box["height"] >= 400, box
    # nothing scrolled to show it: the panel is fixed to the viewport
    assert (
        page.evaluate("() => getComputedStyle(document.querySelector('[data-testid=tensor-panel]')).position")
        == "fixed"
    )


@pytest.mark.parametrize("size", [(1440, 900), (1024, 768)])
def test_a_click_on_a_name_opens_the_tensor_panel_in_view_with_the_whole_run(
    fast: support.ServerProcess, new_page: Any, size: tuple[int, int]
) -> None:
    support.wait_until(lambda: fast.get("/api/session")["training"]["step"] > 1200, 180, "1,200 steps")
    page, log = open_page(new_page, fast, size)
    held_from = support.wait_until(lambda: page.evaluate(FIRST_HELD), 30, "rows held")
    assert held_from > 100, "the page holds its newest window only, not step 1"
    names = hold_worst(page)
    assert len(names) >= 2, names
    first, other = names[0], next(n for n in names if n != names[0])
    scroll = page.evaluate("() => window.scrollY")
    click_name(page, first)
    panel = page.get_by_test_id(PANEL)
    expect(panel).to_be_visible()
    expect(panel).to_have_attribute("data-param", first)
    in_viewport(page, size)
    assert page.evaluate("() => window.scrollY") == scroll
    expect(page.get_by_test_id("tensor-panel-name")).to_have_text(first)

    # The norm over the whole run: from the first step the history has, not the page's window.
    start = fast.get("/api/detail", params={"params": first, "limit": 5000})["steps"][0]
    assert start <= 2
    norm = page.get_by_test_id("tensor-panel-norm")
    expect(norm).to_have_attribute("data-first-step", str(start))
    drawn = page.evaluate(
        """() => { const gd = document.querySelector('[data-testid="tensor-panel-norm"]');
                   return gd.data.map((t) => ({ name: t.name, x0: t.x[0], n: t.x.length,
                                                y: t.y.filter((v) => v !== null).length })); }"""
    )
    raw = next(t for t in drawn if t["name"] == "raw")
    assert raw["x0"] == start and raw["n"] > 1000 and raw["y"] > 1000, drawn
    assert [t["name"] for t in drawn][:2] == ["raw", "final"]
    expect(page.get_by_test_id("tensor-panel-ratio")).not_to_have_attribute("data-points", "0")
    expect(page.get_by_test_id("tensor-panel-facts")).to_contain_text("float32")
    expect(page.get_by_test_id("tensor-panel-status")).to_contain_text(f"the whole run: steps {start}–")

    # Escape closes; a click opens again; a second click on the same name closes.
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    click_name(page, first)
    expect(panel).to_be_visible()
    click_name(page, first)
    expect(panel).to_be_hidden()
    # Another name switches.
    click_name(page, first)
    expect(panel).to_have_attribute("data-param", first)
    click_name(page, other)
    expect(panel).to_have_attribute("data-param", other)
    expect(page.get_by_test_id("tensor-panel-name")).to_have_text(other)
    in_viewport(page, size)
    page.get_by_test_id("tensor-panel-close").click()
    expect(panel).to_be_hidden()
    assert log.errors == []


def test_a_chart_click_a_table_row_and_an_event_naming_a_tensor_open_it(demo: Any, new_page: Any) -> None:
    page, log = open_page(new_page, demo, (1440, 900))
    panel = page.get_by_test_id(PANEL)
    # A bar of the flow chart, as Plotly reports a click: the existing followers still follow.
    page.wait_for_function("() => Boolean(document.querySelector('[data-testid=\"chart-flow\"]').data)")
    page.evaluate(
        """() => document.querySelector('[data-testid="chart-flow"]')
                   .emit("plotly_click", { points: [{ x: "2.weight" }] })"""
    )
    expect(panel).to_have_attribute("data-param", "2.weight")
    expect(page.get_by_test_id("hist-param")).to_have_value("2.weight")
    expect(page.get_by_test_id("param-picked")).to_contain_text("2.weight")
    page.keyboard.press("Escape")
    expect(panel).to_be_hidden()
    # A row of the statistics table.
    row = page.get_by_test_id("param-table").locator('[data-testid="param-row"][data-param="0.bias"]')
    row.scroll_into_view_if_needed()
    row.click()
    expect(panel).to_have_attribute("data-param", "0.bias")
    in_viewport(page, (1440, 900))
    page.keyboard.press("Escape")
    # An event line that names a tensor (data-tensor), as a non-finite event does.
    page.evaluate(
        """() => window.__dashboard.log.add("nonfinite", "1 NaN in 0.weight · no guard", Date.now() / 1000,
                                              7, "0.weight")"""
    )
    page.locator('[data-testid="event-item"][data-tensor="0.weight"]').click()
    expect(panel).to_have_attribute("data-param", "0.weight")
    expect(panel).to_be_visible()
    # The hooks on it: those whose target glob matches its name (as fnmatchcase matches them).
    hook = demo.client.post(
        "/api/hooks", json={"kind": "clip_norm", "target": "0.*", "params": {"max_norm": 1.0}}
    )
    hook.raise_for_status()
    other = demo.client.post(
        "/api/hooks", json={"kind": "clip_norm", "target": "2.*", "params": {"max_norm": 1.0}}
    )
    other.raise_for_status()
    rows = page.get_by_test_id("tensor-panel-hook")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-hook", hook.json()["id"])
    expect(rows.first).to_contain_text("(2 tensors)")
    globs = ["0.*", "*.weight", "?.bias", "[02].weight", "[!0].weight", "0.w*t", "*", "0.[a-z]ias"]
    names = ["0.weight", "0.bias", "2.weight", "0.sub.bias", "10.weight", "0.Weight"]
    got = page.evaluate(
        """async ([globs, names]) => { const { globRegExp } = await import("/static/groups.js");
             return globs.map((g) => names.map((n) => globRegExp(g).test(n))); }""",
        [globs, names],
    )
    assert got == [[fnmatch.fnmatchcase(n, g) for n in names] for g in globs]
    for h in (hook, other):
        demo.client.delete(f"/api/hooks/{h.json()['id']}").raise_for_status()
    assert log.errors == []


def test_the_panels_log_axes_keep_their_tick_labels_apart(fast: support.ServerProcess, new_page: Any) -> None:
    """A tensor's norm over a run that blows up (0.006 to 10, the deep demo's layers.71) and its
    update ratio (1e-5 to 0.26) on the panel's short charts: neighbouring tick labels at least a
    label's height (14 px) apart, at the height the open panel gives its norm chart."""
    page, _ = open_page(new_page, fast, (1440, 900))
    click_name(page, hold_worst(page)[0])
    expect(page.get_by_test_id("tensor-panel-norm")).not_to_have_attribute("data-points", "0")
    gaps = page.evaluate(
        """async () => {
          const { yAxisFor } = await import("/static/tensorpanel.js");
          const gd = document.querySelector('[data-testid="tensor-panel-norm"]');
          const len = gd._fullLayout.yaxis._length;
          return [[0.006, 0.02, 9.88], [1e-5, 1e-4, 0.26]].map((vals) => {
            const ax = yAxisFor(vals, "t");
            const lo = Math.log10(Math.min(...vals)), hi = Math.log10(Math.max(...vals));
            const v = ax.tickvals.map(Math.log10).sort((a, b) => a - b);
            let gap = Infinity;
            for (let i = 1; i < v.length; i++) gap = Math.min(gap, ((v[i] - v[i - 1]) / (hi - lo)) * len);
            return { ticks: ax.ticktext, len, gap };
          });
        }"""
    )
    for g in gaps:
        assert len(g["ticks"]) >= 2 and g["gap"] >= 14, gaps


def test_on_a_wide_page_the_panel_leaves_the_main_column_and_the_top_bar_in_reach(
    fast: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_page(new_page, fast, (1440, 900))
    names = hold_worst(page)
    click_name(page, names[0])
    expect(page.get_by_test_id(PANEL)).to_be_visible()
    panel = page.get_by_test_id(PANEL).bounding_box()
    charts = page.locator("main.layout > section.charts").bounding_box()
    top = page.locator("header.topbar").bounding_box()
    assert panel is not None and charts is not None and top is not None
    # every chart of the main column stays clickable: the panel covers the side column only
    assert panel["x"] >= charts["x"] + charts["width"], (panel, charts)
    # the training controls stay in reach: the panel starts below the sticky stack
    assert panel["y"] >= top["y"] + top["height"], (panel, top)
    hit = page.evaluate(
        """() => { const b = document.querySelector('[data-testid="pause"]').getBoundingClientRect();
                   const el = document.elementFromPoint(b.x + b.width / 2, b.y + b.height / 2);
                   return Boolean(el && el.closest('[data-testid="pause"]')); }"""
    )
    assert hit, "the Pause button is covered"
    assert log.errors == []
