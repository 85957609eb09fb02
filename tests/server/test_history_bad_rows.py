"""A history with rows that cannot be read (a crash mid-write, a disk error, a crafted file):
the bad row is skipped with one warning naming it, and replay, export and the report go on; a
run whose own row cannot be read gets a one-line error. And the thinning of long runs is not
stopped by routine events (a hook change or an automatic checkpoint every step)."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.cli import main
from server.history.storage import HistoryStore
from server.settings import Settings
from server.sources import ReplaySource

PARAMS = [{"name": "w", "shape": [2], "numel": 2, "module": ""}]


def snapshot(step: int, events: list | None = None) -> dict:
    return {
        "step": step,
        "time": float(step),
        "config_version": 0,
        "loss": None,
        "scalars": {},
        "grad_norm": [float(step)],
        "total_norm": float(step),
        "total_norm_raw": float(step),
        "events": events or [],
    }


def history(path, steps: int = 10) -> int:
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""], scenario="mlp")
    for s in range(1, steps + 1):
        store.add_snapshot(run, snapshot(s))
        store.add_scalars(run, {"step": s, "loss": 1.0 / s, "scalars": {}})
        store.add_event(run, {"seq": s, "kind": "note", "step": s, "time": float(s)})
    store.close()
    return run


def spoil(path, sql: str, *args) -> None:
    conn = sqlite3.connect(path)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


@pytest.fixture
def bad_db(tmp_path):
    path = tmp_path / "h.sqlite"
    run = history(path)
    spoil(path, "UPDATE snapshots SET data = ? WHERE run = ? AND step = 4", '{"step": 4, "grad_no', run)
    spoil(path, "UPDATE scalars SET data = ? WHERE run = ? AND step = 6", "\x00garbage", run)
    spoil(path, "UPDATE scalars SET data = ? WHERE run = ? AND step = 7", "[1, 2]", run)
    spoil(path, "UPDATE events SET data = ? WHERE run = ? AND seq = 2", "{", run)
    return path, run


def test_replay_skips_a_bad_row_with_one_warning_naming_it(bad_db, caplog):
    path, run = bad_db
    caplog.set_level(logging.WARNING, logger="gradient_inspector.server")
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        for _ in range(2):  # asked twice: warned once
            snaps = c.get("/api/snapshots")
            assert snaps.status_code == 200, snaps.text
            assert [s["step"] for s in snaps.json()["snapshots"]] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
            r = c.get("/api/snapshots", params={"buckets": 3})
            assert r.status_code == 200 and 4 not in [s["step"] for s in r.json()["snapshots"]]
            scalars = c.get("/api/scalars")
            assert scalars.status_code == 200, scalars.text
            assert [s["step"] for s in scalars.json()["scalars"]] == [1, 2, 3, 4, 5, 8, 9, 10]
            r = c.get("/api/scalars", params={"buckets": 2})
            assert r.status_code == 200 and 6 not in [s["step"] for s in r.json()["scalars"]]
            events = c.get("/api/events")
            assert events.status_code == 200 and [e["seq"] for e in events.json()["events"]] == [
                1,
                *range(3, 11),
            ]
            assert c.get("/api/session").status_code == 200
    bad = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(bad) == 4, bad
    assert any("snapshots row of run 1 at step 4: not valid JSON" in m for m in bad)
    assert any("scalars row of run 1 at step 6" in m for m in bad)
    assert any("scalars row of run 1 at step 7: a JSON list, not an object" in m for m in bad)
    assert any("events row of run 1 at seq 2" in m for m in bad)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "html"])
def test_export_goes_on_past_a_bad_row(bad_db, tmp_path, fmt, caplog):
    path, run = bad_db
    out = tmp_path / f"out.{fmt}"
    assert main(["export", str(path), "--format", fmt, "-o", str(out)]) == 0
    text = out.read_text()
    if fmt == "jsonl":
        rows = [json.loads(line) for line in text.splitlines()]
        assert [r["data"]["step"] for r in rows if r["type"] == "snapshot"] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    elif fmt == "csv":
        assert [line.split(",")[0] for line in text.splitlines()[1:]] == [
            "1",
            "2",
            "3",
            "5",
            "6",
            "7",
            "8",
            "9",
            "10",
        ]
    else:
        assert "<html" in text
    assert any("snapshots row of run 1 at step 4" in r.getMessage() for r in caplog.records)


def test_a_run_that_cannot_be_read_gets_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    run = history(path, steps=3)
    spoil(path, "UPDATE runs SET params = ? WHERE id = ?", "[{", run)
    assert main(["export", str(path), "--format", "jsonl", "-o", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "run 1 cannot be read" in err and "Traceback" not in err
    assert main(["replay", str(path), "--port", "0"]) == 2
    assert "run 1 cannot be read" in capsys.readouterr().err
    source = ReplaySource.__new__(ReplaySource)  # a live server listing an older, spoilt run
    source.store, source.run_id = HistoryStore(path, read_only=True), None
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        assert c.get("/api/runs").json()["runs"][0]["params"] is None
        r = c.get("/api/session", params={"run": run})
        assert r.status_code == 409 and "cannot be read" in r.json()["detail"]


def test_routine_events_do_not_stop_the_thinning_but_incidents_keep_their_snapshot(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", full_window=16)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    for s in range(1, 601):  # a change from a page every step: its checkpoint and its hook change
        events = [{"seq": 2 * s, "kind": "checkpoint"}, {"seq": 2 * s + 1, "kind": "hook_applied"}]
        if s == 101:
            events.append({"seq": 10_000, "kind": "nonfinite"})
        store.add_snapshot(run, snapshot(s, events))
        if s % 100 == 0:
            assert store.flush(10)
    store.close()
    reader = HistoryStore(tmp_path / "h.sqlite", read_only=True)
    steps = reader.steps("snapshots", run, cap=None)
    reader.close()
    assert len(steps) < 100, f"thinned like a run without events: {len(steps)} of 600 kept"
    assert 101 in steps, "a snapshot that carries an incident is always kept"


def test_replay_shows_the_losses_the_live_page_showed(tmp_path):
    import torch
    from torch import nn

    import inspector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    insp = inspector.attach(model, opt, every=1)
    insp.serve(port=0, db=str(tmp_path / "h.sqlite"))
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for step in range(1, 6):
        opt.zero_grad()
        for micro in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            if micro == 0:
                insp.record(loss=float(step))
        opt.step()
        insp.record(loss=step + 3.0)  # after step(): the step's loss is the mean, step + 1.5
    insp.finish()
    live = [(s["step"], s["loss"]) for s in insp.snapshots()]
    insp.close()
    assert live == [(s, s + 1.5) for s in range(1, 6)]
    source = ReplaySource(HistoryStore(tmp_path / "h.sqlite", read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        stored = [(s["step"], s["loss"]) for s in c.get("/api/snapshots").json()["snapshots"]]
        scalars = [(s["step"], s["loss"]) for s in c.get("/api/scalars").json()["scalars"]]
    assert stored == scalars == live
