"""The dashboard in a real Chromium against a real `gradient-inspector demo` server.

What it must show: the page loads without console errors and its charts get
points; a clip_value hook added through the form caps the flow chart's final abs-max bars
while raw stays above; toggling it off restores them; removing it removes its row; a bad
value shows the server's reason beside the field and changes nothing; pause holds the step
counter and single step advances it by exactly one; after a server restart on the same
database the page reconnects by itself, shows the new run, and opens the previous run.
Also: a page gets its history in the websocket's `hello` (no HTTP backfill), each event and
hook change once, and on a reconnection only what it missed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# The flow chart as drawn: its traces by name and the step it shows.
FLOW = """() => {
  const gd = document.querySelector('[data-testid="chart-flow"]');
  if (!gd || !gd.data) return null;
  const t = Object.fromEntries(gd.data.map((d) => [d.name, Array.from(d.y || [])]));
  return { step: Number(gd.dataset.step || -1), metric: gd.dataset.metric, raw: t.raw, final: t.final };
}"""

# The flow chart as FLOW reads it once it shows a step >= a whose largest raw value is above t
# (arg: [a, t]); null until then.
RAW_ABOVE = f"""([a, t]) => {{
  const f = ({FLOW})();
  return f !== null && f.step >= a && f.raw.some((v) => v !== null && v > t) ? f : null;
}}"""

# Points in each trace of a chart, by trace name.
POINTS = """(id) => {
  const gd = document.querySelector(`[data-testid="${id}"]`);
  if (!gd || !gd.data) return null;
  return Object.fromEntries(gd.data.map((d, i) => [d.name || String(i), (d.type === "heatmap" ? d.z : d.y || []).length]));
}"""


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    return support.wait_until(pred, timeout, what, interval=0.05)


def reset(server: support.ServerProcess) -> None:
    """No hooks, training running: each test starts from the same state."""
    for hook in server.get("/api/hooks"):
        server.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    server.client.post("/api/training/resume").raise_for_status()


def open_dashboard(page: Any, server: support.ServerProcess) -> None:
    page.goto(server.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    # A few streamed steps drawn: every chart that follows the newest snapshot has data.
    page.wait_for_function(
        """() => {
          const gd = document.querySelector('[data-testid="chart-flow"]');
          return gd && gd.data && gd.data.length === 2 && gd.data[0].y.length > 0 && Number(gd.dataset.step) > 0;
        }"""
    )


def pick_by_click(page: Any, chart: str, params: list[str], index: int) -> None:
    """Click parameter `index` in the flow chart (its bar) or the heatmap (its row)."""
    page.get_by_test_id(chart).scroll_into_view_if_needed()
    plot = page.locator(f"[data-testid={chart}] .nsewdrag").first.bounding_box()
    n = len(params)
    if chart == "chart-flow":  # categories left to right
        x, y = plot["x"] + (index + 0.5) / n * plot["width"], plot["y"] + plot["height"] - 4
    else:  # rows top to bottom, newest steps on the right
        x, y = plot["x"] + plot["width"] * 0.95, plot["y"] + (index + 0.5) / n * plot["height"]
    page.mouse.click(x, y)


def numbers(values: list[Any]) -> list[float]:
    return [float(v) for v in values if v is not None]


def test_page_loads_without_console_errors_and_the_charts_get_points(
    demo: support.ServerProcess, new_page: Any
) -> None:
    reset(demo)
    page, log = new_page()
    open_dashboard(page, demo)
    params = [p["name"] for p in demo.get("/api/session")["params"]]
    # The time series grow as steps stream in.
    first = page.evaluate(POINTS, "chart-loss")
    page.wait_for_function(
        """([id, n]) => { const gd = document.querySelector(`[data-testid="${id}"]`);
                          return gd.data[1].x.length > n + 3; }""",
        arg=["chart-loss", first["grad norm raw"]],
    )
    loss = page.evaluate(POINTS, "chart-loss")
    assert loss["loss"] > 0 and loss["grad norm raw"] > 0 and loss["grad norm final"] > 0
    heat = page.evaluate(POINTS, "chart-heatmap")
    assert heat["raw"] > 0  # one row of z per sampled step
    flow = page.evaluate(FLOW)
    assert len(flow["raw"]) == len(params) and len(numbers(flow["final"])) > 0
    ratio = page.evaluate(POINTS, "chart-ratio")
    assert list(ratio.values())[0] == len(params)
    # The histogram: a parameter is picked (the list, or a click in the heatmap/flow chart),
    # subscribed to over the websocket, and its bins arrive.
    page.get_by_test_id("hist-param").select_option(params[0])
    page.wait_for_function(
        """(name) => { const gd = document.querySelector('[data-testid="chart-hist"]');
                       return gd.data && gd.data.length === 2 && gd.data[0].y.length > 0
                         && document.querySelector('[data-testid="hist-status"]').textContent.startsWith(name); }""",
        arg=params[0],
    )
    # ... a click on a bar of the flow chart, or on a row of the heatmap, picks it too.
    pick_by_click(page, "chart-flow", params, len(params) - 1)
    expect(page.get_by_test_id("hist-param")).to_have_value(params[-1])
    pick_by_click(page, "chart-heatmap", params, 1)
    expect(page.get_by_test_id("hist-param")).to_have_value(params[1])
    expect(page.get_by_test_id("step-counter")).to_have_text(re.compile(r"^\d+$"))
    expect(page.get_by_test_id("overhead")).not_to_have_text("–")
    expect(page.get_by_test_id("cadence")).to_contain_text("every")
    assert page.url == demo.url + "#all"  # no navigation: the address opened, its view kept
    assert log.errors == []


def test_clip_value_from_the_form_caps_final_toggle_restores_remove_removes(
    demo: support.ServerProcess, new_page: Any
) -> None:
    reset(demo)
    page, log = new_page()
    open_dashboard(page, demo)
    page.get_by_test_id("flow-metric").locator('button[data-value="absmax"]').click()
    page.wait_for_function(f"() => ({FLOW})().metric === 'absmax'")
    flow = page.evaluate(FLOW)
    # Below most raw abs-max values, so clipping shows while raw stays above.
    threshold = float(f"{max(numbers(flow['raw'])) * 0.3:.3g}")

    form = page.get_by_test_id("add-hook-form")
    form.get_by_test_id("add-hook-kind").select_option("clip_value")
    assert form.get_by_test_id("add-hook-point").input_value() == "pre_step"
    form.get_by_test_id("add-hook-target").fill("*")
    n = len(demo.get("/api/session")["params"])
    expect(form.get_by_test_id("add-hook-matches")).to_contain_text(f"{n} matches")
    form.get_by_test_id("hook-param-threshold").fill(str(threshold))
    form.get_by_test_id("add-hook-submit").click()
    step_at_click = demo.get("/api/session")["training"]["step"]

    row = page.get_by_test_id("hook-row")
    expect(row).to_have_count(1)
    expect(row.get_by_test_id("hook-status")).to_contain_text("since step")
    applied = int(row.get_by_test_id("hook-status").inner_text().split()[-1])
    assert applied <= step_at_click + 3, ("the hook took effect within a few steps", applied, step_at_click)
    hooks = demo.get("/api/hooks")
    assert [(h["kind"], h["target"], h["params"]["threshold"]) for h in hooks] == [
        ("clip_value", "*", threshold)
    ]

    # From applied_step on: final abs-max <= threshold on a drawn step where raw is above it (the
    # demo's per-step abs-max varies tenfold from batch to batch, so a step is waited for).
    flow = page.wait_for_function(RAW_ABOVE, arg=[applied, threshold]).json_value()
    assert max(numbers(flow["final"])) <= threshold * (1 + 1e-6), flow
    assert max(numbers(flow["raw"])) > threshold, flow

    # Toggle off: once applied, final equals raw again.
    row.get_by_test_id("hook-toggle").click()
    expect(row).to_have_attribute("data-pending", "false")
    expect(row.get_by_test_id("hook-status")).not_to_have_text(f"since step {applied}")
    # the change is "pending" until the step it applies at is known (a page change waits for its
    # automatic what-if checkpoint at the next boundary): wait for that step, then read it
    expect(row.get_by_test_id("hook-status")).to_have_text(re.compile(r"since step \d+$"))
    off = int(row.get_by_test_id("hook-status").inner_text().split()[-1])
    assert demo.get("/api/hooks")[0]["enabled"] is False
    flow = page.wait_for_function(RAW_ABOVE, arg=[off, threshold]).json_value()
    assert max(numbers(flow["final"])) > threshold
    for r, f in zip(flow["raw"], flow["final"], strict=True):
        assert (r is None and f is None) or math.isclose(r, f, rel_tol=1e-6), flow

    # Remove: the row goes, and so does the hook.
    row.get_by_test_id("hook-remove").click()
    expect(page.get_by_test_id("hook-row")).to_have_count(0)
    assert demo.get("/api/hooks") == []
    assert log.errors == []


def test_a_change_from_another_page_shows_pending_at_once_then_the_step_it_applied_at(
    demo: support.ServerProcess, new_page: Any
) -> None:
    """A change accepted (by another tab, a script over HTTP) is on every page at once, pending
    (the `requested` message), and shows the step it applied at once it is applied (`hooks`)."""
    reset(demo)
    page, log = new_page()
    open_dashboard(page, demo)
    demo.client.post("/api/training/rate", json={"steps_per_second": 0.5}).raise_for_status()
    try:
        hook = demo.client.post(
            "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}}
        )
        assert hook.status_code == 201, hook.text
        row = page.get_by_test_id("hook-row")
        expect(row).to_have_count(1)
        expect(row).to_have_attribute("data-pending", "true")
        expect(row.get_by_test_id("hook-status")).to_have_text("pending")
        expect(row).to_have_attribute("data-pending", "false", timeout=15_000)
        expect(row.get_by_test_id("hook-status")).to_have_text(re.compile(r"since step \d+$"))
    finally:
        demo.client.post("/api/training/rate", json={"steps_per_second": 10}).raise_for_status()
    assert log.errors == []


def test_a_bad_value_shows_the_servers_reason_beside_the_field_and_changes_nothing(
    demo: support.ServerProcess, new_page: Any
) -> None:
    reset(demo)
    hook = demo.client.post(
        "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}}
    )
    assert hook.status_code == 201, hook.text
    hook_id = hook.json()["id"]
    page, log = new_page()
    open_dashboard(page, demo)
    row = page.get_by_test_id("hook-row")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-pending", "false")
    version = demo.get("/api/session")["config_version"]

    # The server's own words for these values (invalid requests change nothing).
    patch = demo.client.patch(f"/api/hooks/{hook_id}", json={"params": {"threshold": -1}})
    assert patch.status_code == 422
    reason = patch.json()["detail"][0]["msg"]

    field = row.get_by_test_id("hook-param-threshold")
    field.fill("-1")
    field.press("Enter")
    # `has` locators are relative to the outer match: start them from the page.
    error = row.locator(".field", has=page.get_by_test_id("hook-param-threshold")).get_by_test_id(
        "field-error"
    )
    expect(error).to_have_text(f"{reason}; in force: 1")  # the field is back to the value in force
    expect(field).to_have_value("1")
    assert demo.get("/api/hooks")[0]["params"]["threshold"] == 1.0
    assert demo.get("/api/session")["config_version"] == version

    # The add form likewise: the reason beside its threshold field, no hook added.
    post = demo.client.post(
        "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 0}}
    )
    assert post.status_code == 422
    form = page.get_by_test_id("add-hook-form")
    form.get_by_test_id("add-hook-kind").select_option("clip_value")
    form.get_by_test_id("add-hook-target").fill("*")
    form.get_by_test_id("hook-param-threshold").fill("0")
    form.get_by_test_id("add-hook-submit").click()
    form_error = form.locator(".field", has=page.get_by_test_id("hook-param-threshold")).get_by_test_id(
        "field-error"
    )
    expect(form_error).to_have_text(post.json()["detail"][0]["msg"])
    # A target that matches nothing: the reason beside the target field.
    form.get_by_test_id("add-hook-target").fill("no.such.parameter")
    expect(form.get_by_test_id("add-hook-matches")).to_have_text("matches nothing")
    form.get_by_test_id("hook-param-threshold").fill("0.5")
    form.get_by_test_id("add-hook-submit").click()
    target_error = form.locator(".field", has=page.get_by_test_id("add-hook-target")).get_by_test_id(
        "field-error"
    )
    expect(target_error).not_to_be_empty()
    hooks = demo.get("/api/hooks")
    assert [(h["id"], h["params"]["threshold"]) for h in hooks] == [(hook_id, 1.0)]
    assert demo.get("/api/session")["config_version"] == version
    expect(page.get_by_test_id("hook-row")).to_have_count(1)
    # Chromium logs every 4xx response; the refused requests are this test's point.
    assert [e for e in log.errors if "status of 422" not in e] == []


class Wire:
    """What one page sends and gets: its HTTP requests and each websocket's URL and messages."""

    def __init__(self, page: Any) -> None:
        self.requests: list[str] = []
        self.sockets: list[tuple[str, list[dict[str, Any]]]] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("websocket", self.socket)

    def socket(self, ws: Any) -> None:
        got: list[dict[str, Any]] = []
        self.sockets.append((ws.url, got))
        ws.on("framereceived", lambda payload: got.append(json.loads(payload)))

    def api(self, path: str) -> list[str]:
        return [u for u in self.requests if urlparse(u).path == path]


