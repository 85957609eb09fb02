"""An agent's command (the MCP interface, server/agent.py) shows in the page's event log with an
"agent" badge, next to the hook change it made (a demo served in this process, its page in
Chromium)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from playwright.sync_api import expect

pytest.importorskip("mcp", reason="the agent extra: pip install gradient-inspector[agent]")

from tests.server.test_mcp import agent  # noqa: E402 - after the skip: it imports the SDK

pytestmark = pytest.mark.e2e


def test_the_event_log_badges_an_agents_commands(live: Any, new_page: Any) -> None:
    srv = live()
    srv.wait_step(2)
    page, log = new_page()
    page.set_viewport_size({"width": 1440, "height": 900})
    page.goto(srv.base + "/")
    page.get_by_test_id("step-counter").wait_for()
    calls = [
        ("add_hook", {"kind": "clip_norm", "target": "*", "params": {"max_norm": 0.5}}),
        ("add_hook", {"kind": "clip_norm", "params": {"max_norm": -1}}),
    ]
    with ThreadPoolExecutor(1) as pool:  # Playwright's own event loop runs in this thread
        pool.submit(agent, srv.base, calls).result(timeout=60)
    items = page.locator("[data-testid='event-item'][data-kind='command']")
    expect(items).to_have_count(2)
    ok = items.filter(has_text="add_hook (kind=clip_norm")
    expect(ok.filter(has_text="refused")).to_have_count(1)
    expect(ok.filter(has_not_text="refused")).to_have_count(1)
    for i in range(2):
        expect(items.nth(i).locator(".event-badge")).to_have_text("agent")
    # the change itself: its hook_applied event, beside the agent's line
    expect(page.locator("[data-testid='event-item'][data-kind='hook_applied']")).to_have_count(1)
    shot = os.environ.get("GI_AGENT_SCREENSHOT")
    if shot:  # for a person to look at: GI_AGENT_SCREENSHOT=/tmp/agent.png
        page.screenshot(path=shot)
    assert log.errors == [], log.errors
