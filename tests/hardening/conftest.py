"""Fixtures of the hardening tests: a websocket `observer` that checks the stream as it goes, and
a `swarm` of clients in another process. The suite-wide ones (`live`, `cli_server`) are in
tests/fixtures.py; plain helpers in tests/support.py, tests/live.py and tools.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from .tools import Swarm


class Observer(threading.Thread):
    """A websocket client that reads everything, in a thread, and checks the stream as it goes:
    snapshot steps strictly increase (hello's history included), `hooks` messages' config_version
    never goes down. `closed` holds the close code if the server closed it."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="observer")
        self.url = url
        self.steps: list[int] = []
        self.versions: list[int] = []
        self.events: list[dict[str, Any]] = []
        self.types: dict[str, int] = {}
        self.errors: list[str] = []
        self.closed: int | None = None
        self.ready = threading.Event()
        self._halt = threading.Event()
        self._ws: ClientConnection | None = None

    def run(self) -> None:
        try:
            with connect(self.url, proxy=None, max_size=None, open_timeout=10) as ws:
                self._ws = ws
                hello = json.loads(ws.recv(timeout=10))
                assert hello["type"] == "hello", hello["type"]
                self.steps.extend(s["step"] for s in hello["history"])
                self.ready.set()
                while not self._halt.is_set():
                    try:
                        msg = json.loads(ws.recv(timeout=0.2))
                    except TimeoutError:
                        continue
                    kind = msg["type"]
                    self.types[kind] = self.types.get(kind, 0) + 1
                    if kind == "snapshot":
                        step = msg["data"]["step"]
                        if self.steps and step <= self.steps[-1]:
                            self.errors.append(f"snapshot step {step} after {self.steps[-1]}")
                        self.steps.append(step)
                    elif kind == "event":
                        self.events.append(msg["data"])
                    elif kind == "hooks":
                        v = msg["config_version"]
                        if self.versions and v < self.versions[-1]:
                            self.errors.append(f"config_version {v} after {self.versions[-1]}")
                        self.versions.append(v)
        except ConnectionClosed as e:
            self.closed = e.rcvd.code if e.rcvd is not None else -1
        except Exception as e:  # noqa: BLE001 - reported by check()
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.ready.set()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def check(self) -> None:
        assert self.closed is None, f"the observer was closed with {self.closed}"
        assert not self.errors, self.errors


@pytest.fixture
def observer() -> Iterator[Any]:
    """`observer(url)`: a started Observer (stopped at teardown)."""
    started: list[Observer] = []

    def make(url: str) -> Observer:
        obs = Observer(url)
        obs.start()
        assert obs.ready.wait(15), "observer: no hello"
        started.append(obs)
        return obs

    yield make
    for obs in started:
        obs.stop()


@pytest.fixture
def swarm() -> Iterator[Any]:
    started: list[Swarm] = []

    def make(url: str, **kwargs: Any) -> Swarm:
        s = Swarm(url, **kwargs)
        started.append(s)
        s.start()
        return s

    yield make
    for s in started:
        s.kill()
