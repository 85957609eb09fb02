"""A layout that fits a laptop, and demos that can be followed.

At 1024x768 the add-hook button, the "try this" hint and the loss chart are in view together
and the top bar is one line (also at 1440x900). A demo trains only once the first page
connects, and after a scenario reset the hint says it can be tried again. A server restart
that dropped the hooks says so and re-applies them in one click; while the server is down the
controls are off and the state reads "disconnected". The steps/s field takes 0 (no cap) and
refuses negatives and text with a message. The form describes the kind and the point from the
schema, shows limits in words and the root module as "(root)", and warns before adding a
duplicate. A refused value goes back to the value in force beside the reason, and is refused
in the page: no request fails, no console error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e


def reset(server: support.ServerProcess) -> None:
    """No hooks, training running, the default cap: each test starts from the same state."""
    for hook in server.get("/api/hooks"):
        server.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    server.client.post("/api/training/resume").raise_for_status()
    server.client.post("/api/training/rate", json={"steps_per_second": 10.0}).raise_for_status()


def open_page(new_page: Any, server: support.ServerProcess, size: tuple[int, int] | None = None) -> Any:
    page, log = new_page()
    if size is not None:
        page.set_viewport_size({"width": size[0], "height": size[1]})
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(server.url)
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live", timeout=40_000)
    expect(page.get_by_test_id("add-hook-kind")).not_to_have_value("")
    return page, log, failed


def in_viewport(page: Any, testid: str) -> bool:
    """The element's box lies wholly inside the window (no scrolling needed to see it)."""
    return page.evaluate(
        """(id) => { const r = document.querySelector(`[data-testid="${id}"]`).getBoundingClientRect();
                     return r.width > 0 && r.top >= 0 && r.left >= 0 &&
                            r.bottom <= window.innerHeight && r.right <= window.innerWidth; }""",
        testid,
    )


@pytest.mark.parametrize("size", [(1024, 768), (1440, 900)])
def test_layout_fits_the_add_hook_button_beside_the_loss_chart(demo, new_page, size):
    reset(demo)
    page, log, _ = open_page(new_page, demo, size)
    for testid in ("add-hook-submit", "chart-loss", "add-hook-kind", "pause", "connection-status"):
        assert in_viewport(page, testid), f"{testid} is not in view at {size}"
    box = page.locator(".topbar").bounding_box()
    assert box["height"] < 64, f"the top bar wraps at {size}: {box['height']} px tall"
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    # The side panel scrolls on its own: the event log at its bottom is reachable without
    # moving the loss chart out of view.
    page.get_by_test_id("event-log").scroll_into_view_if_needed()
    assert in_viewport(page, "chart-loss")
    assert log.errors == []


def test_a_demo_waits_for_the_first_page_and_the_hint_says_a_reset_can_be_tried_again(tmp_path, new_page):
    # exploding without a cap goes NaN within ~100 steps and is reset 30 steps later
    with support.start_demo(tmp_path, scenario="exploding", rate=0, wait=True) as server:
        assert "training starts when the first page connects" in server.log()
        assert server.get("/api/session")["training"]["step"] == 0
        page, log, _ = open_page(new_page, server, (1024, 768))
        hint = page.locator('[data-role="try-this"]')
        expect(hint).to_be_visible()
        assert in_viewport(page, "add-hook-submit")
        page.wait_for_function(
            "() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > 0"
        )
        expect(hint).to_contain_text("you can try it again", timeout=90_000)
        resets = [e for e in server.get("/api/events")["events"] if e["kind"] == "scenario_reset"]
        expect(hint).to_contain_text(f"reset at step {resets[-1]['step']}")
        assert log.errors == []


