"""What-if over HTTP: the demo's shadow at a hook change, checkpoints and rewind in a
user's loop with both branches in the history, and the routes' refusals."""

from __future__ import annotations

import copy
import math
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from torch import nn

import inspector
from inspector.scenarios import make
from tests.support import wait_until
from tests.unit.test_whatif import Loop, same_tensors


def reference_losses(name: str, steps: int) -> list[float]:
    """The scenario on its own, no inspector, no hooks: the loss of steps 1..steps."""
    sc = make(name, seed=0)
    return [float(sc.step()) for _ in range(steps)]


def same_value(wire, ref: float) -> bool:
    if isinstance(wire, str):  # "nan", "inf"
        return math.isnan(ref) if wire == "nan" else math.isinf(ref)
    return wire == ref  # bitwise: a float32 loss read as a Python float


def test_a_shadow_at_a_clip_norm_change_is_the_run_without_it(live):
    srv = live("exploding", rate=50)
    c = srv.http()
    srv.wait_step(20)
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    branch = srv.insp.step
    assert branch < 40, "the clip comes before the explosion (the scenario's hint: before step ~40)"
    srv.trainer.set_rate(None)
    r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})
    assert r.status_code == 201, r.text
    cps = c.get("/api/checkpoints").json()
    auto = cps["checkpoints"][-1]
    assert auto["auto"] and auto["step"] == branch and auto["label"] == "before add clip_norm"
    assert auto["hooks"] == [] and cps["bytes"] == auto["bytes"] > 0
    srv.insp.resume()
    wait_until(lambda: c.get("/api/shadow").json()["active"], what="the shadow to start")
    state = c.get("/api/shadow").json()
    assert state["branch_step"] == branch and state["label"] == "shadow: without clip_norm h1"
    assert "second training step" in state["cost"]
    wait_until(lambda: not c.get("/api/shadow").json()["active"], timeout=120, what="the shadow to give up")
    state = c.get("/api/shadow").json()
    assert "non-finite for 30 steps" in state["ended"]
    points = state["points"]
    n = points[-1]["step"]
    ref = reference_losses("exploding", n)
    assert [p["step"] for p in points] == list(range(branch + 1, n + 1))
    diffs = [p["step"] for p in points if not same_value(p["loss"], ref[p["step"] - 1])]
    shown = [(s, points[s - branch - 1]["loss"], ref[s - 1]) for s in diffs[:5]]
    assert diffs == [], (
        f"shadow losses differ from the run without the hook (step, shadow, reference): {shown}"
    )
    assert any(isinstance(p["loss"], str) for p in points), "without the clip it diverges"
    # ... while the main run trains, its final norm held at 1.0
    srv.wait_step(n + 5)
    main = c.get("/api/snapshots", params={"since": branch, "limit": 5000}).json()["snapshots"]
    assert all(isinstance(s["loss"], float) or s["loss"] is None for s in main)
    assert max(s["total_norm"] for s in main) <= 1.0 + 1e-5
    assert all(math.isfinite(s["loss"]) for s in main[-20:] if s["loss"] is not None)
    # both branches in the history: the shadow is a branch run of the live one
    runs = c.get("/api/runs").json()["runs"]
    assert len(runs) == 1
    (shadow,) = runs[0]["branches"]
    assert shadow["id"] == state["run"] and shadow["branch"] == "shadow" and shadow["branch_step"] == branch
    assert shadow["label"] == "shadow: without clip_norm h1" and shadow["parent_run"] == runs[0]["id"]
    wait_until(
        lambda: len(c.get("/api/scalars", params={"run": shadow["id"]}).json()["scalars"]) == n - branch,
        what="the shadow's losses in the history",
    )
    stored = c.get("/api/scalars", params={"run": shadow["id"]}).json()["scalars"]
    assert all(same_value(r["loss"], ref[r["step"] - 1]) for r in stored)
    session = c.get("/api/session", params={"run": shadow["id"]}).json()
    assert session["branch"]["branch"] == "shadow" and session["hooks"] == []
    assert c.get("/api/session").json()["branches"][0]["id"] == shadow["id"]


