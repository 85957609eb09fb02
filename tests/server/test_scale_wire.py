"""The wire at scale: a large run's snapshot messages carry the per-parameter detail of the union
of the pages' subscriptions and of the worst-now tensors (`subscribe`'s `detail`), every snapshot
carries `worst`, the session `groups`; `GET /api/detail` for live and stored runs.

A large run is one with more than `DETAIL_ALL` (64) tensors; the live tests lower that constant
for the `mlp` demo's 4 tensors, so that a quick real server shows the large run's messages."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import server.hub
import server.sources
from server.app import create_app
from server.history.packing import PER_PARAM, short_values
from server.history.storage import HistoryStore
from server.hub import wire_snapshot
from server.settings import DETAIL_ALL, Settings
from server.sources import ReplaySource
from tests.live import Inbox


def synthetic(n: int, step: int = 1) -> dict:
    return {
        "step": step,
        "time": 1.0,
        "lr": [0.1],
        **{k: [float(i) + j / 10 for i in range(n)] for j, k in enumerate(PER_PARAM)},
        "total_norm_raw": 2.0,
        "groups": {"norm": [0.10000000149011612, "nan", None], "nan_count": [0, 1, None]},
        "events": [{"seq": 1}],
    }


def test_a_large_snapshot_carries_the_detail_of_the_index_only():
    snap = synthetic(DETAIL_ALL + 36)
    wire = wire_snapshot(snap, [70, 3, 3, 500, -1])
    assert not any(k in wire for k in PER_PARAM) and "events" not in wire
    assert wire["detail"]["index"] == [3, 70], "ascending, once, in range"
    assert wire["detail"]["grad_norm_raw"] == [3.0, 70.0] and wire["detail"]["update_ratio"] == [3.9, 70.9]
    assert wire["groups"] == {"norm": [0.1, "nan", None], "nan_count": [0, 1, None]}, "float32 written short"
    assert wire_snapshot(snap)["detail"] == {"index": [], **{k: [] for k in PER_PARAM}}
    small = synthetic(DETAIL_ALL)
    assert wire_snapshot(small, [1]) == {k: v for k, v in small.items() if k not in ("events", "groups")}, (
        "a small run keeps its lists, without the group aggregates (its page shows tensors)"
    )


@pytest.fixture
def large(monkeypatch):
    """The `mlp` demo (4 tensors) served as a large run."""
    monkeypatch.setattr(server.hub, "DETAIL_ALL", 2)
    monkeypatch.setattr(server.sources, "DETAIL_ALL", 2)


def test_small_run_snapshots_keep_their_lists_and_add_worst(live):
    srv = live()
    with srv.ws() as ws:
        inbox = Inbox(ws)
        hello = inbox.next(lambda m: m["type"] == "hello")
        groups = hello["session"]["groups"]
        assert groups["names"] == [g for g in groups["names"] if g] and groups["members"]
        snap = inbox.next(lambda m: m["type"] == "snapshot")["data"]
        assert len(snap["grad_norm_raw"]) == 4 and "detail" not in snap
        assert isinstance(snap["worst"], list)
        assert "groups" not in snap, "a small run's page makes its group aggregates itself"


def test_a_large_run_streams_the_union_of_subscriptions_and_the_worst(live, large):
    srv = live()
    srv.wait_step(12)
    with srv.ws() as ws, srv.ws() as other:
        inbox, inbox2 = Inbox(ws), Inbox(other)
        hello = inbox.next(lambda m: m["type"] == "hello")
        inbox2.next(lambda m: m["type"] == "hello")
        assert hello["history"] and all(s["detail"]["index"] == [] for s in hello["history"])
        assert not any("grad_norm_raw" in s for s in hello["history"])
        assert isinstance(hello["history"][-1]["worst"], list)
        ws.send(json.dumps({"type": "subscribe", "request_id": "d", "detail": ["2.weight"]}))
        assert inbox.reply("d")["result"] == {"max_rate": None, "hist": None, "detail": ["2.weight"]}
        other.send(json.dumps({"type": "subscribe", "request_id": "e", "detail": ["0.bias"]}))
        assert inbox2.reply("e")["type"] == "ack"

        def both(m):
            return m["type"] == "snapshot" and {1, 2} <= set(m["data"]["detail"]["index"])

        data = inbox.next(both)["data"]
        detail = data["detail"]
        assert "grad_norm_raw" not in data and isinstance(data["worst"], list)
        assert set(detail["index"]) == {1, 2} | {w["param"] for w in data["worst"]}
        assert all(len(detail[k]) == len(detail["index"]) for k in PER_PARAM)
        assert inbox2.next(both)["data"]["detail"]["index"] == detail["index"], "one cut for every page"

        ws.send(
            json.dumps(
                {"type": "subscribe", "request_id": "u", "detail": ["2.weight", "no.such", "nor.this"]}
            )
        )
        err = inbox.reply("u")
        assert err["type"] == "error" and err["status"] == 422 and err["detail"][0]["loc"] == ["detail"]
        assert "'no.such'" in err["detail"][0]["msg"] and "'nor.this'" in err["detail"][0]["msg"]
        ws.send(json.dumps({"type": "subscribe", "request_id": "c", "detail": ["0.weight"] * 257}))
        assert inbox.reply("c")["status"] == 422, "at most 256 names"
        other.close()  # its subscription goes with it

        def only_mine(m):
            if m["type"] != "snapshot":
                return False
            d = m["data"]
            return set(d["detail"]["index"]) == {2} | {w["param"] for w in d["worst"]}

        inbox.next(only_mine)


def test_detail_route_on_a_live_run(live):
    srv = live()
    srv.wait_step(8)
    c = srv.http()
    r = c.get("/api/detail", params={"params": "2.weight,0.bias", "limit": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["params"] == ["2.weight", "0.bias"] and len(body["steps"]) == 5
    assert body["steps"] == sorted(body["steps"])
    assert set(body["stats"]) == set(PER_PARAM)
    assert all(len(rows) == 2 and all(len(row) == 5 for row in rows) for rows in body["stats"].values())
    snaps = {s["step"]: s for s in c.get("/api/snapshots", params={"limit": 50}).json()["snapshots"]}
    step = body["steps"][0]
    if step in snaps:
        assert body["stats"]["grad_norm_raw"][0][0] == pytest.approx(
            snaps[step]["grad_norm_raw"][2], rel=1e-6
        )
    since = body["steps"][-2]
    later = c.get("/api/detail", params={"params": "0.weight", "since": since}).json()
    assert later["steps"][0] > since
    for params, loc in (
        ({"params": "0.weight,nope"}, ["query", "params"]),
        ({"params": ""}, ["query", "params"]),
        ({"params": ","}, ["query", "params"]),
        ({}, ["query", "params"]),
        ({"params": "0.weight", "limit": 0}, ["query", "limit"]),
        ({"params": "0.weight", "limit": 5001}, ["query", "limit"]),
        ({"params": "0.weight", "since": "x"}, ["query", "since"]),
        ({"params": ",".join(["0.weight"] * 257)}, ["query", "params"]),
        ({"params": ",".join(["0.weight"] * 256), "limit": 601}, ["query", "limit"]),
    ):
        r = c.get("/api/detail", params=params)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (params, r.text)
    assert "'nope'" in c.get("/api/detail", params={"params": "nope"}).json()["detail"][0]["msg"]
    assert c.get("/api/detail", params={"params": "0.weight", "run": 99}).status_code == 404


def test_detail_route_is_a_read_with_the_token_rules(live):
    srv = live(read_only=True, token="s3cret-token-value")
    srv.wait_step(3)
    assert srv.http().get("/api/detail", params={"params": "0.weight"}).status_code == 401
    c = srv.http(headers={"Authorization": "Bearer s3cret-token-value"})
    r = c.get("/api/detail", params={"params": "0.weight"})
    assert r.status_code == 200 and r.json()["steps"], "allowed on a read-only server"


def test_detail_route_and_groups_of_a_stored_run(tmp_path):
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    groups = {"source": "tree", "names": ["a"], "members": [[0, 1]], "stacks": []}
    run = store.new_run(params=[{"name": "a.w"}, {"name": "a.b"}], modules=[""], meta={"groups": groups})
    for s in range(1, 11):
        store.add_snapshot(run, {"step": s, "grad_norm_raw": [float(s), "inf" if s == 10 else None]})
    store.close()
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        assert c.get("/api/session").json()["groups"] == groups
        r = c.get("/api/detail", params={"params": "a.b,a.w", "since": 6})
        assert r.status_code == 200, r.text
        assert r.json() == {
            "steps": [7, 8, 9, 10],
            "params": ["a.b", "a.w"],
            "stats": {
                **{k: [[None] * 4, [None] * 4] for k in PER_PARAM},
                "grad_norm_raw": [[None, None, None, "inf"], [7.0, 8.0, 9.0, 10.0]],
            },
        }
        assert c.get("/api/detail", params={"params": "a.x"}).status_code == 422
        with c.websocket_connect("ws://127.0.0.1/ws") as ws:
            hello = recv_json_tc(ws)
            assert hello["history"][-1]["worst"][0] == {
                "param": 1,
                "stat": "grad_norm_raw",
                "z": "inf",
                "value": "inf",
                "median": None,
                "since": 10,  # the stored step it went non-finite at
                "before": None,
            }, "ranked from the stored rows (the run was recorded without worst)"
            ws.send_text(json.dumps({"type": "subscribe", "request_id": 1, "detail": ["a.q"]}))
            assert json.loads(ws.receive_text())["status"] == 422


def recv_json_tc(ws) -> dict:
    return json.loads(ws.receive_text())


def test_snapshots_route_without_detail_for_a_large_run(tmp_path):
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    n = DETAIL_ALL + 6
    run = store.new_run(params=[{"name": f"p{i}"} for i in range(n)], modules=[""])
    for s in range(1, 6):
        snap = synthetic(n, s)
        snap["events"] = [{"seq": s, "kind": "nonfinite", "step": s}]
        store.add_snapshot(run, snap)
    store.close()
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        whole = c.get("/api/snapshots").json()["snapshots"]
        assert len(whole[0]["grad_norm_raw"]) == n and "detail" not in whole[0], "whole by default"
        light = c.get("/api/snapshots", params={"detail": "false", "limit": 2}).json()["snapshots"]
        assert [s["step"] for s in light] == [4, 5]
        assert light[0]["detail"] == {"index": [], **{k: [] for k in PER_PARAM}}
        assert not any(k in light[0] for k in PER_PARAM)
        assert light[0]["events"] == [{"seq": 4, "kind": "nonfinite", "step": 4}]
        assert light[0]["groups"]["norm"] == [0.1, "nan", None]


def test_a_rewind_forgets_the_abandoned_steps_worst_now():
    """The steps after a rewind's are another branch's: a page's hello must not get the old
    branch's ranking for them (it did until the new branch's snapshot was ranked)."""
    import torch
    from torch import nn

    import inspector
    from server.live.source import LiveSource

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    insp = inspector.attach(model, opt, every=1)
    src = LiveSource(insp)
    try:
        for _ in range(20):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        for snap in insp.snapshots():  # what the dispatcher hands a recording source
            src._on_message("snapshot", snap)
        assert max(src._worst_at) == 20
        src._rewound({"step": 11, "from_step": 20})
        assert max(src._worst_at) == 11
    finally:
        insp.close()


def test_a_final_group_aggregate_equal_to_its_raw_one_is_sent_once():
    """No hook changed a group's gradients: its final norm and abs-max are its raw ones, and the
    message leaves them out (the page reads the raw ones); where a hook changed one, both go."""
    n = DETAIL_ALL + 6
    raw = [0.10000000149011612, "nan", None]
    snap = {**synthetic(n, 1), "groups": {"norm_raw": raw, "norm": list(raw), "absmax_raw": [1.0, 2.0, None]}}
    snap["groups"]["absmax"] = list(snap["groups"]["absmax_raw"])
    wire = wire_snapshot(snap, [1])
    assert "norm" not in wire["groups"] and "absmax" not in wire["groups"]
    assert wire["groups"]["norm_raw"] == short_values(raw) == [0.1, "nan", None]
    snap["groups"]["norm"] = [*raw[:-1], 0.5]  # one group clipped
    wire = wire_snapshot(snap, [1])
    assert wire["groups"]["norm"][-1] == 0.5 and "absmax" not in wire["groups"]
