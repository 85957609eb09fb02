"""Soak (issue 7, point 4), CI form: 5,000 uncapped steps of the `mlp` demo with history on and
four websocket clients in another process; bench/soak.py runs the same for 100,000 steps.

The same checks, scaled to the shorter run (tools.check_soak): rows within the store's thinning
bound, the file growing with the log of the run, no write failure and no backed-up writer,
every client's queue bounded, RSS flat after the first quarter, snapshots in order."""

from __future__ import annotations

import pytest

from .tools import check_soak, run_soak

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
