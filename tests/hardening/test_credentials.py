"""Credentials and addresses: the page's token is origin-scoped, the forwarded-for header is
ignored unless a proxy is trusted, every loopback address is loopback, the Origin check compares
the scheme and `Host: localhost:evil` is refused. Traffic goes to loopback only; the browser is Debian's Chromium, as in tests/e2e."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support import NO_CHROMIUM, chromium_path, launch_chromium

TOKEN = "origin-scoped-token-0123456789"


class Recorder(ThreadingHTTPServer):
    """Another service on the same host (another port): it records what each request carried."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[str] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                recorder.seen.append(f"{self.requestline}\n{self.headers}")
                body = b"<!doctype html><title>other service</title>"
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail(NO_CHROMIUM)
        pytest.skip(NO_CHROMIUM)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


@pytest.mark.parametrize("form", ["#token=", "?token="])
def test_the_token_never_reaches_another_port_of_the_same_host(live, recorder, chromium, form):
    """After the token URL (fragment or query form), the page works, keeps the token in
    its origin's sessionStorage, and another server on 127.0.0.1 receives no credential."""
    from playwright.sync_api import expect

    srv = live(token=TOKEN)
    ctx = chromium.new_context()
    try:
        page = ctx.new_page()
        page.set_default_timeout(20_000)
        page.goto(f"{srv.base}/{form}{TOKEN}")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        assert TOKEN not in page.url, "the token left the address bar"

        other = f"http://127.0.0.1:{recorder.server_address[1]}"
        visitor = ctx.new_page()
        visitor.goto(f"{other}/")
        visitor.evaluate("(u) => fetch(u, {credentials: 'include'}).then((r) => r.text())", f"{other}/x")
        assert len(recorder.seen) >= 2, recorder.seen
        for request in recorder.seen:
            assert TOKEN not in request, request
            assert "cookie" not in request.lower(), request

        assert TOKEN in json.dumps(page.evaluate("() => Object.entries(sessionStorage)"))
        assert ctx.cookies() == [], "no cookie holds the token"
        page.reload()  # the tab keeps it: the dashboard comes back without the URL
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    finally:
        ctx.close()


def test_no_cookie_and_the_socket_takes_the_token_as_a_subprotocol(live):
    """On the wire: `/?token=T` sets no cookie, the page shell needs no token, the API and
    the socket still do, and a socket offering `gi-token.HEX` is accepted with our subprotocol."""
    srv = live(token=TOKEN)
    c = srv.http(follow_redirects=False)
    r = c.get("/", params={"token": TOKEN})
    assert r.status_code == 200 and "set-cookie" not in r.headers
    assert c.get("/static/app.js").status_code == 200
    assert c.get("/api/session").status_code == 401
    with srv.ws(subprotocols=["gradient-inspector", f"gi-token.{TOKEN.encode().hex()}"]) as ws:
        assert ws.subprotocol == "gradient-inspector"
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as info:
        srv.ws(subprotocols=["gradient-inspector", f"gi-token.{b'wrong-token-value'.hex()}"])
    assert info.value.response.status_code == 401


def test_forwarded_for_is_ignored_unless_a_proxy_is_trusted(live):
    """A forged X-Forwarded-For per request does not escape the per-address command
    budget (uvicorn's proxy headers are off: the access log's address is the real one too)."""
    srv = live(rate=None, commands_per_second=5.0)  # bursts of 10
    c = srv.http()
    codes = [
        c.post("/api/hooks", json={"kind": "nope"}, headers={"x-forwarded-for": f"10.0.{i // 250}.{i % 250}"})
        for i in range(40)
    ]
    assert 429 in [r.status_code for r in codes], [r.status_code for r in codes]
    assert srv.server.server.config.proxy_headers is False


def test_a_trusted_proxy_is_believed(live):
    srv = live(rate=None, commands_per_second=5.0, trusted_proxy="127.0.0.1")
    c = srv.http()
    codes = [
        c.post("/api/hooks", json={"kind": "nope"}, headers={"x-forwarded-for": f"10.0.0.{i}"}).status_code
        for i in range(40)
    ]
    assert 429 not in codes, codes  # each forwarded address has its own budget


@pytest.mark.parametrize("address", ["127.0.0.2", "127.1.2.3"])
def test_every_loopback_address_serves_the_url_it_prints(live, address):
    """`--host 127.0.0.2` prints a URL its own Host guard accepts (no token needed)."""
    srv = live(rate=None, host=address)
    url = srv.server.url
    assert url.startswith(f"http://{address}:") and "token" not in url, url
    with httpx.Client(trust_env=False, timeout=10) as c:
        assert c.get(url).status_code == 200
        assert c.get(url.rstrip("/") + "/api/session").status_code == 200


@pytest.mark.parametrize(
    "host,status",
    [
        ("127.0.0.2", 200),
        ("127.255.255.254", 200),
        ("localhost:evil", 403),
        ("127.0.0.1:80:80", 403),
        ("[::1]:x", 403),
        ("127.000.0.1", 403),
        ("128.0.0.1", 403),
    ],
)
def test_host_names_loopback_addresses_and_ports(live, host, status):
    """Any plain 127.x.y.z counts as loopback; a port that is not digits does not."""
    srv = live(rate=None)
    r = srv.http().get("/api/session", headers={"host": host})
    assert r.status_code == status, (host, r.text[:200])


def test_the_origin_check_compares_the_scheme(live):
    """`https://127.0.0.1:P` is not the origin of the plain-HTTP server on that port,
    for a command and for the websocket's handshake; nor is `Host: localhost:evil` its host."""
    from websockets.exceptions import InvalidStatus

    srv = live(rate=None)
    c = srv.http()
    own = f"127.0.0.1:{srv.port}"
    assert c.post("/api/training/pause", headers={"origin": f"https://{own}"}).status_code == 403
    assert c.post("/api/training/pause", headers={"origin": f"http://{own}"}).status_code == 202
    for headers in ({"Origin": f"https://{own}"}, {"Host": "localhost:evil"}):
        with pytest.raises(InvalidStatus) as info:
            srv.ws(additional_headers=headers)
        assert info.value.response.status_code == 403, headers
    with srv.ws(additional_headers={"Origin": f"http://{own}"}) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
