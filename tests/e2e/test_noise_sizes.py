"""The Noise scale card on uneven micro-batches, replayed from a database of real snapshots.

Three runs of micro-batches of 8, 8, 8 and 2 examples (inspector/stats/noise_scale.py): in the
first every step has one forward per backward, and the card says the small batch is the sizes'
harmonic mean; in the second the last step runs two forwards per micro-batch, so its sizes cannot
be matched to the backward passes: the card still shows the average of the earlier steps and
says why the newest step added none; in the third every step does: no estimate, the reason and
how to get one. No console errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import inspector
from server.history.storage import HistoryStore
from tests.support import start_cli

pytestmark = pytest.mark.e2e

STATUS = "() => document.querySelector('[data-testid=\"noise-status\"]').textContent"


def uneven_run(store: HistoryStore, twice: range) -> int:
    """A run's snapshots into ``store``; its id."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    insp = inspector.attach(model, opt, every=1)
    for step in range(6):
        opt.zero_grad()
        for b in (8, 8, 8, 2):
            x = torch.randn(b, 6)
            loss = model(x).pow(2).mean()
            if step in twice:
                loss = loss + model(x).abs().mean()  # a second forward of the micro-batch
            (loss / 4).backward()
        opt.step()
    snaps = insp.snapshots()
    insp.close()
    params = [
        {"name": n, "shape": list(p.shape), "numel": p.numel(), "module": n.rsplit(".", 1)[0]}
        for n, p in model.named_parameters()
    ]
    run = store.new_run(params=params, modules=["", "0", "2"], scenario="mlp")
    for s in snaps:
        store.add_snapshot(run, s)
    return run


def test_the_card_says_how_uneven_sizes_were_used_or_why_a_step_added_none(
    tmp_path: Path, new_page: Any
) -> None:
    db = tmp_path / "history.sqlite"
    store = HistoryStore(db)
    store.start_writer()
    known = uneven_run(store, twice=range(0))
    unknown = uneven_run(store, twice=range(5, 6))
    never = uneven_run(store, twice=range(6))
    store.close()
    with start_cli(["replay", str(db)], log_dir=tmp_path) as server:
        page, log = new_page()
        page.goto(f"{server.base}/?run={known}#all")
        page.get_by_test_id("card-noise").scroll_into_view_if_needed()
        status = page.wait_for_function(
            f"() => {{ const t = ({STATUS})(); return t.includes('B_simple') ? t : null; }}"
        )
        text = status.json_value()
        assert "uneven sizes (8, 8, 8, 2)" in text and "harmonic mean (4.57)" in text, text
        assert "added none" not in text

        page.goto(f"{server.base}/?run={unknown}#all")
        page.get_by_test_id("card-noise").scroll_into_view_if_needed()
        status = page.wait_for_function(
            f"() => {{ const t = ({STATUS})(); return t.includes('added none') ? t : null; }}"
        )
        text = status.json_value()
        assert "B_simple ≈" in text and "averaged over 5 sampled steps" in text, text
        assert "Step 6 added none: micro-batches of uneven sizes (8, 8, 8, 8, 8, 8, 2, 2)" in text
        assert "8 forwards for 4 backward passes" in text

        page.goto(f"{server.base}/?run={never}#all")
        page.get_by_test_id("card-noise").scroll_into_view_if_needed()
        status = page.wait_for_function(
            f"() => {{ const t = ({STATUS})(); return t.startsWith('No estimate') ? t : null; }}"
        )
        text = status.json_value()
        assert text.startswith("No estimate: micro-batches of uneven sizes (8, 8, 8, 8, 8, 8, 2, 2)"), text
        assert "one forward of the model per backward pass" in text
        assert log.errors == []  # (a replay asks nothing it refuses: no failed load either)
