"""Fixtures shared by the server and hardening suites, registered for the whole suite by
``pytest_plugins`` in tests/conftest.py.

``live``: an in-process demo server (`tests.live.Live`); ``cli_server``: `gradient-inspector`
as a subprocess (`tests.support.start_cli`). Each is a factory that stops what it started
after the test. Plain helpers (``wait_until``, ``Inbox``, ``recv_until``, ...) are imported
from tests/support.py and tests/live.py, not taken as fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import ServerProcess, start_cli

if TYPE_CHECKING:
    from tests.live import Live


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Callable[..., Live]]:
    """`live(scenario="mlp", rate=50.0, db=True, read_only=False, host="127.0.0.1", token=None, every=1, wait=False)`;
    `wait`: train nothing until `srv.trainer.client_arrived()` (or a page connects)."""
    # imported here, not at the top: a suite that never asks for `live` does not import the web stack
    from tests.live import Live

    started: list[Live] = []

    def make(
        scenario: str = "mlp",
        *,
        rate: float | None = 50.0,
        db: bool | Path = True,
        read_only: bool = False,
        host: str = "127.0.0.1",
        token: str | None = None,
        every: int | None = 1,
        wait: bool = False,
        **settings: Any,
    ) -> Live:
        server = Live(
            tmp_path,
            scenario,
            rate=rate,
            db=db,
            read_only=read_only,
            host=host,
            token=token,
            every=every,
            wait=wait,
            **settings,
        )
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def cli_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """`cli_server(args, token=None, timeout=60.0)`: `gradient-inspector ARGS --port P` on a free
    port, run in ``tmp_path`` with its output in a log file there, ready once /api/health answers."""
    started: list[ServerProcess] = []

    def make(args: list[str], *, token: str | None = None, timeout: float = 60.0) -> ServerProcess:
        server = start_cli(args, log_dir=tmp_path, token=token, timeout=timeout)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