def test_a_page_gets_each_fact_once_its_history_in_hello_and_on_a_reconnection_what_it_missed(
    demo: support.ServerProcess, new_page: Any
) -> None:
    reset(demo)
    page, log = new_page()
    wire = Wire(page)
    open_dashboard(page, demo)
    # the first round: hello alone brings the history (no HTTP backfill, no session poll)
    assert wire.api("/api/snapshots") == [] and wire.api("/api/events") == [], wire.requests
    assert wire.api("/api/session") == [], wire.requests
    url, got = wire.sockets[0]
    assert urlparse(url).query == "", "a new page has nothing to resume"
    hello = got[0]
    assert hello["type"] == "hello" and hello["resumed"] is False
    shown = page.evaluate("() => window.__dashboard.live.snapshots.map((r) => r.step)")
    assert shown[: len(hello["history"])] == [s["step"] for s in hello["history"]]

    # a hook change: one message, whose event the log shows once
    hook = demo.client.post(
        "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 9.0}}
    )
    assert hook.status_code == 201, hook.text
    row = page.get_by_test_id("hook-row")
    expect(row.get_by_test_id("hook-status")).to_contain_text("since step")
    about = [
        m
        for m in got
        if m["type"] == "hooks" or (m["type"] == "event" and m["data"]["kind"] == "hook_applied")
    ]
    assert [(m["type"], m["event"]["hook_id"]) for m in about] == [("hooks", hook.json()["id"])], about
    items = page.get_by_test_id("event-item").filter(has_text=hook.json()["id"])
    expect(items).to_have_count(1)
    assert all("events" not in m["data"] for m in got if m["type"] == "snapshot")

    # a reconnection names what the page has; the hello brings only what came after
    with page.expect_websocket() as reconnected:
        had = page.evaluate(
            "() => { const d = window.__dashboard; d.conn.socket.close();"
            " return {run: d.live.runId, since: d.live.latest.step, seq: d.live.lastSeq}; }"
        )
    reconnected.value.wait_for_event("framereceived")  # its hello
    url, again = wire.sockets[1]
    query = parse_qs(urlparse(url).query)
    assert int(query["run"][0]) == had["run"] and int(query["since"][0]) >= had["since"]
    assert again[0]["type"] == "hello" and again[0]["resumed"] is True
    since, seq = int(query["since"][0]), int(query["seq"][0])
    assert all(s["step"] > since for s in again[0]["history"])
    assert all(e["seq"] > seq for e in again[0]["events"])
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    page.wait_for_function("(s) => window.__dashboard.live.step > s + 3", arg=since)
    steps = page.evaluate("() => window.__dashboard.live.snapshots.map((r) => r.step)")
    assert steps == sorted(set(steps)), "no step twice"
    seqs = page.evaluate(
        "() => window.__dashboard.live.events.filter((e) => e.seq !== undefined).map((e) => e.seq)"
    )
    assert seqs == sorted(set(seqs)), "no event twice"
    expect(items).to_have_count(1)
    assert wire.api("/api/snapshots") == [] and wire.api("/api/events") == [], wire.requests
    assert log.errors == []


