"""An in-process server for the tests, and the websocket readers they use with it.

`Live` trains a demo scenario in a thread and serves it with a real uvicorn server on a free
127.0.0.1 port (a `ThreadedServer` in this process, waited on through uvicorn's `started`
flag), so a test reaches both ends: the HTTP and websocket API, and the core (`insp`).
The `live` fixture (tests/fixtures.py) makes them and stops them after the test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

import inspector
from inspector import scenarios
from server.app import create_app
from server.history.storage import HistoryStore
from server.live.demo import Trainer
from server.live.source import LiveSource
from server.serving import ThreadedServer
from server.settings import Settings
from tests.support import wait_until


def recv_json(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=timeout))


def recv_until(
    ws: ClientConnection,
    pred: Callable[[dict[str, Any]], bool],
    timeout: float = 10.0,
    seen: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Read messages until one satisfies `pred` (every message read is appended to `seen`)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no matching message within {timeout} s")
        msg = recv_json(ws, left)
        if seen is not None:
            seen.append(msg)
        if pred(msg):
            return msg


class Inbox:
    """Messages of one socket, read in order; `next(pred)` takes the first unconsumed match,
    so a message that arrives before the one a test waits for is not lost."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.pending: list[dict[str, Any]] = []
        self.all: list[dict[str, Any]] = []

    def next(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        for i, msg in enumerate(self.pending):
            if pred(msg):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching message within {timeout} s")
            msg = recv_json(self.ws, left)
            self.all.append(msg)
            if pred(msg):
                return msg
            self.pending.append(msg)
            if len(self.pending) > 10_000:
                del self.pending[:5_000]

    def reply(self, request_id: Any, timeout: float = 10.0) -> dict[str, Any]:
        return self.next(
            lambda m: m["type"] in ("ack", "error") and m.get("request_id") == request_id, timeout
        )


class Live:
    """A demo scenario trained in a thread, served by a real uvicorn server on a free port."""

    def __init__(
        self,
        tmp: Path,
        scenario: str,
        *,
        rate: float | None,
        db: bool | Path,
        read_only: bool,
        host: str,
        token: str | None,
        every: int | None,
        wait: bool = False,
        **settings: Any,
    ) -> None:
        self.sc = scenarios.make(scenario, seed=0)
        self.insp = inspector.attach(self.sc.model, self.sc.optimizer, every=every, flight=256)
        self.trainer = Trainer(self.sc, self.insp, steps_per_second=rate, wait_for_client=wait)
        self.db = (db if isinstance(db, Path) else tmp / f"history-{id(self)}.sqlite") if db else None
        store = HistoryStore(self.db) if self.db else None
        self.settings = Settings(host=host, port=0, token=token, read_only=read_only, **settings)
        self.source = LiveSource(
            self.insp,
            mode="demo",
            store=store,
            read_only=read_only,
            trainer=self.trainer,
            owns_inspector=True,
            scenario={"name": self.sc.name, "description": self.sc.description, "try_this": self.sc.try_this},
        )
        self.app = create_app(self.source, self.settings)
        self.server = ThreadedServer(self.app, self.settings, quiet=True)
        self.server.start()
        self.port = self.server.port
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        self._clients: list[Any] = []

    def http(self, **kwargs: Any) -> httpx.Client:
        client = httpx.Client(base_url=self.base, trust_env=False, timeout=10.0, **kwargs)
        self._clients.append(client)
        return client

    def ws(self, path: str = "/ws", **kwargs: Any) -> ClientConnection:
        kwargs.setdefault("max_size", None)
        conn = connect(f"ws://127.0.0.1:{self.port}{path}", proxy=None, open_timeout=10, **kwargs)
        self._clients.append(conn)
        return conn

    def source_clients(self) -> list[Any]:
        """The hub's client queues (read from the test thread: a snapshot of the dict)."""
        return list(self.app.state.hub.clients.values())

    def wait_step(self, n: int, timeout: float = 20.0) -> int:
        return wait_until(lambda: self.insp.step >= n and self.insp.step, timeout, f"step {n}")

    def stop(self) -> None:
        for client in self._clients:
            try:
                client.close()
            except Exception:
                pass
        self.server.stop()
