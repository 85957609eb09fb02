"""The history database's schema, and opening it (:func:`connect`): a new file gets the schema,
an older one its missing columns, a read-only opening checks that it is one of ours.

:mod:`server.history.storage` writes it; :mod:`server.history.queries` reads it.
"""

from __future__ import annotations

import os
import sqlite3

__all__ = ["BRANCH_COLUMNS", "SNAPSHOT_COLUMNS", "StoreError", "connect"]

_SCHEMA = """
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
    data TEXT NOT NULL,            -- the snapshot, strict JSON, without what the two BLOBs hold
    detail BLOB,                   -- the per-parameter lists, packed (packing.py); x'' once thinned
    groups BLOB,                   -- the group aggregates, packed (packing.py)
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
CREATE TABLE IF NOT EXISTS flight (  -- the flight recorder's dumped steps, one row per step (latest dump)
    run INTEGER NOT NULL, step INTEGER NOT NULL,
    data TEXT NOT NULL,            -- JSON: {"step", "loss", "nonfinite", "norm_raw", "norm", "groups_raw", "raw", "final"}
    PRIMARY KEY (run, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS hook_requests (
    run INTEGER NOT NULL, seq INTEGER NOT NULL, time REAL,
    action TEXT, hook_id TEXT,     -- add, update, remove, import; the hook's id (null for import)
    config_version INTEGER NOT NULL,  -- the version the requested config has once applied
    hooks TEXT NOT NULL,           -- JSON: the requested hook list after the change
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;
"""

# Columns added to `runs` after the first release: a database written before them gets them on
# opening for writing (ALTER TABLE; old rows read NULL: runs of their own); a read-only one is
# read as it is (history.py selects NULL for a missing column).
BRANCH_COLUMNS = (
    ("parent_run", "INTEGER"),
    ("branch_step", "INTEGER"),
    ("branch", "TEXT"),
    ("label", "TEXT"),
)

# Columns added to `snapshots` for the packed per-parameter lists and group aggregates: an older
# database gets them on opening for writing (its rows read NULL: their lists are in `data`); a
# read-only one is read as it is (queries.py selects NULL for a missing column).
SNAPSHOT_COLUMNS = (("detail", "BLOB"), ("groups", "BLOB"))


class StoreError(RuntimeError):
    """The database cannot be opened (missing file, not a gradient-inspector database)."""


def connect(path: str, *, create: bool) -> sqlite3.Connection:
    if not create and not os.path.exists(path):
        raise StoreError(f"no such database: {path}")
    try:
        conn = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
        if create and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a new file: only before its first table
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        if create:
            conn.executescript(_SCHEMA)
            have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
            for name, kind in BRANCH_COLUMNS:
                if name not in have:
                    conn.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
            have = {row[1] for row in conn.execute("PRAGMA table_info(snapshots)")}
            for name, kind in SNAPSHOT_COLUMNS:
                if name not in have:
                    conn.execute(f"ALTER TABLE snapshots ADD COLUMN {name} {kind}")
        else:
            conn.execute("SELECT id FROM runs LIMIT 1")
    except sqlite3.DatabaseError as e:
        raise StoreError(f"cannot open {path} as a gradient-inspector database: {e}") from e
    return conn