def test_a_restart_that_dropped_the_hooks_says_so_and_reapplies_them(tmp_path: Path, new_page):
    db = tmp_path / "history.sqlite"
    first = support.start_demo(tmp_path, db=db)
    second: support.ServerProcess | None = None
    try:
        page, _, _ = open_page(new_page, first)
        spec = {"kind": "clip_value", "target": "0.*", "params": {"threshold": 0.5}}
        first.client.post("/api/hooks", json=spec).raise_for_status()
        expect(page.get_by_test_id("hook-row")).to_have_count(1)
        old_run = first.get("/api/session")["run_id"]
        first.stop()
        expect(page.get_by_test_id("training-state")).to_have_text("disconnected")
        for testid in ("pause", "resume", "step", "add-hook-submit", "hook-remove"):
            expect(page.get_by_test_id(testid)).to_be_disabled()

        second = support.start_demo(tmp_path, db=db, port=first.port)
        new_run = second.get("/api/session")["run_id"]
        banner = page.get_by_test_id("restart-banner")
        expect(banner).to_be_visible(timeout=40_000)
        expect(banner).to_contain_text(f"New run {new_run}: its hooks are not the previous run's")
        expect(banner).to_contain_text(f"run {old_run} had 1 hook")
        expect(page.get_by_test_id("training-state")).not_to_have_text("disconnected")
        expect(page.get_by_test_id("pause")).to_be_enabled()
        assert second.get("/api/hooks") == []
        page.get_by_test_id("reapply-hooks").click()
        expect(banner).to_be_hidden()
        hooks = second.get("/api/hooks")
        assert [(h["kind"], h["target"], h["params"]) for h in hooks] == [
            ("clip_value", "0.*", {"threshold": 0.5})
        ]
        expect(page.get_by_test_id("hook-row")).to_have_count(1)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_steps_per_second_takes_zero_and_refuses_negatives_and_text(demo, new_page):
    reset(demo)
    page, log, failed = open_page(new_page, demo)
    rate, error = page.get_by_test_id("rate"), page.get_by_test_id("rate-error")
    expect(rate).to_have_value("10")
    rate.fill("0")
    rate.press("Enter")
    support.wait_until(lambda: demo.get("/api/session")["training"]["steps_per_second"] is None, 10, "no cap")
    expect(rate).to_have_value("0")
    expect(error).to_have_text("")
    for text, reason in (("-2", "must be ≥ 0"), ("fast", "not a number")):
        rate.fill(text)
        rate.press("Enter")
        expect(error).to_contain_text(reason)
        expect(rate).to_have_value("0")  # back to the cap in force
    assert demo.get("/api/session")["training"]["steps_per_second"] is None
    expect(page.get_by_test_id("rate-measured")).to_contain_text("/s", timeout=15_000)
    rate.fill("25")
    rate.press("Enter")
    support.wait_until(lambda: demo.get("/api/session")["training"]["steps_per_second"] == 25, 10, "25")
    expect(error).to_have_text("")
    assert log.errors == [] and failed == []


