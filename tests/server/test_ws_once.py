"""Each fact reaches a websocket client once: an event, a hook change, the end of training, and
the history a (re)connecting page needs, in `hello` alone."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from server.hub import ClientQueue
from tests.live import Inbox
from tests.support import wait_until


def event_seqs(messages: list[dict]) -> list[int]:
    """Every event seq the messages carry, wherever: `event`, a snapshot's `events`, a `hooks`
    message's `event`, `hello`'s `events` and its snapshots' `events`."""
    seqs: list[int] = []
    for m in messages:
        if m["type"] == "event":
            seqs.append(m["data"]["seq"])
        elif m["type"] == "snapshot":
            seqs += [e["seq"] for e in m["data"].get("events", [])]
        elif m["type"] == "hooks" and m.get("event"):
            seqs.append(m["event"]["seq"])
        elif m["type"] == "hello":
            seqs += [e["seq"] for e in m["events"]]
            seqs += [e["seq"] for s in m["history"] for e in s.get("events", [])]
    return seqs


def snapshots_after(box: Inbox, step: int, n: int = 3) -> None:
    """Read until `n` snapshots past `step` came (whatever was due before them has come too)."""
    for i in range(n):
        box.next(lambda m, i=i: m["type"] == "snapshot" and m["data"]["step"] > step + i)


def test_an_event_reaches_the_socket_once_and_the_history_keeps_it_in_its_snapshot(live):
    srv = live()
    srv.wait_step(3)
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        ev = srv.insp.add_event("server_error", message="a test event")
        box.next(lambda m: m["type"] == "event" and m["data"]["seq"] == ev["seq"])
        snapshots_after(box, srv.insp.step)
        assert event_seqs(box.all).count(ev["seq"]) == 1, "one message carries it, once"
        assert all("events" not in m["data"] for m in box.all if m["type"] == "snapshot")
    # the history still has it, in its own table and in the snapshot of its step
    assert [e["seq"] for e in srv.http().get("/api/events").json()["events"]].count(ev["seq"]) == 1

    def stored() -> list[dict]:
        with sqlite3.connect(srv.db) as db:
            rows = db.execute("SELECT data FROM snapshots WHERE run = ?", (srv.source.run_id,)).fetchall()
        snaps = [json.loads(data) for (data,) in rows]
        return [s for s in snaps if any(e["seq"] == ev["seq"] for e in s["events"])]

    assert len(wait_until(stored, what="the stored snapshot holding the event")) == 1


