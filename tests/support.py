"""Helpers shared by the test suites: polling against a deadline, free ports, stopping processes."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
               interval: float = 0.01) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail naming ``what`` after ``timeout`` s.

    For conditions in other threads or processes that offer nothing to await; the interval
    only bounds how often ``pred`` runs, the deadline bounds the wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], grace: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
