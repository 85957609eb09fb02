"""The histogram chart of a frozen parameter in a real Chromium.

A parameter frozen by a `freeze` hook has no final gradient, so its snapshot histogram has
`"final": null`: the page draws the raw series alone, says why, and logs no console error.
"""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# The histogram chart as drawn: its trace names and the raw series' total count.
HIST = """() => {
  const gd = document.querySelector('[data-testid="chart-hist"]');
  if (!gd || !gd.data) return null;
  const raw = gd.data.find((d) => d.name === "raw");
  const notes = ((gd.layout && gd.layout.annotations) || []).map((a) => a.text);
  return { names: gd.data.map((d) => d.name), rawPoints: raw ? raw.y.length : 0, notes };
}"""


def test_a_frozen_parameters_histogram_draws_raw_alone_without_console_errors(
    demo: support.ServerProcess, new_page: Any
) -> None:
    params = [p["name"] for p in demo.get("/api/session")["params"]]
    frozen, live = params[0], params[-1]
    r = demo.client.post("/api/hooks", json={"kind": "freeze", "target": frozen})
    r.raise_for_status()
    page, log = new_page()
    page.goto(demo.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")

    page.get_by_test_id("hist-param").select_option(frozen)
    page.wait_for_function(
        f"() => {{ const h = ({HIST})(); return h && h.names.length === 1 && h.rawPoints > 0; }}"
    )
    drawn = page.evaluate(HIST)
    assert drawn["names"] == ["raw"], drawn
    assert any("no final gradient" in t for t in drawn["notes"]), drawn

    # An unfrozen parameter: final bars and the raw outline again, no note.
    page.get_by_test_id("hist-param").select_option(live)
    page.wait_for_function(
        f"() => {{ const h = ({HIST})(); return h && h.names.length === 2 && h.rawPoints > 0; }}"
    )
    drawn = page.evaluate(HIST)
    assert drawn["names"] == ["final", "raw"] and drawn["notes"] == [], drawn
    assert log.errors == []
