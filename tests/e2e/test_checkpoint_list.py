"""The loss card's checkpoints: the automatic ones (``checkpoint_every``) listed with step, size
and time, each a rewind; and why an automatic one was not taken (a user's loop served in this
process, its page in Chromium)."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from tests.support import wait_until
from tests.unit.test_whatif import Loop

pytestmark = pytest.mark.e2e


def test_the_automatic_checkpoints_are_listed_and_one_rewinds(new_page: Any) -> None:
    loop = Loop(checkpoint_every=5, checkpoints=3)
    insp = loop.insp
    try:
        url = insp.serve(port=0, db=False)
        loop.run(range(20))
        page, log = new_page()
        page.goto(url)
        summary = page.get_by_test_id("checkpoints")
        expect(summary).to_contain_text("checkpoints: 3 kept")
        expect(summary).to_contain_text("every 5 steps")
        summary.click()
        buttons = page.get_by_test_id("rewind-checkpoint")
        expect(buttons).to_have_count(3)
        for cp, button in zip(insp.checkpoints.list(), buttons.all(), strict=True):
            expect(button).to_contain_text(f"{cp['id']} · step {cp['step']} · ")
            expect(button).to_contain_text(" KB · ")  # the size (about 30 KB), then the time
            assert "taken by every N steps" in (button.get_attribute("title") or "")
        assert [c["step"] for c in insp.checkpoints.list()] == [10, 15, 20]
        buttons.nth(1).click()
        wait_until(lambda: insp.checkpoints.pending_rewind() is not None, what="the rewind request")
        loop.step(20)  # the rewind is carried out at the loop's next boundary
        assert insp.step == 15
        assert log.errors == [], log.errors
    finally:
        insp.close()


def test_the_page_says_why_an_automatic_checkpoint_was_not_taken(new_page: Any) -> None:
    loop = Loop(checkpoint_every=2, checkpoint_memory="1KB")
    insp = loop.insp
    try:
        url = insp.serve(port=0, db=False)
        loop.run(range(6))
        page, log = new_page()
        page.goto(url)
        summary = page.get_by_test_id("checkpoints")
        expect(summary).to_contain_text("checkpoints: 0 kept")
        expect(summary).to_contain_text("⚠ not taken")
        summary.click()
        note = page.get_by_test_id("checkpoints-note")
        expect(note).to_be_visible()
        expect(note).to_contain_text("automatic checkpoint at step 6 not taken")
        expect(note).to_contain_text("checkpoint memory budget")
        assert log.errors == [], log.errors
    finally:
        insp.close()
