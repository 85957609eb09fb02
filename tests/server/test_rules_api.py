"""Rules over HTTP: GET/POST /api/rules, PATCH/DELETE /api/rules/{id} (a bad field is a 422 naming it
and changes nothing; an unknown id a 404), a preset by name, a firing stored in the history and
served by GET /api/events, and a replay that refuses commands."""

from __future__ import annotations

from server.history.storage import HistoryStore
from server.sources import ReplaySource
from tests.support import wait_until


def test_rules_are_added_validated_changed_and_removed(live):
    srv = live(rate=None)
    srv.wait_step(2)
    c = srv.http()
    listed = c.get("/api/rules").json()
    assert listed["rules"] == [] and set(listed["presets"]) == {"safe overnight", "clip on spike"}
    for body, loc in (
        ({"signal": "loss", "op": "=>", "threshold": 1, "action": "alert"}, "op"),
        ({"signal": "nope", "op": ">", "threshold": 1, "action": "alert"}, "signal"),
        ({"signal": "loss", "op": ">", "threshold": "x", "action": "alert"}, "threshold"),
        ({"signal": "loss", "op": ">", "threshold": 1, "action": "alert", "cooldown": -2}, "cooldown"),
        (
            {
                "signal": "loss",
                "op": ">",
                "threshold": 1,
                "action": "add_hook",
                "args": {"kind": "clip_norm", "params": {"max_norm": 0}},
            },
            "max_norm",
        ),
        ({"preset": "reckless"}, "preset"),
    ):
        r = c.post("/api/rules", json=body)
        assert r.status_code == 422, (body, r.text)
        assert loc in r.json()["detail"][0]["loc"], r.json()
        assert c.get("/api/rules").json()["rules"] == [], "nothing changed"
    r = c.post(
        "/api/rules", json={"signal": "step", "op": ">=", "threshold": 1, "action": "alert", "cooldown": 1000}
    )
    assert r.status_code == 201 and r.json()["id"] == "r1"
    r = c.post("/api/rules", json={"preset": "safe overnight"})
    assert r.status_code == 201 and [x["name"] for x in r.json()["rules"]] == ["safe overnight"]
    before = c.get("/api/rules").json()["rules"]
    r = c.patch("/api/rules/r2", json={"for_steps": 0})
    assert r.status_code == 422 and "for_steps" in r.json()["detail"][0]["loc"]
    assert c.patch("/api/rules/r9", json={"enabled": False}).status_code == 404
    assert [x["enabled"] for x in c.get("/api/rules").json()["rules"]] == [x["enabled"] for x in before]
    r = c.patch("/api/rules/r2", json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False
    assert c.delete("/api/rules/r2").status_code == 204
    assert c.delete("/api/rules/r2").status_code == 404
    assert [x["id"] for x in c.get("/api/rules").json()["rules"]] == ["r1"]
    # r1 fires at the next boundary; its firing is an event of the history
    wait_until(lambda: c.get("/api/rules").json()["rules"][0]["state"]["fired"] == 1, 60, "the rule fired")
    fired = wait_until(
        lambda: [e for e in c.get("/api/events").json()["events"] if e["kind"] == "rule_fired"],
        60,
        "rule_fired stored",
    )
    assert fired[0]["rule"] == "r1" and fired[0]["action"] == "alert"
    srv.source.store.flush()
    replay = ReplaySource(HistoryStore(srv.db, read_only=True), run_id=srv.source.run_id)
    assert replay.rules() == []
    kinds = [e["kind"] for e in replay.events(None) if e["kind"].startswith("rule_")]
    changes = [k for k in kinds if k != "rule_fired"]  # (r1 may fire between the changes)
    assert changes == ["rule_added", "rule_added", "rule_updated", "rule_removed"] and "rule_fired" in kinds
