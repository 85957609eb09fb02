"""The page's views, collapsible cards and themes in a real Chromium (frontend/views.js,
frontend/themetoggle.js, theme.js's setChartTheme).

Each view is reachable from the nav bar and by its URL fragment, the fragment survives a reload,
back and forward move between views; a collapsed card stays collapsed after a reload; the overview
of the `deep` demo at 1440x900 is at most two screens tall; at 1024x768 nothing overflows sideways
and the top bar's controls are in view; the theme follows prefers-color-scheme, the toggle is
remembered and changes the charts' background; the health line's text reads on its background in
either theme; an Events badge's text is not clipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# view -> a card (data-testid or data-help) it shows, and one it does not
VIEWS = {
    "overview": ('[data-testid="card-worst"]', '[data-testid="card-optim"]'),
    "tensors": ('[data-help="flow"]', '[data-testid="card-worst"]'),
    "optimizer": ('[data-testid="card-optim"]', '[data-help="flow"]'),
    "noise": ('[data-testid="card-noise"]', '[data-help="loss"]'),
    "whatif": ('[data-help="loss"]', '[data-testid="card-worst"]'),
    "events": ('[data-help="events"]', '[data-help="heatmap"]'),
}


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    tmp = tmp_path_factory.mktemp("views-deep")
    with support.start_demo(tmp, scenario="deep", rate=20) as server:
        yield server


def open_page(browser: Any, url: str, size=(1440, 900), scheme: str = "dark") -> tuple[Any, Any, list[str]]:
    ctx = browser.new_context(viewport={"width": size[0], "height": size[1]}, color_scheme=scheme)
    page = ctx.new_page()
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live", timeout=40_000)
    return ctx, page, errors


def shows(page: Any, view: str) -> None:
    on, off = VIEWS[view]
    expect(page.locator(on)).to_be_visible()
    expect(page.locator(off)).to_be_hidden()
    expect(page.get_by_test_id(f"view-tab-{view}")).to_have_attribute("aria-current", "page")


def test_each_view_from_the_nav_and_by_fragment_survives_reload_and_history(browser, demo):
    ctx, page, errors = open_page(browser, demo.url)
    try:
        shows(page, "overview")  # no fragment: the overview
        for view in VIEWS:
            page.get_by_test_id(f"view-tab-{view}").click()
            assert page.evaluate("location.hash") == f"#{view}"
            shows(page, view)
        # the nav stays in view when the page scrolls
        page.get_by_test_id("view-tab-tensors").click()
        page.mouse.wheel(0, 2000)
        page.wait_for_function("window.scrollY > 0")
        box = page.get_by_test_id("view-nav").bounding_box()
        assert box is not None and 0 <= box["y"] < 120, box
        # back and forward
        page.go_back()
        shows(page, "events")
        page.go_back()
        shows(page, "whatif")
        page.go_forward()
        shows(page, "events")
        # a fragment opened directly, and after a reload
        for view in VIEWS:
            page.goto(f"{demo.url}#{view}")
            shows(page, view)
        page.reload()
        shows(page, "events")
        # a chart in a view that was hidden is drawn at its card's width once shown
        page.goto(f"{demo.url}#overview")
        page.get_by_test_id("view-tab-tensors").click()
        page.wait_for_function(
            """() => { const gd = document.querySelector('[data-testid="chart-flow"]');
                       const svg = gd && gd.querySelector('svg.main-svg');
                       return svg && Math.abs(svg.getBoundingClientRect().width - gd.clientWidth) < 2; }"""
        )
        # charts of a hidden view are off screen for the scheduler (drawn at its off-screen rate)
        page.get_by_test_id("view-tab-overview").click()
        page.wait_for_function(
            """() => { const s = window.__dashboard.scheduler.slots.find((x) => x.name === 'flow');
                       return s && s.visible === false; }"""
        )
        assert errors == []
    finally:
        ctx.close()


def test_a_collapsed_card_stays_collapsed_after_a_reload(browser, demo):
    ctx, page, errors = open_page(browser, f"{demo.url}#overview")
    try:
        card = page.locator('[data-testid="card-worst"]')
        expect(card.get_by_test_id("worst-list")).to_be_visible()
        page.get_by_test_id("collapse-worst").click()
        expect(card.get_by_test_id("worst-list")).to_be_hidden()
        expect(page.get_by_test_id("collapse-worst")).to_have_attribute("aria-expanded", "false")
        page.reload()
        expect(page.get_by_test_id("collapse-worst")).to_have_attribute("aria-expanded", "false")
        expect(card.get_by_test_id("worst-list")).to_be_hidden()
        page.get_by_test_id("collapse-worst").click()
        expect(card.get_by_test_id("worst-list")).to_be_visible()
        page.reload()
        expect(card.get_by_test_id("worst-list")).to_be_visible()
        assert errors == []
    finally:
        ctx.close()


PLOT_BG = """() => { const r = document.querySelector('[data-testid="chart-loss"] .bglayer rect.bg');
                     return r ? getComputedStyle(r).fill : null; }"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_theme_follows_the_system_and_the_toggle_is_remembered(browser, demo, scheme):
    ctx, page, errors = open_page(browser, demo.url, scheme=scheme)
    other = "dark" if scheme == "light" else "light"
    bg = {"light": "rgb(255, 255, 255)", "dark": "rgb(14, 19, 26)"}
    try:
        expect(page.locator("html")).to_have_attribute("data-theme", scheme)
        page.wait_for_function(f"({PLOT_BG})() === {bg[scheme]!r}")
        page_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        page.get_by_test_id("theme-toggle").click()
        expect(page.locator("html")).to_have_attribute("data-theme", other)
        # the drawn chart is restyled in place, no reload
        page.wait_for_function(f"({PLOT_BG})() === {bg[other]!r}")
        assert page.evaluate("getComputedStyle(document.body).backgroundColor") != page_bg
        page.reload()
        expect(page.locator("html")).to_have_attribute("data-theme", other)
        page.wait_for_function(f"({PLOT_BG})() === {bg[other]!r}")
        assert errors == []
    finally:
        ctx.close()


