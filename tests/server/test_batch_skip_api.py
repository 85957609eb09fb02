"""Rewind-and-skip over HTTP on the ``nan`` demo (a bad batch at step 30): the skipped window is
named in the history's events, the bad batch is not met again, and training goes on finite; a
skip that cannot be honoured is a 422 naming why, with nothing changed."""

from __future__ import annotations

import math

from tests.support import wait_until


def test_rewind_and_skip_on_the_nan_demo_leaves_the_bad_batch_behind(live):
    srv = live("nan", rate=None)
    c = srv.http()
    srv.wait_step(12)
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    r = c.post("/api/checkpoints", json={"label": "before the bad batch"})
    assert r.status_code == 202, r.text
    cp = r.json()["id"]
    wait_until(
        lambda: any(x["id"] == cp and x["taken"] for x in c.get("/api/checkpoints").json()["checkpoints"])
    )
    cp_step = next(x["step"] for x in c.get("/api/checkpoints").json()["checkpoints"] if x["id"] == cp)
    assert cp_step < 30
    srv.insp.resume()
    srv.wait_step(34)
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    from_step = srv.insp.step
    losses = {r["step"]: r["loss"] for r in c.get("/api/scalars", params={"limit": 5000}).json()["scalars"]}
    assert losses[30] == "nan"  # the bad batch, the first time

    # refused: the body's form (pydantic) and what the core cannot honour; nothing changes
    for body, where in [
        ({"skip": "everything"}, "skip"),
        ({"skip": 0}, "skip"),
        ({"skip": [5]}, "skip"),
        ({"skip": [cp_step - 5, 40]}, "starts before the checkpoint's data position"),
    ]:
        r = c.post(f"/api/checkpoints/{cp}/rewind", json=body)
        assert r.status_code == 422, (body, r.text)
        assert where in r.text, r.text
    assert srv.insp.step == from_step and srv.insp.checkpoints.rewinds == 0
    assert not [
        e for e in c.get("/api/events").json()["events"] if e["kind"] in ("rewind", "batches_skipped")
    ]

    r = c.post(f"/api/checkpoints/{cp}/rewind", json={"skip": "since_checkpoint"})
    assert r.status_code == 202, r.text
    wait_until(lambda: srv.insp.checkpoints.rewinds == 1, what="the rewind")
    srv.insp.resume()
    srv.wait_step(from_step + 15, timeout=60)
    events = c.get("/api/events", params={"limit": 5000}).json()["events"]
    (ev,) = [e for e in events if e["kind"] == "batches_skipped"]
    # batches are counted from 0: the bad one (the 30th) is batch 29
    assert ev["first"] == cp_step and ev["last"] == from_step - 1 and ev["first"] <= 29 <= ev["last"]
    assert ev["checkpoint"] == cp and ev["step"] == cp_step and ev["from_step"] == from_step
    assert ev["steps"] == [cp_step + 1, from_step] and ev["seek"] is True
    assert f"batches {cp_step}-{from_step - 1} skipped" in ev["message"]
    # the new branch: finite from the checkpoint on, past step 30
    wait_until(
        lambda: (
            len(
                [
                    r
                    for r in c.get("/api/scalars", params={"since": cp_step, "limit": 5000}).json()["scalars"]
                    if r["step"] > 35
                ]
            )
            > 0
        ),
        what="the new branch's losses past step 35",
    )
    rows = c.get("/api/scalars", params={"since": cp_step, "limit": 5000}).json()["scalars"]
    after = [r["loss"] for r in rows if r["step"] > cp_step]
    assert after and all(isinstance(v, float) and math.isfinite(v) for v in after), after
    assert max(r["step"] for r in rows) > 30
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    # every step of the new branch received one batch, after the window
    assert srv.insp.data_position["position"] == srv.insp.step + (from_step - cp_step)
    srv.insp.resume()


def test_a_skip_past_what_can_be_drawn_is_a_422_naming_why_and_nothing_changes(live):
    """`skip: 10**12` (and a window as far) would keep the training thread drawing and dropping
    batches for good: refused with the reason (MAX_SKIP), the run as it was, training going on."""
    srv = live(rate=None)
    c = srv.http()
    srv.wait_step(3)
    r = c.post("/api/checkpoints", json={"label": "before"})
    assert r.status_code == 202, r.text
    cp = r.json()["id"]
    wait_until(
        lambda: any(x["id"] == cp and x["taken"] for x in c.get("/api/checkpoints").json()["checkpoints"])
    )
    cp_step = next(x["step"] for x in c.get("/api/checkpoints").json()["checkpoints"] if x["id"] == cp)
    hooks, version = c.get("/api/hooks").json(), srv.insp.config_version
    for body, why in [
        ({"skip": 10**12}, "must be <= 100000 (MAX_SKIP"),
        ({"skip": [cp_step, 10**12]}, "more than 100000 (MAX_SKIP)"),
    ]:
        r = c.post(f"/api/checkpoints/{cp}/rewind", json=body)
        assert r.status_code == 422, (body, r.text)
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["skip"] and why in detail["msg"], detail
    assert srv.insp.checkpoints.rewinds == 0 and srv.insp.checkpoints.pending_rewind() is None
    assert srv.insp.data_position["pending"] is None
    assert c.get("/api/hooks").json() == hooks and srv.insp.config_version == version
    step = srv.insp.step
    srv.wait_step(step + 3)  # training goes on
