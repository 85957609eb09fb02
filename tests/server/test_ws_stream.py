"""The websocket against a real server: hello, snapshots, live hook edits, invalid input."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed

from tests.live import Inbox, recv_json, recv_until
from tests.support import wait_until

THRESHOLD = 1e-3  # far below the mlp's raw gradient abs-max (about 1)
TARGETED = ("0.weight", "0.bias")


def send(ws, **msg):
    ws.send(json.dumps(msg))


def snapshot_after(box, *, config_version: int, step: int = 0) -> dict:
    return box.next(
        lambda m: (
            m["type"] == "snapshot"
            and m["data"]["config_version"] >= config_version
            and m["data"]["step"] >= step
        )
    )["data"]


def test_hello_then_snapshots_in_order(live):
    srv = live()
    srv.wait_step(3)
    with srv.ws() as ws:
        hello = recv_json(ws)
        assert hello["type"] == "hello"
        session = hello["session"]
        assert [p["name"] for p in session["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert session["mode"] == "demo" and session["live"] is True and session["read_only"] is False
        assert "clip_value" in session["hook_kinds"]
        assert session["training"]["scenario"] == "mlp"
        steps = [s["step"] for s in hello["history"]]
        assert steps and steps == sorted(steps) and len(set(steps)) == len(steps)
        seen = []
        for _ in range(5):
            seen.append(recv_until(ws, lambda m: m["type"] == "snapshot")["data"]["step"])
        assert seen[0] > steps[-1], "no step of hello's history is sent again"
        assert seen == sorted(seen) and len(set(seen)) == 5


def test_clip_value_added_over_the_socket_bounds_final_not_raw(live):
    srv = live()
    srv.wait_step(2)
    names = list(srv.insp.params)
    idx = [names.index(n) for n in TARGETED]
    other = [i for i in range(len(names)) if i not in idx]
    with srv.ws() as ws:
        box = Inbox(ws)
        assert box.next(lambda m: True)["type"] == "hello"
        send(
            ws,
            type="add_hook",
            request_id="r1",
            kind="clip_value",
            target="0.*",
            params={"threshold": THRESHOLD},
        )
        ack = box.reply("r1")
        assert ack["type"] == "ack", ack
        hook_id = ack["result"]["id"]
        hooks = box.next(
            lambda m: (
                m["type"] == "hooks"
                and any(h["id"] == hook_id and h["applied_step"] is not None for h in m["hooks"])
            )
        )
        applied = next(h for h in hooks["hooks"] if h["id"] == hook_id)["applied_step"]
        version = hooks["config_version"]
        for _ in range(3):
            snap = snapshot_after(box, config_version=version, step=applied)
            for i in idx:
                assert snap["grad_absmax"][i] <= THRESHOLD * (1 + 1e-6)
                assert snap["grad_absmax_raw"][i] > THRESHOLD
            for i in other:
                assert snap["grad_absmax"][i] == pytest.approx(snap["grad_absmax_raw"][i])

        # disable: final equals raw again
        send(ws, type="update_hook", request_id="r2", id=hook_id, enabled=False)
        assert box.reply("r2")["type"] == "ack"
        hooks = box.next(lambda m: m["type"] == "hooks" and m["config_version"] > version)
        assert next(h for h in hooks["hooks"] if h["id"] == hook_id)["enabled"] is False
        snap = snapshot_after(box, config_version=hooks["config_version"])
        for i in idx:
            assert snap["grad_absmax"][i] == pytest.approx(snap["grad_absmax_raw"][i])
            assert snap["grad_norm"][i] == pytest.approx(snap["grad_norm_raw"][i])

        # remove
        send(ws, type="remove_hook", request_id="r3", id=hook_id)
        assert box.reply("r3") == {"type": "ack", "request_id": "r3", "result": {"id": hook_id}}
        hooks = box.next(lambda m: m["type"] == "hooks" and all(h["id"] != hook_id for h in m["hooks"]))
        assert hooks["hooks"] == []
    assert srv.http().get("/api/hooks").json() == []


INVALID = [
    ('{"type": "add_hook", "request_id": "a", "kind": "nope", "params": {}}', "a", ["kind"]),
    (
        '{"type": "add_hook", "request_id": "b", "kind": "clip_value", "params": {"threshold": -1}}',
        "b",
        ["params", "threshold"],
    ),
    (
        '{"type": "add_hook", "request_id": "c", "kind": "scale", "params": {"factor": NaN}}',
        "c",
        ["params", "factor"],
    ),
    (
        '{"type": "add_hook", "request_id": "d", "kind": "scale", "params": {"factor": true}}',
        "d",
        ["params", "factor"],
    ),
    (
        '{"type": "add_hook", "request_id": "e", "kind": "clip_value", "target": "nothing.*", '
        '"params": {"threshold": 1}}',
        "e",
        ["target"],
    ),
    (
        '{"type": "add_hook", "request_id": "f", "kind": "clip_value", "params": {"threshold": 1}, "colour": 1}',
        "f",
        ["colour"],
    ),
    (
        '{"type": "add_hook", "request_id": "g", "kind": "clip_value", "params": {"threshold": 1}, "enabled": 1}',
        "g",
        ["enabled"],
    ),
    ('{"type": "update_hook", "request_id": "h", "id": "h404", "enabled": false}', "h", None),
    ('{"type": "explode", "request_id": "i"}', "i", ["type"]),
    ('{"request_id": "j"}', "j", ["type"]),
    ('{"type": "subscribe", "request_id": "k", "hist": ["no.such.param"]}', "k", ["hist"]),
    ('{"type": "subscribe", "request_id": "l", "max_rate": -5}', "l", ["max_rate"]),
    (
        '{"type": "add_hook", "kind": "clip_value", "params": {"target": 1}, "request_id": "m"}',
        "m",
        ["params", "target"],
    ),
    ("{not json", None, ["body"]),
    ("[1, 2]", None, ["body"]),
    ("[" * 5000 + "]" * 5000, None, ["body"]),
]


def test_invalid_commands_get_an_error_naming_the_field_and_change_nothing(live):
    srv = live()
    start = srv.wait_step(2)
    version = srv.insp.config_version
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        for text, rid, loc in INVALID:
            ws.send(text)
            err = box.reply(rid)
            assert err["type"] == "error", (text[:80], err)
            if loc is None:
                assert err["status"] == 404 and err["detail"] == [
                    {"loc": [], "msg": "no hook with id 'h404'"}
                ]
            else:
                assert err["detail"][0]["loc"][: len(loc)] == loc, (text[:80], err)
                assert err["detail"][0]["msg"]
        # the socket is still open and working
        send(ws, type="subscribe", request_id="ok", max_rate=100)
        assert box.reply("ok")["type"] == "ack"
    srv.wait_step(start + 5)
    assert srv.insp.config_version == version
    assert srv.insp.hooks() == []


def test_subscribe_caps_the_rate_and_asks_for_histograms(live):
    srv = live(rate=100.0)
    with srv.ws() as ws:
        recv_json(ws)
        send(ws, type="subscribe", request_id="s", max_rate=5, hist=["2.weight"])
        ack = recv_until(ws, lambda m: m.get("request_id") == "s")
        assert ack == {"type": "ack", "request_id": "s", "result": {"max_rate": 5, "hist": ["2.weight"]}}
        assert "2.weight" in srv.insp.hist_params
        snap = recv_until(ws, lambda m: m["type"] == "snapshot" and m["data"].get("hist"), timeout=20)["data"]
        assert "2.weight" in snap["hist"]
        times = []
        for _ in range(6):
            recv_until(ws, lambda m: m["type"] == "snapshot")
            times.append(srv.insp.step)
        # 5 snapshots a second at most while training runs at up to 100 steps a second
        assert times[-1] - times[0] >= 5 * 3, (
            "snapshots are coalesced, not queued: steps move on between them"
        )
    # the client's histogram subscription goes away with it
    import time

    deadline = time.monotonic() + 5
    while "2.weight" in srv.insp.hist_params and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "2.weight" not in srv.insp.hist_params


def test_training_commands_over_the_socket(live):
    srv = live()
    srv.wait_step(2)
    with srv.ws() as ws:
        box = Inbox(ws)
        send(ws, type="pause", request_id="p")
        assert box.reply("p")["result"]["state"] == "paused"
        held = wait_until(lambda: srv.insp.state["state"] == "paused" and srv.insp.step)
        send(ws, type="step", request_id="s")
        assert box.reply("s")["type"] == "ack"
        # (the core has no public "the pause took hold" signal: a step in flight may still finish)
        wait_until(lambda: srv.insp.step >= held + 1, what="one step")
        assert srv.insp.state["state"] == "paused"
        send(ws, type="rate", request_id="r", steps_per_second=20)
        assert box.reply("r")["result"] == {"steps_per_second": 20}
        send(ws, type="resume", request_id="q")
        assert box.reply("q")["result"]["state"] == "running"
        srv.wait_step(held + 3)


@pytest.mark.parametrize("frame", [b"\x00binary", "x" * (100 << 10)], ids=["binary", "oversized"])
def test_binary_and_oversized_frames_close_the_socket_with_1008(live, frame):
    srv = live()
    with srv.ws() as ws:
        recv_json(ws)
        ws.send(frame)
        with pytest.raises(ConnectionClosed) as info:
            while True:
                ws.recv(timeout=10)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
    # the server is fine, and so is training
    assert srv.http().get("/api/health").json() == {"status": "ok"}
    srv.wait_step(srv.insp.step + 2)


def test_a_command_flood_closes_that_socket_only(live):
    srv = live()
    with srv.ws() as other, srv.ws() as ws:
        recv_json(other)
        recv_json(ws)
        with pytest.raises(ConnectionClosed) as info:
            for i in range(2000):
                ws.send(json.dumps({"type": "subscribe", "request_id": i}))
            while True:
                ws.recv(timeout=10)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        send(other, type="subscribe", request_id="still-here")
        assert recv_until(other, lambda m: m.get("request_id") == "still-here")["type"] == "ack"


def test_socket_commands_run_through_the_command_layer(live, monkeypatch):
    """Every websocket command that changes something calls the same function of server/commands.py
    as its HTTP route and the agent's tool (each call recorded here), so the three cannot drift."""
    import server.commands as commands

    calls: list[str] = []
    for name in ("add_hook", "update_hook", "remove_hook", "training", "set_rate"):
        real = getattr(commands, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(commands, name, spy)
    srv = live()
    srv.wait_step(2)
    with srv.ws() as ws:
        box = Inbox(ws)
        send(ws, type="add_hook", request_id="a", kind="scale", params={"factor": 0.5})
        hook = box.reply("a")["result"]
        send(ws, type="update_hook", request_id="u", id=hook["id"], params={"factor": 0.25})
        assert box.reply("u")["type"] == "ack"
        send(ws, type="remove_hook", request_id="d", id=hook["id"])
        assert box.reply("d")["type"] == "ack"
        send(ws, type="pause", request_id="p")
        assert box.reply("p")["type"] == "ack"
        send(ws, type="rate", request_id="r", steps_per_second=20)
        assert box.reply("r")["type"] == "ack"
        send(ws, type="resume", request_id="q")
        assert box.reply("q")["type"] == "ack"
    assert calls == ["add_hook", "update_hook", "remove_hook", "training", "set_rate", "training"]
