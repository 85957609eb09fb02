"""The history's packed columns (server/history/packing.py, storage.py): a snapshot's ten
per-parameter lists and group aggregates stored packed in float32, read back whole; the detail
thinned past the window, the group aggregates kept; `HistoryReader.detail`; and a database
written before the packed columns (its lists in the JSON) still read, for writing and read-only."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from server.history.packing import PER_PARAM, PackError, pack, split, unpack
from server.history.storage import DETAIL_KEEP, HistoryStore
from server.sources import ReplaySource

N = 5
PARAMS = [{"name": f"p{i}", "shape": [2], "numel": 2, "module": ""} for i in range(N)]

# The schema of the history before the packed columns, as it was created then.
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started REAL NOT NULL,
    scenario TEXT,
    params TEXT NOT NULL,          -- JSON: [{name, shape, numel, module}, ...]
    modules TEXT NOT NULL,         -- JSON: [name, ...]
    meta TEXT NOT NULL DEFAULT '{}',
    last_step INTEGER NOT NULL DEFAULT 0,
    updated REAL,
    parent_run INTEGER,            -- a branch: the run it branched from (see BRANCH_COLUMNS)
    branch_step INTEGER,           -- ... after this step of the parent
    branch TEXT,                   -- "abandoned" (left by a rewind) or "shadow" (a what-if copy)
    label TEXT                     -- what the branch is: "without clip_norm h1"
);
CREATE TABLE IF NOT EXISTS snapshots (  -- a rowid table: see "The file stays bounded" above
    run INTEGER NOT NULL, step INTEGER NOT NULL, time REAL,
    n_events INTEGER NOT NULL DEFAULT 0,
    data TEXT NOT NULL,            -- the wire snapshot, strict JSON
    UNIQUE (run, step)
);
CREATE TABLE IF NOT EXISTS scalars (
    run INTEGER NOT NULL, step INTEGER NOT NULL, time REAL,
    loss REAL, data TEXT NOT NULL,  -- data: {"loss", "scalars"} as sent
    PRIMARY KEY (run, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    run INTEGER NOT NULL, seq INTEGER NOT NULL, kind TEXT, time REAL, step INTEGER,
    data TEXT NOT NULL,
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS hook_changes (
    run INTEGER NOT NULL, config_version INTEGER NOT NULL, time REAL,
    hooks TEXT NOT NULL,           -- JSON: the full hook list after the change
    PRIMARY KEY (run, config_version)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS hook_requests (
    run INTEGER NOT NULL, seq INTEGER NOT NULL, time REAL,
    action TEXT, hook_id TEXT,     -- add, update, remove, import; the hook's id (null for import)
    config_version INTEGER NOT NULL,  -- the version the requested config has once applied
    hooks TEXT NOT NULL,           -- JSON: the requested hook list after the change
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;
"""


