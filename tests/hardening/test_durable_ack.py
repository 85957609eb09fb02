"""A hook change is acknowledged only once it is durable in the history.

A real `gradient-inspector demo` subprocess is sent a hook change and killed with SIGKILL the
moment its reply arrives; the database it leaves must hold the change. The demo waits for its
first page, so training has not started and the change (a `post_accumulate` hook, which the
training thread itself must register) stays pending: before, only the applied change was
recorded, so it was lost every time. The history shows it as the live `GET /api/hooks` would
have: requested, `applied_step` null; a replay of the run serves it.
"""

from __future__ import annotations

import json
import signal

from websockets.sync.client import connect

from server.history.storage import HistoryStore
from tests.support import start_cli, start_demo

HOOK = {"kind": "clip_value", "target": "*", "point": "post_accumulate", "params": {"threshold": 0.5}}


def killed_after(tmp_path, send):
    """Start a waiting demo, `send(server)` a change (returns the acknowledged hook), SIGKILL the
    process at once; returns (the hook, the run's recorded hooks, its recorded requests)."""
    db = tmp_path / "history.sqlite"
    server = start_demo(tmp_path, db=db, wait=True)
    try:
        run = server.get("/api/session")["run_id"]
        hook = send(server)
        server.proc.send_signal(signal.SIGKILL)  # at once: no shutdown, no flush
        assert server.proc.wait(30) == -signal.SIGKILL
    finally:
        server.stop()
    store = HistoryStore(db, read_only=True)
    try:
        return hook, store.hooks(run), store.hook_requests(run)
    finally:
        store.close()


def test_a_hook_added_over_http_survives_a_kill_right_after_the_201(tmp_path):
    def send(server):
        r = server.client.post("/api/hooks", json=HOOK)
        assert r.status_code == 201, r.text
        return r.json()

    hook, (version, hooks), requests = killed_after(tmp_path, send)
    assert hook["applied_step"] is None, "still pending when acknowledged: training had not started"
    assert version == 0, "no change applied"
    assert hooks == [hook], "the history shows the requested configuration, as GET /api/hooks did"
    assert [(r["action"], r["hook_id"], r["config_version"]) for r in requests] == [("add", hook["id"], 1)]
    with start_cli(["replay", str(tmp_path / "history.sqlite")], log_dir=tmp_path) as replay:
        assert replay.get("/api/hooks") == [hook], "a replay of the run serves it"


def test_a_hook_change_over_the_websocket_survives_a_kill_right_after_the_ack(tmp_path):
    def send(server):
        first = server.client.post("/api/hooks", json=HOOK)
        assert first.status_code == 201, first.text
        with connect(f"ws://127.0.0.1:{server.port}/ws", proxy=None, max_size=None, open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
            ws.send(
                json.dumps(
                    {
                        "type": "update_hook",
                        "request_id": "r1",
                        "id": first.json()["id"],
                        "params": {"threshold": 0.25},
                    }
                )
            )
            while True:
                msg = json.loads(ws.recv(timeout=10))
                if msg["type"] in ("ack", "error") and msg.get("request_id") == "r1":
                    assert msg["type"] == "ack", msg
                    return msg["result"]

    hook, (version, hooks), requests = killed_after(tmp_path, send)
    assert [h["id"] for h in hooks] == [hook["id"]]
    assert hooks[0]["params"]["threshold"] == 0.25, "the update acknowledged on the socket is recorded"
    assert [r["action"] for r in requests] == ["add", "update"]


def test_the_last_request_is_shown_only_until_it_is_applied(tmp_path):
    """The history's rule (HistoryReader.hooks): the applied configuration, unless the last
    request's version is past it; then the request, with the applied_step of hooks in force."""
    store = HistoryStore(tmp_path / "h.sqlite")
    store.start_writer()
    run = store.new_run(params=[{"name": "w", "shape": [2], "numel": 2, "module": ""}], modules=[""])
    a = {"id": "h1", "kind": "scale", "point": "pre_step", "target": "*", "params": {"factor": 2.0}}
    b = {"id": "h2", "kind": "freeze", "point": "pre_step", "target": "*", "params": {}}
    store.add_hooks(run, 1, [{**a, "applied_step": 3}])
    assert store.record_request(
        run,
        1,
        action="add",
        hook_id="h2",
        config_version=2,
        hooks=[{**a, "applied_step": 3}, {**b, "applied_step": None}],
    )
    assert store.hooks(run) == (1, [{**a, "applied_step": 3}, {**b, "applied_step": None}])
    store.add_hooks(run, 2, [{**a, "applied_step": 3}, {**b, "applied_step": 7}])
    assert store.flush()
    assert store.hooks(run) == (2, [{**a, "applied_step": 3}, {**b, "applied_step": 7}])
    # a removal pending: already gone; an update pending: applied_step null
    assert store.record_request(
        run, 2, action="remove", hook_id="h1", config_version=3, hooks=[{**b, "applied_step": 7}]
    )
    assert store.hooks(run) == (2, [{**b, "applied_step": 7}])
    changed = {**b, "enabled": False, "applied_step": None}
    assert store.record_request(run, 3, action="update", hook_id="h2", config_version=4, hooks=[changed])
    assert store.hooks(run) == (2, [changed])
    store.close()


def test_a_pending_removal_of_another_hook_leaves_a_hooks_applied_step_in_the_record(tmp_path):
    """The record's view of a pending request: a hook that the removal of another only shifts (its
    `position`) keeps the applied_step of its own configuration; a pending move is null for the hook
    moved and for those it moves past (their order changes)."""
    store = HistoryStore(tmp_path / "h.sqlite")
    store.start_writer()
    run = store.new_run(params=[{"name": "w", "shape": [2], "numel": 2, "module": ""}], modules=[""])
    a = {"id": "h1", "kind": "clip_value", "point": "pre_step", "target": "*", "params": {"threshold": 1.0}}
    b = {"id": "h2", "kind": "scale", "point": "pre_step", "target": "*", "params": {"factor": 0.25}}
    c = {"id": "h3", "kind": "freeze", "point": "pre_step", "target": "*", "params": {}}
    store.add_hooks(
        run,
        3,
        [
            {**a, "position": 0, "applied_step": 1},
            {**b, "position": 1, "applied_step": 4},
            {**c, "position": 2, "applied_step": 2},
        ],
    )
    assert store.record_request(
        run,
        1,
        action="remove",
        hook_id="h1",
        config_version=4,
        hooks=[{**b, "position": 0, "applied_step": None}, {**c, "position": 1, "applied_step": None}],
    )
    assert store.flush()
    assert [(h["id"], h["applied_step"]) for h in store.hooks(run)[1]] == [("h2", 4), ("h3", 2)]
    assert store.record_request(
        run,
        2,
        action="update",
        hook_id="h3",
        config_version=5,
        hooks=[{**c, "position": 0, "applied_step": None}, {**b, "position": 1, "applied_step": None}],
    )
    assert store.flush()
    version, hooks = store.hooks(run)
    assert version == 3
    assert [(h["id"], h["applied_step"]) for h in hooks] == [("h3", None), ("h2", None)]
    store.close()
