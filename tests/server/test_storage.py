"""The SQLite history: batching, late scalars, thinning, failing writes, read-only opening."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from server.history import schema
from server.history.queries import HistoryQuery, pick_even, select
from server.history.storage import HistoryStore, StoreError

PARAMS = [{"name": "w", "shape": [2], "numel": 2, "module": ""}]


def snap(step: int, **extra) -> dict:
    return {
        "step": step,
        "time": 1.0 + step,
        "config_version": 0,
        "loss": None,
        "scalars": {},
        "grad_norm": [float(step)],
        "events": [],
        **extra,
    }


def test_runs_snapshots_scalars_events_hooks(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite")
    statuses = []
    store.start_writer(lambda kind, reason: statuses.append(kind))
    run = store.new_run(params=PARAMS, modules=[""], scenario="mlp", meta={"mode": "demo"})
    assert run == 1
    for s in range(1, 6):
        store.add_snapshot(run, snap(s))
        store.add_scalars(run, {"step": s, "loss": 1.0 / s, "scalars": {"acc": 0.5}})
    store.add_event(run, {"seq": 1, "kind": "hook_applied", "time": 2.0, "hook_id": "h1"})
    store.add_hooks(run, 1, [{"id": "h1", "kind": "freeze"}])
    assert store.flush()
    rows = store.snapshots(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1]["loss"] == 0.5 and rows[1]["scalars"] == {"acc": 0.5}, "late scalars merged on read"
    assert [r["step"] for r in store.snapshots(run, HistoryQuery(since=3))] == [4, 5]
    assert [r["step"] for r in store.snapshots(run, HistoryQuery(limit=2))] == [4, 5]
    assert [r["step"] for r in store.snapshots(run, HistoryQuery(points=3))] == [1, 3, 5]
    assert store.scalars(run, HistoryQuery(since=4)) == [{"step": 5, "loss": 0.2, "scalars": {"acc": 0.5}}]
    assert store.events(run)[0]["hook_id"] == "h1"
    assert store.hooks(run) == (1, [{"id": "h1", "kind": "freeze"}])
    runs = store.runs(live_run=run)
    assert runs == [
        {
            "id": 1,
            "started": runs[0]["started"],
            "scenario": "mlp",
            "steps": 5,
            "params": 1,
            "live": True,
            "branches": [],
        }
    ]
    assert store.run(run)["meta"] == {"mode": "demo"}
    store.close()
    store.close()  # idempotent
    assert statuses == []


def test_snapshots_are_committed_within_the_flush_interval(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", flush_interval=0.2)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    reader = HistoryStore(tmp_path / "h.sqlite", read_only=True)
    store.add_snapshot(run, snap(1))
    import time

    deadline = time.monotonic() + 5
    while not reader.snapshots(run) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r["step"] for r in reader.snapshots(run)] == [1]
    reader.close()
    store.close()


def test_thinning_keeps_recent_steps_and_a_log_number_of_old_ones(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", full_window=64)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    last = 4096
    for s in range(1, last + 1):
        events = [{"seq": 1, "kind": "nonfinite"}] if s == 7 else []
        store.add_snapshot(run, snap(s, events=events))
        if s % 256 == 0:  # a thinning pass runs when the newest step moved 64 on: here, at each flush
            store.flush()
    steps = set(store.steps("snapshots", run, cap=None))
    newest = last
    assert set(range(newest - 63, newest + 1)) <= steps, "the full window is kept"
    assert 7 in steps, "a step with events is always kept"
    # the documented rule: age in [W*2^k, W*2^(k+1)) keeps multiples of 2^(k+1)
    for s in steps:
        age = newest - s
        if age >= 64 and s != 7:
            k = (age // 64).bit_length() - 1
            assert s % 2 ** (k + 1) == 0, (s, age, k)
    assert len(steps) < 64 * (1 + 6) and len(steps) < newest / 8
    store.close()


def test_failing_writes_pause_history_and_resume(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", flush_interval=0.05)
    statuses: list[tuple[str, str]] = []
    changed = threading.Event()

    def on_status(kind, reason):
        statuses.append((kind, reason))
        changed.set()

    store.start_writer(on_status)
    run = store.new_run(params=PARAMS, modules=[""])

    def full_disk():
        raise sqlite3.OperationalError("database or disk is full")

    store.fault = full_disk
    for s in range(1, 4):
        store.add_snapshot(run, snap(s))
    assert changed.wait(5)
    assert statuses[0][0] == "history_paused" and "disk is full" in statuses[0][1]
    assert store.paused_reason is not None
    changed.clear()
    store.add_snapshot(run, snap(4))
    store.fault = None
    assert changed.wait(5)
    assert [k for k, _ in statuses] == ["history_paused", "history_resumed"]
    store.flush()
    assert [r["step"] for r in store.snapshots(run)] == [1, 2, 3, 4], "rows kept in memory meanwhile"
    store.close()


def test_memory_stays_bounded_while_writes_fail(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite", flush_interval=0.01, max_pending=10)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])

    def broken():
        raise sqlite3.OperationalError("disk I/O error")

    store.fault = broken
    for s in range(1, 101):
        store.add_snapshot(run, snap(s))
        if s % 10 == 0:
            store.flush()
    store.fault = None
    store.flush()
    store.flush()
    steps = store.steps("snapshots", run)
    assert len(steps) <= 20 and steps[-1] == 100 and store.dropped >= 80
    store.close()


def test_read_only_open(tmp_path):
    with pytest.raises(StoreError, match="no such database"):
        HistoryStore(tmp_path / "missing.sqlite", read_only=True)
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match="cannot open"):
        HistoryStore(tmp_path / "junk.sqlite", read_only=True)
    store = HistoryStore(tmp_path / "h.sqlite")
    store.new_run(params=PARAMS, modules=[""])
    store.close()
    ro = HistoryStore(tmp_path / "h.sqlite", read_only=True)
    assert ro.latest_run_id() == 1
    with pytest.raises(StoreError):
        ro.new_run(params=PARAMS, modules=[""])
    ro.close()


def test_step_selection_helpers():
    assert pick_even(10, 3) == [0, 4, 9] or pick_even(10, 3) == [0, 5, 9]
    assert pick_even(3, 10) == [0, 1, 2]
    assert pick_even(5, 1) == [4]
    assert select([1, 2, 3, 4, 5], 2, None) == [4, 5]
    assert select([1, 2, 3, 4, 5], None, 2) == [1, 5]
    assert select([], 3, 3) == []


def test_a_database_of_the_earlier_layout_is_read_and_written(tmp_path):
    """Databases made before snapshots became a rowid table keep their
    WITHOUT ROWID table and no auto_vacuum: the store reads, writes, replaces and thins them alike."""
    path = tmp_path / "old.sqlite"
    old_schema = schema._SCHEMA.replace(
        "    UNIQUE (run, step)\n);\nCREATE TABLE IF NOT EXISTS scalars",
        "    PRIMARY KEY (run, step)\n) WITHOUT ROWID;\nCREATE TABLE IF NOT EXISTS scalars",
    )
    assert old_schema != schema._SCHEMA
    conn = sqlite3.connect(path)
    conn.executescript(old_schema)
    conn.close()
    store = HistoryStore(path, full_window=16)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    for s in range(1, 301):
        store.add_snapshot(run, snap(s))
    store.add_snapshot(run, snap(300, loss=0.5))  # a second write of one step replaces it
    assert store.flush()
    steps = store.steps("snapshots", run)
    assert steps[-1] == 300 and len(steps) < 300, "thinned"
    assert store.snapshots(run, HistoryQuery(limit=1))[0]["loss"] == 0.5
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    assert (
        "WITHOUT ROWID"
        in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'snapshots'").fetchone()[0]
    )
    conn.close()


def test_a_new_database_has_a_rowid_snapshot_table_and_incremental_vacuum(tmp_path):
    store = HistoryStore(tmp_path / "new.sqlite")
    store.close()
    conn = sqlite3.connect(tmp_path / "new.sqlite")
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
    assert (
        "WITHOUT ROWID"
        not in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'snapshots'").fetchone()[0]
    )
    conn.close()


def test_a_commit_part_holds_one_run_up_to_one_step():
    """The writer's parts (storage._part): one run's rows at a time, the oldest run first, the
    snapshots and scalars both cut at the same step, so the thinning after the part counts ages
    from a step every row up to it is in by (before: a part mixed runs, one run's scalars reaching
    far past its snapshots)."""
    from collections import OrderedDict

    from server.history import storage

    snaps: OrderedDict = OrderedDict()
    scalars: OrderedDict = OrderedDict()
    for step in range(1, 401):
        for run in (1, 2):
            snaps[(run, step)] = ("{}", 0.0, 0, None, None)
            scalars[(run, step)] = ("{}", 0.0, None)
    seen = []
    while snaps or scalars:
        part_snaps, part_scalars = storage._part(snaps, scalars)  # noqa: SLF001
        assert part_snaps or part_scalars
        runs = {r for r, _ in [*part_snaps, *part_scalars]}
        assert len(runs) == 1, runs
        assert len(part_snaps) <= storage.COMMIT_SNAPSHOTS and len(part_scalars) <= storage.COMMIT_SCALARS
        if part_snaps and part_scalars:
            assert max(s for _, s in part_snaps) == max(s for _, s in part_scalars)
        for k in part_snaps:
            del snaps[k]
        for k in part_scalars:
            del scalars[k]
        seen.append((runs.pop(), len(part_snaps), len(part_scalars)))
    assert sum(n for _, n, _ in seen) == 800 and sum(n for _, _, n in seen) == 800
