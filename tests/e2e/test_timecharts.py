"""The whole run at any scale, in a real Chromium.

Zooming out after 2,000 steps fetches a downsampled history and shows step 1 on every time
chart, zooming into an old range shows it at full resolution, and the charts share one
step axis; on the exploding demo the axes switch to log with round ticks and the heatmap's
colours follow robust quantiles; a non-finite value is a marker; the EMA slider smooths
with the raw line kept faint; another run is overlaid; hook-change markers say which action.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

from tests import support

pytestmark = pytest.mark.e2e

# The loss chart as drawn: each trace's name, x and y, and the axes' ranges and tick labels.
LOSS = """() => {
  const gd = document.querySelector('[data-testid="chart-loss"]');
  if (!gd || !gd.data || !gd._fullLayout) return null;
  const fl = gd._fullLayout;
  const tr = {};
  for (const d of gd.data) tr[d.name] = { x: Array.from(d.x || []), y: Array.from(d.y || []),
    opacity: d.opacity === undefined ? 1 : d.opacity, text: Array.from(d.hovertext || []),
    symbol: d.marker ? d.marker.symbol : null, color: d.marker ? d.marker.color : null };
  return { traces: tr, range: fl.xaxis.range, y: { type: fl.yaxis.type, text: fl.yaxis.ticktext || null },
           y2: { type: fl.yaxis2.type, text: fl.yaxis2.ticktext || null }, scale: gd.dataset.lossScale };
}"""

HEAT = """() => {
  const gd = document.querySelector('[data-testid="chart-heatmap"]');
  if (!gd || !gd.data || !gd.data.length || !gd._fullLayout) return null;
  return { x: Array.from(gd.data[0].x), range: gd._fullLayout.xaxis.range,
           zmin: gd.data[0].zmin, zmax: gd.data[0].zmax };
}"""

ROUND = re.compile(r"^(0\.0*[125]|[125]0*|[125]e-?\d+|0)$")


def wait_until(pred: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    return support.wait_until(pred, timeout, what, interval=0.05)


def open_page(new_page: Any, server: support.ServerProcess, size: tuple[int, int] = (1440, 900)) -> tuple:
    page, log = new_page()
    page.set_viewport_size({"width": size[0], "height": size[1]})
    page.goto(server.url + "#all")  # every card: some tests read charts outside the overview
    expect(page.get_by_test_id("connection-status")).to_have_attribute("data-state", "live")
    wait_until(
        lambda: (page.evaluate(LOSS) or {}).get("traces", {}).get("loss", {}).get("x"), what="loss drawn"
    )
    return page, log


def loss(page: Any) -> dict:
    return page.evaluate(LOSS)


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.ServerProcess]:
    """An mlp demo at 400 steps/s: past 2,000 steps within seconds."""
    tmp = tmp_path_factory.mktemp("fast")
    with support.start_demo(tmp, rate=400, db=tmp / "h.sqlite") as server:
        yield server


def test_zooming_out_after_2000_steps_shows_step_1_and_zooming_in_full_resolution(fast, new_page):
    wait_until(lambda: fast.get("/api/session")["training"]["step"] > 2000, 120, "2,000 steps")
    page, log = open_page(new_page, fast)
    first = loss(page)["traces"]["loss"]["x"][0]
    assert first > 1000, "before zooming out the chart holds the streamed window only"
    page.get_by_test_id("whole-run").click()
    wait_until(lambda: loss(page)["traces"]["loss"]["x"][0] == 1, what="step 1 on the loss chart")
    wait_until(lambda: page.evaluate(HEAT)["x"][0] <= 2, what="the oldest steps on the heatmap")
    # the thinned history and the streamed window are unevenly spaced: drawn on an even grid,
    # which Plotly draws as one image of a pixel a cell (not cell by cell, then encoded)
    drawn = page.evaluate(
        """() => { const gd = document.querySelector('[data-testid="chart-heatmap"]');
                   const img = gd.querySelector('image');
                   return { linear: gd._fullData[0]._islinear, rendering: getComputedStyle(img).imageRendering }; }"""
    )
    assert drawn == {"linear": True, "rendering": "pixelated"}, drawn
    # the hover names the step a cell shows: the run's step nearest to the grid point
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    at = page.evaluate(
        """() => { const gd = document.querySelector('[data-testid="chart-heatmap"]'), t = gd.data[0];
                   const j = Math.floor(t.x.length * 0.3), xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
                   const r = gd.getBoundingClientRect();
                   return { x: r.left + xa._offset + xa.l2p(t.x[j]), y: r.top + ya._offset + ya.l2p(ya.d2l(t.y[0])),
                            steps: [...new Set(t.text[0])] }; }"""
    )
    page.mouse.move(at["x"], at["y"])
    hover = """() => { const h = document.querySelector('[data-testid="chart-heatmap"]')._hoverdata;
                       return h && h[0] ? { x: h[0].x, text: h[0].text } : null; }"""
    h = wait_until(lambda: page.evaluate(hover), what="the heatmap's hover")
    assert h["text"] in at["steps"], h
    assert abs(h["text"] - h["x"]) == min(abs(s - h["x"]) for s in at["steps"]), h
    d = loss(page)
    assert d["range"][0] <= 1, "the axis shows step 1"
    assert len(d["traces"]["loss"]["x"]) < 2 * 2000, "the whole run comes downsampled"
    # streaming goes on at the right edge
    right = d["range"][1]
    wait_until(lambda: loss(page)["range"][1] > right + 50, what="the right edge following the stream")
    # zooming into an old range: that range at full resolution, on every time chart
    page.evaluate(
        """() => Plotly.relayout(document.querySelector('[data-testid="chart-loss"]'),
                                 {"xaxis.range[0]": 300, "xaxis.range[1]": 360})"""
    )

    def zoomed() -> bool:
        xs = [x for x in loss(page)["traces"]["loss"]["x"] if 300 <= x <= 360]
        return xs == list(range(300, 361))

    wait_until(zoomed, what="every step of 300..360 on the loss chart")
    wait_until(lambda: [round(v) for v in page.evaluate(HEAT)["range"]] == [300, 360], what="heatmap linked")
    assert log.errors == []


def test_the_loss_chart_smooths_with_an_ema_and_keeps_the_raw_line_faint(fast, new_page):
    page, log = open_page(new_page, fast)
    assert loss(page)["traces"]["loss smoothed"]["y"] == []
    slider = page.get_by_test_id("smoothing")
    slider.fill("0.9")
    expect(page.get_by_test_id("smoothing-value")).to_have_text("0.9")

    def smoothed() -> dict | None:
        t = loss(page)["traces"]
        return t if len(t["loss smoothed"]["y"]) == len(t["loss"]["y"]) > 20 else None

    t = wait_until(smoothed, what="a smoothed loss as long as the loss")
    assert t["loss"]["opacity"] < 0.5 and t["grad norm final"]["opacity"] < 0.5, "raw kept, faint"
    raw = [v for v in t["loss"]["y"] if v is not None]
    ema = [v for v in t["loss smoothed"]["y"] if v is not None]
    rough = lambda ys: sum(abs(a - b) for a, b in zip(ys, ys[1:], strict=False))  # noqa: E731
    assert rough(ema) < 0.5 * rough(raw), "the EMA is smoother than the raw loss"
    assert len(t["grad norm final smoothed"]["y"]) == len(t["grad norm final"]["y"])
    assert log.errors == []


def test_hook_change_markers_show_the_action_with_its_own_symbol(fast, new_page):
    page, log = open_page(new_page, fast)
    fast.client.post("/api/training/pause").raise_for_status()
    try:
        hook = fast.client.post(
            "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 5.0}}
        ).json()
        for change in (
            lambda: fast.client.patch(f"/api/hooks/{hook['id']}", json={"params": {"threshold": 2.5}}),
            lambda: fast.client.patch(f"/api/hooks/{hook['id']}", json={"enabled": False}),
            lambda: fast.client.patch(f"/api/hooks/{hook['id']}", json={"enabled": True}),
            lambda: fast.client.delete(f"/api/hooks/{hook['id']}"),
        ):
            fast.client.post("/api/training/step").raise_for_status()  # each change on a step of its own
            change().raise_for_status()
        fast.client.post("/api/training/step").raise_for_status()

        def tips() -> dict | None:
            t = loss(page)["traces"]["hook change"]
            return t if len(t["x"]) >= 5 else None

        t = wait_until(tips, what="five hook-change markers")
    finally:
        fast.client.post("/api/training/resume").raise_for_status()
    texts = t["text"][-5:]
    for word, text in zip(["added", "updated", "disabled", "enabled", "removed"], texts, strict=True):
        assert word in text, texts
    assert "threshold 5 → 2.5" in texts[1], "an edit names the values before and after"
    assert "threshold=2.5" in texts[2] and "threshold=2.5" in texts[4], "disable and remove name the values"
    assert len(set(t["symbol"][-5:])) == 5 and len(set(t["color"][-5:])) == 5, t
    # the heatmap, on the same step axis, shows the same changes as lines
    shapes = """() => (document.querySelector('[data-testid="chart-heatmap"]').layout.shapes || [])
                       .map((s) => s.x0)"""
    wait_until(lambda: set(t["x"][-5:]) <= set(page.evaluate(shapes)), what="the markers on the heatmap")
    assert log.errors == []


def test_the_exploding_demos_axes_go_log_with_round_ticks_and_robust_heatmap_colours(tmp_path, new_page):
    with support.start_demo(tmp_path, scenario="exploding", rate=40, db=None) as server:
        page, log = open_page(new_page, server, (1024, 768))

        def exploded() -> dict | None:
            d = loss(page)
            ys = [v for v in d["traces"]["loss"]["y"] if v is not None and v > 0]
            return d if ys and max(ys) / min(ys) > 1e12 and d["scale"] == "log" else None

        d = wait_until(exploded, 60, "the loss spanning 12 decades, on a log axis")
        for ax in ("y", "y2"):
            assert d[ax]["type"] == "log"
            labels = d[ax]["text"]
            assert labels and 2 <= len(labels) <= 12, labels
            assert all(ROUND.match(s) for s in labels), labels
            assert len(set(labels)) == len(labels)
        # the heatmap's colour range: robust quantiles, below the largest cell's value
        cells = """() => {
          const gd = document.querySelector('[data-testid="chart-heatmap"]');
          if (!gd.data || !gd.data.length || gd.data[0].x.length < 90) return null;
          const z = gd.data[0].z.flat().filter((v) => v !== null && Number.isFinite(v));
          const max = Math.max(...z);
          return max > 20 ? { max, zmax: gd.data[0].zmax } : null; // wait until the explosion is drawn
        }"""
        heat = wait_until(
            lambda: page.evaluate(cells), 60, "the heatmap drawn past the explosion (cells > 1e20)"
        )
        assert heat["zmax"] < heat["max"] - 5, heat  # one explosive stretch does not set the colour range
        page.screenshot(path=str(tmp_path / "exploding-1024.png"))
        assert log.errors == []


def test_tick_labels_are_round_at_every_span_and_one_outlier_does_not_set_the_colours(fast, new_page):
    page, log = open_page(new_page, fast)
    out = page.evaluate(
        """async () => {
          const { logTicks } = await import("/static/ticks.js");
          const { HeatmapChart } = await import("/static/charts.js");
          const spans = [[1e-3, 1e34], [0.94482, 1.43408], [0.5, 3], [2.1, 2.3], [1e-5, 1e-2], [0.2, 40]];
          const ticks = spans.map((s) => logTicks(s, 8).ticktext);
          const hm = new HeatmapChart(document.createElement("div"), () => {});
          const rows = Array.from({ length: 50 }, (_, i) => [-2 + (i % 5) * 0.1, -1]);
          rows[7][0] = 31; // the one 1e31 cell
          return { ticks, z: hm.zRange(rows) };
        }"""
    )
    for labels in out["ticks"]:
        # at least four where the span allows (a round linear step within a decade: 0.5 ... 3)
        assert 4 <= len(labels) <= 8 and all(
            ROUND.match(s) or re.match(r"^\d(\.\d+)?$", s) for s in labels
        ), labels
        assert len(set(labels)) == len(labels)
    assert out["ticks"][1] == ["1", "1.1", "1.2", "1.3", "1.4"], "never 1.43408 / 0.94482"
    assert out["z"][1] < 1, f"the colour range ignores the outlier: {out['z']}"
    assert log.errors == []


def test_uneven_heatmap_columns_go_on_an_even_grid_each_point_the_nearest_column(fast, new_page):
    page, log = open_page(new_page, fast)
    out = page.evaluate(
        """async () => {
          const { evenColumns } = await import("/static/charts.js");
          const steps = [...Array.from({ length: 20 }, (_, i) => i + 1), 22, 24, 28, 36, 52];
          const cols = steps.map((s) => [s]);
          const a = evenColumns(steps, cols);
          const even = evenColumns([10, 20, 30, 40], [[1], [2], [3], [4]]);
          const wide = Array.from({ length: 5000 }, (_, i) => i * i);  // 0 .. 25M, gaps from 1 up
          const b = evenColumns(wide, wide.map((s) => [s]));
          return { x: a.x, z: a.z.map((c) => c[0]), steps: a.steps, shared: a.z[3] === cols[3],
                   even: even.x, bn: b.x.length, bx: [b.x[0], b.x[b.x.length - 1]],
                   bgaps: new Set(b.x.slice(1).map((v, i) => Math.round((v - b.x[i]) * 1e6))).size };
        }"""
    )
    assert out["x"] == list(range(1, 53)), "every step from the first to the last, one apart"
    assert out["shared"], "the columns are shared, not copied"
    assert out["z"] == out["steps"]
    for x, shown in zip(out["x"], out["steps"], strict=True):  # the nearest column
        near = min(abs(s - x) for s in [*range(1, 21), 22, 24, 28, 36, 52])
        assert abs(shown - x) == near, (x, shown)
    assert out["steps"][21 - 1] == 22, "a tie: the later column"
    assert out["steps"][28 - 1] == 28 and out["steps"][30 - 1] == 28 and out["steps"][33 - 1] == 36
    assert out["even"] == [10, 20, 30, 40], "evenly spaced steps are kept"
    assert out["bn"] == 1200 and out["bx"] == [0, 4999**2] and out["bgaps"] == 1, "at most 1200, even"
    # the hover names the step a cell shows
    text = page.evaluate(
        """() => { const t = document.querySelector('[data-testid="chart-heatmap"]').data[0];
                   return { rows: t.text.length, cols: t.text[0].length, x: t.x.length, y: t.y.length,
                            tpl: t.hovertemplate }; }"""
    )
    assert text["rows"] == text["y"] and text["cols"] == text["x"] and "step %{text}" in text["tpl"], text
    assert log.errors == []


def test_a_non_finite_value_is_a_marker_and_a_scenario_reset_has_its_own(tmp_path, new_page):
    with support.start_demo(tmp_path, scenario="nan", rate=40, db=None) as server:
        page, log = open_page(new_page, server)

        def marked() -> dict | None:
            t = loss(page)["traces"]
            return t if t["non-finite value"]["x"] and t["NaN/Inf"]["x"] else None

        t = wait_until(marked, 60, "a non-finite value marker and a NaN/Inf event marker")
        bad = t["non-finite value"]
        assert all(re.search(r"(NaN|Inf)", s) for s in bad["text"]), bad["text"]
        events = server.get("/api/events")["events"]
        first_nf = min(e["step"] for e in events if e["kind"] == "nonfinite")
        assert min(t["NaN/Inf"]["x"]) == first_nf, "the NaN/Inf event marker at the first such step"
        assert min(bad["x"]) <= first_nf + 1, "the value's marker where the event is"

        def reset() -> dict | None:
            r = loss(page)["traces"]["scenario reset"]
            return r if r["x"] else None

        r = wait_until(reset, 60, "the scenario reset's marker (weights NaN for 30 steps)")
        assert "scenario reset" in r["text"][0] and r["symbol"][0] == "star"
        assert log.errors == []


def test_another_run_of_the_database_is_overlaid_with_its_hook_markers(tmp_path, new_page):
    db = tmp_path / "h.sqlite"
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with support.start_demo(tmp_path / "a", rate=200, db=db) as first:
        first.client.post(
            "/api/hooks", json={"kind": "clip_value", "target": "*", "params": {"threshold": 1.0}}
        ).raise_for_status()
        wait_until(lambda: first.get("/api/session")["training"]["step"] > 300, 60, "300 steps of run 1")
        run1 = first.get("/api/session")["run_id"]
    with support.start_demo(tmp_path / "b", rate=40, db=db) as second:
        page, log = open_page(new_page, second)
        picker = page.get_by_test_id("compare-run")
        picker.focus()
        expect(picker.locator(f'option[value="{run1}"]')).to_have_count(1)
        picker.select_option(str(run1))

        def overlaid() -> dict | None:
            t = loss(page)["traces"]
            return t if t.get(f"run {run1} loss", {}).get("x") else None

        t = wait_until(overlaid, what="run 1's loss overlaid")
        assert max(t[f"run {run1} loss"]["x"]) > 300 and t[f"run {run1} final norm"]["x"]
        marks = t[f"run {run1} hook change"]
        assert marks["x"] and "added clip_value" in marks["text"][0]
        assert all(math.isfinite(v) for v in t[f"run {run1} loss"]["y"] if v is not None)
        assert log.errors == []


def test_a_chart_under_a_pressed_pointer_is_redrawn_only_once_released(fast, new_page):
    """A redraw between a press and its release would lose the click (Plotly replaces what was
    pressed on): the scheduler holds the pressed chart's redraws, and draws it on release."""
    page, log = open_page(new_page, fast)
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    draws = "() => (window.__dashboard.scheduler.stats.heatmap || {draws: 0}).draws"
    step = "() => window.__dashboard.live.step"
    start = page.evaluate(draws)
    wait_until(lambda: page.evaluate(draws) >= start + 2, what="the heatmap redrawn as steps come")
    box = page.locator('[data-testid="chart-heatmap"] .nsewdrag').first.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    held, at = page.evaluate(draws), page.evaluate(step)
    wait_until(lambda: page.evaluate(step) >= at + 20, what="20 more steps while pressed")
    assert page.evaluate(draws) == held, "not redrawn while pressed"
    page.mouse.up()
    wait_until(lambda: page.evaluate(draws) > held, what="redrawn once released")
    assert log.errors == []