def f32(x: float) -> float:
    """`x` in float32 precision, printed short, as the history reads it back."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def lists(step: int) -> dict:
    out: dict = {}
    for j, k in enumerate(PER_PARAM):
        if k in ("nan_count", "inf_count"):
            out[k] = [0] * (N - 1) + [None]
        elif k == "grad_norm":
            out[k] = list(out["grad_norm_raw"])
        else:
            out[k] = [0.1 * step + j + i / 3 for i in range(N - 1)] + [None]
    return out


def snapshot(step: int, events: list | None = None) -> dict:
    return {
        "step": step,
        "time": float(step),
        "config_version": 0,
        "loss": 0.5,
        "scalars": {},
        "lr": [0.01],
        **lists(step),
        "total_norm_raw": 1.5,
        "total_norm": 1.5,
        "groups": {"norm": [0.1 * step, "nan"], "nan_count": [0, 3], "ratio_min": [None, 1e-3]},
        "worst": [],
        "events": events or [],
    }


def as_f32(snap: dict) -> dict:
    """What the history gives back: per-parameter and group values in float32."""

    def conv(v):
        return f32(v) if type(v) is float else v

    out = {k: ([conv(x) for x in v] if k in PER_PARAM else v) for k, v in snap.items()}
    out["groups"] = {k: [conv(x) for x in v] for k, v in snap["groups"].items()}
    return out


def test_pack_round_trip_keeps_none_nan_inf_ints_and_float32():
    cols = {
        "a": [1.5, None, "nan", "inf", "-inf", 0.1, -3e-5],
        "b": [1.5, None, "nan", "inf", "-inf", 0.1, -3e-5],  # equal to a: stored once
        "zero": [0] * 7,
        "none": [None] * 7,
        "ints": [1, 2, None, 4, 5, 6, 2**20],
    }
    blob = pack(cols)
    back = unpack(blob)
    assert back["a"] == back["b"] == [1.5, None, "nan", "inf", "-inf", f32(0.1), f32(-3e-5)]
    assert back["zero"] == [0] * 7 and back["none"] == [None] * 7
    assert back["ints"] == [1, 2, None, 4, 5, 6, 2**20] and all(type(v) is int for v in back["ints"] if v)
    once = pack({"a": cols["a"], "zero": cols["zero"], "none": cols["none"], "ints": cols["ints"]})
    assert len(blob) - len(once) < 8, "an equal column costs its header only"
    assert unpack(blob, ["ints"], [6, 0]) == {"ints": [2**20, 1]}
    with pytest.raises(PackError):
        unpack(b"junk")
    with pytest.raises(PackError):
        unpack(blob[:-3])


def test_split_leaves_what_it_cannot_pack_in_the_json():
    rest, detail, groups = split(
        {"step": 1, "grad_norm": [1.0, "x"], "grad_mean": [0.5], "groups": {"a": [1, {}]}}
    )
    assert rest == {"step": 1, "grad_norm": [1.0, "x"], "groups": {"a": [1, {}]}}
    assert detail is not None and unpack(detail) == {"grad_mean": [0.5]} and groups is None


def test_stored_packed_and_read_back_whole(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite")
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    store.add_snapshot(run, snapshot(1))
    store.flush()
    ((data, detail, groups),) = store._all("SELECT data, detail, groups FROM snapshots")
    stored = json.loads(data)
    assert not any(k in stored for k in PER_PARAM) and "groups" not in stored, "the lists are packed"
    assert detail and groups
    got = store.snapshots(run)[0]
    want = as_f32(snapshot(1))
    assert got == {**want, "loss": 0.5}
    assert list(got)[:16] == list(want)[:16], "the lists are back in their place (after lr)"
    assert got["nan_count"] == [0, 0, 0, 0, None] and got["groups"]["norm"][1] == "nan"
    store.close()


def test_the_optimizer_and_noise_scale_group_lists_are_packed_with_the_groups(tmp_path):
    """`optim.groups` and `noise_scale.groups` (one value per group each) go to the `groups` BLOB,
    not the JSON, and read back in place (float32); the detail-less form leaves out a list with no
    value, as the wire does."""
    snap = {
        **snapshot(1),
        "optim": {
            "kind": "adam",
            "cos_prev_gap": 1,
            "model": {"step_ratio": 0.25},
            "groups": {"step_ratio": [0.1, 0.2], "exp_avg_norm": [None, None]},
            **{k: [0.5] * (N - 1) + [None] for k in ("step_ratio", "exp_avg_norm")},
        },
        "noise_scale": {"b_simple": 12.5, "mode": "accumulation", "groups": {"g_sq": [1e-3, None]}},
    }
    store = HistoryStore(tmp_path / "h.sqlite")
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    store.add_snapshot(run, snap)
    store.flush()
    ((data, groups),) = store._all("SELECT data, groups FROM snapshots")
    stored = json.loads(data)
    assert "groups" not in stored["optim"] and "groups" not in stored["noise_scale"]
    assert stored["optim"]["kind"] == "adam" and stored["noise_scale"]["b_simple"] == 12.5
    assert sorted(unpack(groups)) == sorted(
        [*snap["groups"], "optim.groups.step_ratio", "optim.groups.exp_avg_norm", "noise_scale.groups.g_sq"]
    )
    got = store.snapshots(run)[0]
    assert got["optim"]["groups"] == {"step_ratio": [f32(0.1), f32(0.2)], "exp_avg_norm": [None, None]}
    assert got["optim"]["kind"] == "adam" and got["optim"]["step_ratio"] == [0.5] * (N - 1) + [None]
    assert got["noise_scale"] == {**snap["noise_scale"], "groups": {"g_sq": [f32(1e-3), None]}}
    assert got["groups"] == as_f32(snap)["groups"], "the group aggregates alone under groups"
    (bare,) = store.snapshots_at(run, [1], detail=False)
    assert bare["optim"]["groups"] == {"step_ratio": [f32(0.1), f32(0.2)]}
    assert bare["noise_scale"]["groups"] == {"g_sq": [f32(1e-3), None]}
    store.close()


def test_detail_thinned_past_the_window_groups_kept(tmp_path):
    window, steps = 16, 80
    store = HistoryStore(tmp_path / "h.sqlite", detail_window=window, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    for s in range(1, steps + 1):
        incident = [{"seq": s, "kind": "nonfinite", "step": s}] if s == 30 else None
        store.add_snapshot(run, snapshot(s, incident))
        store.flush()
    store.flush()
    rows = {s: (d, g) for s, d, g in store._all("SELECT step, length(detail), length(groups) FROM snapshots")}
    inside = range(steps - window + 1, steps + 1)
    past = range(1, steps - window + 1)
    assert all(rows[s][0] > 0 for s in inside), "the window keeps every step's detail"
    kept = [s for s in past if rows[s][0] > 0]
    # the first row of each aligned bucket of 8 steps (the multiples of 8: the rows the step
    # thinning keeps longest), and incidents
    assert kept == sorted({1, *range(DETAIL_KEEP, steps - window + 1, DETAIL_KEEP), 30}), kept
    assert all(rows[s][1] > 0 for s in rows), "group aggregates on every step"
    snaps = {s["step"]: s for s in store.snapshots(run)}
    assert snaps[2]["grad_norm_raw"] == [None] * N and snaps[2]["groups"]["norm"][0] == f32(0.2)
    assert snaps[8]["grad_norm_raw"][0] == f32(0.8) and snaps[steps]["grad_norm_raw"][0] == f32(0.1 * steps)
    steps_, stats = store.detail(run, [0, 4], ("grad_norm_raw", "nan_count"), since=5, before=11, limit=5)
    assert steps_ == [6, 7, 8, 9, 10]
    assert stats["grad_norm_raw"] == [[None, None, f32(0.8), None, None], [None] * 5]
    assert stats["nan_count"] == [[None, None, 0, None, None], [None] * 5]
    store.close()


def old_database(path) -> int:
    """A database as the history wrote it before the packed columns: lists in `data`."""
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    conn.execute(
        "INSERT INTO runs (started, scenario, params, modules, meta, last_step) VALUES (1, 'mlp', ?, '[\"\"]', '{}', 40)",
        (json.dumps(PARAMS),),
    )
    for s in range(1, 41):
        snap = {k: v for k, v in snapshot(s).items() if k not in ("groups", "worst")}
        conn.execute(
            "INSERT INTO snapshots (run, step, time, n_events, data) VALUES (1, ?, ?, 0, ?)",
            (s, float(s), json.dumps(snap, separators=(",", ":"))),
        )
    conn.commit()
    conn.close()
    return 1


@pytest.mark.parametrize("read_only", [True, False])
def test_a_database_from_before_the_packed_columns_still_reads(tmp_path, read_only):
    path = tmp_path / "old.sqlite"
    run = old_database(path)
    store = HistoryStore(path, read_only=read_only)
    snaps = store.snapshots(run)
    assert len(snaps) == 40
    want = {k: v for k, v in snapshot(40).items() if k not in ("groups", "worst")}
    assert snaps[-1] == want, "rows of the old format read as they were written (float64 too)"
    steps, stats = store.detail(run, [1], ("grad_norm_raw",), limit=3)
    assert steps == [38, 39, 40] and stats["grad_norm_raw"] == [[s * 0.1 + 1 / 3 for s in (38, 39, 40)]]
    light = store.snapshots_at(run, [40], detail=False)[0]
    assert light["detail"]["index"] == [] and "grad_norm_raw" not in light
    if not read_only:  # opened for writing: the columns were added, and new rows are packed
        store.start_writer()
        store.add_snapshot(run, snapshot(41))
        store.flush()
        assert store.snapshots(run)[-1]["grad_norm_raw"][0] == f32(4.1)
    store.close()
    replay = ReplaySource(HistoryStore(path, read_only=True))
    hello = replay.hello()
    assert len(hello["history"]) == 40 + (not read_only)
    worst = hello["history"][-1]["worst"]  # ranked from the stored rows (none was recorded)
    assert isinstance(worst, list) and {w["param"] for w in worst} <= set(range(N))
    groups = hello["session"]["groups"]  # recorded without: the default partition of its names
    assert groups["source"] == "tree" and groups["names"] == [p["name"] for p in PARAMS]


def test_counts_are_stored_exactly():
    big = [16777217, 5 * 10**10, 0, None, 2**24 + 3, 7]
    back = unpack(pack({"nan_count": big, "inf_count": [16777217] * 6}))
    assert back["nan_count"] == big, "integer columns read back exactly (not through float32)"
    assert all(type(v) is int for v in back["nan_count"] if v is not None)
    assert back["inf_count"] == [16777217] * 6
    neg = [-(2**40), 3, None]
    assert unpack(pack({"n": neg}))["n"] == neg
    assert unpack(pack({"n": big}), ["n"], [1, 0])["n"] == [5 * 10**10, 16777217]
    # an int column equal in value to a float one is not taken for it
    back = unpack(pack({"f": [1.0, 2.0], "i": [1, 2]}))
    assert back == {"f": [1.0, 2.0], "i": [1, 2]} and all(type(v) is int for v in back["i"])
    rest, detail, _ = split({"step": 1, "nan_count": [16777217, 5 * 10**10], "grad_norm_raw": [1.0, 2.0]})
    assert detail is not None and unpack(detail)["nan_count"] == [16777217, 5 * 10**10]


def _detail_rows(every: int, first: int, steps: int, full: int, window: int, path) -> tuple[dict, int]:
    store = HistoryStore(path, full_window=full, detail_window=window, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    s = first
    for i in range(steps):
        store.add_snapshot(run, snapshot(s))
        if i % 32 == 31:
            store.flush()
        s += every
    store.flush()
    rows = dict(store._all("SELECT step, length(detail) FROM snapshots WHERE run = ?", (run,)))
    store.close()
    return rows, s - every


@pytest.mark.parametrize("every, first", [(1, 1), (3, 1), (3, 3), (8, 1)])
def test_detail_survives_thinning_past_the_full_window(tmp_path, every, first):
    """The rows that keep their detail are the ones the step thinning keeps longest: older than
    the full window, an aligned span of 8 sampled steps (rounded up to a power of two) that still
    has a row has one with its detail, whatever the cadence."""
    full, window = 64, 32
    rows, last = _detail_rows(every, first, 1100, full, window, tmp_path / "h.sqlite")
    span = 8
    while span < 8 * every:
        span *= 2
    newest = sorted(rows)[-window:]
    assert all(rows[s] for s in newest), "the detail window keeps every row's detail"
    old = [s for s in rows if s <= last - full]
    assert len(old) < 1100 * 0.6, "the step thinning ran"
    buckets: dict[int, list[int]] = {}
    for s in old:
        buckets.setdefault(s // span, []).append(s)
    missing = [b * span for b, ss in buckets.items() if not any(rows[s] for s in ss)]
    # The step thinning drops an octave's first row when its bucket starts in the older octave
    # and it is not a multiple of the stride (storage.py `_thin`): with a sampled cadence a few
    # detail rows go that way (with every step recorded, none). Before: nearly every bucket.
    assert len(missing) <= len(buckets) // 4, (len(missing), len(buckets), missing[:20])
    if every == 1:
        assert not missing and all(rows[s] for s in old if s % 8 == 0), "the multiples of 8 keep it"
    kept = [s for s in old if rows[s]]
    assert len(kept) <= len(buckets) * 2 + 6, "the detail past the window is dropped elsewhere"


def _replay_client(path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    source = ReplaySource(HistoryStore(path, read_only=True))
    return TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1")


def test_corrupt_packed_rows_read_as_nulls_through_the_api(tmp_path, caplog):
    import logging
    import struct

    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    for s in range(1, 5):
        store.add_snapshot(run, snapshot(s))
    store.close()
    good = pack({"grad_norm_raw": [1.0] * N, "nan_count": [0] * N})
    # the same blob with its second column (ZERO) made first, and a SAME column pointing at it
    name = b"nan_count"
    head = struct.pack("<4sIH", good[:4], N, 2)
    zero_then_same = (
        head
        + bytes([len(name)])
        + name
        + struct.pack("<BBH", 2, 1, 0)  # ZERO
        + bytes([len(b"grad_norm_raw")])
        + b"grad_norm_raw"
        + struct.pack("<BBH", 1, 0, 0)  # SAME as 0
        + __import__("zlib").compress(b"")
    )
    conn = sqlite3.connect(path)
    conn.execute("UPDATE snapshots SET detail = ? WHERE step = 2", (zero_then_same,))
    conn.execute("UPDATE snapshots SET detail = 'not a blob at all' WHERE step = 3")
    conn.execute("UPDATE snapshots SET groups = 'text' WHERE step = 4")
    conn.commit()
    conn.close()
    caplog.set_level(logging.WARNING, logger="gradient_inspector.server")
    with _replay_client(path) as c:
        for _ in range(2):
            r = c.get("/api/snapshots")
            assert r.status_code == 200, r.text
            snaps = {s["step"]: s for s in r.json()["snapshots"]}
            assert sorted(snaps) == [1, 2, 3, 4]
            assert "grad_norm_raw" not in snaps[2] and "grad_norm_raw" not in snaps[3]
            assert snaps[1]["grad_norm_raw"][0] == f32(0.1) and "groups" not in snaps[4]
            r = c.get("/api/detail", params={"params": "p0,p1"})
            assert r.status_code == 200, r.text
            got = r.json()["stats"]
            assert got["grad_norm_raw"][0][1:3] == [None, None] and got["nan_count"][1][1:3] == [None, None]
            assert got["grad_norm_raw"][0][0] == f32(0.1)
    warned = [m for m in caplog.messages if f"snapshots row of run {run}" in m]
    assert len(warned) == 3, warned