def test_a_hook_change_is_one_message_with_its_event_and_the_hooks_it_leaves(live):
    srv = live()
    srv.wait_step(3)
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        c = srv.http()
        hook = c.post("/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}})
        assert hook.status_code == 201, hook.text
        hook_id = hook.json()["id"]
        msg = box.next(lambda m: m["type"] == "hooks" and any(h["id"] == hook_id for h in m["hooks"]))
        assert msg["event"]["kind"] == "hook_applied" and msg["event"]["action"] == "add"
        assert msg["event"]["hook_id"] == hook_id
        assert msg["event"]["config_version"] == msg["config_version"]
        assert [h["id"] for h in msg["hooks"]] == [hook_id]
        assert msg["hooks"][0]["applied_step"] == msg["event"]["applied_step"] is not None
        snapshots_after(box, srv.insp.step)
        about = [
            m
            for m in box.all
            if (m["type"] == "hooks" and m["config_version"] == msg["config_version"])
            or (m["type"] == "event" and m["data"]["kind"] == "hook_applied")
            or (m["type"] == "snapshot" and m["data"].get("events"))
        ]
        assert about == [msg], "the change is one message"
        assert event_seqs(box.all).count(msg["event"]["seq"]) == 1


def test_the_end_of_training_is_pushed(live):
    srv = live()
    srv.wait_step(3)
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        srv.trainer.stop()  # the demo's loop ends; then training is over, as a script's finish()
        srv.insp.finish()
        msg = box.next(lambda m: m["type"] == "training" and m["state"] == "finished", timeout=10)
        assert msg["step"] == srv.insp.step
        assert "steps_per_second" in msg  # (as every training message: the demo's cap)
        assert srv.http().get("/api/session").json()["training"]["state"] == "finished"
        assert [m["type"] for m in box.all].count("training") == 1, "finished, once"


def test_hello_carries_a_pages_history_and_a_reconnection_gets_only_what_it_missed(live):
    srv = live()
    srv.wait_step(5)
    ev = srv.insp.add_event("server_error", message="before the page")
    with srv.ws() as ws:
        hello = json.loads(ws.recv(timeout=10))
    assert hello["type"] == "hello" and hello["resumed"] is False
    steps = [s["step"] for s in hello["history"]]
    assert steps[0] == 1 and steps == list(range(1, steps[-1] + 1)), "every step so far (every=1, < 600)"
    assert all("events" not in s for s in hello["history"])
    assert ev["seq"] in [e["seq"] for e in hello["events"]]
    assert event_seqs([hello]).count(ev["seq"]) == 1
    run, last, seq = hello["session"]["run_id"], steps[-1], hello["events"][-1]["seq"]

    srv.wait_step(last + 5)
    later = srv.insp.add_event("server_error", message="while the page was away")
    query = f"run={run}&step={last}&since={last}&seq={seq}"
    with srv.ws(f"/ws?{query}") as ws:
        again = json.loads(ws.recv(timeout=10))
        assert again["resumed"] is True
        steps = [s["step"] for s in again["history"]]
        assert steps and steps[0] == last + 1 and steps == sorted(steps)
        assert [e["seq"] for e in again["events"]] == [later["seq"]]
        box = Inbox(ws)
        snapshots_after(box, steps[-1])
        assert all(m["data"]["step"] > steps[-1] for m in box.all if m["type"] == "snapshot")
        assert event_seqs([again, *box.all]).count(later["seq"]) == 1

    # another run (or a step count that went back: another process): the whole history again
    for query in (f"run={run + 1}&step={last}&since={last}&seq={seq}", f"run={run}&step=999999&since=1"):
        with srv.ws(f"/ws?{query}") as ws:
            full = json.loads(ws.recv(timeout=10))
        assert full["resumed"] is False and full["history"][0]["step"] == 1
        assert ev["seq"] in [e["seq"] for e in full["events"]]
    # a query that is not plain integers is left out: a whole hello, never an error
    with srv.ws("/ws?run=x&step=-1&since=1e3&seq=%C2%B2") as ws:
        assert json.loads(ws.recv(timeout=10))["resumed"] is False


def test_an_event_older_than_the_last_one_sent_still_goes_out():
    """Events may reach the hub out of `seq` order (two threads add them); only those `hello`
    carried are skipped."""

    async def main():
        sent: list[dict] = []

        async def send(text):
            sent.append(json.loads(text))

        client = ClientQueue(send)
        client.forget_before(step=0, seq=3)
        client.task = asyncio.create_task(client.run())
        for seq in (3, 5, 4):
            client.offer("event", json.dumps({"type": "event", "data": {"seq": seq}}), seq=seq)
        while len(sent) < 2:
            await asyncio.sleep(0.001)
        client.task.cancel()
        assert [m["data"]["seq"] for m in sent] == [5, 4]

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_pages_hook_change_is_shown_requested_until_the_hooks_message_of_its_version(live):
    """A change from a page applies at a later safe point (after its automatic checkpoint, at a
    step boundary): every page learns at once what was asked for (`requested`, the hook pending),
    and the `hooks` message of that version when it is applied. Two facts, one message each."""
    srv = live(rate=2.0)  # a boundary every half second: the change waits for one
    srv.wait_step(2)
    with srv.ws() as ws:
        box = Inbox(ws)
        hello = box.next(lambda m: m["type"] == "hello")
        applied = hello["session"]["config_version"]
        c = srv.http()
        hook = c.post("/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}})
        assert hook.status_code == 201, hook.text
        hook_id = hook.json()["id"]
        req = box.next(lambda m: m["type"] == "requested")
        assert req["config_version"] == applied + 1
        assert [(h["id"], h["applied_step"]) for h in req["hooks"]] == [(hook_id, None)]
        done = box.next(lambda m: m["type"] == "hooks" and m["config_version"] == req["config_version"])
        assert done["hooks"][0]["applied_step"] is not None
        assert [m["type"] for m in box.all].count("requested") == 1


def test_a_reconnection_after_a_rewind_gets_the_whole_history(live):
    """The page's newest steps may be of the branch a rewind abandoned: not `resumed`."""
    srv = live(rate=None)
    srv.wait_step(3)
    with srv.ws() as ws:
        hello = json.loads(ws.recv(timeout=10))
    run, seq = hello["session"]["run_id"], hello["events"][-1]["seq"] if hello["events"] else 0
    c = srv.http()
    cp = c.post("/api/checkpoints", json={"label": "here"}).json()
    srv.wait_step(srv.insp.step + 3)
    page_step = srv.insp.step
    assert c.post(f"/api/checkpoints/{cp['id']}/rewind").status_code == 202
    wait_until(lambda: any(e["kind"] == "rewind" for e in srv.insp.events()), what="the rewind")
    query = f"run={run}&step={min(page_step, srv.insp.step)}&since={page_step}&seq={seq}"
    with srv.ws(f"/ws?{query}") as ws:
        again = json.loads(ws.recv(timeout=10))
    assert again["resumed"] is False
    assert any(e["kind"] == "rewind" for e in again["events"])
