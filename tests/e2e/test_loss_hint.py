"""The loss chart of a run that records no loss says how to record one, and the hint goes with
the first loss recorded (a user's loop served in this process, its page in Chromium)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from playwright.sync_api import expect

from tests.unit.test_whatif import Loop

pytestmark = pytest.mark.e2e


def test_an_empty_loss_chart_says_how_to_fill_it(new_page: Any) -> None:
    loop = Loop()
    insp = loop.insp
    try:
        url = insp.serve(port=0, db=False)
        for i in range(5):  # no insp.record(...)
            x, y = loop.batches[i]
            loop.opt.zero_grad()
            torch.nn.functional.mse_loss(loop.model(x), y).backward()
            loop.opt.step()
        page, log = new_page()
        page.goto(url)
        hint = page.get_by_test_id("loss-hint")
        expect(hint).to_be_visible()
        expect(hint).to_contain_text("insp.record(loss=loss)")
        loop.run(range(5, 8))  # Loop.step records the loss
        expect(hint).to_be_hidden()
        assert log.errors == [], log.errors
    finally:
        insp.close()


def test_the_page_says_when_the_users_loop_changed_the_gradients(new_page: Any) -> None:
    loop = Loop()
    insp = loop.insp
    try:
        url = insp.serve(port=0, db=False)
        loop.run(range(3))  # no clip of its own: no note
        page, log = new_page()
        page.goto(url)
        page.get_by_test_id("step-counter").filter(has_text="3").wait_for()
        note = page.get_by_test_id("changed-note")
        expect(note).to_be_hidden()
        for i in range(3, 6):  # nanoGPT's own clip between backward() and step()
            x, y = loop.batches[i]
            loop.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(loop.model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1e-3)
            loop.opt.step()
            insp.record(loss=loss)
        expect(note).to_be_visible()
        expect(note).to_contain_text("changed the gradients between backward() and optimizer.step()")
        expect(note).to_contain_text("1.00e-3 at the step")
        assert log.errors == [], log.errors
    finally:
        insp.close()


# the note's "at 2 of the N sampled steps shown" names the steps the loss chart draws (their
# backward norms), the newest of them `last`
SHOWN_AS_DRAWN = """(last) => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  const t = gd && gd.data && gd.data.find((d) => d.name === "grad norm as backward left it");
  if (!t || !t.x || !t.x.length || t.x[t.x.length - 1] !== last) return false;
  const note = document.querySelector('[data-testid="changed-note"]').textContent;
  return note.includes(`at 2 of the ${t.x.length} sampled steps shown`);
}"""


def test_the_note_stays_while_a_clipped_step_is_shown(new_page: Any) -> None:
    """A clip that acts only where the norm is above its bound (the HF Trainer's max_grad_norm=1.0):
    the newest step unchanged, an earlier one clipped, and the page still says so."""
    loop = Loop()
    insp = loop.insp
    try:
        url = insp.serve(port=0, db=False)
        for i in range(4):  # a clip that acts at steps 2 and 3 only
            x, y = loop.batches[i]
            loop.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(loop.model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 1e-3 if i in (1, 2) else 1e9)
            loop.opt.step()
            insp.record(loss=loss)
        page, log = new_page()
        page.goto(url)
        page.get_by_test_id("step-counter").filter(has_text="4").wait_for()
        note = page.get_by_test_id("changed-note")
        expect(note).to_be_visible()
        expect(note).to_contain_text("at 2 of the 4 sampled steps shown")
        expect(note).to_contain_text("at step 3, the latest of them")
        expect(note).to_contain_text("1.00e-3 at the step")
        loop.run(range(4, 6))  # streamed steps, none clipped: the note stays
        page.get_by_test_id("step-counter").filter(has_text="6").wait_for()
        # it counts the steps the chart shows: a slow page may never get step 5's snapshot (the hub
        # keeps a client's newest pending snapshot only), so 5 or 6 of them, as drawn
        page.wait_for_function(SHOWN_AS_DRAWN, arg=6)
        expect(note).to_contain_text("at step 3, the latest of them")
        assert log.errors == [], log.errors
    finally:
        insp.close()
