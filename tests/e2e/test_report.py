"""The shareable HTML report in a real Chromium, with every network request refused.

A real `gradient-inspector demo --scenario exploding` records a run; a `clip_norm` hook is added
over HTTP mid-run, so the run has a hook change; then the real CLI exports it with
`--format html`. The file is opened from disk (file://) while every request that is not the
file itself is aborted and recorded: the page must draw its four charts with no console error
and no network attempt, and list the clip_norm change in its hook-change table.

A second run, written through the HistoryStore API, carries hostile names (a parameter called
`</script><script>...`, a hook target with an `<img onerror>`): nothing of it may run.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server import cli
from server.history.storage import HistoryStore
from tests import support

pytestmark = pytest.mark.e2e

CHARTS = ("chart-norms", "chart-heatmap", "chart-absmax", "chart-ratio")

# Per chart: is it a Plotly graph, and how many points has its first trace.
DRAWN = """(ids) => Object.fromEntries(ids.map((id) => {
  const gd = document.getElementById(id);
  const ok = gd && gd.classList.contains("js-plotly-plot") && Array.isArray(gd.data) && gd.data.length > 0;
  return [id, ok ? gd.data[0].x.length : -1];
}))"""

# The hook-change table, as text cells.
CHANGES = """() => Array.from(document.querySelectorAll("table.changes tbody tr"))
  .map((tr) => Array.from(tr.cells).map((td) => td.textContent.trim()))"""


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    return support.wait_until(pred, timeout, what, interval=0.1)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A recorded exploding run with a clip_norm hook added at about step 15, stopped near step 40."""
    tmp = tmp_path_factory.mktemp("report")
    db = tmp / "history.sqlite"
    server = support.start_demo(tmp, db=db, scenario="exploding", rate=20.0)
    try:

        def step() -> int:
            return int(server.get("/api/session")["training"]["step"])

        wait_until(lambda: step() >= 15, 60, "15 steps")
        r = server.client.post(
            "/api/hooks",
            json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0, "mode": "global"}},
        )
        assert r.status_code == 201, r.text
        hook_id = r.json()["id"]
        applied = wait_until(
            lambda: next((h["applied_step"] for h in server.get("/api/hooks") if h["id"] == hook_id), None),
            30,
            "the hook applied",
        )
        wait_until(lambda: step() >= 40, 60, "40 steps")
        run_id = server.get("/api/session")["run_id"]
    finally:
        server.stop()
    yield {"tmp": tmp, "db": db, "hook_id": hook_id, "applied_step": applied, "run": run_id}


