"""The Recent steps card (frontend/flight.js) and the spike markers in a real Chromium against a
real demo: the `nan` demo's NaN at step 30 dumps the flight recorder, and the page draws every
step of the dump with the incident marked; a refused spike setting shows its reason beside the
field and changes nothing, a good one applies; the `exploding` demo's spike gets a marker on the
loss chart; a replay of the database shows the stored dump. No console errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support
from tests.support import start_cli

pytestmark = pytest.mark.e2e

# The Recent steps chart as drawn: its steps, the incident, its traces' names and the status line.
FLIGHT = """() => {
  const gd = document.querySelector('[data-testid="chart-flight"]');
  if (!gd || !gd.data) return null;
  const t = Object.fromEntries(gd.data.map((d) => [d.name, Array.from(d.x || [])]));
  return { steps: Number(gd.dataset.steps || 0), incident: gd.dataset.incident, traces: t,
           status: document.querySelector('[data-testid="flight-status"]').textContent };
}"""

# The loss chart's spike markers (the "spike" tip trace): their steps and hover texts.
SPIKES = """() => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  if (!gd || !gd.data) return null;
  const t = gd.data.find((d) => d.name === "spike" && d.mode === "markers");
  // (first: the oldest step the page keeps markers from, its window's or its history's)
  return t ? { x: Array.from(t.x), text: Array.from(t.hovertext || []),
               first: window.__dashboard.live.markersFrom() } : null;
}"""


def incident_at(step: int) -> str:
    return (
        f"() => {{ const f = ({FLIGHT})(); return f && f.incident === '{step}' && f.steps > 0 ? f : null; }}"
    )


def test_a_nan_dump_settings_and_replay(new_page: Any, tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite"
    # (training starts with the page: at 20 steps/s a page slow to load, beside a busy CPU, met a
    # newer dump than step 30's, the NaN recurring every 100 steps)
    with support.start_demo(
        tmp_path, scenario="nan", rate=20, db=db, extra=["--no-shadow"], wait=True
    ) as srv:
        page, log = new_page()
        page.goto(srv.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        card = page.get_by_test_id("card-flight")
        expect(card).to_be_visible()
        card.scroll_into_view_if_needed()
        # the settings as the server has them
        expect(page.get_by_test_id("spike-z")).to_have_value("6")
        # the NaN at step 30: the dump arrives by itself, every step up to it, the incident marked
        f = page.wait_for_function(incident_at(30), timeout=60_000).json_value()
        assert 30 in f["traces"]["‖g‖ raw"] and f["steps"] >= 30
        assert f["traces"]["NaN/Inf"] and 30 in f["traces"]["NaN/Inf"]
        assert "NaN/Inf at 30" in f["status"]
        stored = srv.get("/api/flight")["rows"]
        assert [r["step"] for r in stored][:30] == list(range(1, 31)) and stored[29]["nonfinite"]

        # a refused value: its reason beside the field, nothing changed; then a good one applies
        page.get_by_test_id("spike-z").fill("-1")
        page.get_by_test_id("spike-apply").click()
        expect(page.get_by_test_id("spike-z-error")).to_contain_text("greater than or equal to 0.5")
        assert srv.get("/api/spikes")["settings"]["z"] == 6.0
        page.get_by_test_id("spike-z").fill("8")
        page.get_by_test_id("spike-cooldown").fill("30")
        page.get_by_test_id("spike-apply").click()
        expect(page.get_by_test_id("spike-z-error")).to_have_text("")
        support.wait_until(lambda: srv.get("/api/spikes")["settings"]["z"] == 8.0, 10, "z applied")
        assert srv.get("/api/spikes")["settings"]["cooldown"] == 30

        # the button: a dump now, of the steps up to the newest
        page.get_by_test_id("flight-now").click()
        page.wait_for_function(
            f"() => {{ const f = ({FLIGHT})(); return f && f.incident === '' ? f : null; }}"
        )
        # (the refused PUT is the one error: the browser's own line for a 422 response)
        assert [e for e in log.errors if "status of 422" not in e] == []
        page.close()

    # the replay: the stored dump, its NaN/Inf step marked; no settings (nothing to command)
    with start_cli(["replay", str(db)], log_dir=tmp_path) as replay:
        page, log = new_page()
        bad: list[tuple[int, str]] = []
        page.on("response", lambda r: bad.append((r.status, r.url)) if r.status >= 400 else None)
        page.goto(replay.url + "#all")
        card = page.get_by_test_id("card-flight")
        expect(card).to_be_visible()
        card.scroll_into_view_if_needed()
        f = page.wait_for_function(incident_at(30)).json_value()
        assert 30 in f["traces"]["NaN/Inf"]
        expect(page.get_by_test_id("spike-form")).to_be_hidden()
        expect(page.get_by_test_id("flight-now")).to_be_hidden()
        # (the replay's page asks nothing a replay refuses: the session's capabilities)
        assert bad == []
        assert log.errors == []


def test_a_spike_has_a_marker_on_the_loss_chart(new_page: Any, tmp_path: Path) -> None:
    with support.start_demo(tmp_path, scenario="exploding", rate=0, extra=["--no-shadow"]) as srv:
        page, log = new_page()
        bad: list[tuple[int, str]] = []
        page.on("response", lambda r: bad.append((r.status, r.url)) if r.status >= 400 else None)
        page.goto(srv.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        s = page.wait_for_function(
            f"() => {{ const s = ({SPIKES})(); return s && s.x.length ? s : null; }}", timeout=90_000
        ).json_value()
        assert any("spike:" in t and "σ" in t for t in s["text"])
        events = [e for e in srv.get("/api/events")["events"] if e["kind"] == "spike"]
        # the oldest spike the page shows (one before its window, on a page opened late, is not)
        shown = sorted(e["step"] for e in events if e["step"] >= s["first"])
        assert shown and shown[0] in s["x"], (shown[:5], s["x"][:5], s["first"])
        # its dump: the Recent steps card draws the spike's step
        page.get_by_test_id("card-flight").scroll_into_view_if_needed()
        f = page.wait_for_function(
            f"() => {{ const f = ({FLIGHT})(); return f && f.traces.spike && f.traces.spike.length ? f : null; }}"
        ).json_value()
        assert f["incident"] != ""
        # (with --no-shadow the what-if card's GET /api/shadow is a 404: not this card's)
        assert [u for _, u in bad if "/api/shadow" not in u] == []
        assert [e for e in log.errors if "Failed to load resource" not in e] == []
