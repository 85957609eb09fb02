"""A replay is a clean read-only page, and the demo's hints can be followed (real Chromium):

- a replay loads with no request answered 4xx/5xx (it asks the session's `capabilities` first:
  no `/api/targets`, no `/api/checkpoints`), no "● live" badge, no "Try this" hint, no write
  control; its histogram starts on a tensor the run recorded histograms of, and a note says
  where the history thinned per-tensor detail;
- "checkpoint now" on a live demo makes a checkpoint that appears in the list;
- the demo pauses before its hint's step, the reason on the page, until resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from server.history.storage import HistoryStore
from tests import support
from tests.support import start_cli

pytestmark = pytest.mark.e2e

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]
HIST = {"edges": [-1.0, -0.5, 0.0, 0.5, 1.0], "raw": [1, 3, 4, 2], "final": [1, 3, 4, 2]}
STEPS = 200
WINDOW = 16  # the history keeps every step's per-tensor detail for the newest 16 recorded steps only


def make_db(path: Path) -> None:
    """A recorded nan-like run: 0.weight's norm the largest, histograms of 2.bias only (the tensor a
    live page watched), and old steps' per-tensor detail thinned by the history's window."""
    store = HistoryStore(path, detail_window=WINDOW)
    store.start_writer()
    scenario = {"name": "nan", "description": "a test run", "try_this": "Add nan_guard before step 30."}
    run = store.new_run(
        params=[{"name": n, "shape": [2], "numel": 2, "module": n.split(".")[0]} for n in NAMES],
        modules=["", "0", "2"],
        scenario="nan",
        meta={"scenario": scenario},
    )
    for step in range(1, STEPS + 1):
        norms = [3.0, 1.0, 0.5, 0.25]
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": 10.0 + step,
                "config_version": 0,
                "loss": 1.0 / step,
                "scalars": {},
                "events": [],
                "grad_norm": norms,
                "grad_norm_raw": norms,
                "total_norm": 3.2,
                "total_norm_raw": 3.2,
                "hist": {"2.bias": HIST} if step % 5 == 0 else {},
            },
        )
        store.add_scalars(run, {"step": step, "loss": 1.0 / step, "scalars": {}})
    assert store.flush(30.0)
    store.close()


def test_a_replay_asks_nothing_it_is_refused_and_shows_no_live_control(tmp_path: Path, new_page: Any) -> None:
    db = tmp_path / "history.sqlite"
    make_db(db)
    with start_cli(["replay", str(db)], log_dir=tmp_path) as replay:
        page, log = new_page()
        bad: list[tuple[int, str]] = []
        page.on("response", lambda r: bad.append((r.status, r.url)) if r.status >= 400 else None)
        page.goto(replay.url + "#all")
        # (a replay's first load is slow on a busy machine: 27 s here beside other work)
        expect(page.get_by_test_id("step-counter")).to_have_text(str(STEPS), timeout=120_000)
        # the histogram: on 2.bias, the tensor with histograms (not 0.weight, the largest norm)
        expect(page.get_by_test_id("hist-status")).to_contain_text("2.bias · step 200")
        page.wait_for_function(
            "() => { const gd = document.querySelector('[data-testid=\"chart-hist\"]');"
            " return gd && gd.data && gd.data.some((t) => (t.y || []).length > 0); }"
        )
        # where the history thinned per-tensor detail, a note says so
        note = page.get_by_test_id("detail-thinned")
        expect(note).to_be_visible()
        expect(note).to_contain_text("every 8th step")
        # no live badge, no hint, no write control
        status = page.get_by_test_id("connection-status")
        expect(status).to_have_text("● replay")
        expect(page.locator('[data-role="try-this"]')).to_be_hidden()
        for testid in ("pause", "resume", "step", "add-hook-form", "preset-import-button", "compare-here"):
            expect(page.get_by_test_id(testid)).to_be_hidden()
        expect(page.get_by_test_id("checkpoint-now")).to_be_hidden()
        expect(page.get_by_test_id("checkpoints")).to_be_hidden()
        expect(page.get_by_test_id("read-only-badge")).to_be_visible()
        # the page has settled: its cards drew from what the replay serves
        page.wait_for_function("() => document.querySelector('[data-testid=\"param-table\"] tbody tr')")
        assert bad == [], f"requests a replay refused: {bad}"
        assert log.errors == []


def test_checkpoint_now_appears_in_the_list(tmp_path: Path, new_page: Any) -> None:
    with support.start_demo(tmp_path, scenario="mlp", rate=10, db=None) as srv:
        page, log = new_page()
        page.goto(srv.url)
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        button = page.get_by_test_id("checkpoint-now")
        expect(button).to_be_visible()
        expect(button).to_be_enabled()
        before = {c["id"] for c in srv.get("/api/checkpoints")["checkpoints"]}
        button.click()
        cp = support.wait_until(
            lambda: [
                c
                for c in srv.get("/api/checkpoints")["checkpoints"]
                if c["id"] not in before and c["taken"] and c["origin"] == "page"
            ],
            20,
            "the checkpoint taken",
        )[0]
        page.get_by_test_id("checkpoints").click()  # the list opens
        expect(
            page.locator(f'[data-testid="rewind-checkpoint"][data-checkpoint="{cp["id"]}"]')
        ).to_contain_text(f"step {cp['step']}")
        assert log.errors == []


def test_the_demo_pauses_before_its_hints_step_saying_why_until_resumed(
    tmp_path: Path, new_page: Any
) -> None:
    with support.start_demo(
        tmp_path, scenario="nan", rate=0, db=None, hint_pause=True, extra=["--no-shadow"]
    ) as srv:
        page, log = new_page()
        page.goto(srv.url)
        reason = page.get_by_test_id("pause-reason")
        expect(reason).to_be_visible(timeout=60_000)
        expect(reason).to_contain_text("paused at step 25, 5 steps before step 30")
        expect(page.get_by_test_id("training-state")).to_have_text("paused")
        expect(page.get_by_test_id("step-counter")).to_have_text("25")
        events = page.locator('[data-testid="event-item"][data-kind="hint_pause"]')
        expect(events).to_have_count(1)
        page.get_by_test_id("resume").click()
        expect(reason).to_be_hidden()
        support.wait_until(lambda: srv.get("/api/session")["training"]["step"] > 30, 60, "past step 30")
        assert log.errors == []
