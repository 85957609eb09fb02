"""What a replay's first page load costs the server: its hello (the session, the newest history and
events) is built without importing torch (the core's tables it needs are torch-free), from the
newest `hello_history` rows only, and the stored rows' float columns are written back in one pass
per chunk of rows, not one per column of every row. Counts, not durations."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.history import packing
from server.history.storage import HistoryStore
from server.settings import Settings
from server.sources import HistoryQuery, ReplaySource

from .test_history_packed import PARAMS, as_f32, snapshot

ROOT = Path(__file__).resolve().parents[2]
STEPS = 700  # more than a hello holds (Settings.hello_history: 600)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "h.sqlite"
    store = HistoryStore(str(path), detail_window=STEPS)
    store.start_writer()
    # as a live server records a run: its groups in the meta (`Inspector.groups`)
    groups = {"source": "tree", "names": ["all"], "members": [list(range(len(PARAMS)))], "stacks": []}
    run = store.new_run(params=PARAMS, modules=[""], scenario="mlp", meta={"groups": groups})
    for step in range(1, STEPS + 1):
        store.add_snapshot(run, snapshot(step))
        store.add_scalars(run, {"step": step, "loss": 0.5, "scalars": {}})
    store.add_event(run, {"seq": 1, "kind": "hook_applied", "time": 1.0, "config_version": 1})
    store.close()
    return path


def test_a_replays_hello_imports_no_torch(db: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        from server.history.storage import HistoryStore
        from server.settings import Settings
        from server.sources import ReplaySource
        s = Settings()
        hello = ReplaySource(HistoryStore({str(db)!r}, read_only=True)).hello(s.hello_history, s.hello_events)
        assert hello["session"]["hook_kinds"] and len(hello["history"]) == s.hello_history
        print("torch imported:", "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch imported: False"


def test_a_replays_hello_reads_the_newest_rows_and_writes_their_floats_in_one_pass(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = HistoryStore(str(db), read_only=True)
    try:
        src = ReplaySource(store)
        read_rows: list[int] = []
        snapshots_at = store.snapshots_at

        def counting(run, steps, **kw):
            read_rows.append(len(steps))
            return snapshots_at(run, steps, **kw)

        monkeypatch.setattr(store, "snapshots_at", counting)
        passes: list[int] = []
        short = packing._short

        def counting_short(v):
            passes.append(len(v))
            return short(v)

        monkeypatch.setattr(packing, "_short", counting_short)
        settings = Settings()
        hello = src.hello(settings.hello_history, settings.hello_events)
        history = hello["history"]
        assert read_rows == [settings.hello_history]  # the newest rows only
        assert [s["step"] for s in history] == list(range(STEPS - settings.hello_history + 1, STEPS + 1))
        # 600 rows of two packed BLOBs (detail, groups) each: one pass per chunk of 500 rows
        assert len(passes) == 2, len(passes)
        # ... and the values are those the history has (float32, printed short)
        want = as_f32(snapshot(STEPS))
        got = src.snapshots(None, HistoryQuery(since=STEPS - 1))[0]
        for k in (*packing.PER_PARAM, "groups"):
            assert got[k] == want[k], k
    finally:
        store.close()
