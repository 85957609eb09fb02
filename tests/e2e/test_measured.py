"""What the core measures, shown on the page: module gradients, per-parameter statistics,
histograms over steps, hook effects, and CSV and PNG export.

A real `gradient-inspector demo` (mlp) and Debian's Chromium; every wait is on a condition.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e


def open_live(demo: support.ServerProcess, new_page: Any) -> tuple[Any, Any]:
    for hook in demo.get("/api/hooks"):
        demo.client.delete(f"/api/hooks/{hook['id']}").raise_for_status()
    page, log = new_page()
    page.goto(demo.url + "#all")
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    return page, log


def card_of(page: Any, chart_testid: str) -> Any:
    return page.locator(f'.card:has([data-testid="{chart_testid}"])')


def test_each_chart_exports_csv_and_png(demo: support.ServerProcess, new_page: Any) -> None:
    page, log = open_live(demo, new_page)
    charts = page.evaluate(
        "() => [...document.querySelectorAll('.card .chart')].map((el) => el.dataset.testid)"
    )
    assert "chart-loss" in charts and "chart-flow" in charts, charts
    for testid in charts:
        card = card_of(page, testid)
        expect(card.get_by_test_id("export-csv")).to_have_count(1)
        expect(card.get_by_test_id("export-png")).to_have_count(1)

    # The loss chart's CSV holds its loss series, as drawn.
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-loss"]');
                   return gd && gd.data && gd.data[0].x.length >= 3; }"""
    )
    with page.expect_download() as dl:
        card_of(page, "chart-loss").get_by_test_id("export-csv").click()
    download = dl.value
    assert download.suggested_filename == "gradient-inspector-chart-loss.csv"
    text = Path(download.path()).read_text(encoding="utf-8")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["series", "x", "y"]
    loss_rows = [r for r in rows[1:] if r[0] == "loss"]
    assert len(loss_rows) >= 3 and all(float(r[1]) >= 1 for r in loss_rows), rows[:5]

    # The flow chart's PNG is a real PNG image.
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-flow"]');
                   return Boolean(gd.data && gd.dataset.step); }"""
    )
    with page.expect_download() as dl:
        card_of(page, "chart-flow").get_by_test_id("export-png").click()
    download = dl.value
    assert download.suggested_filename == "gradient-inspector-chart-flow.png"
    data = Path(download.path()).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert log.errors == []


def drawn(page: Any, testid: str) -> Any:
    """The traces of a chart as drawn: name, meta, x and y."""
    return page.evaluate(
        """(id) => { const gd = document.querySelector(`[data-testid="${id}"]`);
             if (!gd || !gd.data) return null;
             return gd.data.map((t) => ({ name: t.name, meta: t.meta || null, x: t.x, y: t.y })); }""",
        testid,
    )


def snapshots_by_step(demo: support.ServerProcess) -> dict[int, dict[str, Any]]:
    return {s["step"]: s for s in demo.get("/api/snapshots", params={"limit": 600})["snapshots"]}


def test_a_module_log_hook_makes_a_module_chart_with_finite_values(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_live(demo, new_page)
    expect(page.get_by_test_id("card-modules")).to_be_hidden()  # no module_log hook: no chart
    demo.client.post("/api/hooks", json={"kind": "module_log", "target": "0"}).raise_for_status()
    expect(page.get_by_test_id("card-modules")).to_be_visible()
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-modules"]');
                   return gd && gd.data && gd.data.length &&
                          gd.data[0].y.filter((v) => v !== null).length >= 3; }"""
    )
    traces = drawn(page, "chart-modules")
    assert [t["meta"] for t in traces] == [{"module": "0", "key": "grad_output_norm"}], traces
    stored = snapshots_by_step(demo)
    compared = 0
    for x, y in zip(traces[0]["x"], traces[0]["y"], strict=True):
        if y is None:
            continue
        assert y > 0 and y == pytest.approx(stored[x]["modules"]["0"]["grad_output_norm"], rel=1e-9)
        compared += 1
    assert compared >= 3
    # The hook's row shows the newest value.
    row = page.get_by_test_id("hook-row").filter(has_text="module_log")
    expect(row).to_contain_text("‖grad_output‖")
    # grad_input when a hook asks for it (module 0's input is the data: it has none; module 2's is
    # the ReLU's output).
    demo.client.post(
        "/api/hooks", json={"kind": "module_log", "target": "2", "params": {"grad_input": True}}
    ).raise_for_status()
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-modules"]');
                   return gd.data.some((t) => t.meta.module === "2" && t.meta.key === "grad_input_norm" &&
                                              t.y.some((v) => v !== null && v > 0)); }"""
    )
    second = page.get_by_test_id("hook-row").filter(has_text="module_log").nth(1)
    expect(second).to_contain_text("‖grad_input‖")
    assert log.errors == []


def test_picking_a_parameter_shows_its_mean_and_std_equal_to_the_api(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_live(demo, new_page)
    card = page.get_by_test_id("card-param-stats")
    expect(card).to_contain_text("mean")
    expect(card).to_contain_text("std")
    # A name filter, matched by the server with the targets' rule.
    page.get_by_test_id("param-filter").fill("0.weight")
    expect(page.get_by_test_id("param-picked").get_by_test_id("param-chip")).to_have_count(1)
    expect(page.get_by_test_id("param-filter-status")).to_have_text("1 match")
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-param-stats"]');
                   return gd && gd.data && gd.data.length === 2 &&
                          gd.data.every((t) => t.meta.param === "0.weight" &&
                                               t.y.filter((v) => v !== null).length >= 3); }"""
    )
    traces = drawn(page, "chart-param-stats")
    assert [t["meta"]["stat"] for t in traces] == ["grad_mean", "grad_std"]
    stored = snapshots_by_step(demo)
    params = [p["name"] for p in demo.get("/api/session")["params"]]
    i = params.index("0.weight")
    for t in traces:
        pairs = [(x, y) for x, y in zip(t["x"], t["y"], strict=True) if y is not None]
        assert len(pairs) >= 3
        for x, y in pairs:
            assert y == pytest.approx(stored[x][t["meta"]["stat"]][i], rel=1e-9), (t["name"], x)

    # A glob picks every match; another statistic adds a row of the chart.
    page.get_by_test_id("param-filter").fill("0.*")
    expect(page.get_by_test_id("param-picked").get_by_test_id("param-chip")).to_have_count(2)
    page.get_by_test_id("param-stats-toggle").locator('button[data-value="update_ratio"]').click()
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-param-stats"]');
                   return gd && gd.data && gd.data.length === 6; }"""
    )
    # A pattern that matches nothing says so, and keeps what is shown.
    page.get_by_test_id("param-filter").fill("nothing.here*")
    expect(page.get_by_test_id("param-filter-status")).to_have_text("no parameter matches")
    expect(page.get_by_test_id("param-picked").get_by_test_id("param-chip")).to_have_count(2)

    # The table of the newest sampled step, sorted by a column on a click.
    table = page.get_by_test_id("param-table")
    expect(table.get_by_test_id("param-row")).to_have_count(len(params))
    table.locator('[data-testid="param-sort"][data-key="grad_std"]').click()
    expect(table.locator('th[aria-sort="descending"]')).to_contain_text("std")
    shown = page.evaluate(
        """() => { const t = document.querySelector('[data-testid="param-table"]');
                   return { step: Number(t.dataset.step),
                            names: [...t.querySelectorAll('[data-testid="param-row"]')].map((r) => r.dataset.param) }; }"""
    )
    snap = demo.get("/api/snapshots", params={"since": shown["step"] - 1})["snapshots"][0]
    assert snap["step"] == shown["step"]
    std = {p: snap["grad_std"][k] for k, p in enumerate(params)}
    with_std = [p for p in shown["names"] if std[p] is not None]
    assert with_std == sorted(with_std, key=lambda p: -std[p])
    assert shown["names"][: len(with_std)] == with_std  # no value (one element: null) last
    # A click on a chart picks a parameter (the flow chart's bar, as Plotly reports a click).
    page.wait_for_function("() => Boolean(document.querySelector('[data-testid=\"chart-flow\"]').data)")
    page.evaluate(
        """() => document.querySelector('[data-testid="chart-flow"]')
                   .emit("plotly_click", { points: [{ x: "2.weight" }] })"""
    )
    expect(page.get_by_test_id("param-picked")).to_contain_text("2.weight")
    # A row's click picks its parameter.
    table.locator('[data-testid="param-row"][data-param="2.bias"]').click()
    expect(page.get_by_test_id("param-picked")).to_contain_text("2.bias")
    assert log.errors == []


def test_a_histogram_over_steps_shows_quantile_bands_raw_and_final(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_live(demo, new_page)
    page.get_by_test_id("hist-param").select_option("2.weight")
    page.wait_for_function(
        """() => { const el = document.querySelector('[data-testid="chart-hist-time"]');
                   return el.dataset.param === "2.weight" && Number(el.dataset.points) >= 3; }""",
        timeout=60_000,
    )
    traces = drawn(page, "chart-hist-time")
    low, high, median = traces[0]["y"], traces[1]["y"], traces[-1]["y"]  # min, max, median
    assert traces[-1]["name"] == "median"
    for lo, hi, med in zip(low, high, median, strict=True):
        assert lo <= med <= hi and lo < hi
    # The newest histogram's range is the bands' outer edge.
    newest = traces[0]["x"][-1]
    stored = snapshots_by_step(demo)[newest]["hist"]["2.weight"]
    counts = stored["raw"]
    first = next(k for k, c in enumerate(counts) if c > 0)
    last = max(k for k, c in enumerate(counts) if c > 0)
    assert low[-1] == pytest.approx(stored["edges"][first]) and high[-1] == pytest.approx(
        stored["edges"][last + 1]
    )
    page.get_by_test_id("hist-time-source").locator('button[data-value="final"]').click()
    page.wait_for_function(
        """() => { const gd = document.querySelector('[data-testid="chart-hist-time"]');
                   return gd.layout.yaxis.title.text.startsWith("final") && gd.data[0].x.length >= 3; }"""
    )
    assert log.errors == []


def test_hook_effects_show_a_post_accumulate_clip_and_an_l2_hook(
    demo: support.ServerProcess, new_page: Any
) -> None:
    page, log = open_live(demo, new_page)
    clip = demo.client.post(
        "/api/hooks",
        json={
            "kind": "clip_value",
            "target": "0.*",
            "point": "post_accumulate",
            "params": {"threshold": 0.01},
        },
    )
    l2 = demo.client.post("/api/hooks", json={"kind": "l2", "target": "*", "params": {"lam": 0.01}})
    clip.raise_for_status()
    l2.raise_for_status()
    ids = [clip.json()["id"], l2.json()["id"]]

    def series(hook: str, key: str) -> list[float]:
        for t in drawn(page, "chart-effects") or []:
            if t["meta"] == {"hook": hook, "key": key}:
                return [y for y in t["y"] if y is not None]
        return []

    page.wait_for_function(
        """(ids) => { const gd = document.querySelector('[data-testid="chart-effects"]');
                      return gd && gd.data && ids.every((id) => gd.data.some((t) =>
                        t.meta.hook === id && t.meta.key === "norm_ratio" &&
                        t.y.filter((v) => v !== null).length >= 3)); }""",
        arg=ids,
    )
    # The clip acts at post_accumulate, inside "raw": only its effect shows it.
    assert all(r < 0.9 for r in series(ids[0], "norm_ratio"))
    assert all(c > 0 for c in series(ids[0], "changed"))
    # l2 changes the norm by about a percent, visibly not 1.
    assert all(0.8 < r < 1.2 and r != 1.0 for r in series(ids[1], "norm_ratio"))
    legend = [t["name"] for t in drawn(page, "chart-effects")]
    assert any("clip_value @post_accumulate on 0.*" in n for n in legend), legend
    expect(page.get_by_test_id("flow-note")).to_contain_text("pre_step")
    assert log.errors == []


def test_a_filter_typed_before_the_first_snapshot_keeps_its_picks(new_page: Any, tmp_path: Path) -> None:
    """The page's own first choice of a parameter (the histogram's default, the largest gradient
    norm when the first snapshot arrives) joins the parameter statistics only while nothing is
    picked there: a filter typed before any data reached the page (a slow machine, a busy server)
    keeps exactly what it picked (before: the default was added beside it, two chips). The page's
    websocket is routed through the test, which holds the snapshots back (the hello's history
    too), lets the filter pick another parameter than the default the newest held one gives, then
    sends that one and drops the rest until the page has chosen its default."""
    import json

    held: list[dict[str, Any]] = []
    state = {"mode": "hold"}  # hold -> drop (after the held ones are sent) -> pass
    page_side: list[Any] = []

    def route(ws: Any) -> None:
        server = ws.connect_to_server()
        page_side.append(ws)

        def from_server(message: Any) -> None:
            if state["mode"] != "pass" and isinstance(message, str):
                m = json.loads(message)
                if m.get("type") == "snapshot":
                    if state["mode"] == "hold":
                        held.append(m["data"])
                    return
                if m.get("type") == "hello" and m.get("history"):
                    held.extend(m["history"])
                    message = json.dumps({**m, "history": []})
            ws.send(message)

        server.on_message(from_server)

    def hist_param(page: Any) -> str:
        return page.evaluate("() => document.querySelector('[data-testid=hist-param]').value")

    with support.start_demo(tmp_path, scenario="mlp", rate=10) as srv:
        support.wait_until(lambda: srv.get("/api/session")["training"]["step"] >= 3, 30, "step 3")
        names = srv.get("/api/snapshots", params={"limit": 1})["params"]
        page, log = new_page()
        page.route_web_socket("**/ws*", route)
        page.goto(srv.url + "#all")
        expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
        # (the route's handler runs while Playwright works: each poll asks the page something)
        support.wait_until(lambda: page.evaluate("() => true") and held, 30, "a snapshot held back")
        state["mode"] = "drop"
        assert hist_param(page) == ""
        norms = held[-1]["grad_norm_raw"]
        default = names[max(range(len(names)), key=lambda i: norms[i])]
        other = next(n for n in names if n != default)
        page.get_by_test_id("param-filter").fill(other)
        chips = page.get_by_test_id("param-picked").get_by_test_id("param-chip")
        expect(chips).to_have_count(1)
        # the newest held snapshot alone: the page's first frame with data picks its default from it
        # (several could be drawn over several frames, the first of them deciding)
        page_side[-1].send(json.dumps({"type": "snapshot", "data": held[-1]}))
        # the snapshot drawn: the histogram picked its default parameter
        page.wait_for_function("() => !!document.querySelector('[data-testid=hist-param]').value")
        assert hist_param(page) == default
        state["mode"] = "pass"
        expect(chips).to_have_count(1)
        expect(chips).to_have_attribute("data-param", other)
        assert log.errors == []
