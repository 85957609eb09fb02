"""What-if under concurrency, over HTTP: rewinds and checkpoints racing each other and hook
changes, the bounded request queue, a shadow's label at its end, rewinds that abandon nothing.

Each race is made to happen the same way every time: in a user's loop nothing is carried out
until the test runs the next step; in the demo, training is held at a boundary (paused) and a
wrapper of the test's own runs the competing request at the exact point it needs to."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
import pytest

from tests.support import wait_until
from tests.unit.test_whatif import Loop


@pytest.fixture
def served(tmp_path):
    """A user's loop (this thread trains), served with a history, and a client."""
    loop = Loop()
    url = loop.insp.serve(port=0, db=str(tmp_path / "user.sqlite"))
    c = httpx.Client(base_url=f"http://127.0.0.1:{urlsplit(url).port}", trust_env=False, timeout=30)
    yield loop, c
    c.close()
    loop.insp.close()


def test_two_rewinds_before_one_boundary_leave_one_consistent_history(served):
    loop, c = served
    insp = loop.insp
    loop.run(range(3))
    c1 = insp.checkpoint("c1")
    loop.run(range(3, 5))
    c2 = insp.checkpoint("c2")
    loop.run(range(5, 7))
    assert c.post(f"/api/checkpoints/{c1}/rewind").status_code == 202
    assert c.post(f"/api/checkpoints/{c2}/rewind").status_code == 202  # a second page, before the boundary
    loop.step(7)  # step 8's boundary carries both out
    assert insp.step == 3
    loop.run(range(10, 13))
    insp.finish()
    wait_until(lambda: len(c.get("/api/scalars").json()["scalars"]) == 6, what="the main run's losses")
    (run,) = c.get("/api/runs").json()["runs"]
    (branch,) = run["branches"]
    assert branch["branch_step"] == 3 and branch["steps"] == 8
    main = c.get("/api/snapshots", params={"run": run["id"]}).json()["snapshots"]
    assert [s["step"] for s in main] == list(range(1, 7)), "no step missing from the main run"
    old = c.get("/api/snapshots", params={"run": branch["id"]}).json()["snapshots"]
    assert [s["step"] for s in old] == list(range(4, 9))
    events = c.get("/api/events", params={"run": run["id"]}).json()["events"]
    rewinds = [e for e in events if e["kind"] == "rewind"]
    assert [(e["from_step"], e["step"]) for e in rewinds] == [(8, 3)], "the main run never jumps forward"
    (refused,) = [e for e in events if e["kind"] == "rewind_error"]
    assert refused["checkpoint"] == c2 and "abandoned" in refused["message"]
    old_events = c.get("/api/events", params={"run": branch["id"]}).json()["events"]
    assert not any(e["kind"] in ("rewind", "rewind_error") for e in old_events)


def test_a_hook_change_asked_for_while_a_rewind_waits_is_refused_with_409(served):
    loop, c = served
    insp = loop.insp
    store = insp._dashboard.server._source.store
    loop.run(range(3))
    cp = insp.checkpoint()
    loop.run(range(3, 6))
    assert c.post(f"/api/checkpoints/{cp}/rewind").status_code == 202
    rows = len(store.hook_requests(1))
    r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})
    assert r.status_code == 409, r.text
    assert f"rewind to checkpoint {cp}" in r.json()["detail"] and "after it" in r.json()["detail"]
    assert c.get("/api/hooks").json() == [] and len(store.hook_requests(1)) == rows, "nothing recorded"
    assert [cp["auto"] for cp in c.get("/api/checkpoints").json()["checkpoints"]] == [False]
    loop.step(6)
    r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})
    assert r.status_code == 201, r.text
    loop.step(7)
    assert c.get("/api/hooks").json()[0]["applied_step"] == 5, "after the rewind a change applies"


def held_demo(live):
    """The mlp demo after 3 steps, its training held at a boundary (paused), and a client."""
    srv = live("mlp", rate=None)
    c = srv.http()
    srv.wait_step(3)
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    return srv, c


def test_post_hooks_racing_a_rewind_answers_from_the_accepted_spec(live):
    srv, c = held_demo(live)
    cp = c.post("/api/checkpoints", json={"label": "before"}).json()["id"]
    wait_until(lambda: srv.insp.checkpoints.list()[-1]["taken"], what="the checkpoint")
    store = srv.source.store
    record = store.record_request

    def rewind_meanwhile(*args, **kwargs):
        # the hook is accepted; before the reply is made, another page's rewind is carried out by
        # the held training thread, and puts the checkpoint's hooks (none) back
        record(*args, **kwargs)
        before = srv.insp.checkpoints.rewinds
        srv.insp.rewind(cp)
        wait_until(lambda: srv.insp.checkpoints.rewinds > before, what="the rewind")

    store.record_request = rewind_meanwhile
    try:
        r = c.post("/api/hooks", json={"kind": "scale", "target": "*", "params": {"factor": 0.5}})
    finally:
        store.record_request = record
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "scale" and r.json()["params"] == {"factor": 0.5}
    assert c.get("/api/hooks").json() == [], "the rewind asked for after it took it away, and says so"
    assert any(e["kind"] == "rewind" for e in srv.insp.events())
    assert c.get("/api/health").status_code == 200