def test_pause_holds_the_step_counter_and_single_step_advances_it_by_one(
    demo: support.ServerProcess, new_page: Any
) -> None:
    reset(demo)
    page, log = new_page()
    open_dashboard(page, demo)
    counter = page.get_by_test_id("step-counter")
    start = int(counter.inner_text())
    page.wait_for_function(
        "(n) => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > n", arg=start
    )

    page.get_by_test_id("pause").click()
    expect(page.get_by_test_id("training-state")).to_have_text("paused")
    # The step under way still completes; then the server holds and the page shows its step.
    held = wait_until(
        lambda: (
            (s := demo.get("/api/session")["training"])["held"]  # the pause has taken hold
            and counter.inner_text() == str(s["step"])
            and s["step"]
        ),
        what="the page's counter to match the paused server",
    )
    page.wait_for_timeout(1500)  # observation window: 15 steps' worth at 10 steps/s, nothing may move
    assert counter.inner_text() == str(held)
    assert demo.get("/api/session")["training"]["step"] == held

    page.get_by_test_id("step").click()
    expect(counter).to_have_text(str(held + 1))
    page.wait_for_timeout(1500)  # observation window: still exactly one step more
    assert counter.inner_text() == str(held + 1)
    training = demo.get("/api/session")["training"]
    assert (training["state"], training["step"]) == ("paused", held + 1)

    page.get_by_test_id("resume").click()
    expect(page.get_by_test_id("training-state")).to_have_text("running")
    page.wait_for_function(
        "(n) => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > n + 2",
        arg=held + 1,
    )
    assert log.errors == []


