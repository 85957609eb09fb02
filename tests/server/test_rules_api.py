"""Rules over HTTP: GET/POST /api/rules, PATCH/DELETE /api/rules/{id} (a bad field is a 422 naming it
and changes nothing; an unknown id a 404), a preset by name, a firing stored in the history and
served by GET /api/events, and a replay that refuses commands."""

from __future__ import annotations

import httpx
import pytest

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


def _kept(rules: list[dict]) -> list[dict]:
    """The rules as a change would alter them: definitions and counts (not the evaluation state,
    which moves every step)."""
    moving = ("last_step", "last_value", "waiting", "streak")
    return [{**r, "state": {k: v for k, v in r["state"].items() if k not in moving}} for r in rules]


def _deep(depth: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return root


def test_a_bad_rule_body_is_a_422_with_its_reason_and_changes_nothing(live):
    """A body that once made a 500 (a PATCH key named like an argument, a 400-digit threshold,
    args nested hundreds deep, non-finite numbers in args) is a 422 naming the field, on POST and
    on PATCH; the rules stay as they were and no rule event is filed."""
    import json

    srv = live(rate=None)
    srv.wait_step(1)
    c = srv.http()
    good = {"signal": "step", "op": "<", "threshold": 0, "action": "alert"}
    assert c.post("/api/rules", json=good).status_code == 201
    before = c.get("/api/rules").json()["rules"]
    seq = max((e["seq"] for e in srv.insp.events()), default=0)

    def send(method: str, path: str, body: dict | str) -> httpx.Response:
        text = body if isinstance(body, str) else json.dumps(body)
        # (a fresh connection each: a server that drops one must not hide the next answer)
        return srv.http().request(method, path, content=text, headers={"content-type": "application/json"})

    huge = "1" + "0" * 400  # a 401-digit integer: past the float range
    rule = '{"signal": "loss", "op": ">", "action": "alert", '  # + the fields under test + "}"
    cases: list[tuple[str, dict | str, str]] = [
        ("PATCH", {"rule_id": "r1"}, "rule_id"),
        ("PATCH", {"self": 1}, "self"),
        ("PATCH", {"fn": 1}, "fn"),
        ("PATCH", {"change": {}}, "change"),
        ("POST", rule + '"threshold": ' + huge + "}", "threshold"),
        ("PATCH", '{"threshold": ' + huge + "}", "threshold"),
        ("POST", rule + '"threshold": -' + huge + "}", "threshold"),
        ("POST", rule + '"threshold": 1e400}', "threshold"),
        ("POST", rule + '"threshold": NaN}', "threshold"),
        ("POST", rule + '"threshold": 1, "for_steps": ' + huge + "}", "for_steps"),
        ("POST", rule + '"threshold": 1, "args": {"a": ' + huge + "}}", "args"),
        ("PATCH", '{"args": {"a": [1, ' + huge + "]}}", "args"),
        ("POST", rule + '"threshold": 1, "args": {"a": NaN}}', "args"),
        ("PATCH", '{"args": {"a": Infinity}}', "args"),
        ("POST", rule + '"threshold": 1, "args": {"a": 1e999}}', "args"),
        ("PATCH", '{"name": NaN}', "name"),
    ]
    for depth in (20, 600, 900):
        cases.append(("POST", {**good, "args": _deep(depth)}, "args"))
        cases.append(("PATCH", {"args": _deep(depth)}, "args"))
    cases.append(("POST", {**good, "args": {"a": list(range(5000))}}, "args"))
    for method, body, loc in cases:
        r = send(method, "/api/rules" if method == "POST" else "/api/rules/r1", body)
        shown = str(body)[:80]
        assert r.status_code == 422, (method, shown, r.status_code, r.text[:300])
        detail = r.json()["detail"]
        assert loc in detail[0]["loc"] and detail[0]["msg"], (method, shown, detail)
        assert _kept(c.get("/api/rules").json()["rules"]) == _kept(before), ("nothing changed", method, shown)
    assert not [e for e in srv.insp.events(seq) if e["kind"].startswith("rule_")]


def test_the_agents_bad_rules_are_refused_as_the_apis_are(live):
    """The agent's rule tools share the rules' validation: the same bodies are tool errors
    saying 422 and the reason, and nothing is stored."""
    pytest.importorskip("mcp", reason="the agent extra: pip install gradient-inspector[agent]")
    from tests.server.test_mcp import agent, text

    srv = live(rate=None)
    srv.wait_step(1)
    c = srv.http()
    assert (
        c.post(
            "/api/rules", json={"signal": "step", "op": "<", "threshold": 0, "action": "alert"}
        ).status_code
        == 201
    )
    before = c.get("/api/rules").json()["rules"]
    rule = {"signal": "loss", "op": ">", "action": "alert"}
    calls = [
        ("update_rule", {"rule_id": "r1", "change": {"rule_id": "r2"}}),
        ("update_rule", {"rule_id": "r1", "change": {"fn": 1}}),
        ("update_rule", {"rule_id": "r1", "change": {"threshold": 10**400}}),
        ("add_rule", {"rule": {**rule, "threshold": 10**400}}),
        ("add_rule", {"rule": {**rule, "threshold": 1, "args": _deep(100)}}),
        ("update_rule", {"rule_id": "r1", "change": {"args": _deep(100)}}),
    ]
    out = agent(srv.base, calls)
    for (tool, args), result in zip(calls, out["results"], strict=True):
        said = text(result)
        assert result.is_error and "422" in said and "internal" not in said, (
            tool,
            str(args)[:80],
            said[:300],
        )
    assert _kept(c.get("/api/rules").json()["rules"]) == _kept(before)