# Every Plotly call a chart makes inside the scheduler's update draws (not its resets), per draw;
# those made by a chart's retick (new round ticks after the visible range moved) are told apart.
COUNT_CALLS = """() => {
  const sc = window.__dashboard.scheduler;
  const draws = (window.__updateDraws = []);
  let current = null;
  for (const f of ["react", "newPlot", "update", "restyle", "relayout", "extendTraces", "addTraces"]) {
    const orig = Plotly[f];
    Plotly[f] = function (gd, ...args) {
      if (current && gd === current.el) current.calls.push((current.retick ? "retick:" : "") + f);
      return orig.call(this, gd, ...args);
    };
  }
  for (const s of sc.slots) {
    const c = s.chart;
    if (typeof c.retick !== "function") continue;
    const retick = c.retick.bind(c);
    c.retick = () => {
      if (current) current.retick = true;
      try { retick(); } finally { if (current) current.retick = false; }
    };
  }
  const draw = sc.draw.bind(sc);
  sc.draw = (slot, reset, now, pending) => {
    const rec = { name: slot.name, el: slot.chart.el, calls: [], retick: false };
    current = rec;
    try { draw(slot, reset, now, pending); } finally { current = null; }
    if (!reset) draws.push({ name: rec.name, calls: rec.calls });
  };
}"""