def test_compare_from_here_and_its_refusals(live):
    srv = live("mlp", rate=None)
    c = srv.http()
    srv.wait_step(5)
    assert c.delete("/api/shadow").status_code == 409
    r = c.post("/api/shadow")
    assert r.status_code == 202, r.text
    assert c.post("/api/shadow").json()["detail"].startswith("a comparison is running")

    def stepped() -> bool:
        st = c.get("/api/shadow").json()
        return st["active"] and st["step"] > st["branch_step"]

    wait_until(stepped, what="the shadow to step")
    assert c.get("/api/shadow").json()["label"] == "shadow: same hooks"
    c.post("/api/hooks", json={"kind": "noise", "target": "*", "params": {"std": 3.0}})
    wait_until(lambda: c.get("/api/shadow").json()["label"].startswith("shadow: without noise"))
    assert c.delete("/api/shadow").status_code == 204
    wait_until(lambda: not c.get("/api/shadow").json()["active"], what="the shadow to end")
    assert c.post("/api/checkpoints/c999/rewind").status_code == 404
    assert c.post("/api/checkpoints/" + "x" * 65 + "/rewind").status_code == 422
    assert c.post("/api/checkpoints", json={"label": 3}).status_code == 422
    assert c.post("/api/checkpoints", json={"nope": 1}).status_code == 422
    r = c.post("/api/checkpoints", json={"label": "<b>mine</b>"})
    assert r.status_code == 202 and r.json()["label"] == "<b>mine</b>"


def test_rewind_in_a_users_loop_keeps_both_branches_in_the_history(tmp_path):
    loop = Loop()
    insp = loop.insp
    url = insp.serve(port=0, db=str(tmp_path / "user.sqlite"))
    c = httpx.Client(base_url=f"http://127.0.0.1:{urlsplit(url).port}", trust_env=False, timeout=30)
    try:
        loop.run(range(10))
        r = c.post("/api/checkpoints", json={"label": "before noise"})  # taken at the next boundary
        assert r.status_code == 202 and r.json()["taken"] is False
        cp = r.json()["id"]
        loop.step(10)
        assert c.get("/api/checkpoints").json()["checkpoints"][0]["step"] == 11
        ref_model, ref_opt = copy.deepcopy(loop.model.state_dict()), copy.deepcopy(loop.opt.state_dict())
        ref_hooks = loop.config()
        # a change from the page: accepted at once, it waits for its automatic checkpoint (the
        # loop's next boundary) and applies right after it
        r = c.post("/api/hooks", json={"kind": "noise", "target": "*", "params": {"std": 1.0}})
        assert r.status_code == 201 and r.json()["applied_step"] is None and insp.checkpoints.holds_changes
        loop.step(11)
        assert c.get("/api/hooks").json()[0]["applied_step"] == 13
        assert c.get("/api/checkpoints").json()["checkpoints"][-1]["step"] == 12
        loop.run(range(12, 20))
        assert insp.step == 20
        first = dict(loop.losses)
        r = c.post(f"/api/checkpoints/{cp}/rewind")
        assert r.status_code == 202 and r.json() == {"checkpoint": cp, "step": 11, "done": False}
        loop.step(20)  # step 21 runs; the training thread rewinds at its boundary
        assert insp.step == 11
        assert same_tensors(loop.model.state_dict(), ref_model) and same_tensors(
            loop.opt.state_dict(), ref_opt
        )
        assert loop.config() == ref_hooks
        loop.run(range(30, 35))  # the loader goes on: other batches
        assert insp.step == 16
        insp.finish()
        wait_until(lambda: len(c.get("/api/scalars").json()["scalars"]) == 16, what="the new branch's losses")
        runs = c.get("/api/runs").json()["runs"]
        (run,) = runs
        (abandoned,) = run["branches"]
        assert abandoned["branch"] == "abandoned" and abandoned["branch_step"] == 11
        assert abandoned["steps"] == 21 and "rewound to " + cp in abandoned["label"]
        main = c.get("/api/snapshots", params={"run": run["id"]}).json()["snapshots"]
        assert [s["step"] for s in main] == list(range(1, 17))
        old = c.get("/api/snapshots", params={"run": abandoned["id"]}).json()["snapshots"]
        assert [s["step"] for s in old] == list(range(12, 22))
        old_losses = {
            r["step"]: r["loss"]
            for r in c.get("/api/scalars", params={"run": abandoned["id"]}).json()["scalars"]
        }
        new_losses = {
            r["step"]: r["loss"] for r in c.get("/api/scalars", params={"run": run["id"]}).json()["scalars"]
        }
        assert set(old_losses) == set(range(12, 21)), (
            "step 21's loss came after its boundary's rewind: dropped"
        )
        assert set(new_losses) == set(range(1, 17))
        assert all(old_losses[s] == first[s] for s in old_losses), "the abandoned branch's own losses"
        events = c.get("/api/events", params={"run": run["id"]}).json()["events"]
        old_events = c.get("/api/events", params={"run": abandoned["id"]}).json()["events"]
        assert [e["kind"] for e in events if e["kind"] in ("rewind", "checkpoint")] == [
            "checkpoint",
            "rewind",
        ]
        assert [e["action"] for e in events if e["kind"] == "hook_applied"] == ["rewind"]
        assert any(e["kind"] == "hook_applied" and e["action"] == "add" for e in old_events)
        assert any(e["kind"] == "checkpoint" and e["label"] == "before add noise" for e in old_events)
        old_session = c.get("/api/session", params={"run": abandoned["id"]}).json()
        assert [h["kind"] for h in old_session["hooks"]] == ["noise"] and old_session["branch"][
            "parent_run"
        ] == run["id"]
    finally:
        c.close()
        insp.close()


