"""Soak, CI form: 5,000 uncapped steps of the `mlp` demo with history on and
four websocket clients in another process; bench/soak.py runs the same for 100,000 steps.

The same checks, scaled to the shorter run (tools.check_soak): rows within the store's thinning
bound, the file growing with the log of the run, no write failure and no backed-up writer,
every client's queue bounded, RSS flat after the first quarter, snapshots in order."""

from __future__ import annotations

import pytest

from .tools import check_soak, file_size, run_soak

STEPS = 5000


@pytest.mark.slow
def test_short_soak(tmp_path):
    result = run_soak(STEPS, tmp_path / "soak.sqlite", every=1, sample_s=1.0, timeout=240)
    s = result["summary"]
    print(
        f"\n{s['steps']} steps in {s['seconds']} s; RSS {s['rss_start'] / 2**20:.0f} -> {s['rss_max'] / 2**20:.0f} MiB;"
        f" db {s['db_bytes'] / 2**20:.1f} MiB (+wal {s['wal_bytes'] / 2**20:.1f}); rows {s['snapshot_rows']}"
        f"/{s['snapshot_bound']} snapshots, {s['scalar_rows']}/{s['scalar_bound']} scalars"
    )
    assert check_soak(result) == []
    assert s["snapshot_rows"] < s["steps"], "thinning ran"
    clients = s["clients"]["clients"]
    for c in clients:
        assert not c["violations"] and not c["errors"], c
    reader = next(c for c in clients if c["kind"] == "reader")
    assert reader["snapshots"] > 0 and not reader["close_codes"]
    assert reader["last_step"] >= s["steps"] // 2, "the reader kept up through the run"


def synthetic_snapshot(step: int, n_params: int) -> dict:
    """A snapshot as the core writes it for a model of `n_params` tensors (every statistic, as full
    floats: for 4 tensors about 1.1 KB, the size of the `mlp` demo's)."""
    vals = [0.1 + ((step * 7919 + i * 104729) % 1000003) / 1000003 for i in range(n_params)]  # full floats
    stats = ("grad_norm_raw", "grad_norm", "grad_mean", "grad_std", "grad_absmax_raw", "grad_absmax")
    return {
        "step": step,
        "time": 1000.0 + step,
        "config_version": 0,
        "loss": vals[0],
        "scalars": {},
        "lr": [0.01],
        **{k: vals for k in stats},
        "nan_count": [0] * n_params,
        "inf_count": [0] * n_params,
        "param_norm": vals,
        "update_ratio": vals,
        "total_norm_raw": sum(vals),
        "total_norm": sum(vals),
        "hook_effects": {},
        "hist": {},
        "modules": {},
        "ranks": None,
        "sampled_every": 1,
        "overhead": 0.02,
        "events": [],
    }


def four_tensor_run(store) -> int:  # noqa: ANN001
    """A run of four 10x10 weights in `store`, as `synthetic_snapshot(step, 4)` writes for."""
    return store.new_run(
        params=[{"name": f"{i}.weight", "shape": [10, 10], "numel": 100, "module": str(i)} for i in range(4)],
        modules=["", "0", "1", "2", "3"],
    )


@pytest.mark.slow
def test_a_long_history_keeps_the_wal_and_the_file_bounded(tmp_path):
    """20,000 steps of a 4-tensor model's snapshots and scalars, committed in
    batches of 200 steps. The WAL is checkpointed and truncated, so it never holds more than
    WAL_LIMIT (before: it stayed at its high-water mark, 6.8 MiB here, more on a real run); the file
    holds at most twice what it stores, plus 1 MiB (before: 18 MiB for 4.3 MiB of rows, as every
    1.2 KB snapshot began an overflow page of its own), and no more free pages than it keeps for
    reuse after thinning."""
    from server.history.storage import KEEP_FREE_PAGES, WAL_LIMIT, HistoryStore

    db = tmp_path / "long.sqlite"
    wal = tmp_path / "long.sqlite-wal"
    store = HistoryStore(db, flush_interval=0.05)
    walls = []
    try:
        run = four_tensor_run(store)
        store.start_writer()
        for step in range(1, 20_001):
            store.add_snapshot(run, synthetic_snapshot(step, 4))
            store.add_scalars(run, {"step": step, "loss": 1.0 / step, "scalars": {}})
            if step % 200 == 0:
                assert store.flush(30.0)
                walls.append(file_size(wal))
        assert store.paused_reason is None
        import sqlite3

        conn = sqlite3.connect(db)
        try:
            payload = sum(
                conn.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {t}").fetchone()[0]
                for t in ("snapshots", "scalars")
            )
            free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        finally:
            conn.close()
        size = file_size(db)
    finally:
        store.close()
    print(
        f"\ndb {size / 2**20:.2f} MiB for {payload / 2**20:.2f} MiB of rows; WAL at most {max(walls) / 2**20:.2f} MiB"
    )
    assert max(walls) <= WAL_LIMIT, f"the WAL reached {max(walls)} bytes"
    assert size <= 2 * payload + (1 << 20), f"{size} bytes of file for {payload} bytes of rows"
    assert free <= KEEP_FREE_PAGES, f"{free} free pages"


@pytest.mark.slow
def test_the_wal_holds_its_limit_and_one_bounded_write_however_many_rows_a_flush_brings(
    tmp_path, monkeypatch
):
    """10,000 steps of snapshots the size the `mlp` demo writes now (about 1.9 KB a row, its
    optimizer, worst-now and noise-scale entries included), 2,000 steps a flush: what a fast run
    queues in one flush interval, or more. The writer looks at the WAL's size after each of its
    writes, to checkpoint it past WAL_LIMIT; each look is recorded here, so the largest is the
    WAL at its largest. It holds WAL_LIMIT and at most one bounded write (before: a flush
    interval's rows and both thinnings went in one transaction, and the WAL reached 2.1 times
    WAL_LIMIT here, 2.4 times in a CI run of the soak at 400 steps a second)."""
    from server.history import storage
    from server.history.storage import WAL_LIMIT, HistoryStore

    seen: list[int] = []
    real_size = storage._size

    def size(path: str) -> int:
        n = real_size(path)
        if path.endswith("-wal"):
            seen.append(n)
        return n

    monkeypatch.setattr(storage, "_size", size)
    store = HistoryStore(tmp_path / "wal.sqlite", flush_interval=60.0)
    try:
        run = four_tensor_run(store)
        store.start_writer()
        for step in range(1, 10_001):
            snap = synthetic_snapshot(step, 4)
            snap["scalars"] = {f"s{i}": 0.1 + ((step * 31 + i * 7) % 997) / 997 for i in range(60)}
            store.add_snapshot(run, snap)
            store.add_scalars(run, {"step": step, "loss": 1.0 / step, "scalars": {}})
            if step % 2000 == 0:
                assert store.flush(60.0)
        assert store.paused_reason is None
    finally:
        store.close()
    assert seen, "the writer looked at the WAL"
    print(f"\nthe WAL at its largest: {max(seen) / WAL_LIMIT:.2f} x WAL_LIMIT")
    assert max(seen) <= WAL_LIMIT + (1 << 20), f"the WAL reached {max(seen)} bytes"
