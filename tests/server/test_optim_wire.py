"""`Snapshot.optim` on the wire and in the history (server/history/optim.py): a large run's
per-parameter lists cut to the followed tensors, the group lists whole; stored and read back by
`GET /api/snapshots` and a replay's hello, whole or without detail."""

from __future__ import annotations

import json

import numpy as np
import torch
from fastapi.testclient import TestClient
from torch import nn

import inspector
from server.app import create_app
from server.history.optim import OPTIM_PER_PARAM
from server.history.storage import HistoryStore
from server.hub import wire_snapshot
from server.settings import DETAIL_ALL, Settings
from server.sources import ReplaySource


def real_snapshots(steps: int = 3) -> list[dict]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    insp = inspector.attach(net, opt, every=1)
    try:
        for _ in range(steps):
            opt.zero_grad()
            net(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        return insp.snapshots()
    finally:
        insp.close()


def f32(x: float) -> float:
    """`x` in float32 precision, printed short, as the history reads a packed value back."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def as_stored(optim: dict) -> dict:
    """What the history gives back: the per-parameter and per-group lists packed in float32 (the
    per-group ones with the group aggregates), the rest as sent."""

    def packed(v: list) -> list:
        return [f32(x) if type(x) is float else x for x in v]

    return {
        k: packed(v) if k in OPTIM_PER_PARAM else {g: packed(x) for g, x in v.items()} if k == "groups" else v
        for k, v in optim.items()
    }


def large_optim(n: int) -> dict:
    return {
        **{k: [float(i) + j / 10 for i in range(n)] for j, k in enumerate(OPTIM_PER_PARAM)},
        "groups": {k: [0.10000000149011612, None] for k in OPTIM_PER_PARAM},
        "model": {k: 0.5 for k in OPTIM_PER_PARAM},
        "kind": "adam",
        "cos_prev_gap": 3,
    }


def test_a_large_run_sends_the_followed_tensors_and_the_groups():
    n = DETAIL_ALL + 10
    snap = {"step": 1, "grad_norm_raw": [1.0] * n, "optim": large_optim(n)}
    wire = wire_snapshot(snap, [70, 3])
    o = wire["optim"]
    assert o["index"] == wire["detail"]["index"] == [3, 70]
    assert o["step_ratio"] == [3.3, 70.3] and o["exp_avg_norm"] == [3.0, 70.0]
    assert o["groups"]["cos_grad_prev"] == [0.1, None], "group lists whole, float32 written short"
    assert o["kind"] == "adam" and o["cos_prev_gap"] == 3
    small = {"step": 1, "grad_norm_raw": [1.0] * 4, "optim": large_optim(4)}
    assert wire_snapshot(small, [1])["optim"] == small["optim"], "a small run's is sent whole"
    assert wire_snapshot({**small, "optim": None})["optim"] is None


def test_stored_and_replayed_with_the_snapshot(tmp_path):
    snaps = real_snapshots()
    assert all(s["optim"]["kind"] == "adam" for s in snaps)
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=[{"name": f"p{i}"} for i in range(4)], modules=[""])
    for s in snaps:
        store.add_snapshot(run, json.loads(json.dumps(s)))
    store.close()
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        got = c.get("/api/snapshots").json()["snapshots"]
        assert [g["optim"] for g in got] == [as_stored(s["optim"]) for s in snaps]
        with c.websocket_connect("ws://127.0.0.1/ws") as ws:
            hello = json.loads(ws.receive_text())
            assert hello["history"][-1]["optim"] == as_stored(snaps[-1]["optim"])


def test_stored_packed_with_the_detail_and_thinned_with_it(tmp_path):
    """The six per-parameter lists go to the packed `detail` column (not the JSON), come back in
    `optim`, and past the full-resolution window are None like the other per-parameter lists."""
    n, window, steps = 5, 4, 12
    store = HistoryStore(tmp_path / "h.sqlite", detail_window=window, flush_interval=0.01)
    store.start_writer()
    run = store.new_run(params=[{"name": f"p{i}"} for i in range(n)], modules=[""])
    for s in range(1, steps + 1):
        store.add_snapshot(run, {"step": s, "lr": [0.1], "grad_norm_raw": [0.5] * n, "optim": large_optim(n)})
        store.flush()
    ((data,),) = store._all("SELECT data FROM snapshots WHERE step = ?", (steps,))
    stored = json.loads(data)["optim"]
    assert not any(k in stored for k in OPTIM_PER_PARAM) and stored["kind"] == "adam", "the lists are packed"
    snaps = {s["step"]: s for s in store.snapshots(run)}
    assert snaps[steps]["optim"] == large_optim(n)
    thinned = snaps[2]["optim"]
    assert snaps[2]["grad_norm_raw"] == [None] * n, "(step 2 is past the window and thinned)"
    assert all(thinned[k] == [None] * n for k in OPTIM_PER_PARAM)
    assert thinned["groups"] == large_optim(n)["groups"] and thinned["model"] == large_optim(n)["model"]
    store.close()


def test_a_large_stored_run_without_detail_has_the_group_lists_only(tmp_path):
    n = DETAIL_ALL + 6
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path)
    store.start_writer()
    run = store.new_run(params=[{"name": f"p{i}"} for i in range(n)], modules=[""])
    store.add_snapshot(run, {"step": 1, "lr": [0.1], "grad_norm_raw": [1.0] * n, "optim": large_optim(n)})
    store.close()
    source = ReplaySource(HistoryStore(path, read_only=True))
    with TestClient(create_app(source, Settings(read_only=True)), base_url="http://127.0.0.1") as c:
        (whole,) = c.get("/api/snapshots").json()["snapshots"]
        assert whole["optim"] == large_optim(n)
        (light,) = c.get("/api/snapshots", params={"detail": "false"}).json()["snapshots"]
        o = light["optim"]
        assert o["index"] == [] and all(o[k] == [] for k in OPTIM_PER_PARAM)
        assert o["groups"]["step_ratio"] == [0.1, None] and o["cos_prev_gap"] == 3


def test_a_large_runs_group_lists_without_a_value_are_left_out():
    """An SGD run has no Adam moments, and a run without accumulation no noise scale: their
    per-group lists (null for every group, 2.6 KB and 0.9 KB at 58 groups) are not sent; a list
    with one value is, and a small run's snapshot is sent whole."""
    n = DETAIL_ALL + 10
    optim = {**large_optim(n), "kind": "other"}
    optim["groups"] = {k: [None, None] for k in OPTIM_PER_PARAM}
    optim["groups"]["step_ratio"] = [0.25, None]
    noise = {
        "b_simple": None,
        "reason": "needs accumulation",
        "groups": {"b_simple": [None, None], "g_sq": [None, 2.0]},
    }
    snap = {"step": 1, "grad_norm_raw": [1.0] * n, "optim": optim, "noise_scale": noise}
    wire = wire_snapshot(snap, [3])
    assert wire["optim"]["groups"] == {"step_ratio": [0.25, None]}
    assert wire["noise_scale"]["groups"] == {"g_sq": [None, 2.0]}
    assert wire["noise_scale"]["reason"] == "needs accumulation"
    assert snap["optim"]["groups"]["exp_avg_norm"] == [None, None], "the snapshot itself is not changed"
    small = {**snap, "grad_norm_raw": [1.0] * 4}
    assert wire_snapshot(small, [1])["noise_scale"] == noise and wire_snapshot(small)["optim"] == optim
