"""Downsampled history: `buckets=N` on /api/snapshots and /api/scalars keeps
each bucket's smallest and largest values, so a spike survives where `points` (evenly spaced
steps) would miss it; `until` bounds a range from above, for zooming in at full resolution."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.history.queries import bucket_extremes
from server.history.storage import HistoryStore
from server.sources import ReplaySource

PARAMS = [{"name": "w", "shape": [2], "numel": 2, "module": ""}]
STEPS = 2000
SPIKE = 1237  # a step no even spacing of 50 points over 1..2000 lands on


def norm(step: int) -> float | str:
    if step == SPIKE:
        return 1e30
    if step == 1501:
        return "inf"
    return 1.0 + (step % 7) * 0.01


def loss(step: int) -> float:
    return 1e6 if step == SPIKE else 2.0 - step * 1e-4


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("buckets") / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=PARAMS, modules=[""], scenario="mlp")
    for s in range(1, STEPS + 1):
        store.add_snapshot(
            run,
            {
                "step": s,
                "time": float(s),
                "config_version": 0,
                "loss": None,
                "scalars": {},
                "events": [],
                "total_norm_raw": norm(s),
                "total_norm": 1.0,
                "grad_norm": [1.0],
            },
        )
        store.add_scalars(run, {"step": s, "loss": loss(s), "scalars": {}})
    assert store.flush()
    store.close()
    replay = HistoryStore(path, read_only=True)
    with TestClient(create_app(ReplaySource(replay)), base_url="http://127.0.0.1") as c:
        yield c


def steps_of(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows]


def test_bucketed_snapshots_keep_spikes_the_even_points_miss(client):
    r = client.get("/api/snapshots", params={"points": 50})
    assert r.status_code == 200, r.text
    even = steps_of(r.json()["snapshots"])
    assert SPIKE not in even, "the test's spike must be one even spacing misses"
    rows = client.get("/api/snapshots", params={"buckets": 50}).json()["snapshots"]
    steps = steps_of(rows)
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == STEPS
    assert SPIKE in steps and 1501 in steps, "the largest finite and the non-finite norm both kept"
    assert len(rows) <= 4 * 50 + 2
    assert {r["step"]: r["total_norm_raw"] for r in rows}[1501] == "inf"


def test_bucketed_scalars_keep_the_loss_spike(client):
    rows = client.get("/api/scalars", params={"buckets": 40}).json()["scalars"]
    assert SPIKE in steps_of(rows) and len(rows) <= 2 * 40 + 2
    assert max(r["loss"] for r in rows) == 1e6


def test_until_and_buckets_give_a_range_at_full_resolution(client):
    rows = client.get("/api/snapshots", params={"since": 1899, "until": 1950, "buckets": 500}).json()
    # the newest 1024 steps are kept in full (older ones thinned): fewer than buckets, every one
    assert steps_of(rows["snapshots"]) == list(range(1900, 1951))
    rows = client.get("/api/scalars", params={"since": 1999, "until": 5000}).json()["scalars"]
    assert steps_of(rows) == [2000]


def test_points_and_buckets_together_are_refused(client):
    r = client.get("/api/snapshots", params={"points": 5, "buckets": 5})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "buckets"]
    assert client.get("/api/scalars", params={"buckets": 0}).status_code == 422


def test_bucket_extremes_of_rows_without_values_keep_a_step_per_bucket():
    rows = [(s, None) for s in range(1, 101)]
    assert bucket_extremes(rows, 10) == list(range(1, 101, 10)) + [100]
    assert bucket_extremes(rows[:5], 10) == [1, 2, 3, 4, 5]