@pytest.fixture(scope="module")
def report(recorded: dict[str, Any]) -> Path:
    """The run exported by the real CLI: `gradient-inspector export DB --format html -o OUT`."""
    out = recorded["tmp"] / "shared" / "report.html"
    out.parent.mkdir()
    proc = subprocess.run(
        [*support.cli_command(), "export", str(recorded["db"]), "--format", "html", "-o", str(out)],
        cwd=recorded["tmp"],
        capture_output=True,
        text=True,
        timeout=120,
        env=support.repo_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # the report went to the file, not to the terminal
    assert f"of run {recorded['run']} to {out}" in proc.stderr
    return out


def open_offline(page: Any, path: Path) -> list[str]:
    """Open a file with every other request refused; returns the list of refused URLs (filled as they come)."""
    refused: list[str] = []
    own = path.resolve().as_uri()

    def route(r: Any) -> None:
        if r.request.url == own:
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(own)
    page.wait_for_function("document.body.dataset.drawn === 'true'")
    return refused


def embedded(path: Path) -> dict[str, Any]:
    """The report's data, parsed as strict JSON (NaN/Infinity literals refused)."""
    text = path.read_text(encoding="utf-8")
    start = text.index('<script type="application/json" id="report-data">') + len(
        '<script type="application/json" id="report-data">'
    )
    body = text[start : text.index("</script>", start)]

    def refuse(name: str) -> Any:
        raise AssertionError(f"non-strict JSON constant {name} in the report")

    return json.loads(body, parse_constant=refuse)


def test_report_opens_offline_and_draws_every_chart_and_the_hook_change(
    recorded: dict[str, Any], report: Path, new_page: Any, tmp_path: Path
) -> None:
    page, log = new_page()
    refused = open_offline(page, report)

    points = page.evaluate(DRAWN, list(CHARTS))
    data = embedded(report)
    n_steps = len(data["steps"])
    assert n_steps >= 40, n_steps
    assert points == {
        "chart-norms": n_steps,
        "chart-heatmap": n_steps,
        "chart-absmax": len(data["params"]),
        "chart-ratio": n_steps,
    }, points
    # the norms chart: raw and final global norms and the loss, each with points
    lengths = page.evaluate("""() => document.getElementById("chart-norms").data
                                 .map((t) => t.y.filter((v) => v !== null).length)""")
    assert all(n > 0 for n in lengths[:3]), lengths
    # the heatmaps have real colours (log10 values), not only gaps
    for chart in ("chart-heatmap", "chart-ratio"):
        finite = page.evaluate(
            """(id) => document.getElementById(id).data[0].z.flat()
                                    .filter((v) => typeof v === "number").length""",
            chart,
        )
        assert finite > 0, chart

    # the clip_norm change: a row of the table, and a marker on the step charts at its step
    rows = page.evaluate(CHANGES)
    applied = recorded["applied_step"]
    assert [str(applied), "add", recorded["hook_id"], "clip_norm", "*"] in [r[:5] for r in rows], rows
    (row,) = [r for r in rows if r[2] == recorded["hook_id"]]
    assert "max_norm=1" in row[5] and "→" in row[5]
    shapes = page.evaluate("""() => document.getElementById("chart-norms").layout.shapes.map((s) => s.x0)""")
    assert applied in shapes
    # after the hook, the final global norm is held at 1.0 (clip_norm global, max_norm 1)
    after = [v for s, v in zip(data["steps"], data["total_norm"], strict=True) if s >= applied]
    assert after and max(after) <= 1.0 + 1e-3, after

    # the header: run, scenario, steps, parameters, and how it was made
    header = page.locator("dl.facts").inner_text()
    import inspector

    for text in (
        f"Run\n{recorded['run']}",
        "exploding",
        "tensors",
        f"version {inspector.__version__}",
        "gradient-inspector export",
    ):
        assert text in header, text

    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert log.errors == []
    assert refused == []


def test_default_output_is_run_id_html_in_the_current_directory(
    recorded: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", str(recorded["db"]), "--format", "html"]) == 0
    out = tmp_path / f"run-{recorded['run']}.html"
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "Plotly" in text
    assert 3_000_000 < out.stat().st_size < 10_000_000  # plotly.js inlined, a small run's data


def test_hostile_names_are_escaped_and_nothing_of_them_runs(tmp_path: Path, new_page: Any) -> None:
    db = tmp_path / "hostile.sqlite"
    store = HistoryStore(db)
    evil = "</script><script>window.pwned = 1</script>"
    names = [f"{evil}.weight", "<img src=x onerror=window.pwned=2>.bias"]
    run = store.new_run(
        params=[{"name": n, "shape": [4], "numel": 4, "module": "m"} for n in names],
        modules=["", "m"],
        scenario="<b>evil</b>",
    )
    store.start_writer()
    store.add_hooks(run, 0, [])
    hook = {
        "id": "h1",
        "kind": "clip_value",
        "point": "pre_step",
        "target": "<img src=x onerror=window.pwned=3>",
        "params": {"threshold": 0.5},
        "enabled": True,
        "position": 0,
        "applied_step": 3,
    }
    store.add_event(
        run,
        {
            "seq": 1,
            "kind": "hook_applied",
            "time": time.time(),
            "hook_id": "h1",
            "action": "add",
            "before": None,
            "after": hook,
            "applied_step": 3,
            "config_version": 1,
        },
    )
    store.add_hooks(run, 1, [hook])
    store.add_event(
        run,
        {
            "seq": 2,
            "kind": "nonfinite",
            "time": time.time(),
            "step": 4,
            "param": names[0],
            "rank": 0,
            "nan": 4,
            "inf": 0,
            "action_taken": "report",
        },
    )
    for step in range(1, 7):
        bad = float("nan") if step == 4 else 0.5
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": time.time(),
                "loss": 1.0 / step,
                "grad_norm_raw": [bad, 0.1],
                "grad_norm": [bad, 0.1],
                "grad_absmax_raw": [0.9, 0.2],
                "grad_absmax": [0.5, 0.2],
                "update_ratio": [1e-3, None],
                "total_norm_raw": bad,
                "total_norm": bad,
                "events": [],
            },
        )
    store.close()
    out = tmp_path / "hostile.html"
    assert cli.main(["export", str(db), "--format", "html", "-o", str(out)]) == 0
    data = embedded(out)  # strict JSON although the run holds NaN
    assert data["params"] == names and data["total_norm"][3] == "nan"

    page, log = new_page()
    refused = open_offline(page, out)
    assert page.evaluate("window.pwned") is None
    assert page.evaluate(DRAWN, list(CHARTS))["chart-heatmap"] == 6
    # the names are shown as text
    assert page.locator("table.changes").inner_text().count("<img src=x onerror=window.pwned=3>") >= 1
    assert "<b>evil</b>" in page.locator("h1").inner_text()
    assert log.errors == []
    assert refused == []
