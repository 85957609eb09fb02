"""The Rules panel (frontend/rules.js) and rule firings on the loss chart, in a real Chromium against
a real `nan` demo (a NaN batch at step 30): with a checkpoint taken before step 30, the "safe
overnight" preset added from the panel fires on the NaN, rewinds to the checkpoint and skips the
batches since it; the page shows the firing as a marker on the loss chart (its hover naming the
rule, the value that fired it, the action and its result), as a sentence in the event log and as
the panel's fired count; training goes on finite. A bad threshold from the add form shows the
server's reason beside the field and adds nothing; the enable toggle reaches the server. A replay
of the database shows the rule from its history, with no editing controls. No console errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support
from tests.support import start_cli

pytestmark = pytest.mark.e2e

# The loss chart's rule markers (the "rule fired" / "rule failed" tip traces): steps and hover texts.
RULE_MARKS = """() => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  if (!gd || !gd.data) return null;
  const tip = (name) => gd.data.find((d) => d.name === name && d.mode === "markers");
  const read = (t) => (t ? { x: Array.from(t.x), text: Array.from(t.hovertext || []) } : null);
  const fired = read(tip("rule fired"));
  return fired && fired.x.length ? { fired, failed: read(tip("rule failed")) } : null;
}"""


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_safe_overnight_from_the_panel_rewinds_past_the_nan(new_page: Any, tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite"
    # training starts with the first page (wait=True), slowly: the set-up is done paused, before step 30
    with support.start_demo(tmp_path, scenario="nan", rate=4, db=db, wait=True, extra=["--no-shadow"]) as srv:
        page, log = new_page()
        page.goto(srv.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        srv.client.post("/api/training/pause").raise_for_status()
        support.wait_until(lambda: srv.get("/api/session")["training"].get("held"), 20, "the pause held")
        assert srv.get("/api/session")["training"]["step"] < 25
        # a checkpoint before the NaN (the page's "checkpoint now"; the demo also takes one every 10
        # steps): taken at the held boundary
        srv.client.post("/api/checkpoints", json={}).raise_for_status()
        cps = support.wait_until(
            lambda: [c for c in srv.get("/api/checkpoints")["checkpoints"] if c["taken"]], 20, "checkpoint"
        )
        cp_step = cps[0]["step"]
        assert cp_step < 30

        card = page.get_by_test_id("card-rules")
        card.scroll_into_view_if_needed()
        expect(page.get_by_test_id("rule-row")).to_have_count(0)
        # a bad threshold: the server's reason beside the field, nothing added
        card.locator("summary", has_text="Add a rule").click()
        page.get_by_test_id("add-rule-threshold").fill("abc")
        page.get_by_test_id("add-rule-submit").click()
        threshold = card.locator("label.field", has=page.get_by_test_id("add-rule-threshold"))
        expect(threshold.get_by_test_id("field-error")).to_contain_text("must be a finite number (got 'abc')")
        expect(threshold).to_have_class("field invalid")
        assert srv.get("/api/rules")["rules"] == []
        expect(page.get_by_test_id("rule-row")).to_have_count(0)

        # the preset, one click
        preset = page.locator('[data-testid="rule-preset"][data-preset="safe overnight"]')
        expect(card).to_contain_text("rewind to the newest checkpoint")
        preset.click()
        row = page.get_by_test_id("rule-row")
        expect(row).to_have_count(1)
        expect(row).to_contain_text("safe overnight")
        expect(row).to_contain_text("when nonfinite > 0 → rewind & skip")
        expect(row.get_by_test_id("rule-fired")).to_contain_text("not fired yet")
        (rule,) = srv.get("/api/rules")["rules"]
        assert rule["action"] == "rewind_skip" and rule["enabled"]

        srv.client.post("/api/training/resume").raise_for_status()
        # the rewind goes to the newest checkpoint before the NaN: the page's, or step 24's when
        # that one is newer (the nan demo keeps one every 8 steps; the next, step 32's, is not: NaN)
        support.wait_until(lambda: srv.get("/api/session")["training"]["step"] >= 25, 60, "step 25")
        newest = max(
            (c for c in srv.get("/api/checkpoints")["checkpoints"] if c["taken"] and c["step"] < 30),
            key=lambda c: (c["step"], int(c["id"][1:])),
        )
        cp_step, cp_id = newest["step"], newest["id"]
        # the firing: a marker on the loss chart at the step the run went on from, its hover
        # naming the rule, the value, the action and its result
        marks = page.wait_for_function(f"() => ({RULE_MARKS})()", timeout=90_000).json_value()
        assert marks["fired"]["x"] == [cp_step]
        (hover,) = marks["fired"]["text"]
        assert "rule r1 “safe overnight” fired at step 31" in hover
        assert "when nonfinite 6 (&gt; 0)" in hover or "when nonfinite 6 (> 0)" in hover
        assert "action: rewind &amp; skip" in hover or "action: rewind & skip" in hover
        assert f"rewound to checkpoint {cp_id} (step {cp_step})" in hover
        assert not marks["failed"]["x"]
        # the event log: a sentence with the rule, the value and what it did
        item = page.locator('[data-testid="event-item"][data-kind="rule_fired"]')
        expect(item).to_have_count(1)
        expect(item).to_contain_text(
            f"rule r1 “safe overnight” fired on nonfinite 6 (> 0) → rewound to checkpoint {cp_id} (step {cp_step})"
        )
        # the panel: fired once, at step 31, rewound
        expect(row).to_have_attribute("data-fired", "1")
        expect(row.get_by_test_id("rule-fired")).to_contain_text("fired 1× · last at step 31")
        expect(row.get_by_test_id("rule-fired")).to_contain_text(
            f"rewound to checkpoint {cp_id} (step {cp_step})"
        )

        # training goes on finite past the bad batch's step, the skipped batches named
        # (20 finite losses after the checkpoint, asked below: 25 steps past it, the newest few late)
        on = max(45, cp_step + 25)
        support.wait_until(lambda: srv.get("/api/session")["training"]["step"] >= on, 60, f"step {on}")
        # the Recent steps card no longer shows the abandoned branch's NaN at step 30
        flight = page.get_by_test_id("chart-flight")
        expect(flight).not_to_have_attribute("data-incident", "30")
        assert all(r["step"] <= cp_step or not r["nonfinite"] for r in srv.get("/api/flight")["rows"])
        snaps = srv.get("/api/snapshots", params={"since": cp_step})["snapshots"]
        assert snaps and max(s["step"] for s in snaps) >= 40
        # (the newest steps' loss may not be recorded yet: null, never NaN)
        assert [
            (s["step"], s["loss"], s["total_norm"])
            for s in snaps
            if not ((s["loss"] is None or finite(s["loss"])) and finite(s["total_norm"]))
        ] == []
        assert sum(finite(s["loss"]) for s in snaps) >= 20
        events = srv.get("/api/events")["events"]
        (skipped,) = [e for e in events if e["kind"] == "batches_skipped"]
        assert skipped["checkpoint"] == cp_id and skipped["last"] >= 29
        assert not [e for e in events if e["kind"] in ("rule_failed", "scenario_reset")]

        # the toggle reaches the server, and the row shows it off
        row.get_by_test_id("rule-toggle").click()
        support.wait_until(lambda: not srv.get("/api/rules")["rules"][0]["enabled"], 10, "disabled")
        expect(row).to_have_class("rule-row disabled")
        # (the refused POST is the one error: the browser's own line for a 422 response)
        assert [e for e in log.errors if "status of 422" not in e] == []
        page.close()

    # the replay: the rule from the history's events, fired once; nothing to edit
    with start_cli(["replay", str(db)], log_dir=tmp_path) as replay:
        page, log = new_page()
        page.goto(replay.url + "#all")
        card = page.get_by_test_id("card-rules")
        card.scroll_into_view_if_needed()
        row = page.get_by_test_id("rule-row")
        expect(row).to_have_count(1)
        expect(row.get_by_test_id("rule-fired")).to_contain_text("fired 1× · last at step 31")
        expect(row.get_by_test_id("rule-toggle")).to_be_hidden()
        expect(row.get_by_test_id("rule-remove")).to_be_hidden()
        expect(page.get_by_test_id("rule-preset")).to_have_count(2)
        expect(page.get_by_test_id("rule-preset").first).to_be_hidden()
        expect(page.get_by_test_id("add-rule-form")).to_be_hidden()
        page.wait_for_function(f"() => ({RULE_MARKS})()")
        # (a replay's page asks nothing the replay refuses: no failed load either)
        assert log.errors == []


def test_a_rule_on_the_loss_recorded_after_step_fires_and_the_panel_shows_what_each_rule_saw(
    new_page: Any, tmp_path: Path
) -> None:
    """The demo records its loss after ``step()`` (the README's loop): "loss > 0 for 2 steps ->
    pause" fires for step 2 at the boundary that loss reached the host (4, on the CPU) and holds
    training there; each row tells the last step its rule evaluated and the value, or why none."""
    with support.start_demo(tmp_path, scenario="mlp", rate=10, db=None, wait=True) as srv:
        rule = {"signal": "loss", "op": ">", "for_steps": 2, "cooldown": 1000}
        for body in (
            {**rule, "threshold": 1e9, "action": "alert", "name": "never"},
            {**rule, "threshold": 0, "action": "pause", "name": "stop"},
            {"signal": "norm:nope", "op": ">", "threshold": 0, "action": "alert"},
        ):
            srv.client.post("/api/rules", json=body).raise_for_status()
        page, log = new_page()
        page.goto(srv.url + "#all")  # training starts with the first page
        support.wait_until(lambda: srv.get("/api/session")["training"].get("held"), 60, "the rule's pause")
        fired = [e for e in srv.get("/api/events")["events"] if e["kind"] == "rule_fired"]
        assert [(e["rule"], e["step"], e["at"]) for e in fired] == [("r2", 2, 4)]
        assert srv.get("/api/session")["training"]["step"] == 4
        card = page.get_by_test_id("card-rules")
        card.scroll_into_view_if_needed()
        rows = page.get_by_test_id("rule-row")
        expect(rows).to_have_count(3)
        expect(rows.nth(1).get_by_test_id("rule-fired")).to_contain_text("fired 1× · last at step 2 (loss ")
        seen = rows.nth(0).get_by_test_id("rule-evaluated")
        expect(seen).to_contain_text("last evaluated: step 2, loss ")
        expect(seen).to_contain_text("0 of 2 steps in a row")
        expect(rows.nth(2).get_by_test_id("rule-evaluated")).to_contain_text(
            "not evaluated yet: no parameter named 'nope' here"
        )
        assert log.errors == []
        page.close()