def test_1024_top_bar_in_view_and_no_horizontal_overflow(browser, demo):
    for view in VIEWS:
        ctx, page, errors = open_page(browser, f"{demo.url}#{view}", size=(1024, 768))
        try:
            shows(page, view)
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), view
            for sel in (".topbar", ".run-picker", ".stat", ".controls", ".conn", ".theme-toggle", ".viewnav"):
                # each wholly inside the window, and nothing in it cut by its own box
                cut = page.evaluate(
                    """(sel) => [...document.querySelectorAll(sel)].filter((el) => {
                                 const r = el.getBoundingClientRect();
                                 return !(r.width > 0 && r.left >= 0 && r.right <= window.innerWidth
                                          && el.scrollWidth <= el.clientWidth + 1); }).length""",
                    sel,
                )
                assert cut == 0, f"{sel} is cut at 1024 in {view}"
            box = page.locator(".topbar").bounding_box()
            assert box is not None and box["height"] < 64
            assert errors == []
        finally:
            ctx.close()


def test_event_badges_are_not_clipped(browser, demo):
    ctx, page, errors = open_page(browser, f"{demo.url}#events")
    try:
        demo.client.post("/api/shadow").raise_for_status()
        expect(page.locator('[data-testid="event-item"][data-kind="shadow_started"]').first).to_be_visible()
        demo.client.delete("/api/shadow").raise_for_status()
        expect(page.locator('[data-testid="event-item"][data-kind="shadow_ended"]').first).to_be_visible()
        clipped = page.evaluate(
            """() => [...document.querySelectorAll('.event-badge')]
                   .filter((b) => b.scrollWidth > b.clientWidth).map((b) => b.textContent)"""
        )
        assert clipped == []
        height = page.locator('[data-help="events"]').bounding_box()["height"]
        assert height > 400, height
        assert errors == []
    finally:
        ctx.close()