def update_draws(page: Any, name: str) -> list[list[str]]:
    """The Plotly calls of each update draw of chart ``name`` so far (retick's marked)."""
    return [d["calls"] for d in page.evaluate("() => window.__updateDraws") if d["name"] == name]


def test_a_streamed_update_redraws_each_time_chart_once_with_history_ahead_too(fast, new_page):
    """The loss chart and the heatmap take a snapshot's news in one Plotly call (traces, colour
    range, markers and the shared x range together: each call is a whole redraw), also when the
    fetched history of the whole run lies ahead of the streamed window, which stays drawn."""
    page, log = open_page(new_page, fast)
    page.get_by_test_id("chart-heatmap").scroll_into_view_if_needed()
    page.evaluate(COUNT_CALLS)

    def drawn(n: int) -> bool:
        return all(len([c for c in update_draws(page, k) if c]) >= n for k in ("loss", "heatmap"))

    wait_until(lambda: drawn(5), what="5 update draws of each time chart")
    for name in ("loss", "heatmap"):
        for calls in update_draws(page, name):
            assert len([c for c in calls if not c.startswith("retick:")]) <= 1, (name, calls)
    page.get_by_test_id("chart-loss").scroll_into_view_if_needed()
    page.get_by_test_id("whole-run").click()
    wait_until(lambda: loss(page)["traces"]["loss"]["x"][0] == 1, what="step 1 on the loss chart")
    page.evaluate("() => { window.__updateDraws.length = 0; }")
    newest = max(loss(page)["traces"]["grad norm final"]["x"])
    wait_until(lambda: drawn(3), what="3 more update draws with the history ahead")
    d = loss(page)
    assert d["traces"]["loss"]["x"][0] == 1, "the history ahead is kept"
    assert max(d["traces"]["grad norm final"]["x"]) > newest, "the streamed steps are drawn after it"
    for name in ("loss", "heatmap"):
        for calls in update_draws(page, name):
            assert len([c for c in calls if not c.startswith("retick:")]) <= 1, (name, calls)
    assert log.errors == []