def test_after_a_server_restart_the_page_reconnects_shows_the_new_run_and_opens_the_old_one(
    tmp_path: Path, new_page: Any
) -> None:
    db = tmp_path / "history.sqlite"
    first = support.start_demo(tmp_path, db=db)
    second: support.ServerProcess | None = None
    try:
        page, _ = new_page()
        open_dashboard(page, first)
        old_run = first.get("/api/session")["run_id"]
        expect(page.get_by_test_id("run-picker")).to_have_value(str(old_run))
        page.wait_for_function(
            "() => Number(document.querySelector('[data-testid=\"step-counter\"]').textContent) > 15"
        )
        first.stop()
        status = page.get_by_test_id("connection-status")
        expect(status).not_to_have_attribute("data-state", "live")

        second = support.start_demo(tmp_path, db=db, port=first.port)
        new_run = second.get("/api/session")["run_id"]
        assert new_run != old_run
        expect(status).to_have_attribute("data-state", "live", timeout=40_000)
        expect(page.get_by_test_id("run-picker")).to_have_value(str(new_run))
        expect(page.locator("body")).to_have_attribute("data-run", str(new_run))
        expect(page.get_by_test_id("event-log")).to_contain_text(f"new run {new_run}")

        runs = {r["id"]: r for r in second.get("/api/runs")["runs"]}
        first_steps = runs[old_run]["steps"]
        assert first_steps > 15 and runs[new_run]["live"] and not runs[old_run]["live"]
        old_steps = second.get("/api/snapshots", params={"run": old_run})["snapshots"]
        assert old_steps

        # The previous run, read-only, from its stored history.
        page.get_by_test_id("run-picker").select_option(str(old_run))
        banner = page.get_by_test_id("history-banner")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text(f"Run {old_run}")
        last_old = max(s["step"] for s in old_steps)
        page.wait_for_function(
            """(last) => { const gd = document.querySelector('[data-testid="chart-loss"]');
                           const x = gd.data[1].x; return x.length > 10 && x[x.length - 1] === last; }""",
            arg=last_old,
        )
        expect(page.get_by_test_id("step-counter")).to_have_text(str(last_old))
        for control in ("pause", "resume", "step", "add-hook-submit"):
            expect(page.get_by_test_id(control)).to_be_disabled()

        page.get_by_test_id("back-to-live").click()
        expect(banner).to_be_hidden()
        expect(page.get_by_test_id("pause")).to_be_enabled()
        expect(page.get_by_test_id("run-picker")).to_have_value(str(new_run))
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_a_token_url_leaves_the_address_bar_and_read_only_disables_every_control(
    tmp_path: Path, new_page: Any
) -> None:
    token = "e2e-secret-token-0123456789abcdef"
    server = support.start_demo(
        tmp_path, db=tmp_path / "history.sqlite", extra=["--token", token, "--read-only"]
    )
    try:
        page, log = new_page()
        page.goto(f"{server.url}?token={token}#all")
        # The page moved the token to sessionStorage: the address bar is clean.
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        assert "token" not in page.url
        page.wait_for_function(
            "() => { const gd = document.querySelector('[data-testid=\"chart-flow\"]');"
            " return gd.data && gd.data[0].y.length > 0; }"
        )
        expect(page.get_by_test_id("read-only-badge")).to_be_visible()
        controls = page.locator(
            "[data-testid=pause], [data-testid=resume], [data-testid=step], [data-testid=rate],"
            " [data-testid=add-hook-form] input, [data-testid=add-hook-form] select,"
            " [data-testid=add-hook-form] button, [data-testid=preset-import-button]"
        )
        assert controls.count() >= 8
        for i in range(controls.count()):
            expect(controls.nth(i)).to_be_disabled()
        assert log.errors == []
    finally:
        server.stop()
