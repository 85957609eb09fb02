"""Issue 15, caps on what a client can grow: the number of hooks (point 2) and the length of event
strings (point 8). Traffic goes to 127.0.0.1 only."""

from __future__ import annotations

import json

from inspector.registry import MAX_HOOKS
from tests.live import Inbox

HOOK = {"kind": "scale", "target": "*", "params": {"factor": 1.0}}


def test_one_cap_on_hooks_for_add_and_import_alike(live):
    """Point 2: the exported `{"hooks": [...]}` form, the bare list, POST and the socket all stop
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
