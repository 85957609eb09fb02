"""Fixtures for the browser tests: a real `gradient-inspector demo` server and Debian's Chromium.

The server is the real CLI as a subprocess on a free 127.0.0.1 port (`tests.support.start_demo`),
waited on by polling /api/health against a deadline. Chromium is Debian's (`scripts/setup.sh
--browser` installs it; Playwright's own download cannot run here), launched by
`tests.support.launch_chromium` and driven by Python Playwright. Tests wait on conditions
(Playwright's `expect`, `wait_for_function`), never on sleeps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support import NO_CHROMIUM, ServerProcess, chromium_path, launch_chromium, start_demo


@pytest.fixture(autouse=True)
def patient_expect() -> Iterator[None]:
    """Generous waits for Playwright's `expect` (its default is 5 s): the machine running the suite
    may be busy (beside a CPU hog, a replay's page took 6 s to draw its first cards). A wait ends
    as soon as its condition holds; a module may set its own."""
    from playwright.sync_api import expect

    expect.set_options(timeout=20_000)
    yield
    expect.set_options(timeout=5_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per test module. Not per session: while playwright's sync API is active it
    keeps an event loop running on this thread, and later modules' asyncio.run() would fail."""
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail(NO_CHROMIUM)
        pytest.skip(NO_CHROMIUM)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch_chromium(p)
        yield b
        b.close()


class PageLog:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))


@pytest.fixture
def new_page(browser: Any) -> Iterator[Callable[[], tuple[Any, PageLog]]]:
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
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One mlp demo server shared by a module's tests (each test starts by clearing hooks)."""
    tmp = tmp_path_factory.mktemp("e2e")
    with start_demo(tmp, db=tmp / "history.sqlite") as server:
        yield server
