"""Every HTTP route against a real server: results, errors (never a 500), strict JSON."""

from __future__ import annotations

import json

import pytest

from tests.live import recv_until
from tests.support import wait_until


def strict(text: str):
    """Parse JSON that must not hold NaN/Infinity literals."""

    def bad(name):
        raise AssertionError(f"non-strict JSON literal {name}")

    return json.loads(text, parse_constant=bad)


def test_health_session_targets_runs(live):
    srv = live()
    srv.wait_step(2)
    c = srv.http()
    assert c.get("/api/health").json() == {"status": "ok"}
    session = strict(c.get("/api/session").text)
    assert session["params"][0] == {
        **session["params"][0],
        "name": "0.weight",
        "shape": [10, 10],
        "numel": 100,
    }
    assert session["modules"][0] == ""
    assert session["hook_kinds"]["clip_value"]["points"][0] == "pre_step"
    assert session["training"]["state"] == "running" and session["training"]["steps_per_second"] == 50
    assert session["run_id"] == 1 and session["read_only"] is False
    assert c.get("/api/targets", params={"glob": "0.*"}).json() == {"matches": ["0.weight", "0.bias"]}
    assert c.get("/api/targets", params={"glob": "*", "point": "module"}).json()["matches"][:2] == ["", "0"]
    r = c.get("/api/targets", params={"glob": "*", "point": "sideways"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["point"]
    runs = c.get("/api/runs").json()["runs"]
    assert runs == [{**runs[0], "id": 1, "scenario": "mlp", "params": 4, "live": True}]


def test_hook_crud_export_import(live):
    srv = live()
    c = srv.http()
    r = c.post("/api/hooks", json={"kind": "clip_value", "target": "0.*", "params": {"threshold": 0.5}})
    assert r.status_code == 201, r.text
    hook = r.json()
    assert (
        hook["kind"] == "clip_value" and hook["params"] == {"threshold": 0.5} and hook["point"] == "pre_step"
    )
    hid = hook["id"]
    wait_until(lambda: c.get("/api/hooks").json()[0]["applied_step"] is not None, what="applied")
    r = c.patch(
        f"/api/hooks/{hid}",
        json={
            "params": {"threshold": 0.25},
        },
    )
    assert r.status_code == 200 and r.json()["params"] == {"threshold": 0.25}
    assert c.patch(f"/api/hooks/{hid}", json={"enabled": False}).json()["enabled"] is False

    preset = c.get("/api/hooks/export").json()
    assert preset["hooks"] == [
        {
            "kind": "clip_value",
            "target": "0.*",
            "point": "pre_step",
            "params": {"threshold": 0.25},
            "enabled": False,
        }
    ]
    code = c.get("/api/hooks/export", params={"format": "python"})
    assert code.headers["content-type"].startswith("text/x-python")
    assert (
        "insp.add_hook('clip_value', target='0.*', point='pre_step', enabled=False, threshold=0.25)"
        in code.text
    )

    # the Python export recreates the same hooks on a fresh inspector
    import inspector
    from inspector import scenarios

    sc = scenarios.make("mlp")
    with inspector.attach(sc.model, sc.optimizer) as insp:
        exec(compile(code.text, "export.py", "exec"), {"insp": insp})
        assert insp.export_hooks()["hooks"] == preset["hooks"]

    # (two edits pending at one boundary may be applied as one change: wait for the last one)
    wait_until(lambda: any(e.get("action") == "disable" for e in srv.insp.events()), what="disable applied")
    before = srv.insp.config_version
    r = c.post(
        "/api/hooks/import",
        json={
            **preset,
            "hooks": [
                {"kind": "scale", "target": "2.*", "params": {"factor": 0.5}},
                {"kind": "nan_guard", "target": "*"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert [h["kind"] for h in r.json()] == ["scale", "nan_guard"]
    wait_until(lambda: srv.insp.config_version == before + 1, what="one change for the whole import")
    for h in c.get("/api/hooks").json():
        assert c.delete(f"/api/hooks/{h['id']}").status_code == 204
    assert c.get("/api/hooks").json() == []
    for gone in (c.delete(f"/api/hooks/{hid}"), c.patch(f"/api/hooks/{hid}", json={"enabled": True})):
        assert gone.status_code == 404 and gone.json() == {"detail": f"no hook with id {hid!r}"}


BAD_POSTS = [
    ({"kind": "nope"}, ["kind"]),
    ({"kind": "clip_value", "params": {"threshold": -1}}, ["params", "threshold"]),
    ({"kind": "clip_value", "params": {}}, ["params", "threshold"]),
    ({"kind": "scale", "params": {"factor": True}}, ["params", "factor"]),
    ({"kind": "clip_value", "target": "nothing.*", "params": {"threshold": 1}}, ["target"]),
    ({"kind": "clip_value", "target": "x" * 300, "params": {"threshold": 1}}, ["target"]),
    ({"kind": "clip_value", "params": {"threshold": 1}, "colour": "red"}, ["colour"]),
    ({"kind": "clip_value", "params": {"threshold": 1}, "enabled": "yes"}, ["enabled"]),
    ({"kind": "clip_value", "params": {"threshold": 1}, "point": "module"}, ["point"]),
    ({"kind": "clip_value", "params": {"threshold": 1, "enabled": 1}}, ["params", "enabled"]),
    ({"kind": 3}, ["kind"]),
    ({}, ["kind"]),
    ([], ["body"]),
]


def test_invalid_hook_bodies_are_422_naming_the_field(live):
    srv = live()
    c = srv.http()
    version = srv.insp.config_version
    for body, loc in BAD_POSTS:
        r = c.post("/api/hooks", json=body)
        assert r.status_code == 422, (body, r.text)
        detail = strict(r.text)["detail"]
        assert detail[0]["loc"][: len(loc)] == loc and detail[0]["msg"], (body, detail)
        assert set(detail[0]) == {"loc", "msg"}
    assert srv.insp.config_version == version and srv.insp.hooks() == []


def test_more_invalid_inputs_and_step_keeps_going(live):
    srv = live()
    c = srv.http()
    start = srv.wait_step(2)
    version = srv.insp.config_version
    json_headers = {"content-type": "application/json"}
    cases = [
        c.post("/api/hooks", content=b'{"kind": "scale", "params": {"factor": NaN}}', headers=json_headers),
        c.post(
            "/api/hooks", content=b'{"kind": "scale", "params": {"factor": Infinity}}', headers=json_headers
        ),
        c.post("/api/hooks", content=b"{broken", headers=json_headers),
        c.post("/api/hooks", content=b"[" * 5000 + b"]" * 5000, headers=json_headers),
        c.post("/api/hooks", content=b"\xff\xfe", headers=json_headers),
        c.post("/api/hooks", headers=json_headers),
        c.patch("/api/hooks/h1", json={"params": {"threshold": 1}}),
        c.patch("/api/hooks/h1", json={"sideways": 1}),
        c.post("/api/training/rate", json={"steps_per_second": -1}),
        c.post("/api/training/rate", json={"steps_per_second": "fast"}),
        c.post("/api/training/rate", json={}),
        c.post("/api/training/sideways"),
        c.get("/api/snapshots", params={"limit": 0}),
        c.get("/api/snapshots", params={"since": "yesterday"}),
        c.get("/api/snapshots", params={"run": 99}),
        c.get("/api/events", params={"run": -3}),
        c.get("/api/session", params={"run": 42}),
        c.post(
            "/api/hooks/import",
            json={"format": "gradient-inspector/hooks", "version": 1, "hooks": [{"kind": "nope"}]},
        ),
        c.post("/api/hooks/import", json="a string"),
        c.get("/api/hooks/export", params={"format": "yaml"}),
        c.get("/api/nothing-here"),
        c.put("/api/hooks"),
    ]
    expected = [
        422,
        422,
        422,
        422,
        422,
        422,
        404,
        422,
        422,
        422,
        422,
        422,
        422,
        422,
        404,
        422,
        404,
        422,
        422,
        422,
        404,
        405,
    ]
    assert [r.status_code for r in cases] == expected, [(r.status_code, r.text[:100]) for r in cases]
    for r in cases:
        detail = strict(r.text)["detail"]
        assert detail
        if r.status_code == 422:
            assert detail[0]["loc"] and detail[0]["msg"]
    assert strict(cases[0].text)["detail"][0]["loc"] == ["params", "factor"]
    assert strict(cases[2].text)["detail"][0]["loc"] == ["body"]
    srv.wait_step(start + 5)
    assert srv.insp.config_version == version


def test_training_control_and_rate(live):
    srv = live(rate=20.0)
    c = srv.http()
    srv.wait_step(1)
    r = c.post("/api/training/pause")
    assert r.status_code == 202 and r.json()["state"] == "paused"
    held = wait_until(lambda: srv.insp.state["held"] and srv.insp.step, what="the pause to take hold")
    assert c.get("/api/session").json()["training"]["step"] == held
    assert c.post("/api/training/step").status_code == 202
    wait_until(lambda: srv.insp.state["held"] and srv.insp.step == held + 1, what="exactly one step")
    assert srv.insp.step == held + 1
    assert c.post("/api/training/resume").json()["state"] == "running"
    r = c.post("/api/training/rate", json={"steps_per_second": 200})
    assert r.json() == {"steps_per_second": 200}
    assert c.get("/api/session").json()["training"]["steps_per_second"] == 200
    assert c.post("/api/training/rate", json={"steps_per_second": None}).json() == {"steps_per_second": None}


def test_snapshots_since_limit_points_and_late_loss(live):
    srv = live(rate=100.0)
    c = srv.http()
    srv.wait_step(40)
    page = strict(c.get("/api/snapshots").text)
    assert page["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    steps = [s["step"] for s in page["snapshots"]]
    assert steps == list(range(1, steps[-1] + 1)), "every=1: a snapshot per step, oldest first"
    assert all(s["loss"] is not None for s in page["snapshots"][:-2]), "late losses are merged"
    since = [s["step"] for s in c.get("/api/snapshots", params={"since": 30}).json()["snapshots"]]
    assert since[0] == 31
    newest = [s["step"] for s in c.get("/api/snapshots", params={"limit": 5}).json()["snapshots"]]
    assert len(newest) == 5 and newest == sorted(newest) and newest[0] >= steps[-1] - 4
    spread = [
        s["step"] for s in c.get("/api/snapshots", params={"points": 4, "since": 0}).json()["snapshots"]
    ]
    assert len(spread) == 4 and spread[0] == 1 and spread == sorted(spread)
    scalars = c.get("/api/scalars", params={"limit": 3}).json()["scalars"]
    assert len(scalars) == 3 and all(isinstance(s["loss"], float) for s in scalars)
    # the database part and the in-memory part join without a gap once the writer caught up
    srv.source.store.flush()
    steps = [s["step"] for s in c.get("/api/snapshots", params={"since": 0}).json()["snapshots"]]
    assert steps == list(range(1, steps[-1] + 1))


def test_events_since(live):
    srv = live()
    c = srv.http()
    srv.insp.add_event("history_paused", reason="test")
    srv.insp.add_event("history_resumed", reason="test")
    wait_until(lambda: len(c.get("/api/events").json()["events"]) >= 2, what="events")
    events = c.get("/api/events").json()["events"]
    assert [e["kind"] for e in events][-2:] == ["history_paused", "history_resumed"]
    later = c.get("/api/events", params={"since": events[-2]["seq"]}).json()["events"]
    assert [e["seq"] for e in later] == [events[-1]["seq"]]


def test_without_a_database(live):
    srv = live(db=False)
    c = srv.http()
    srv.wait_step(3)
    assert c.get("/api/runs").json()["runs"][0]["live"] is True
    # the step counter moves at the boundary, before that step's snapshot is built and published
    wait_until(lambda: len(c.get("/api/snapshots").json()["snapshots"]) >= 3, what="three snapshots")
    assert c.get("/api/session").json()["history"]["db"] is None


def test_pages_docs_and_vendor_assets_are_served_locally(live):
    srv = live()
    c = srv.http()
    docs = c.get("/docs")
    assert docs.status_code == 200
    assert "cdn" not in docs.text.lower() and "https://" not in docs.text
    for path in ("/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css", "/vendor/plotly.min.js"):
        r = c.get(path)
        assert r.status_code == 200 and len(r.content) > 10_000, path
    schema = c.get("/openapi.json").json()
    for path in (
        "/api/hooks",
        "/api/hooks/{hook_id}",
        "/api/snapshots",
        "/api/training/{action}",
        "/api/runs",
    ):
        assert path in schema["paths"]
    assert c.get("/docs-assets/..%2Fswagger-ui-5.35.0%2FLICENSE").status_code == 404
    assert c.get("/static/../server/app.py").status_code == 404
    index = c.get("/")
    assert index.status_code in (200, 404)
    if index.status_code == 200:
        assert "<html" in index.text.lower()


def test_no_cors_headers(live):
    srv = live()
    c = srv.http()
    r = c.options(
        "/api/hooks", headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
    )
    assert not any(k.lower().startswith("access-control-") for k in r.headers)
    r = c.get("/api/session", headers={"origin": "http://evil.example"})
    assert not any(k.lower().startswith("access-control-") for k in r.headers)
    assert r.headers["x-frame-options"] == "DENY"


@pytest.mark.slow
def test_no_route_answers_500_to_odd_requests(live):
    srv = live(commands_per_second=10_000)
    c = srv.http()
    paths = [
        p.replace("{hook_id}", "h1").replace("{action}", "pause")
        for p in c.get("/openapi.json").json()["paths"]
    ]
    bodies = [
        None,
        {},
        [],
        "text",
        {"hooks": "x"},
        {"hooks": [1, {"kind": None}]},
        [{"kind": ["a"]}],
        {"format": 1, "version": "x", "hooks": [{"kind": "freeze", "params": []}]},
    ]
    statuses = set()
    for path in paths:
        for method in ("GET", "POST", "PATCH", "DELETE", "PUT"):
            for body in bodies:
                r = c.request(method, path, json=body) if body is not None else c.request(method, path)
                assert r.status_code < 500, (method, path, body, r.status_code, r.text)
                strict(r.text or "null")
                statuses.add(r.status_code)
    assert {200, 404, 405, 422} <= statuses
    assert srv.http().get("/api/health").status_code == 200


def test_earlier_runs_can_be_listed_and_opened(live, tmp_path):
    from server.history.storage import HistoryStore

    db = tmp_path / "shared.sqlite"
    old = HistoryStore(db)
    old.start_writer()
    run = old.new_run(
        params=[{"name": "w", "shape": [1], "numel": 1, "module": ""}],
        modules=[""],
        scenario="nan",
        meta={"mode": "demo"},
    )
    old.add_snapshot(
        run, {"step": 1, "time": 1.0, "config_version": 0, "loss": 2.0, "grad_norm": [1.0], "events": []}
    )
    old.add_hooks(run, 1, [{"id": "h1", "kind": "freeze", "target": "*"}])
    old.close()
    srv = live(db=db)
    c = srv.http()
    runs = c.get("/api/runs").json()["runs"]
    assert [(r["id"], r["scenario"], r["live"]) for r in runs] == [(2, "mlp", True), (1, "nan", False)]
    session = c.get("/api/session", params={"run": 1}).json()
    assert session["live"] is False and session["run_id"] == 1 and session["training"]["state"] == "finished"
    assert [p["name"] for p in session["params"]] == ["w"] and session["hooks"][0]["id"] == "h1"
    page = c.get("/api/snapshots", params={"run": 1}).json()
    assert (
        page == {"params": ["w"], "snapshots": [page["snapshots"][0]]} and page["snapshots"][0]["step"] == 1
    )
    assert c.get("/api/session").json()["run_id"] == 2


def test_training_state_changes_are_pushed_to_every_socket(live):
    """Pause, single step, resume and rate from HTTP reach a websocket client as `training` messages."""
    srv = live(rate=20.0)
    c = srv.http()
    with srv.ws() as ws:
        recv_until(ws, lambda m: m["type"] == "hello")
        assert c.post("/api/training/pause").status_code == 202
        msg = recv_until(ws, lambda m: m["type"] == "training" and m["held"])
        assert msg["state"] == "paused" and msg["step"] == srv.insp.step
        assert c.post("/api/training/step").status_code == 202
        recv_until(ws, lambda m: m["type"] == "training" and m["held"] and m["step"] == msg["step"] + 1)
        assert c.post("/api/training/resume").status_code == 202
        recv_until(ws, lambda m: m["type"] == "training" and m["state"] == "running")
        assert c.post("/api/training/rate", json={"steps_per_second": 5}).status_code == 200
        pushed = recv_until(ws, lambda m: m["type"] == "training" and "steps_per_second" in m)
        assert pushed["steps_per_second"] == 5


def test_removing_a_hook_leaves_the_since_step_of_another_on_the_page(live):
    """The page's "since step N" is a hook's `applied_step`: the first step its own configuration
    acted on. Removing another hook before it (its position shifts) leaves it as it was."""
    srv = live(rate=20.0)
    c = srv.http()
    srv.wait_step(1)
    assert c.post("/api/training/pause").status_code == 202
    held = wait_until(lambda: srv.insp.state["held"] and srv.insp.step, what="the pause to take hold")
    clip = c.post("/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}})
    scale = c.post("/api/hooks", json={"kind": "scale", "target": "*", "params": {"factor": 0.5}})
    assert clip.status_code == 201 and scale.status_code == 201, (clip.text, scale.text)
    sid = scale.json()["id"]

    def one_step() -> None:
        n = srv.insp.step
        assert c.post("/api/training/step").status_code == 202
        wait_until(lambda: srv.insp.state["held"] and srv.insp.step == n + 1, what="one step")

    def since() -> dict:
        return {h["id"]: h["applied_step"] for h in c.get("/api/hooks").json()}

    one_step()
    assert c.patch(f"/api/hooks/{sid}", json={"params": {"factor": 0.25}}).status_code == 200
    wait_until(lambda: since()[sid] is not None, what="the update applied")
    updated = since()[sid]
    assert updated == held + 2
    one_step()
    with srv.ws() as ws:
        hello = recv_until(ws, lambda m: m["type"] == "hello")
        version = hello["session"]["config_version"]
        assert c.delete(f"/api/hooks/{clip.json()['id']}").status_code == 204
        msg = recv_until(ws, lambda m: m["type"] == "hooks" and m["config_version"] > version)
    assert [(h["id"], h["applied_step"]) for h in msg["hooks"]] == [(sid, updated)]
    one_step()
    assert since() == {sid: updated}
    assert c.post("/api/training/resume").status_code == 202
