"""Security extras, beyond tests/server/test_security.py: more Host names for
the DNS-rebinding guard, every token path decided by `hmac.compare_digest` alone, a chunked body
past the limit, the websocket frame limit at its edge, the command budget per client address,
no CORS header on any route, and the token kept out of the log however the query spells it.
Traffic goes to 127.0.0.1 only (a second client address, 127.0.0.2, is a loopback source)."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from server import security
from tests.live import Inbox
from tests.support import wait_until


@pytest.mark.parametrize(
    "host",
    [
        "127.1",
        "2130706433",
        "0.0.0.0",
        "[::ffff:127.0.0.1]",
        "[0:0:0:0:0:0:0:1]",
        "localhost.localdomain",
        "127.0.0.1.nip.io",
        "localhost.evil.example",
        "evil.example@localhost",
        "[::1",
        "::1",
        "127.0.0.1 ",
    ],
)
def test_dns_rebinding_guard_refuses_other_spellings(live, host):
    srv = live()
    c = srv.http()
    try:
        r = c.get("/api/session", headers={"host": host})
    except httpx.LocalProtocolError:  # a Host the client itself refuses to send
        return
    assert r.status_code in (400, 403), (host, r.status_code)
    assert c.post("/api/training/pause", headers={"host": host}).status_code in (400, 403)
    assert srv.insp.state["state"] == "running"


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b"content-length: " in out.lower():
                head, _, body = out.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                if len(body) >= length:
                    break
        return out


def test_no_host_header_is_refused(live):
    srv = live()
    reply = raw_request(srv.port, b"GET /api/session HTTP/1.0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403") or reply.startswith(b"HTTP/1.0 403") or b" 400 " in reply[:20], (
        reply[:200]
    )
    with pytest.raises(InvalidStatus) as info:
        srv.ws(additional_headers={"host": "127.0.0.1.nip.io"})
    assert info.value.response.status_code == 403


@pytest.mark.parametrize("verdict", [True, False])
def test_every_token_path_is_decided_by_compare_digest(live, monkeypatch, verdict):
    """Forcing `hmac.compare_digest`'s answer forces every path's: no `==` or prefix check
    anywhere else (query, bearer header, the socket's query and subprotocol)."""
    token = "the-right-token-value"
    srv = live(token=token)
    monkeypatch.setattr(security.hmac, "compare_digest", lambda a, b: verdict)
    given = "a-wrong-token-value!" if verdict else token
    want = 200 if verdict else 401
    c = srv.http(follow_redirects=False)
    assert c.get("/api/session", params={"token": given}).status_code == want
    assert c.get("/api/session", headers={"authorization": f"Bearer {given}"}).status_code == want
    offer = {"subprotocols": ["gradient-inspector", f"gi-token.{given.encode().hex()}"]}
    for path, kwargs in ((f"/ws?token={given}", {}), ("/ws", offer)):
        if verdict:
            with srv.ws(path, **kwargs) as ws:
                assert json.loads(ws.recv(timeout=10))["type"] == "hello"
        else:
            with pytest.raises(InvalidStatus):
                srv.ws(path, **kwargs)


def test_a_chunked_body_past_the_limit_is_refused(live):
    """No Content-Length to refuse early: the limit holds while the body streams in."""
    srv = live()
    chunk = b"[" + b"{}," * 20000
    head = (
        f"POST /api/hooks/import HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40)) + b"0\r\n\r\n"  # 2.4 MB
    reply = raw_request(srv.port, head + body)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert srv.insp.hooks() == [] and srv.http().get("/api/health").status_code == 200


def test_the_frame_limit_at_its_edge(live):
    srv = live()
    with srv.ws() as ws:
        box = Inbox(ws)
        box.next(lambda m: m["type"] == "hello")
        frame = '{"type": "subscribe", "request_id": "edge", "pad": "'
        frame += "x" * ((64 << 10) - len(frame) - 2) + '"}'
        assert len(frame.encode()) == 64 << 10
        ws.send(frame)
        reply = box.reply("edge")
        assert reply["type"] == "error" and reply["detail"][0]["loc"] == ["pad"], "read, answered, still open"
        ws.send(json.dumps({"type": "subscribe", "request_id": "after"}))
        assert box.reply("after")["type"] == "ack"


def test_the_command_budget_is_per_client_address(live):
    srv = live(commands_per_second=5)
    c = srv.http()
    other = httpx.Client(
        base_url=srv.base,
        trust_env=False,
        timeout=10,
        transport=httpx.HTTPTransport(local_address="127.0.0.2"),
    )
    try:
        codes = [c.post("/api/hooks", json={"kind": "nope"}).status_code for _ in range(30)]
        assert 429 in codes and set(codes) <= {422, 429}, codes
        assert c.get("/api/hooks").status_code == 200, "reads are not budgeted"
        assert other.post("/api/hooks", json={"kind": "nope"}).status_code == 422, (
            "another address has its own"
        )
        assert srv.insp.hooks() == []
        # the budget refills (5 a second)
        wait_until(
            lambda: c.post("/api/hooks", json={"kind": "nope"}).status_code == 422, 10, "a refilled budget"
        )
    finally:
        other.close()


@pytest.mark.parametrize("token", [None, "a-token-for-this-test"])
def test_no_cors_header_on_any_route(live, token):
    srv = live(token=token)
    c = srv.http()
    paths = ["/", "/ws", "/docs", "/openapi.json", "/vendor/plotly.min.js", "/static/app.js", "/nope"]
    paths += [
        p.replace("{hook_id}", "h1").replace("{action}", "pause")
        for p in srv.http(headers={"authorization": f"Bearer {token}"} if token else {})
        .get("/openapi.json")
        .json()["paths"]
    ]
    seen = set()
    for path in paths:
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{srv.port}"):
            for method in ("OPTIONS", "GET", "POST", "DELETE"):
                headers = {
                    "origin": origin,
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "content-type, authorization",
                }
                r = c.request(method, path, headers=headers)
                seen.add(r.status_code)
                leaked = [k for k in r.headers if k.lower().startswith("access-control-")]
                assert not leaked, (method, path, origin, leaked)
                assert r.headers.get("x-frame-options") == "DENY", (method, path)
    assert {401} <= seen if token else {200, 403, 405} <= seen, seen


@pytest.mark.slow
def test_the_token_stays_out_of_the_log_however_it_is_spelled(cli_server, tmp_path):
    srv = cli_server(["demo", "--host", "0.0.0.0", "--db", str(tmp_path / "h.sqlite")])
    token = re.findall(r"http://\S+#token=(\S+)", srv.log())[0]
    c = srv.client
    for query in (
        f"token={token}",
        f"TOKEN={token}",
        f"%74oken={token}",
        f"%54%4F%4B%45%4E={token}",
        f"a=1&token={token}",
        f"token={token}&token={token}",
        f"token={token[:-1]}x",
    ):
        c.get(f"/api/session?{query}")
        c.get(f"/nope?{query}")
    c.get("/api/session", headers={"authorization": f"Bearer {token}"})
    for query in (f"token={token}", f"%74oken={token}"):
        with connect(f"ws://127.0.0.1:{srv.port}/ws?{query}", proxy=None, max_size=None) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "hello"
    srv.stop()
    log = srv.log()
    assert log.count(token) == 1, [line for line in log.splitlines() if token in line][1:]
    assert log.count(token[:-1]) == 1, "a near miss is redacted too"