def test_old_databases_get_the_branch_columns(tmp_path):
    import sqlite3

    from server.history.storage import HistoryStore

    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT NULL, scenario TEXT,"
        " params TEXT NOT NULL, modules TEXT NOT NULL, meta TEXT NOT NULL DEFAULT '{}',"
        " last_step INTEGER NOT NULL DEFAULT 0, updated REAL);"
        "INSERT INTO runs (started, scenario, params, modules) VALUES (1.0, 'mlp', '[]', '[]');"
    )
    conn.commit()
    conn.close()
    ro = HistoryStore(path, read_only=True)
    assert ro.runs() == [
        {"id": 1, "started": 1.0, "scenario": "mlp", "steps": 0, "params": 0, "live": False, "branches": []}
    ]
    assert ro.run(1)["parent_run"] is None and ro.branches_of(1) == []
    ro.close()
    rw = HistoryStore(path)
    child = rw.new_run(params=[], modules=[], parent_run=1, branch_step=3, branch="shadow", label="x")
    assert rw.runs()[0]["branches"][0]["id"] == child and rw.run(child)["branch_step"] == 3
    rw.close()


def test_user_mode_refuses_a_shadow_with_the_reason():
    model = nn.Linear(2, 1)
    insp = inspector.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    url = insp.serve(port=0, db=False)
    try:
        c = httpx.Client(base_url=url.rstrip("/"), trust_env=False, timeout=10)
        r = c.post("/api/shadow")
        assert r.status_code == 409 and "inspector.compare" in r.json()["detail"]
        assert c.get("/api/shadow").json()["active"] is False
        c.close()
    finally:
        insp.close()