def test_concurrent_checkpoint_requests_answer_202_from_the_request(live):
    srv, c = held_demo(live)
    mgr = srv.insp.checkpoints
    original = getattr(mgr, "request", None)  # (the code before had no request(): checkpoint() then)

    def another_page() -> str:
        return original("another page")["id"] if original is not None else mgr.checkpoint("another page")

    def racing(request):
        def wrapped(*args, **kwargs):
            out = request(*args, **kwargs)
            # before the reply: other pages' requests, each taken by the held thread, push this
            # one out of the newest `keep`
            for _ in range(mgr.keep):
                cp = another_page()
                wait_until(lambda cp=cp: any(x["id"] == cp and x["taken"] for x in mgr.list()))
            return out

        return wrapped

    srv.insp.checkpoint = racing(srv.insp.checkpoint)  # what a reply was read back from before
    if original is not None:
        mgr.request = racing(original)
    r = c.post("/api/checkpoints", json={"label": "mine"})
    assert r.status_code == 202, r.text
    assert r.json()["label"] == "mine" and r.json()["id"] not in [
        x["id"] for x in c.get("/api/checkpoints").json()["checkpoints"]
    ]


def test_waiting_requests_past_keep_are_refused_with_429(served):
    loop, c = served
    loop.run(range(3))
    keep = loop.insp.checkpoints.keep
    codes = [c.post("/api/checkpoints", json={"label": f"r{i}"}).status_code for i in range(keep + 5)]
    assert codes == [202] * keep + [429] * 5
    r = c.post("/api/checkpoints")
    assert "wait for the next step boundary already" in r.json()["detail"]
    assert len(c.get("/api/checkpoints").json()["checkpoints"]) == keep
    loop.step(3)
    assert [x["taken"] for x in c.get("/api/checkpoints").json()["checkpoints"]] == [True] * keep
    assert c.post("/api/checkpoints").status_code == 202, "after the boundary, requests are taken again"


def test_rewinds_that_abandon_no_step_record_no_branch(served, tmp_path):
    from server.history.storage import HistoryStore

    loop, c = served
    insp = loop.insp
    loop.run(range(5))
    cp = c.post("/api/checkpoints").json()["id"]  # taken at step 6's boundary
    loop.step(5)
    for _ in range(3):  # a double click, a retrying script: one request
        assert c.post(f"/api/checkpoints/{cp}/rewind").json() == {"checkpoint": cp, "step": 6, "done": False}
    loop.step(6)  # step 7 is abandoned: one branch
    for _ in range(3):
        insp.rewind(cp)  # at the checkpoint's own step, nothing to abandon
    insp.close()  # every message the core had queued is recorded before it returns
    store = HistoryStore(tmp_path / "user.sqlite", read_only=True)
    try:
        (run,) = store.runs()
        assert [(b["branch_step"], b["steps"]) for b in run["branches"]] == [(6, 7)], (
            "only the rewind that abandoned a step made a branch"
        )
        rewinds = [e for e in store.events(run["id"]) if e["kind"] == "rewind"]
        assert [(e["from_step"], e["step"]) for e in rewinds] == [(7, 6), (6, 6), (6, 6), (6, 6)]
    finally:
        store.close()


def test_a_shadow_ended_by_a_rewind_keeps_its_label(live):
    srv = live("mlp", rate=None)
    c = srv.http()
    srv.wait_step(3)
    r = c.post("/api/hooks", json={"kind": "clip_norm", "target": "*", "params": {"max_norm": 1.0}})
    assert r.status_code == 201
    wait_until(lambda: c.get("/api/shadow").json()["active"], what="the shadow to start")
    label = c.get("/api/shadow").json()["label"]
    assert label == "shadow: without clip_norm h1"
    srv.insp.pause()
    wait_until(lambda: srv.insp.state["held"], what="the pause to take hold")
    auto = [x for x in c.get("/api/checkpoints").json()["checkpoints"] if x["auto"]][0]["id"]
    assert c.post(f"/api/checkpoints/{auto}/rewind").status_code == 202
    # the held thread rewinds: its hooks reach the server before the abandoned branch is recorded
    wait_until(lambda: c.get("/api/runs").json()["runs"][0]["branches"][-1]["branch"] == "abandoned")
    srv.insp.resume()
    wait_until(lambda: not c.get("/api/shadow").json()["active"], what="the shadow to end")
    state = c.get("/api/shadow").json()
    assert state["label"] == label and state["ended"] == "the main run was rewound"
    (shadow,) = [b for b in c.get("/api/runs").json()["runs"][0]["branches"] if b["branch"] == "shadow"]
    assert shadow["label"] == label
