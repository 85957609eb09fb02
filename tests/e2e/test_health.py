"""The health line and the origin after a NaN, in a real Chromium on the `deep` demo (one block,
layers.71, goes unstable at step 60; the gradients go non-finite a score of steps later and the NaN
spreads to all 993 tensors): healthy at first, trouble named while it builds, and after the NaN
the health line and Worst now both lead with layers.71 (the origin), the line's link opens that
tensor, and a bar chart with nothing to draw says why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import ServerProcess, start_demo, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_demo(tmp_path_factory.mktemp("deep"), scenario="deep", rate=0, extra=["--no-shadow"]) as srv:
        yield srv


def hold_at(srv: ServerProcess, step: int) -> int:
    """Pause the run at `step` or just after it; the step it holds at."""
    wait_until(lambda: srv.get("/api/session")["training"]["step"] >= step - 2, 300, f"step {step - 2}")
    srv.client.post("/api/training/pause").raise_for_status()
    held = wait_until(
        lambda: (t := srv.get("/api/session")["training"])["held"] and t, 60, "the pause to hold"
    )
    at = held["step"]
    while at < step:
        srv.client.post("/api/training/step").raise_for_status()
        at = wait_until(
            lambda a=at: (t := srv.get("/api/session")["training"])["held"] and t["step"] > a and t["step"],
            60,
            "a single step",
        )
    return at


def nonfinite_steps(srv: ServerProcess) -> list[int]:
    return [e["step"] for e in srv.get("/api/events")["events"] if e["kind"] == "nonfinite"]


def shown(page: Any, step: int) -> None:
    page.wait_for_function(
        "s => document.querySelector('[data-testid=step-counter]').textContent === String(s) &&"
        " (document.querySelector('[data-testid=health-text]') || {}).textContent?.includes(`step ${s}`)",
        arg=step,
    )


def test_health_line_and_origin_on_deep(deep: ServerProcess, new_page: Any) -> None:
    from playwright.sync_api import expect

    page, log = new_page()
    page.goto(deep.url + "#all")
    health = page.get_by_test_id("health")

    at = hold_at(deep, 40)  # warm-up done, nothing wrong
    shown(page, at)
    expect(health).to_have_attribute("data-state", "healthy")
    expect(health).to_contain_text("gradients finite")
    deep.client.post("/api/training/resume").raise_for_status()

    at = hold_at(deep, 70)  # the trouble builds: layers.71's q/k/v far from their recent values
    shown(page, at)
    assert health.get_attribute("data-state") not in ("healthy", "nonfinite")
    assert page.get_by_test_id("worst-item").first.get_attribute("data-param").startswith("layers.71.")
    links = health.get_by_test_id("health-link")
    assert links.count() >= 1 and links.first.get_attribute("data-param").startswith("layers.71.")
    deep.client.post("/api/training/resume").raise_for_status()

    # after the NaN: every tensor is non-finite; the first name a reader meets is the origin
    first_bad = min(wait_until(lambda: nonfinite_steps(deep), 300, "a non-finite step"))
    at = hold_at(deep, first_bad + 3)
    shown(page, at)
    expect(health).to_have_attribute("data-state", "nonfinite")
    expect(health).to_contain_text(f"NaN/Inf since step {first_bad}, first in layers.71.")
    origin = health.get_by_test_id("health-link").first.get_attribute("data-param")
    assert origin.startswith("layers.71."), origin
    worst = page.get_by_test_id("worst-item")
    expect(worst.first).to_have_attribute("data-param", origin)
    assert all(worst.nth(k).get_attribute("data-param").startswith("layers.71.") for k in range(3))

    # the link opens the tensor the way a click in Worst now does: the histogram follows it
    health.get_by_test_id("health-link").first.click()
    expect(page.get_by_test_id("hist-param")).to_have_value(origin)

    # the gradient-flow bars have nothing to draw at a non-finite step: the chart says so
    flow = page.get_by_test_id("chart-flow")
    flow.scroll_into_view_if_needed()
    page.wait_for_function(
        "s => (document.querySelector('[data-testid=chart-flow]').dataset.nonfiniteNote || '').startsWith(`step ${s} is non-finite`)",
        arg=at,
    )
    note = flow.get_attribute("data-nonfinite-note")
    assert f"nothing to draw; first in {origin} since step {first_bad}; last finite step" in note, note
    expect(flow.locator(".annotation-text", has_text="nothing to draw")).to_have_count(1)
    assert log.errors == []


def test_a_rule_that_paused_the_run_is_named_on_the_health_line(tmp_path, new_page) -> None:
    """`nan`: every gradient turns NaN at step 30; a rule pauses the run there; the line says both."""
    from playwright.sync_api import expect

    with start_demo(tmp_path, scenario="nan", rate=0, extra=["--no-shadow"], wait=True) as srv:
        rule = srv.client.post(
            "/api/rules", json={"signal": "nonfinite", "op": ">", "threshold": 0, "action": "pause"}
        )
        rule.raise_for_status()
        page, log = new_page()
        page.goto(srv.url + "#all")  # training starts with the first page
        health = page.get_by_test_id("health")
        expect(health).to_have_attribute("data-state", "nonfinite", timeout=120_000)
        expect(health).to_contain_text(f"paused by rule {rule.json()['id']}", timeout=60_000)
        expect(health).to_contain_text("NaN/Inf since step 30, first in ")
        assert log.errors == []