def test_the_html_report_draws_a_runs_branches(tmp_path):
    from server.history.report import collect
    from server.history.storage import HistoryStore

    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.ones(4, 3) * i, torch.zeros(4, 1)) for i in range(6)]

    def step(batch):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss

    clip = [{"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.1}}]
    cmp = inspector.compare(model, opt, step, batches, hooks_b=clip)
    run_a, run_b = cmp.save(tmp_path / "cmp.sqlite")
    store = HistoryStore(tmp_path / "cmp.sqlite", read_only=True)
    try:
        data = collect(store, run_a)
        (b,) = data["branches"]
        assert b["id"] == run_b and b["branch"] == "shadow" and b["label"] == "B: clip_norm on '*'"
        assert b["loss"]["values"] == cmp.b.losses and b["steps"] == list(range(1, 7))
        assert max(b["total_norm"]) <= 0.1 * (1 + 1e-5) < max(data["total_norm"])
    finally:
        store.close()


def test_a_comparisons_warning_is_an_event_of_both_saved_runs(tmp_path):
    """compare() with a warm-up scheduler step_fn steps but was not given: the saved runs' event
    logs (what the page lists) say why branch B is off, naming schedulers=."""
    from server.history.storage import HistoryStore

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 4))
    batches = [(torch.ones(4, 3) * i, torch.zeros(4, 1)) for i in range(6)]

    def step(batch):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        sched.step()
        return loss

    with pytest.warns(inspector.CompareWarning, match="schedulers="):
        cmp = inspector.compare(model, opt, step, batches, hooks_b=[])
    run_a, run_b = cmp.save(tmp_path / "cmp.sqlite")
    store = HistoryStore(tmp_path / "cmp.sqlite", read_only=True)
    try:
        for run in (run_a, run_b):
            (ev,) = [e for e in store.events(run) if e["kind"] == "compare_warning"]
            assert ev["step"] == 2 and "schedulers=" in ev["message"]
    finally:
        store.close()


def test_get_checkpoints_lists_the_automatic_ones_as_the_core_does():
    loop = Loop(checkpoint_every=5, checkpoints=3, checkpoint_memory="64MiB")
    insp = loop.insp
    url = insp.serve(port=0, db=False)
    c = httpx.Client(base_url=f"http://127.0.0.1:{urlsplit(url).port}", trust_env=False, timeout=30)
    try:
        loop.run(range(40))
        body = c.get("/api/checkpoints").json()
        assert body["checkpoints"] == insp.checkpoints.list()
        assert [(cp["step"], cp["origin"]) for cp in body["checkpoints"]] == [
            (30, "auto"),
            (35, "auto"),
            (40, "auto"),
        ]
        assert all(cp["bytes"] > 0 and cp["time"] > 0 and cp["took"] >= 0 for cp in body["checkpoints"])
        assert body["every"] == 5 and body["budget"] == 64 * 2**20 and body["auto_refused"] is None
        assert body["bytes"] == sum(cp["bytes"] for cp in body["checkpoints"])
        r = c.post("/api/checkpoints", json={"label": "from the page"})  # taken at the next boundary
        assert r.status_code == 202 and r.json()["origin"] == "page"
        loop.step(40)
        assert c.get("/api/checkpoints").json()["checkpoints"][-1]["origin"] == "page"
    finally:
        c.close()
        insp.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is .*single process:UserWarning")
def test_the_rewind_route_takes_a_checkpoint_id_never_a_directory(tmp_path, monkeypatch):
    """``insp.rewind`` also takes a DCP directory; the route never does (a client on the network
    would make the training process unpickle files it names): 404, nothing changed."""
    import json

    import torch.distributed.checkpoint as dcp

    loop = Loop()
    insp = loop.insp
    url = insp.serve(port=0, db=str(tmp_path / "user.sqlite"))
    c = httpx.Client(base_url=f"http://127.0.0.1:{urlsplit(url).port}", trust_env=False, timeout=30)
    try:
        loop.run(range(5))
        monkeypatch.chdir(tmp_path)
        dcp.save({"model": loop.model.state_dict(), "optimizer": loop.opt.state_dict()}, checkpoint_id="own")
        (tmp_path / "own" / "inspector.json").write_text(json.dumps({"step": 5}))
        loop.run(range(5, 10))
        before = copy.deepcopy(loop.model.state_dict())
        r = c.post("/api/checkpoints/own/rewind")
        assert r.status_code == 404 and "no checkpoint 'own'" in r.json()["detail"]
        loop.step(10)  # a boundary: nothing was queued
        assert insp.step == 11 and not any(e["kind"] == "rewind" for e in insp.events())
        assert not same_tensors(loop.model.state_dict(), before)  # it trained on, not rewound
        insp.finish()
    finally:
        c.close()
        insp.close()
