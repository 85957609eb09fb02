"""What the core measures, shown on the page (issue 14, part J: points 1, 2, 3, 4 and 18).

A real `gradient-inspector demo` (mlp) and Debian's Chromium; every wait is on a condition.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e


def open_live(demo: support.ServerProcess, new_page: Any) -> tuple[Any, Any]:
    for hook in demo.get("/api/hooks"):
        demo.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    page, log = new_page()
    page.goto(demo.url)
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    return page, log


def card_of(page: Any, chart_testid: str) -> Any:
    return page.locator(f'.card:has([data-testid="{chart_testid}"])')


def test_each_chart_exports_csv_and_png(demo: support.ServerProcess, new_page: Any) -> None:
    page, log = open_live(demo, new_page)
    charts = page.evaluate(
        "() => [...document.querySelectorAll('.card .chart')].map((el) => el.dataset.testid)"
    )
    assert "chart-loss" in charts and "chart-flow" in charts, charts
    for testid in charts:
        card = card_of(page, testid)
        expect(card.get_by_test_id("export-csv")).to_have_count(1)
        expect(card.get_by_test_id("export-png")).to_have_count(1)

    # The loss chart's CSV holds its loss series, as drawn.
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-loss"]');
                   return gd && gd.data && gd.data[0].x.length >= 3; }"""
    )
    with page.expect_download() as dl:
        card_of(page, "chart-loss").get_by_test_id("export-csv").click()
    download = dl.value
    assert download.suggested_filename == "gradient-inspector-chart-loss.csv"
    text = Path(download.path()).read_text(encoding="utf-8")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["series", "x", "y"]
    loss_rows = [r for r in rows[1:] if r[0] == "loss"]
    assert len(loss_rows) >= 3 and all(float(r[1]) >= 1 for r in loss_rows), rows[:5]

    # The flow chart's PNG is a real PNG image.
    page.wait_for_function("() => document.querySelector('[data-testid=\"chart-flow\"]').dataset.step !== ''")
    with page.expect_download() as dl:
        card_of(page, "chart-flow").get_by_test_id("export-png").click()
    download = dl.value
    assert download.suggested_filename == "gradient-inspector-chart-flow.png"
    data = Path(download.path()).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert log.errors == []
