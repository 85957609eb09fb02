"""What-if on the page: "compare from here" draws the shadow dashed on the loss chart,
and "rewind to before this change" on a hook-change marker moves the step counter back and adds
a branch marker."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

SHADOW_TRACES = """() => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  return (gd.data || []).filter((t) => t.line && t.line.dash === "dash" && String(t.name).startsWith("shadow"))
    .map((t) => ({ name: t.name, n: t.x.length, axis: t.yaxis || "y" }));
}"""


def step_of(page) -> int:
    return int(page.get_by_test_id("step-counter").text_content() or 0)


def test_compare_from_here_draws_the_shadow_dashed(tmp_path, new_page):
    with support.start_demo(tmp_path, scenario="exploding", rate=10, db=tmp_path / "h.sqlite") as server:
        page, log = new_page()
        page.goto(server.url)
        page.wait_for_function(
            "() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > 5"
        )
        page.get_by_test_id("compare-here").click()
        bar = page.get_by_test_id("whatif-bar")
        expect(bar).to_have_attribute("data-shadow", "active", timeout=20_000)
        expect(page.get_by_test_id("shadow-status")).to_contain_text("shadow: same hooks")
        expect(page.get_by_test_id("shadow-status")).to_contain_text("costs a second training step")
        page.wait_for_function(
            f"() => ({SHADOW_TRACES})().every((t) => t.n >= 5) && ({SHADOW_TRACES})().length === 3"
        )
        traces = page.evaluate(SHADOW_TRACES)
        assert sorted(t["axis"] for t in traces) == ["y", "y2", "y2"]  # loss; raw and final norm
        # a change now applies to the main run only: the legend names the difference
        r = server.client.post(
            "/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}}
        )
        assert r.status_code == 201
        expect(page.get_by_test_id("shadow-status")).to_contain_text("without clip_norm h1")
        page.get_by_test_id("shadow-diff").click()
        diff = page.get_by_test_id("chart-shadow-diff")
        expect(diff).to_be_visible()
        page.wait_for_function(
            "() => Number(document.querySelector('[data-testid=\"chart-shadow-diff\"]').dataset.points) > 3"
        )
        page.get_by_test_id("shadow-end").click()
        expect(bar).to_have_attribute("data-shadow", "ended")
        # the shadow is a branch of the live run in the run picker
        page.get_by_test_id("run-picker").focus()
        expect(page.locator('[data-testid="run-picker"] option[data-branch="shadow"]')).to_have_count(1)
        assert not log.errors, log.errors


MARKER_XY = """(step) => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  const fl = gd._fullLayout;
  const box = gd.getBoundingClientRect();
  return [box.left + fl.xaxis._offset + fl.xaxis.l2p(step), box.top + fl.yaxis3._offset + fl.yaxis3.l2p(0.96)];
}"""


def test_rewind_on_a_marker_moves_the_step_counter_back(tmp_path, new_page):
    with support.start_demo(
        tmp_path, scenario="mlp", rate=10, db=tmp_path / "h.sqlite", extra=["--no-shadow"]
    ) as server:
        page, log = new_page()
        page.goto(server.url)
        page.wait_for_function(
            "() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > 8"
        )
        r = server.client.post("/api/hooks", json={"kind": "noise", "target": "*", "params": {"std": 3.0}})
        assert r.status_code == 201
        support.wait_until(lambda: server.get("/api/hooks")[0]["applied_step"] is not None, what="the change")
        changed = server.get("/api/hooks")[0]["applied_step"]
        # (the demo also keeps one every 10 steps: the change's is the one labelled for it)
        cp = next(
            c for c in server.get("/api/checkpoints")["checkpoints"] if c["label"] == "before add noise"
        )
        assert cp["auto"] and cp["step"] == changed - 1
        expect(
            page.locator(f'[data-testid="rewind-checkpoint"][data-checkpoint="{cp["id"]}"]')
        ).to_have_count(1)
        page.wait_for_function(
            f"() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > {changed + 10}"
        )
        server.client.post("/api/training/pause")
        support.wait_until(lambda: server.get("/api/session")["training"]["held"], what="the pause")
        before = server.get("/api/session")["training"]["step"]
        expect(page.get_by_test_id("step-counter")).to_have_text(str(before))
        # the last steps' losses reach the page after the counter (unsampled steps' records travel
        # together, a few steps late, and the pause sends them; the held step's own loss is
        # recorded after its step() returns): until they have, the loss chart's step axis still
        # grows, and a marker's position taken now would move under the mouse
        page.wait_for_function(
            """(s) => (document.querySelector('[data-testid="chart-loss"]').data || [])
                .some((t) => t.name === "loss" && t.x.length && t.x[t.x.length - 1] >= s)""",
            arg=before - 1,
        )
        x, y = page.evaluate(MARKER_XY, changed)
        page.mouse.move(x, y)
        # Plotly's click reports what it hovers, and it hovers on its next animation frame: on a
        # busy machine that frame may come after an immediate click (a person never clicks as fast)
        page.wait_for_function(
            """() => (document.querySelector('[data-testid="chart-loss"]')._hoverdata || [])
                .some((p) => p.data && p.data.name === "hook change" && p.data.mode === "markers")"""
        )
        page.mouse.click(x, y)
        button = page.get_by_test_id("marker-rewind")
        expect(button).to_contain_text(f"rewind to before this change ({cp['id']}, step {cp['step']})")
        button.click()
        expect(page.get_by_test_id("step-counter")).to_have_text(str(cp["step"]))
        page.wait_for_function(
            """(k) => {
              const gd = document.querySelector('[data-testid="chart-loss"]');
              return (gd.data || []).some((t) => t.name === "branch" && t.mode === "markers" && t.x.includes(k));
            }""",
            arg=cp["step"],
        )
        assert server.get("/api/hooks") == [], "the hooks are the checkpoint's"
        server.client.post("/api/training/resume")
        page.wait_for_function(
            f"() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > {cp['step'] + 2}"
        )
        assert step_of(page) < before
        (run,) = server.get("/api/runs")["runs"]
        assert [b["branch"] for b in run["branches"]] == ["abandoned"]
        assert not log.errors, log.errors
