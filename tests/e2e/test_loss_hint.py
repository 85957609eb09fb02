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
