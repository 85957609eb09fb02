"""The Noise scale card in a real Chromium against real `gradient-inspector demo` servers.

`tiny_gpt` accumulates 4 micro-batches of 4 windows per step: its card shows a finite B_simple,
the newest stored snapshot's value, the batch in use (16) and the learning rate (1e-3), and says
where the two batch sizes come from. `mlp` (one backward per step, one process) has no estimate:
its card says why (the snapshot's `reason`) and how to get one. Opened from the database as an
earlier run, the tiny_gpt run's card shows the stored estimate again. No console errors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# The card as drawn: its state, newest B_simple, traces (name -> y values) and status text.
CARD = """() => {
  const gd = document.querySelector('[data-testid="chart-noise"]');
  if (!gd || !gd.data) return null;
  return {
    state: gd.dataset.state,
    bsimple: gd.dataset.bsimple,
    points: Number(gd.dataset.points),
    traces: Object.fromEntries(gd.data.map((t) => [t.name, Array.from(t.y || [])])),
    axis2: gd.layout.yaxis2 && gd.layout.yaxis2.title ? gd.layout.yaxis2.title.text : null,
    notes: (gd.layout.annotations || []).map((a) => a.text),
    status: document.querySelector('[data-testid="noise-status"]').textContent,
    caveats: document.querySelector('[data-testid="noise-caveats"]').textContent,
  };
}"""

# The card once it shows `n` or more finite B_simple points, else null.
ESTIMATED = f"""(n) => {{
  const c = ({CARD})();
  return c && c.state === "estimate" && c.points >= n ? c : null;
}}"""


def newest_noise(server: support.ServerProcess, run: Any = None) -> dict[str, Any]:
    """The newest stored snapshot's step and `noise_scale` (GET /api/snapshots)."""
    params = {"limit": 1} if run is None else {"limit": 1, "run": run}
    snap = server.get("/api/snapshots", params=params)["snapshots"][-1]
    return {"step": snap["step"], "noise": snap["noise_scale"], "lr": snap["lr"]}


def pause_held(server: support.ServerProcess) -> None:
    """Pause, and wait until the training thread holds at a step boundary."""
    server.client.post("/api/training/pause").raise_for_status()
    support.wait_until(
        lambda: server.get("/api/session")["training"].get("held"),
        120,
        "the pause to take hold",
        interval=0.1,
    )


def test_noise_card_estimate_reason_and_replay(new_page: Any, tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite"
    # tiny_gpt: a live estimate (every step is sampled in the demo; no shadow: half the CPU)
    with support.start_demo(
        tmp_path, scenario="tiny_gpt", rate=0, db=db, extra=["--no-shadow"], timeout=120
    ) as gpt:
        page, log = new_page()
        page.goto(gpt.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        card = page.get_by_test_id("card-noise")
        card.scroll_into_view_if_needed()
        page.wait_for_function(ESTIMATED, arg=3, timeout=150_000)
        pause_held(gpt)
        newest = newest_noise(gpt)
        ns = newest["noise"]
        assert ns["mode"] == "accumulation" and ns["k"] == 4
        assert ns["b_small"] == 4 and ns["b_big"] == 16 and ns["batch_source"] == "inferred"
        assert ns["b_simple"] is not None and math.isfinite(ns["b_simple"]) and ns["b_simple"] > 0
        # the page drew the newest stored snapshot
        c = page.wait_for_function(
            f"(v) => {{ const c = ({CARD})(); return c && Number(c.bsimple) === v ? c : null; }}",
            arg=ns["b_simple"],
        ).json_value()
        assert c["traces"]["B_big (the batch in use)"][-1] == 16
        assert c["traces"]["lr"][-1] == pytest.approx(1e-3)
        assert c["axis2"] == "lr"
        assert "B_simple ≈" in c["status"] and "4 accumulated micro-batches" in c["status"]
        assert "inferred" in c["status"] and f"averaged over {ns['samples']} sampled step" in c["status"]
        assert "span about 20 sampled steps" in c["caveats"] and "Adam" in c["caveats"]
        # the default selector shows the whole model and the top groups
        assert page.get_by_test_id("noise-group").input_value() == "top"
        assert len(c["traces"]) >= 4  # whole model, at least one group, B_big, lr
        page.get_by_test_id("noise-group").select_option("")
        page.wait_for_function(f"() => Object.keys(({CARD})().traces).length === 3")
        assert log.errors == []
        gpt_run = gpt.get("/api/session")["run_id"]
        page.close()

    # mlp: one backward per step, one process: no estimate, the reason and how to get one
    with support.start_demo(tmp_path, db=db, extra=["--no-shadow"]) as mlp:
        page, log = new_page()
        page.goto(mlp.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        page.get_by_test_id("card-noise").scroll_into_view_if_needed()
        c = page.wait_for_function(
            f"() => {{ const c = ({CARD})(); return c && c.state === 'none' ? c : null; }}"
        )
        c = c.json_value()
        reason = newest_noise(mlp)["noise"]["reason"]
        assert reason and "accumulation" in reason and "DDP" in reason
        assert c["status"].startswith(f"No estimate: {reason}.")
        assert "attach(..., batch_size=N)" in c["status"] and "gradient accumulation" in c["status"]
        assert any(n.startswith("no estimate yet<br>needs gradient accumulation") for n in c["notes"])
        assert c["bsimple"] == "" and c["points"] == 0
        assert c["traces"]["lr"][-1] == pytest.approx(0.01)

        # the tiny_gpt run, replayed from the database: its stored estimate again
        page.goto(f"{mlp.url}?run={gpt_run}#all")
        expect(page.get_by_test_id("history-banner")).to_be_visible()
        page.get_by_test_id("card-noise").scroll_into_view_if_needed()
        stored = newest_noise(mlp, run=gpt_run)["noise"]
        page.wait_for_function(
            f"(v) => {{ const c = ({CARD})(); return c && c.state === 'estimate' && Number(c.bsimple) === v; }}",
            arg=stored["b_simple"],
        )
        assert stored["b_simple"] == ns["b_simple"]
        assert log.errors == []
