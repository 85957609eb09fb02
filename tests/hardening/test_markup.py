"""Markup in names is drawn as text, on the live dashboard and in the HTML report.

Parameter and module names are the user's (a model's attribute names, a dict's keys), and so are
hook targets. Plotly draws a few HTML tags (`<b>`, `<br>`, `<a href>`, `<span style>`) and
entities in whatever text it gets: tick labels, hover text, legends, annotations. Every user
string must reach it escaped exactly once, so it draws the literal characters: no `<a>`, no bold
or styled tspan inside a chart's SVG, `&amp;` shown as the five characters it is, and the
same names untouched where they go into the DOM as text (the parameter table) or into a CSV.

A user-mode server (`insp.serve()`) in this process, a real Chromium, and the real CLI's
`export --format html`. Traffic stays on loopback; the report is opened with every request refused.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import inspector
from server.history.storage import HistoryStore
from tests import support
from tests.support import NO_CHROMIUM, chromium_path, launch_chromium, wait_until

pytestmark = pytest.mark.e2e

# Module names (so parameter names "<name>.weight", "<name>.bias"): a module name holds no dot.
BOLD = "<b>bold</b>"
LINK = '<a href="http:x">link</a>'
BREAK = "y<br>z"
AMP = "a&amp;b"
STYLED = '<span style="color:red">red</span>'
MODULES = [BOLD, LINK, BREAK, AMP, STYLED]
# Shown whole in the ticks (short enough for shortName at 22 characters).
TICKED = [f"{BOLD}.weight", f"{BREAK}.weight", f"{AMP}.weight"]
# A parameter of a dict of tensors may be named anything, dots included.
URL_NAME = '<a href="http://127.0.0.1:1/x">link</a>'

# Everything Plotly drew: each SVG text's characters, and the elements markup would have made.
DRAWN = """() => {
  const svgs = Array.from(document.querySelectorAll(".js-plotly-plot svg"));
  const texts = svgs.flatMap((s) => Array.from(s.querySelectorAll("text"))).map((t) => t.textContent);
  const q = (sel) => svgs.reduce((n, s) => n + s.querySelectorAll(sel).length, 0);
  return {
    texts,
    links: q("a"),
    bold: q('tspan[style*="bold"]'),
    italic: q('tspan[style*="italic"]'),
    styled: q('tspan[style*="red"]'),
  };
}"""

TICKS = """(sel) => Array.from(document.querySelectorAll(sel + " .xtick text, " + sel + " .ytick text"))
  .map((t) => t.textContent)"""

HOVER = (
    """(sel) => Array.from(document.querySelectorAll(sel + " .hoverlayer text")).map((t) => t.textContent)"""
)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name in MODULES:
            self.add_module(name, torch.nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.children():
            x = torch.tanh(m(x))  # no dead units: every gradient is non-zero, every bar drawn
        return x


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail(NO_CHROMIUM)
        pytest.skip(NO_CHROMIUM)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


def hover_until(page: Any, sel: str, curve: int, point: int, name: str) -> None:
    """Hover a bar (Plotly.Fx.hover, again until it shows: Plotly throttles hovers) until the
    hover label holds `name` literally."""

    seen: list[str] = []

    def shown() -> bool:
        page.evaluate(
            "([sel, c, i]) => Plotly.Fx.hover(document.querySelector(sel), [{ curveNumber: c, pointNumber: i }])",
            [sel, curve, point],
        )
        seen[:] = page.evaluate(HOVER, sel)
        return any(name in t for t in seen)

    try:
        wait_until(shown, 20, f"a hover naming {name!r}", interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}; the hover shows {seen}") from None


def check_drawn(drawn: dict[str, Any]) -> None:
    """No element that markup makes, anywhere in the charts."""
    assert drawn["links"] == 0, "an <a> element inside a chart's SVG"
    assert drawn["bold"] == 0 and drawn["italic"] == 0, "a bold or italic tspan inside a chart's SVG"
    assert drawn["styled"] == 0, "a styled tspan inside a chart's SVG"


def test_names_with_markup_are_drawn_literally_on_the_dashboard(tmp_path: Path, chromium: Any) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    db = tmp_path / "markup.sqlite"
    insp = inspector.attach(model, opt, every=1)
    ctx = None
    try:
        # a hook whose target is markup too (the effects chart's legend, the markers' hover), and
        # one that logs every module (the module chart's legend)
        insp.add_hook("clip_value", target=f"{BOLD}.*", threshold=1e-4)
        insp.add_hook("module_log", target="*", point="module")
        url = insp.serve(port=0, db=db)
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            insp.record(loss=loss)
        ctx = chromium.new_context(viewport={"width": 1500, "height": 1000})
        page = ctx.new_page()
        page.set_default_timeout(30_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "#all")  # every card: the flow, ratio and statistics table are not in the overview
        for chart in ("chart-heatmap", "chart-flow", "chart-ratio", "chart-effects", "chart-modules"):
            page.wait_for_function(
                """(id) => { const gd = document.querySelector(`[data-testid="${id}"]`);
                   return gd && gd.data && gd.data.length > 0 && gd.data[0].x && gd.data[0].x.length > 0; }""",
                arg=chart,
            )

        # axis ticks: the heatmap's parameter rows, the flow and ratio charts' bars
        for chart in ("chart-heatmap", "chart-flow", "chart-ratio"):
            ticks = page.evaluate(TICKS, f'[data-testid="{chart}"]')
            for name in TICKED:
                assert any(name in t for t in ticks), (chart, name, ticks)

        # legends: the hook's target (effects), the module names (module chart)
        legends = page.evaluate(
            """() => Array.from(document.querySelectorAll(".js-plotly-plot .legend text"))
                  .map((t) => t.textContent)"""
        )
        assert any(f"on {BOLD}.*" in t for t in legends), legends
        for name in MODULES:
            assert any(name in t for t in legends), (name, legends)

        # hover: a bar of each parameter of the flow chart (a ticked category's hover shows its
        # tick label, shortened past 22 characters: the names that fit it)
        names = page.evaluate(
            """() => document.querySelector('[data-testid="chart-flow"]').data[0].x.length"""
        )
        assert names == len(insp.params)
        for i, name in enumerate(insp.params):
            if len(name) > 22:
                continue
            hover_until(page, '[data-testid="chart-flow"]', 1, i, name)
            check_drawn(page.evaluate(DRAWN))
        # a heatmap cell, hovered with the mouse: its row's full name
        box = page.locator('[data-testid="chart-heatmap"] .nsewdrag').first.bounding_box()
        assert box is not None
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function(
            """() => document.querySelectorAll('[data-testid="chart-heatmap"] .hoverlayer text').length > 0"""
        )
        hover = " ".join(page.evaluate(HOVER, '[data-testid="chart-heatmap"]'))
        assert any(name in hover for name in insp.params), hover

        drawn = page.evaluate(DRAWN)
        check_drawn(drawn)
        assert not any("&amp;amp;" in t or "&lt;" in t for t in drawn["texts"]), "escaped twice"

        # in the DOM as text, the names stay as they are (not entity-escaped)
        page.locator('[data-testid="param-row"]').first.wait_for()
        rows = page.evaluate(
            """() => Array.from(document.querySelectorAll('[data-testid="param-row"]'))
                  .map((r) => r.dataset.param + "|" + r.textContent)"""
        )
        for name in insp.params:
            assert any(r.startswith(f"{name}|") and name in r.split("|", 1)[1] for r in rows), (name, rows)
        # and the CSV of a chart holds them as they are
        csv_names = page.evaluate(
            """async () => { const m = await import("/static/exporting.js");
                 return m.figureRows(document.querySelector('[data-testid="chart-flow"]')).rows.map((r) => r[1]); }"""
        )
        assert set(csv_names) == set(insp.params), csv_names
        # a click on a bar picks that parameter (its category maps back to the name), and the
        # histogram's note names it, literally
        select = page.get_by_test_id("hist-param")
        target = next(n for n in insp.params if n != select.input_value() and n.startswith(LINK))
        page.evaluate(
            """(i) => { const gd = document.querySelector('[data-testid="chart-flow"]');
                 gd.emit("plotly_click", { points: [{ x: gd.data[0].x[i] }] }); }""",
            insp.params.index(target),
        )
        page.wait_for_function(
            """(p) => document.querySelector('[data-testid="hist-param"]').value === p""", arg=target
        )
        wait_until(
            lambda: any(target in t for t in page.evaluate(DRAWN)["texts"]), 20, "the histogram's note"
        )
        check_drawn(page.evaluate(DRAWN))
        assert not errors, errors
    finally:
        if ctx is not None:
            ctx.close()
        insp.close()

    # the HTML report of that run, by the real CLI
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [*support.cli_command(), "export", str(db), "--format", "html", "-o", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=support.repo_env(),
    )
    assert proc.returncode == 0, proc.stderr
    check_report(chromium, out, insp.params, hover_names=[f"{LINK}.weight", f"{BOLD}.bias", f"{AMP}.weight"])


def test_a_dict_of_tensors_named_with_a_link_is_drawn_literally_in_the_report(
    tmp_path: Path, chromium: Any
) -> None:
    """Any name, dots included, from a dict of tensors: written through the history store."""
    names = [URL_NAME, BOLD, f"{AMP}.{BREAK}"]
    db = tmp_path / "dict.sqlite"
    store = HistoryStore(db)
    try:
        run = store.new_run(
            params=[{"name": n, "shape": [4], "numel": 4, "module": None} for n in names], modules=[]
        )
        store.start_writer()
        for step in range(1, 21):
            vals = [0.1 * (i + 1) * step for i in range(len(names))]
            store.add_snapshot(
                run,
                {
                    "step": step,
                    "time": 1.0 * step,
                    "config_version": 0,
                    "loss": 1.0 / step,
                    "grad_norm_raw": vals,
                    "grad_norm": vals,
                    "grad_absmax_raw": vals,
                    "grad_absmax": vals,
                    "update_ratio": [1e-3] * len(names),
                    "total_norm_raw": sum(vals),
                    "total_norm": sum(vals),
                    "events": [],
                },
            )
        store.add_event(
            run,
            {
                "seq": 1,
                "kind": "hook_error",
                "time": 5.0,
                "step": 5,
                "hook_id": "h1",
                "param": URL_NAME,
                "message": "<b>boom</b> &amp; more",
            },
        )
        assert store.flush()
    finally:
        store.close()
    out = tmp_path / "dict.html"
    proc = subprocess.run(
        [*support.cli_command(), "export", str(db), "--format", "html", "-o", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=support.repo_env(),
    )
    assert proc.returncode == 0, proc.stderr
    check_report(chromium, out, names, hover_names=names[1:], marker=f"{URL_NAME}: <b>boom</b> &amp; more")


def check_report(
    chromium: Any, path: Path, names: list[str], *, hover_names: list[str], marker: str | None = None
) -> None:
    """The report, opened offline: its parameter ticks and hovers show `names` literally, and no
    markup element exists in any chart; `marker`: a marker's hover text, shown literally too."""
    ctx = chromium.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = ctx.new_page()
        page.set_default_timeout(30_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        own = path.resolve().as_uri()
        page.route("**/*", lambda r: r.continue_() if r.request.url == own else r.abort())
        page.goto(own)
        page.wait_for_function("document.body.dataset.drawn === 'true'")
        short = [n for n in names if len(n) <= 34]  # report ticks shorten at 34 characters
        for chart in ("chart-heatmap", "chart-absmax", "chart-ratio"):
            ticks = page.evaluate(TICKS, f"#{chart}")
            for name in short:
                assert name in ticks, (chart, name, ticks)
        for name in hover_names:
            hover_until(page, "#chart-absmax", 0, names.index(name), name)
            check_drawn(page.evaluate(DRAWN))
        if marker is not None:
            # the marker's annotation: its hover text is the event's detail, literally
            page.locator("#chart-norms .annotation").first.hover()
            wait_until(
                lambda: any(marker in t for t in page.evaluate(HOVER, "#chart-norms")),
                20,
                "the marker's hover",
            )
        drawn = page.evaluate(DRAWN)
        check_drawn(drawn)
        assert not any("&amp;amp;" in t or "&lt;" in t or "&quot;" in t for t in drawn["texts"]), drawn
        assert not errors, errors
    finally:
        ctx.close()
