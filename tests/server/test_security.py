"""The security rules (server/PROTOCOL.md "Security, briefly") against real servers. Traffic goes
to 127.0.0.1 only, even for 0.0.0.0 binds."""

from __future__ import annotations

import json
import re

import pytest
from websockets.exceptions import InvalidStatus

from server import security
from tests.live import Inbox


def refused(srv, status: int, **kwargs) -> None:
    with pytest.raises(InvalidStatus) as info:
        srv.ws(**kwargs)
    assert info.value.response.status_code == status


def test_any_other_bind_needs_the_token(live):
    srv = live(host="0.0.0.0")
    token = srv.settings.token
    assert token and len(token) >= 22, "generated: at least 128 bits"
    assert srv.server.url.endswith(f"/#token={token}"), "a fragment: never sent over the wire"
    c = srv.http()
    assert c.get("/api/health").status_code == 200, "health needs no token"
    for path in ("/api/session", "/api/hooks", "/api/snapshots", "/api/events"):
        assert c.get(path).status_code == 401, path
    for path in ("/", "/static/app.js", "/openapi.json", "/docs"):  # the static shell holds no data
        assert c.get(path).status_code == 200, path
    assert c.post("/api/training/pause").status_code == 401
    assert c.get("/api/session", headers={"authorization": "Bearer wrong-token"}).status_code == 401
    assert c.get("/api/session", params={"token": token[:-1]}).status_code == 401
    refused(srv, 401)
    refused(srv, 401, additional_headers={"authorization": "Bearer nope"})
    assert srv.insp.state["state"] == "running"

    assert c.get("/api/session", headers={"authorization": f"Bearer {token}"}).status_code == 200
    assert c.get("/api/session", params={"token": token}).status_code == 200
    with srv.ws(f"/ws?token={token}") as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
    with srv.ws(additional_headers={"authorization": f"Bearer {token}"}) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"

    # the page (frontend/api.js) offers the token as a websocket subprotocol; no cookie is set
    with srv.ws(subprotocols=["gradient-inspector", f"gi-token.{token.encode().hex()}"]) as ws:
        assert ws.subprotocol == "gradient-inspector"
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
    assert "set-cookie" not in srv.http().get("/", params={"token": token}).headers


