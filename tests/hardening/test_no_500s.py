"""Inputs that used to answer 500 (an `OverflowError` from a 401-digit integer,
a NUL byte in a static path) answer 4xx, over HTTP and the websocket, and the core's own API
raises `HookError` for them. tests/hardening/test_api_fuzz.py draws such values too."""

from __future__ import annotations

import json

import pytest

from inspector import HookError
from tests.live import Inbox

BIG = 10**400  # a 401-digit integer: valid JSON, too large for a float

HOOKS = [  # (kind, the parameter given a big integer, the kind's required parameters)
    ("clip_value", "threshold", {"threshold": 1.0}),
    ("clip_norm", "max_norm", {"max_norm": 1.0}),
    ("scale", "factor", {"factor": 1.0}),
    ("noise", "std", {"std": 0.1}),
    ("noise", "seed", {"std": 0.1}),
]


def big_body(kind: str, key: str, base: dict, sign: int = 1) -> str:
    return json.dumps({"kind": kind, "target": "*", "params": {**base, key: sign * BIG}})


@pytest.mark.parametrize("kind,key,base", HOOKS)
def test_a_401_digit_integer_is_a_422_never_a_500(live, kind, key, base):
    srv = live(rate=None)
    c = srv.http(headers={"content-type": "application/json"})
    for sign in (1, -1):
        r = c.post("/api/hooks", content=big_body(kind, key, base, sign))
        assert r.status_code == 422, r.text[:300]
        assert r.json()["detail"][0]["loc"] == ["params", key], r.text[:300]
    hook = c.post("/api/hooks", json={"kind": kind, "target": "*", "params": base}).json()
    r = c.patch(f"/api/hooks/{hook['id']}", content=json.dumps({"params": {key: BIG}}))
    assert r.status_code == 422, r.text[:300]
    preset = '{"hooks": [' + big_body(kind, key, base) + "]}"
    assert c.post("/api/hooks/import", content=preset).status_code == 422
    with srv.ws() as ws:
        inbox = Inbox(ws)
        inbox.next(lambda m: m["type"] == "hello")
        ws.send(json.dumps({"type": "add_hook", "request_id": 1, **json.loads(big_body(kind, key, base))}))
        reply = inbox.reply(1)
        assert reply["type"] == "error" and reply["status"] == 422, reply
    assert [h["id"] for h in srv.insp.hooks()] == [hook["id"]]


def test_big_integers_in_queries_and_other_bodies_are_4xx(live):
    srv = live(rate=None)
    c = srv.http(headers={"content-type": "application/json"})
    for path in (
        f"/api/snapshots?since={BIG}",
        f"/api/snapshots?limit={BIG}",
        f"/api/snapshots?since=-{BIG}",
        f"/api/events?since={BIG}",
        f"/api/session?run={BIG}",
        f"/api/snapshots?run={BIG}",
    ):
        r = c.get(path)
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
    r = c.post("/api/training/rate", content=f'{{"steps_per_second": {BIG}}}')
    assert r.status_code == 422, r.text[:300]
    hook = c.post("/api/hooks", json={"kind": "scale", "target": "*", "params": {"factor": 1.0}}).json()
    r = c.patch(f"/api/hooks/{hook['id']}", content=f'{{"position": {BIG}}}')
    assert 400 <= r.status_code < 500, r.text[:300]


@pytest.mark.parametrize("path", ["/static/app.js%00.png", "/static/%00", "/docs-assets/a%00b"])
def test_a_nul_byte_in_a_static_path_is_a_404(live, path):
    r = live(rate=None).http().get(path)
    assert r.status_code == 404, r.text[:300]


def test_the_core_raises_hook_error_for_numbers_too_large_for_a_float(live):
    insp = live(rate=None).insp
    with pytest.raises(HookError):
        insp.record(loss=BIG)
    with pytest.raises(HookError):
        insp.add_hook("clip_value", target="*", threshold=BIG)
    with pytest.raises(HookError):
        insp.add_hook("scale", target="*", factor=-BIG)
    assert insp.hooks() == []


def test_error_details_never_echo_unbounded_input(live):
    """A 500 KB key or value, or a 60 KB id, comes back cut (a few KB at most) in a
    422 or 404, over HTTP and the websocket."""
    srv = live(rate=None)
    c = srv.http()
    big = "x" * 500_000
    for method, path, body in (
        ("POST", "/api/hooks", {big: 1}),
        ("POST", "/api/hooks", {"kind": "nan_guard", "target": "*", "params": {"action": big}}),
        ("POST", "/api/hooks", {"kind": "nan_guard", "target": "*", "params": {big: 1}}),
        ("POST", "/api/hooks/import", {"hooks": [{"kind": big, "target": "*"}]}),
        ("PATCH", f"/api/hooks/{big[:60_000]}", {}),
    ):
        r = c.request(method, path, json=body)
        assert r.status_code in (404, 422), r.status_code
        assert len(r.content) < 4096, (method, path[:40], len(r.content))
    with srv.ws() as ws:
        inbox = Inbox(ws)
        inbox.next(lambda m: m["type"] == "hello")
        ws.send(json.dumps({"type": "add_hook", "request_id": 3, "kind": "scale", big[:60_000]: 1}))
        reply = inbox.reply(3)
        assert reply["type"] == "error" and len(json.dumps(reply)) < 4096, len(json.dumps(reply))
