"""What-if on the page says what the comparison is now (real Chromium):

- `nan`: a shadow from weights the bad batch already ruined has no line (its loss is NaN from
  its first step): the bar says so, and why and at which step it ended;
- `exploding`: after the main run's clip_norm is disabled, then removed, the shadow's label
  follows each change, and the bar says where the main run went NaN/Inf (no difference past it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e


def step_of(srv: Any) -> int:
    return int(srv.get("/api/session")["training"]["step"])


def test_a_nan_shadow_without_a_line_says_why_and_when_it_ended(tmp_path: Path, new_page: Any) -> None:
    with support.start_demo(tmp_path, scenario="nan", rate=20, db=None, wait=True) as srv:
        page, log = new_page()
        page.goto(srv.url)
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        support.wait_until(lambda: step_of(srv) >= 32, 90, "past the bad batch of step 30")
        r = srv.client.post(
            "/api/hooks", json={"kind": "nan_guard", "target": "*", "params": {"action": "skip"}}
        )
        assert r.status_code == 201, r.text
        note = page.get_by_test_id("shadow-ended")
        expect(note).to_contain_text("NaN/Inf from its first step", timeout=60_000)
        expect(note).to_contain_text("no line to draw")
        # it ends (the main run's reset, or 30 non-finite steps): why, and at which step
        expect(note).to_contain_text("ended at step", timeout=90_000)
        expect(page.get_by_test_id("whatif-bar")).to_have_attribute("data-shadow", "ended")
        assert log.errors == []


def test_the_shadows_label_follows_a_disable_then_a_remove_and_the_main_runs_nan_is_said(
    tmp_path: Path, new_page: Any
) -> None:
    # (at 5 steps/s the shadow without the clip runs for 15 s or more before it explodes and ends:
    # time for the page to show each label while it runs)
    with support.start_demo(tmp_path, scenario="exploding", rate=5, db=None, wait=True) as srv:
        page, log = new_page()
        page.goto(srv.url)
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        support.wait_until(lambda: step_of(srv) >= 10, 90, "step 10")
        r = srv.client.post(
            "/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}}
        )
        assert r.status_code == 201, r.text
        support.wait_until(lambda: srv.get("/api/shadow")["active"], 60, "the shadow started")
        status = page.get_by_test_id("shadow-status")
        expect(status).to_contain_text("shadow: without clip_norm h1", timeout=60_000)
        assert srv.client.patch("/api/hooks/h1", json={"enabled": False}).status_code == 200
        expect(status).to_contain_text("which the main run has disabled: the same hooks in effect")
        assert srv.client.delete("/api/hooks/h1").status_code == 204
        expect(status).to_contain_text("shadow: same hooks")
        # without the clip the main run explodes: the bar says from which step it is NaN/Inf
        expect(page.get_by_test_id("shadow-ended")).to_contain_text(
            "the main run is NaN/Inf from step", timeout=120_000
        )
        assert log.errors == []
