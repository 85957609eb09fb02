"""Websocket close codes that need no running training: a failing `hello` (1011)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from server.app import create_app
from server.sources import Source


class BrokenSource(Source):
    """A source whose session cannot be read (a database gone bad under a replay)."""

    def session(self, run: int | None = None) -> dict:
        raise RuntimeError("the database went away")


def test_a_hello_that_cannot_be_built_closes_with_1011_internal_error():
    with TestClient(create_app(BrokenSource())) as client:
        # a loopback name as Host: the DNS-rebinding guard refuses the test client's own "testserver"
        with client.websocket_connect("ws://localhost/ws") as ws, pytest.raises(WebSocketDisconnect) as info:
            ws.receive_text()
    assert info.value.code == 1011 and info.value.reason == "server error: RuntimeError"