def test_the_form_describes_kinds_and_points_shows_limits_in_words_and_warns_of_duplicates(demo, new_page):
    reset(demo)
    kinds = demo.get("/api/session")["hook_kinds"]
    page, log, failed = open_page(new_page, demo)
    form = page.get_by_test_id("add-hook-form")
    page.get_by_test_id("add-hook-kind").select_option("noise")
    expect(page.get_by_test_id("add-hook-kind-info")).to_have_text(kinds["noise"]["description"])
    page.get_by_test_id("add-hook-point").select_option("post_accumulate")
    expect(page.get_by_test_id("add-hook-point-info")).to_have_text(
        kinds["noise"]["point_descriptions"]["post_accumulate"]
    )
    seed = form.get_by_test_id("hook-param-seed")
    expect(seed).to_have_attribute("placeholder", "≥ 0, ≤ 2^63-1")
    assert "9223372036854776000" not in form.inner_text()

    page.get_by_test_id("add-hook-kind").select_option("module_log")
    expect(page.get_by_test_id("add-hook-matches")).to_contain_text("(root)")

    # A duplicate of an existing hook: warned about, added only on a second click.
    demo.client.post("/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}})
    expect(page.get_by_test_id("hook-row")).to_have_count(1)
    page.get_by_test_id("add-hook-kind").select_option("clip_value")
    form.get_by_test_id("hook-param-threshold").fill("1")
    page.get_by_test_id("add-hook-submit").click()
    expect(page.get_by_test_id("add-hook-error")).to_contain_text("identical to")
    assert len(demo.get("/api/hooks")) == 1
    page.get_by_test_id("add-hook-submit").click()
    expect(page.get_by_test_id("hook-row")).to_have_count(2)
    assert log.errors == [] and failed == []


def test_a_refused_value_returns_to_the_value_in_force_without_a_console_error(demo, new_page):
    reset(demo)
    demo.client.post("/api/hooks", json={"kind": "noise", "target": "0.*", "params": {"std": 0.5, "seed": 3}})
    page, log, failed = open_page(new_page, demo)
    row = page.get_by_test_id("hook-row")
    expect(row).to_have_count(1)
    for name, bad, reason, in_force in (
        ("std", "-1", "must be >= 0 (got -1.0)", "0.5"),
        ("std", "nan", "must be finite", "0.5"),
        ("seed", "1.5", "must be an integer", "3"),
        ("seed", "abc", "must be a number", "3"),
    ):
        field = row.get_by_test_id(f"hook-param-{name}")
        field.fill(bad)
        field.press("Enter")
        expect(row.get_by_test_id("field-error").filter(has_text=reason)).to_contain_text(
            f"in force: {in_force}"
        )
        expect(field).to_have_value(in_force)
    target = row.get_by_test_id("hook-target")
    target.fill("nothing.matches.this")
    target.press("Enter")
    expect(row.get_by_test_id("field-error").filter(has_text="matches nothing")).to_be_visible()
    expect(target).to_have_value("0.*")
    # The add-hook form refuses in the page too.
    form = page.get_by_test_id("add-hook-form")
    page.get_by_test_id("add-hook-kind").select_option("clip_value")
    form.get_by_test_id("hook-param-threshold").fill("0")
    page.get_by_test_id("add-hook-submit").click()
    expect(form.get_by_test_id("field-error").filter(has_text="must be > 0")).to_be_visible()
    assert [(h["params"], h["target"]) for h in demo.get("/api/hooks")] == [({"std": 0.5, "seed": 3}, "0.*")]
    assert log.errors == [] and failed == []


def test_a_restart_that_dropped_the_rules_offers_them_back_as_they_stood(tmp_path: Path, new_page):
    db = tmp_path / "history.sqlite"
    first = support.start_demo(tmp_path, db=db)
    second: support.ServerProcess | None = None
    try:
        page, log, _ = open_page(new_page, first)
        loss = {"name": "loss watch", "signal": "loss", "op": ">", "threshold": 50.0, "action": "pause"}
        first.client.post("/api/rules", json=loss).raise_for_status()
        first.client.post("/api/rules", json={"preset": "safe overnight"}).raise_for_status()
        rid = next(r["id"] for r in first.get("/api/rules")["rules"] if r["name"] == "loss watch")
        first.client.patch(f"/api/rules/{rid}", json={"enabled": False}).raise_for_status()
        expect(page.get_by_test_id("rule-list").locator("li")).to_have_count(2)
        expect(page.get_by_test_id("rule-list")).to_contain_text("loss watch")
        defs = sorted(
            (
                {k: v for k, v in r.items() if k not in ("id", "state")}
                for r in first.get("/api/rules")["rules"]
            ),
            key=lambda d: d["name"],
        )
        old_run = first.get("/api/session")["run_id"]
        first.stop()
        expect(page.get_by_test_id("training-state")).to_have_text("disconnected")

        second = support.start_demo(tmp_path, db=db, port=first.port)
        new_run = second.get("/api/session")["run_id"]
        banner = page.get_by_test_id("restart-banner")
        expect(banner).to_be_visible(timeout=40_000)
        expect(banner).to_contain_text(f"New run {new_run}: 2 rules of run {old_run} are not in it")
        expect(page.get_by_test_id("reapply-hooks")).to_be_hidden()  # (no hook was lost)
        assert second.get("/api/rules")["rules"] == []
        page.get_by_test_id("reapply-rules").click()
        expect(banner).to_be_hidden()
        now = sorted(
            (
                {k: v for k, v in r.items() if k not in ("id", "state")}
                for r in second.get("/api/rules")["rules"]
            ),
            key=lambda d: d["name"],
        )
        assert now == defs, "the rules as they stood, the disabled one disabled"
        expect(page.get_by_test_id("rule-list").locator("li")).to_have_count(2)
        # (the browser logs each reconnection refused while no server listened)
        assert [e for e in log.errors if "ERR_CONNECTION_REFUSED" not in e] == []
    finally:
        first.stop()
        if second is not None:
            second.stop()
