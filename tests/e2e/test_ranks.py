"""The distributed card (frontend/ranks.js) on a replayed run whose snapshots carry `ranks`.

A history database is written with four-rank snapshots (rank 2's local norm far from the
others', rank 3 reporting a non-finite gradient in `0.bias`), served by `gradient-inspector
replay`, and opened in Chromium: the card shows the world size, flags rank 2 and names rank 3's
NaN, and lists the groups by how much their norms differ across the ranks; a run without
`ranks` (one process) keeps the card hidden.
"""

from __future__ import annotations

import pytest

from server.history.storage import HistoryStore
from tests.support import start_cli

PARAMS = [
    {"name": "0.weight", "shape": [2, 2], "numel": 4, "module": "0"},
    {"name": "0.bias", "shape": [2], "numel": 2, "module": "0"},
]


def own_errors(log):
    """The page's errors: a replay's page asks nothing the replay refuses (the session's
    capabilities), so not even a failed load is expected."""
    return log.errors


def make_db(path, ranks):
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=["", "0"], scenario="mlp")
    for step in (1, 2, 3):
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": 10.0 + step,
                "config_version": 1,
                "loss": 0.5,
                "scalars": {},
                "grad_norm": [1.0, 0.5],
                "grad_norm_raw": [1.0, 0.5],
                "total_norm": 1.1,
                "total_norm_raw": 1.1,
                "ranks": ranks(step),
                "events": [],
            },
        )
        store.add_scalars(run, {"step": step, "loss": 0.5, "scalars": {}})
    store.close()


def four_ranks(step):
    return {
        "norm_min": [0.9, 0.4],
        "norm_max": [9.0, 0.6],
        "argmin": [0, 1],
        "argmax": [2, 0],
        "rank_norm": [1.02, 0.98, 9.5 if step == 3 else 1.0, 1.01],
        "rank_nonfinite": [None, None, None, 1 if step == 3 else None],
        # per group (one a tensor in so small a model): each rank's norm over the group's tensors
        "group_norm_min": [0.4, 0.9],
        "group_norm_max": [0.6, 9.0],
        "group_argmin": [1, 0],
        "group_argmax": [0, 2],
    }


@pytest.mark.parametrize("with_ranks", [True, False])
def test_the_ranks_card_shows_world_size_a_differing_rank_and_a_nan_rank(tmp_path, new_page, with_ranks):
    db = tmp_path / "history.sqlite"
    make_db(db, four_ranks if with_ranks else (lambda step: None))
    with start_cli(["replay", str(db)], log_dir=tmp_path) as server:
        page, log = new_page()
        page.goto(server.base + "/#all")
        page.get_by_test_id("step-counter").filter(has_text="3").wait_for()
        card = page.get_by_test_id("card-ranks")
        if not with_ranks:
            page.wait_for_function("() => document.querySelector('[data-testid=\"param-table\"] tbody tr')")
            assert card.is_hidden()
            assert own_errors(log) == []
            return
        card.wait_for(state="visible")
        summary = page.get_by_test_id("ranks-summary")
        summary.filter(has_text="world size 4").wait_for()
        text = summary.inner_text()
        assert "step 3" in text and "rank 2 differs" in text and "NaN/Inf on rank 3" in text
        rows = page.get_by_test_id("ranks-table").locator("tbody tr")
        assert rows.count() == 4
        flagged = [rows.nth(r).get_attribute("data-flagged") for r in range(4)]
        assert flagged == ["false", "false", "true", "false"]
        assert rows.nth(3).get_attribute("data-nan") == "true"
        assert "NaN/Inf in 0.bias" in rows.nth(3).inner_text()
        assert "9.5" in rows.nth(2).inner_text()
        # the groups, the one whose ranks differ the most first, each with the ranks at its ends
        groups = page.get_by_test_id("ranks-groups")
        assert groups.is_visible() and "differ the most" not in groups.inner_text()
        cells = [
            [c.inner_text() for c in groups.locator("tbody tr").nth(k).locator("td").all()] for k in range(2)
        ]
        assert cells == [["0.bias", "0.9 (0)", "9 (2)", "10"], ["0.weight", "0.4 (1)", "0.6 (0)", "1.5"]]
        assert own_errors(log) == []
