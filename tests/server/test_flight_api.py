"""The flight recorder and spike detection over HTTP: GET/PUT /api/spikes (a bad value is a 422
naming the field and changes nothing), POST /api/flight (a dump now), a NaN's automatic dump stored
in the history and served by GET /api/flight, live and in a replay."""

from __future__ import annotations

from server.history.storage import HistoryStore
from server.sources import ReplaySource
from tests.support import wait_until


def test_spike_settings_are_validated_and_applied(live):
    srv = live(rate=None)
    srv.wait_step(2)
    c = srv.http()
    before = c.get("/api/spikes").json()["settings"]
    assert before == {"enabled": True, "z": 6.0, "warmup": 50, "alpha": 0.02, "cooldown": 50}
    for body, field in (
        ({"z": -1}, "z"),
        ({"z": "6"}, "z"),
        ({"warmup": 1}, "warmup"),
        ({"warmup": 2.5}, "warmup"),
        ({"alpha": 1.0}, "alpha"),
        ({"cooldown": 0}, "cooldown"),
        ({"enabled": "yes"}, "enabled"),
        ({"z": 5, "sigma": 3}, "sigma"),
    ):
        r = c.put("/api/spikes", json=body)
        assert r.status_code == 422, body
        assert field in r.json()["detail"][0]["loc"], r.json()
        assert srv.insp.spike_detection == before, "nothing changed"
    r = c.put("/api/spikes", json={"z": 8, "warmup": 20})
    assert r.status_code == 200
    assert r.json()["settings"] == {**before, "z": 8.0, "warmup": 20}
    assert srv.insp.spike_detection == r.json()["settings"]


def test_a_dump_on_request_and_on_a_nan_is_stored_and_served(live, tmp_path):
    srv = live("nan", rate=None, every=10, wait=True)
    dumps: list[dict] = []  # every flight record, watched from before the first step
    srv.insp.subscribe(lambda kind, p: dumps.append(p) if kind == "flight" else None, lossless=True)
    srv.trainer.client_arrived()
    srv.wait_step(3)
    c = srv.http()
    r = c.post("/api/flight")
    assert r.status_code == 200
    now = r.json()
    assert now["reason"] == "request" and now["rows"] and "raw" not in now["rows"][0]
    assert now["bytes"] == srv.insp.memory["flight"] > 0
    # the corrupted batch of step 30: a NaN, found at a later boundary, dumps the ring by itself
    # (a request that came late could have read the NaN's row too: the dump's reason tells them apart)
    wait_until(lambda: any(d["reason"] == "nonfinite" for d in dumps), 60, "the NaN's own dump")
    auto = next(d for d in dumps if d["reason"] == "nonfinite")
    assert auto["step"] == 30 and next(r for r in auto["rows"] if r["step"] == 30)["nonfinite"]
    # held still, with everything published so far stored: a dump published between the live
    # read and the stored one would make them differ
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    assert srv.insp.flush()
    srv.source.store.flush()
    rows = c.get("/api/flight", params={"tensors": "true"}).json()["rows"]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and 30 in steps and 29 in steps
    bad = next(r for r in rows if r["step"] == 30)
    assert bad["nonfinite"] and len(bad["raw"]) == len(srv.insp.params)
    assert all(not r["nonfinite"] for r in rows if r["step"] < 30)
    replay = ReplaySource(HistoryStore(srv.db, read_only=True), run_id=srv.source.run_id)
    assert [r["step"] for r in replay.flight(None)] == steps
    assert replay.spike_settings() is None


def test_a_live_server_serves_the_last_dumps_before_they_are_stored_and_with_no_database(live):
    """A page that connects after a dump was sent gets it from GET /api/flight: the live server keeps
    the last dumps' rows (a server with no database stores none, and the history writer stores a
    dump after the pages got it); a rewind drops the abandoned steps' rows."""
    srv = live("nan", rate=None, every=10, db=False)
    c = srv.http()
    wait_until(
        lambda: any(r["nonfinite"] for r in c.get("/api/flight").json()["rows"]), 60, "the NaN's dump served"
    )
    rows = c.get("/api/flight").json()["rows"]
    steps = [r["step"] for r in rows]
    assert (
        steps == sorted(set(steps)) and 30 in steps and next(r for r in rows if r["step"] == 30)["nonfinite"]
    )
    assert [r["step"] for r in c.get("/api/flight", params={"since": 20, "until": 25}).json()["rows"]] == [
        21,
        22,
        23,
        24,
        25,
    ]
    # a rewind to step 10: the rows after it are of an abandoned branch
    srv.source._rewound({"step": 10, "from_step": 40, "checkpoint": "c1"})
    assert max(r["step"] for r in c.get("/api/flight").json()["rows"]) <= 10