def test_the_deep_overview_fits_two_screens_at_1440(browser, deep):
    ctx, page, errors = open_page(browser, deep.url)
    try:
        shows(page, "overview")
        # once the loss chart and the heatmap have drawn
        expect(page.locator('[data-testid="chart-heatmap"] .heatmaplayer')).to_be_attached(timeout=60_000)
        expect(page.get_by_test_id("worst-list").locator("li").first).to_be_visible(timeout=60_000)
        height = page.evaluate("document.documentElement.scrollHeight")
        assert height <= 1800, f"the overview is {height} px tall"
        for sel in ('[data-help="loss"]', '[data-testid="card-worst"]', '[data-help="heatmap"]'):
            expect(page.locator(sel)).to_be_visible()
        expect(page.get_by_test_id("hook-list")).to_be_attached()
        expect(page.get_by_test_id("card-rules")).to_be_visible()
        assert errors == []
    finally:
        ctx.close()


def test_an_empty_chart_is_a_short_message(browser, demo):
    # the hook effects chart has nothing to draw while no hook is applied
    for hook in demo.get("/api/hooks"):
        demo.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    ctx, page, errors = open_page(browser, f"{demo.url}#whatif")
    try:
        chart = page.get_by_test_id("chart-effects")
        page.wait_for_function(
            """() => document.querySelector('[data-testid="chart-effects"]').classList.contains('chart-empty')"""
        )
        assert chart.bounding_box()["height"] < 100
        assert errors == []
    finally:
        ctx.close()


def _rgba(css: str) -> tuple[float, ...]:
    parts = [float(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")]
    return tuple(parts) if len(parts) == 4 else (*parts, 1.0)


def _luminance(rgb: tuple[float, ...]) -> float:
    def lin(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * lin(rgb[0]) + 0.7152 * lin(rgb[1]) + 0.0722 * lin(rgb[2])


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_health_lines_text_reads_on_its_background_in_either_theme(browser, demo, scheme):
    """The health line's text against its background (laid over the page's): a contrast of 4.5:1
    at least (WCAG AA for body text), in the light theme as in the dark one."""
    ctx, page, errors = open_page(browser, demo.url, scheme=scheme)
    try:
        health = page.get_by_test_id("health")
        expect(health).to_be_visible(timeout=40_000)
        text, back, body = page.evaluate(
            """() => { const el = document.querySelector('[data-testid="health"] .health-text');
              const s = (e) => getComputedStyle(e);
              return [s(el).color, s(el.closest('[data-testid="health"]')).backgroundColor,
                      s(document.body).backgroundColor]; }"""
        )
        fg, bg, under = _rgba(text), _rgba(back), _rgba(body)
        shown = tuple(bg[3] * bg[i] + (1 - bg[3]) * under[i] for i in range(3))
        hi, lo = sorted([_luminance(fg), _luminance(shown)], reverse=True)
        contrast = (hi + 0.05) / (lo + 0.05)
        assert contrast >= 4.5, (scheme, text, back, body, contrast)
        assert errors == []
    finally:
        ctx.close()


def test_what_is_scrolled_into_view_lands_below_the_sticky_stack(browser, demo):
    ctx, page, errors = open_page(browser, f"{demo.url}#all")
    try:
        expect(page.get_by_test_id("chart-heatmap")).to_be_visible()
        page.evaluate("() => document.querySelector('[data-testid=chart-heatmap]').scrollIntoView()")
        page.wait_for_function("() => window.scrollY > 0")
        nav = page.get_by_test_id("view-nav").bounding_box()
        chart = page.get_by_test_id("chart-heatmap").bounding_box()
        assert nav is not None and chart is not None
        # its top row is not under the top bar, the health line or the nav
        assert chart["y"] >= nav["y"] + nav["height"], (chart, nav)
        assert errors == []
    finally:
        ctx.close()