def test_the_page_writes_nothing_on_a_frame_where_nothing_changed(fast, new_page):
    """Paused, the step counter is not rewritten on every animation frame (each write is a
    layout for the browser to redo before the next chart's measurements)."""
    page, log = open_page(new_page, fast)
    fast.client.post("/api/training/pause").raise_for_status()
    try:
        held = wait_until(
            lambda: (s := fast.get("/api/session")["training"])["held"] and s["step"], what="the pause held"
        )
        counter = page.get_by_test_id("step-counter")
        wait_until(lambda: counter.inner_text() == str(held), what="the page at the held step")
        writes = page.evaluate(
            """() => new Promise((done) => {
                 const el = document.querySelector('[data-testid="step-counter"]');
                 let n = 0;
                 const obs = new MutationObserver((records) => { n += records.length; });
                 obs.observe(el, { childList: true, characterData: true, subtree: true });
                 let frames = 0;
                 const tick = () => { if (++frames < 30) requestAnimationFrame(tick);
                                      else { obs.disconnect(); done(n); } };
                 requestAnimationFrame(tick);
               })"""
        )
    finally:
        fast.client.post("/api/training/resume").raise_for_status()
    assert writes == 0
    assert log.errors == []


def test_a_small_runs_chart_off_screen_is_drawn_seldom_and_at_once_when_scrolled_to(fast, new_page):
    """Only what is on screen is redrawn at the stream's pace: a chart off screen at most every
    2 s (kept about current, cheaply), and as soon as it scrolls into view."""
    page, log = open_page(new_page, fast)
    page.evaluate("() => window.scrollTo(0, 0)")
    slots = """() => Object.fromEntries(window.__dashboard.scheduler.slots.map((s) =>
                 [s.name, { visible: s.visible, draws: (window.__dashboard.scheduler.stats[s.name] || {draws: 0}).draws }]))"""
    hidden = wait_until(
        lambda: [n for n, s in page.evaluate(slots).items() if not s["visible"]] or None,
        what="a chart off screen",
    )
    name = hidden[-1]
    before = page.evaluate(slots)
    t0 = page.evaluate("() => performance.now()")
    wait_until(
        lambda: page.evaluate(slots)["loss"]["draws"] >= before["loss"]["draws"] + 12, what="12 loss draws"
    )
    after = page.evaluate(slots)
    seconds = (page.evaluate("() => performance.now()") - t0) / 1000
    assert after[name]["draws"] - before[name]["draws"] <= seconds / 2 + 1, (name, seconds, before, after)
    # scrolled into view: drawn at once, whatever its spacing off screen said
    page.evaluate(
        """(name) => { const s = window.__dashboard.scheduler.slots.find((x) => x.name === name);
                       s.nextAt = performance.now() + 60_000; s.chart.el.scrollIntoView(); }""",
        name,
    )
    drawn = page.evaluate(slots)[name]["draws"]
    wait_until(lambda: page.evaluate(slots)[name]["draws"] > drawn, 10, f"{name} drawn once in view")
    assert log.errors == []
