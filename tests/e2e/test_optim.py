"""The Optimizer cards (frontend/optim.js) on a real `gradient-inspector demo` (mlp, SGD) and
Debian's Chromium: the newest step's bars per tensor, drawn from the snapshot's `optim`, and the
whole model over steps; no console error. Every wait is on a condition."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e


def test_the_optimizer_cards_draw_the_newest_step_and_the_model_over_steps(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = new_page()
    page.goto(demo.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    now = page.get_by_test_id("chart-optim-now")
    expect(now).to_have_attribute("data-kind", "other")  # SGD: no Adam state
    expect(now).to_have_attribute("data-by", "tensor")  # a small run: one bar per tensor
    page.wait_for_function(
        "() => Number(document.querySelector('[data-testid=chart-optim-time]').dataset.points) >= 3"
    )
    got = page.evaluate(
        """() => {
            const gd = document.querySelector('[data-testid=chart-optim-now]');
            const byName = Object.fromEntries(gd.data.map((t) => [t.name, t]));
            const t = document.querySelector('[data-testid=chart-optim-time]').data;
            return {
              names: gd.data.map((t) => t.name),
              tensors: byName["‖Δθ‖/‖g‖"].y,
              cos: byName["cos(Δθ, −g)"].x,
              lines: t.map((s) => s.name),
              modelCos: t[0].y.filter((v) => v !== null),
            };
        }"""
    )
    latest = demo.get("/api/snapshots", params={"limit": 1})["snapshots"][-1]["optim"]
    assert got["names"] == ["‖Δθ‖/‖g‖", "cos(Δθ, −g)", "cos(g, g prev)"], "no Adam columns for SGD"
    assert got["tensors"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # plain SGD (the mlp demo's, no momentum): the update is along -g, on the page as in the snapshot
    assert latest["kind"] == "other" and all(c == pytest.approx(1.0, abs=1e-4) for c in got["cos"]), got[
        "cos"
    ]
    assert got["lines"] == ["cos(Δθ, −g)", "cos(g, g prev)", "‖Δθ‖/‖g‖"]
    assert got["modelCos"] and all(c == pytest.approx(1.0, abs=1e-4) for c in got["modelCos"])
    expect(page.get_by_test_id("optim-note")).to_contain_text("per tensor")
    assert log.errors == []
