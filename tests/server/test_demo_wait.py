"""`gradient-inspector demo` trains only once the first page (websocket)
connects, so a scenario's hint can be followed from step 0; `--no-wait` starts at once."""

from __future__ import annotations

import json

from websockets.sync.client import connect

from tests.support import wait_until


def step(server) -> int:
    return server.get("/api/session")["training"]["step"]


def test_demo_waits_for_the_first_page_before_training(cli_server):
    server = cli_server(["demo", "--no-db", "--steps-per-second", "50"])
    assert "training starts when the first page connects" in server.log()
    assert step(server) == 0
    with connect(f"ws://127.0.0.1:{server.port}/ws", proxy=None, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "hello"
        wait_until(lambda: step(server) >= 3, 30, "steps after the first page connected")


def test_demo_no_wait_trains_at_once(cli_server):
    server = cli_server(["demo", "--no-db", "--no-wait", "--steps-per-second", "50"])
    assert "first page connects" not in server.log()
    wait_until(lambda: step(server) >= 3, 30, "steps without any page")
