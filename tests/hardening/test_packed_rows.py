"""Crafted or damaged packed columns in a history (server/history/packing.py): a `detail` or
`groups` BLOB that is junk, cut short, or packed for another number of parameters is skipped with
one warning naming its row; the snapshot is still served (without what the BLOB held), and
`GET /api/detail` answers with nulls there, never a 500."""

from __future__ import annotations

import logging
import sqlite3

from fastapi.testclient import TestClient

from server.app import create_app
from server.history.packing import PER_PARAM, pack
from server.history.storage import HistoryStore
from server.settings import Settings
from server.sources import ReplaySource

PARAMS = [{"name": "a"}, {"name": "b"}]


def recorded(path) -> int:
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""])
    for s in range(1, 6):
        store.add_snapshot(
            run,
            {
                "step": s,
                "total_norm_raw": 1.0,
                "grad_norm_raw": [float(s), 2.0],
                "groups": {"norm": [1.0]},
                "events": [],
            },
        )
    store.close()
    return run


def test_damaged_blobs_are_skipped_with_a_warning_never_a_500(tmp_path, caplog):
    path = tmp_path / "h.sqlite"
    run = recorded(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE snapshots SET detail = x'00ff00ff' WHERE step = 2")
    conn.execute("UPDATE snapshots SET detail = substr(detail, 1, length(detail) - 2) WHERE step = 3")
    conn.execute("UPDATE snapshots SET detail = ? WHERE step = 4", (pack({"grad_norm_raw": [1.0]}),))
    conn.execute("UPDATE snapshots SET groups = x'47495031ffffffff' WHERE step = 5")
    conn.commit()
    conn.close()
    caplog.set_level(logging.WARNING, logger="gradient_inspector.server")
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        for _ in range(2):  # asked twice: warned once a row
            r = c.get("/api/snapshots")
            assert r.status_code == 200, r.text
            snaps = {s["step"]: s for s in r.json()["snapshots"]}
            assert sorted(snaps) == [1, 2, 3, 4, 5], "every row is served"
            assert snaps[1]["grad_norm_raw"] == [1.0, 2.0] and "grad_norm_raw" not in snaps[2]
            assert snaps[4]["grad_norm_raw"] == [1.0], "packed for one parameter: as packed"
            assert "groups" not in snaps[5] and snaps[5]["grad_norm_raw"] == [5.0, 2.0]
            r = c.get("/api/detail", params={"params": "b,a"})
            assert r.status_code == 200, r.text
            assert r.json()["stats"]["grad_norm_raw"] == [
                [2.0, None, None, None, 2.0],
                [1.0, None, None, None, 5.0],
            ], "a damaged row, or one packed for fewer parameters, has nulls"
            assert set(r.json()["stats"]) == set(PER_PARAM)
            r = c.get("/api/session")
            assert r.status_code == 200
    warned = [m for m in caplog.messages if f"snapshots row of run {run}" in m]
    assert len(warned) == 4 and all("packed column set" in m for m in warned), warned
    assert any("fewer parameters" in m for m in warned)
