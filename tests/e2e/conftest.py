"""Fixtures for the browser tests: a real `gradient-inspector demo` server and Debian's Chromium.

The server is the real CLI as a subprocess on a free 127.0.0.1 port, waited on by polling
/api/health against a deadline. Chromium is Debian's (`scripts/setup.sh --browser` installs
it; Playwright's own download cannot run here), driven by Python Playwright. Tests wait on
conditions (Playwright's `expect`, `wait_for_function`), never on sleeps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import free_port, stop_process  # noqa: F401 (free_port is used by the tests)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("GI_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def cli_command() -> list[str]:
    """The `gradient-inspector` script of this interpreter's environment, else `python -m server`."""
    script = Path(sys.executable).with_name("gradient-inspector")
    return [str(script)] if script.exists() else [sys.executable, "-m", "server"]


class DemoServer:
    """`gradient-inspector demo --port P --db DB ...` as a subprocess, output captured to a file."""

    def __init__(self, tmp: Path, *, db: Path, port: int | None = None, scenario: str = "mlp",
                 rate: float = 10.0, extra: list[str] | None = None, timeout: float = 60.0) -> None:
        self.port = port or free_port()
        self.db = db
        self.log_path = tmp / f"server-{self.port}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1"}
        args = [*cli_command(), "demo", "--port", str(self.port), "--db", str(db), "--scenario", scenario,
                "--steps-per-second", str(rate), *(extra or [])]
        self.proc = subprocess.Popen(args, cwd=tmp, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.client = httpx.Client(base_url=self.url, trust_env=False, timeout=10.0)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = self.log()
                self.stop()
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{log}")
            try:
                if self.client.get("/api/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise AssertionError(f"server not up within {timeout} s:\n{log}")
            time.sleep(0.05)  # the readiness poll's interval, bounded by the deadline above

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs: Any) -> Any:
        r = self.client.get(path, **kwargs)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        stop_process(self.proc)
        self.client.close()
        if not self._log.closed:
            self._log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per test module. Not per session: while playwright's sync API is active it
    keeps an event loop running on this thread, and later modules' asyncio.run() would fail."""
    path = chromium_path()
    if path is None:
        msg = "no Chromium: run `bash scripts/setup.sh --browser` (installs Debian's chromium)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


class PageLog:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))


@pytest.fixture
def new_page(browser: Any) -> Iterator[Any]:
    """A factory of fresh pages (each in its own context), closed after the test."""
    contexts: list[Any] = []

    def make() -> tuple[Any, PageLog]:
        ctx = browser.new_context(viewport={"width": 1500, "height": 1000})
        contexts.append(ctx)
        page = ctx.new_page()
        page.set_default_timeout(20_000)
        return page, PageLog(page)

    yield make
    for ctx in contexts:
        ctx.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServer]:
    """One mlp demo server shared by a module's tests (each test starts by clearing hooks)."""
    tmp = tmp_path_factory.mktemp("e2e")
    server = DemoServer(tmp, db=tmp / "history.sqlite")
    yield server
    server.stop()
