"""Caps on what a client can grow: the number of hooks, the length of event strings, the
histogram cap shared among clients, unfinished requests, and the numbers PROTOCOL.md states.
Traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import json
import socket
import sqlite3
import time

from inspector.hooks.registry import MAX_HOOKS
from inspector.wire.records import MAX_EVENT_STRING, event_fields
from tests.live import Inbox
from tests.support import wait_until

HOOK = {"kind": "scale", "target": "*", "params": {"factor": 1.0}}


def test_one_cap_on_hooks_for_add_and_import_alike(live):
    """The exported `{"hooks": [...]}` form, the bare list, POST and the socket all stop
    at MAX_HOOKS, refused with a 422 that names the cap; nothing changes on a refusal."""
    assert MAX_HOOKS == 256
    srv = live(rate=None, commands_per_second=100_000)
    c = srv.http()
    for body in ({"hooks": [HOOK] * (MAX_HOOKS + 1)}, [HOOK] * (MAX_HOOKS + 1), {"hooks": [HOOK] * 5_000}):
        r = c.post("/api/hooks/import", json=body)
        assert r.status_code == 422, r.text[:300]
        assert f"at most {MAX_HOOKS}" in r.text and "MAX_HOOKS" in r.text, r.text[:300]
    assert srv.insp.hooks() == []
    assert c.post("/api/hooks/import", json={"hooks": [HOOK] * MAX_HOOKS}).status_code == 200
    assert len(srv.insp.hooks()) == MAX_HOOKS
    r = c.post("/api/hooks", json=HOOK)
    assert r.status_code == 422 and f"at most {MAX_HOOKS}" in r.text, r.text[:300]
    with srv.ws() as ws:
        inbox = Inbox(ws)
        inbox.next(lambda m: m["type"] == "hello")
        ws.send(json.dumps({"type": "add_hook", "request_id": 7, **HOOK}))
        reply = inbox.reply(7)
        assert reply["type"] == "error" and reply["status"] == 422, reply
    assert len(srv.insp.hooks()) == MAX_HOOKS
    first = srv.insp.hooks()[0]["id"]
    assert c.delete(f"/api/hooks/{first}").status_code in (200, 204)
    assert c.post("/api/hooks", json=HOOK).status_code == 201, "room again once one is removed"


def test_an_oversized_event_string_is_truncated_live_and_stored(live, observer):
    """A hook raising with a 5 MB message, and an event added with a 5 MB field, give
    events of about 2 KB, with a note; every dashboard stays connected, a later hello stays
    small, and so does the stored copy."""
    srv = live(rate=50.0)
    srv.wait_step(2)
    obs = observer(srv.ws_url)
    message = "boom " * 1_000_000

    def raises(name, grad):
        raise RuntimeError(message)

    srv.insp.add_hook(raises, target="*")
    srv.insp.add_event("training_error", message=message, step=srv.insp.step)
    for kind in ("hook_error", "training_error"):
        event = wait_until(
            lambda k=kind: next((e for e in obs.events if e["kind"] == k), None), 20, f"the {kind} event"
        )
        text = event["message"]
        assert len(text) <= MAX_EVENT_STRING + 100, (kind, len(text))
    assert text == f"{message[:MAX_EVENT_STRING]}… [truncated: {len(message)} characters in all]"
    srv.wait_step(srv.insp.step + 3)
    obs.check()
    with srv.ws() as ws:
        hello = ws.recv(timeout=10)
        assert len(hello) < 1 << 20, len(hello)
        assert json.loads(hello)["type"] == "hello"

    def stored() -> list:
        events = srv.http().get("/api/events").json()["events"]
        return [e for e in events if e["kind"] in ("hook_error", "training_error")]

    assert len(wait_until(lambda: len(stored()) == 2 and stored(), 20, "the stored events")) == 2
    biggest = sqlite3.connect(srv.db).execute("SELECT max(length(data)) FROM events").fetchone()[0]
    assert biggest < MAX_EVENT_STRING + 1000, biggest


def test_event_fields_cut_every_string_at_any_depth():
    long = "x" * (MAX_EVENT_STRING + 1)
    out = event_fields({"a": long, "b": [long, {"c": long}], long: 1, "d": "short", "e": float("inf")})
    text = json.dumps(out, allow_nan=False)
    assert long not in text and text.count("truncated") == 4, text[:200]
    assert out["d"] == "short" and out["e"] == "inf"


def test_a_viewer_cannot_deny_histograms_to_another(live):
    """A read-only viewer takes the whole histogram cap first; another client's own
    subscription is still served (the cap is shared in turns)."""
    from inspector.stats.histsel import HIST_CAP

    srv = live("exploding", rate=None, read_only=True)
    names = [p for p in srv.insp.params if p.endswith("weight") or p.endswith("bias")]
    hog, mine = names[:HIST_CAP], names[HIST_CAP]
    with srv.ws() as a, srv.ws() as b:
        inbox_a, inbox_b = Inbox(a), Inbox(b)
        inbox_a.next(lambda m: m["type"] == "hello")
        inbox_b.next(lambda m: m["type"] == "hello")
        a.send(json.dumps({"type": "subscribe", "request_id": 1, "hist": hog}))
        assert inbox_a.reply(1)["type"] == "ack"
        assert srv.insp.hist_params == hog
        b.send(json.dumps({"type": "subscribe", "request_id": 2, "hist": [mine]}))
        assert inbox_b.reply(2)["type"] == "ack"
        served = srv.insp.hist_params
        assert mine in served and len(served) == HIST_CAP, served
        assert hog[0] in served, "the first client keeps its first choice too"
    wait_until(lambda: srv.insp.hist_params == [], 20, "both subscriptions dropped with their sockets")


def test_partial_requests_are_closed_and_bounded_per_address(live):
    """300 requests whose headers never finish, from one address (127.0.0.2, a loopback
    source): the server holds at most `connections_per_client` of them, closes each within its
    request timeout, and a complete request from another address is served meanwhile."""
    srv = live(rate=None, request_timeout=1.0, connections_per_client=16)
    partial = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", srv.port))
            try:
                s.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            except OSError:  # already refused: over the cap
                pass
            partial.append(s)
        assert srv.http().get("/api/health").status_code == 200

        def held() -> int:
            conns = list(srv.server.server.server_state.connections)
            return sum(1 for c in conns if c.client and c.client[0] == "127.0.0.2")

        wait_until(lambda: held() <= 16, 10, "at most 16 connections held for 127.0.0.2")
        deadline = time.monotonic() + 30
        for s in partial:  # every one is closed by the server (EOF or reset), none left hanging
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                data = s.recv(1024)  # a timeout here: the server left it open
            except ConnectionResetError:
                data = b""
            assert data == b"", data
        assert held() == 0
    finally:
        for s in partial:
            s.close()


def test_protocol_md_states_the_real_frame_limit_and_seed_maximum():
    """PROTOCOL.md's numbers are the server's: uvicorn's frame limit, noise's seed range."""
    from pathlib import Path

    from inspector.wire.kinds import KINDS
    from server.app import create_app
    from server.serving import uvicorn_config
    from server.settings import Settings

    text = Path(__file__).parents[2].joinpath("server", "PROTOCOL.md").read_text()
    settings = Settings(port=0)
    config = uvicorn_config(create_app(_NoSource(), settings), settings, quiet=True)  # type: ignore[arg-type]
    assert config.ws_max_size == 1 << 20
    assert "| 1009 | a frame over 1 MiB" in text
    assert f"a frame over {settings.max_frame >> 10} KiB" in text
    (seed,) = [p for p in KINDS["noise"].params if p.name == "seed"]
    assert seed.maximum == 2**63 - 1 and "from 0 to 2^63-1" in text


class _NoSource:
    read_only = True