def test_tokens_are_compared_in_constant_time(live, monkeypatch):
    calls = []
    real = security.hmac.compare_digest
    monkeypatch.setattr(security.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    srv = live(token="s3cret-token-value")
    assert srv.http().get("/api/session", params={"token": "s3cret-token-value"}).status_code == 200
    assert calls


def test_foreign_origin_is_refused_on_commands_and_the_socket(live):
    srv = live()
    c = srv.http()
    evil = {"origin": "http://evil.example"}
    r = c.post("/api/hooks", json={"kind": "freeze", "target": "*"}, headers=evil)
    assert r.status_code == 403 and "Origin" in r.json()["detail"]
    assert c.post("/api/training/pause", headers=evil).status_code == 403, "body-less POSTs too"
    assert c.delete("/api/hooks/h1", headers=evil).status_code == 403
    assert c.post("/api/training/pause", headers={"origin": "null"}).status_code == 403
    refused(srv, 403, origin="http://evil.example")
    refused(srv, 403, origin=f"http://localhost.evil.example:{srv.port}")
    assert srv.insp.state["state"] == "running" and srv.insp.hooks() == []

    # the page's own origin works, also through an SSH tunnel on another local port
    own = {"origin": f"http://127.0.0.1:{srv.port}"}
    assert c.get("/api/session", headers=evil).status_code == 200, "reads are not origin-checked"
    assert c.post("/api/hooks", json={"kind": "freeze", "target": "2.*"}, headers=own).status_code == 201
    tunnel = {"host": "localhost:9999", "origin": "http://localhost:9999"}
    assert c.post("/api/training/pause", headers=tunnel).status_code == 202
    with srv.ws(origin=f"http://127.0.0.1:{srv.port}") as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"


@pytest.mark.parametrize(
    "host,ok",
    [
        ("localhost:1234", True),
        ("127.0.0.1", True),
        ("[::1]:8000", True),
        ("LOCALHOST:80", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("127.0.0.2:8000", True),  # all of 127.0.0.0/8 is loopback
        ("127.1:8000", False),
        ("localhost.:80", False),
        ("", False),
    ],
)
def test_dns_rebinding_guard_on_loopback(live, host, ok):
    srv = live()
    r = srv.http().get("/api/session", headers={"host": host})
    assert r.status_code == (200 if ok else 403), r.text


def test_forged_host_refused_on_the_socket_too(live):
    srv = live()
    refused(srv, 403, additional_headers={"host": f"evil.example:{srv.port}"})


def test_text_plain_posts_change_nothing(live):
    srv = live()
    c = srv.http()
    body = json.dumps({"kind": "freeze", "target": "*"})
    r = c.post("/api/hooks", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = c.post(
        "/api/training/pause", content="x=1", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415
    r = c.post("/api/hooks/import", content="[]", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert srv.insp.hooks() == [] and srv.insp.state["state"] == "running"


def test_read_only_refuses_every_command(live):
    srv = live(read_only=True)
    c = srv.http()
    srv.wait_step(2)
    attempts = [
        c.post("/api/hooks", json={"kind": "freeze", "target": "*"}),
        c.post("/api/hooks", content="garbage", headers={"content-type": "application/json"}),
        c.patch("/api/hooks/h1", json={"enabled": False}),
        c.delete("/api/hooks/h1"),
        c.post("/api/hooks/import", json=[]),
        c.post("/api/training/pause"),
        c.post("/api/training/resume"),
        c.post("/api/training/step"),
        c.post("/api/training/rate", json={"steps_per_second": 1}),
    ]
    assert [r.status_code for r in attempts] == [403] * len(attempts)
    assert c.get("/api/session").json()["read_only"] is True
    assert c.get("/api/hooks").status_code == 200
    with srv.ws() as ws:
        box = Inbox(ws)
        assert box.next(lambda m: True)["type"] == "hello"
        for i, cmd in enumerate(
            [{"type": "add_hook", "kind": "freeze"}, {"type": "pause"}, {"type": "remove_hook", "id": "h1"}]
        ):
            ws.send(json.dumps({**cmd, "request_id": i}))
            err = box.reply(i)
            assert err["type"] == "error" and err["status"] == 403
        box.next(lambda m: m["type"] == "snapshot"), "the stream still flows"
    assert srv.insp.hooks() == [] and srv.insp.state["state"] == "running"


def test_body_size_limit_and_command_rate_limit(live):
    srv = live(commands_per_second=5)
    c = srv.http()
    r = c.post(
        "/api/hooks/import",
        content=b"[" + b"{}," * (1 << 19) + b"{}]",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    codes = [c.post("/api/hooks", json={"kind": "nope"}).status_code for _ in range(40)]
    assert codes[0] == 422 and 429 in codes
    assert c.get("/api/health").status_code == 200


@pytest.mark.slow
def test_token_never_reaches_the_access_log(cli_server, tmp_path):
    srv = cli_server(["demo", "--host", "0.0.0.0", "--db", str(tmp_path / "h.sqlite")], token=None)
    urls = re.findall(r"http://\S+#token=(\S+)", srv.log())
    assert len(urls) == 1
    token = urls[0]
    c = srv.client
    assert c.get("/api/session", params={"token": token}).status_code == 200
    assert c.get("/", params={"token": token}, follow_redirects=False).status_code == 200
    assert c.get("/api/hooks", params={"token": token, "x": 1}).status_code == 200
    assert c.get("/api/session", headers={"authorization": f"Bearer {token}"}).status_code == 200
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{srv.port}/ws?token={token}", proxy=None, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
    srv.stop()
    log = srv.log()
    assert "GET /api/session?token=<redacted>" in log
    assert "/ws?token=<redacted>" in log
    assert log.count(token) == 1, "only in the start-up URL"


def test_the_agents_streams_per_address_stay_under_its_connections():
    """Streams that could take every connection an address may hold would lock it out again."""
    from server.settings import Settings

    assert Settings(agent_streams_per_client=63).agent_streams_per_client == 63
    with pytest.raises(ValueError, match="agent streams per client"):
        Settings(agent_streams_per_client=64)
