"""The HTML report's page: its files in frontend/report/, with frontend/ticks.js inlined.

tests/e2e/test_report.py opens real reports in Chromium; these check without a browser that
render() fills every field of the template, and that the inlining refuses what it cannot
inline instead of writing a page whose script fails.
"""

from __future__ import annotations

import re
import time

import pytest

from server.history import report
from server.history.report_assets import ReportError, inline_module, page_source
from server.history.storage import HistoryStore

TICKS = "export function a(x) {\n  return x;\n}\n\nfunction hidden() {}\n\nexport const b = 2;\n"
MODULE_SYNTAX = re.compile(r"^\s*(?:import|export)\b", re.M)


def test_the_module_and_the_helpers_it_imports_become_one_classic_script() -> None:
    script = inline_module('import { a } from "../ticks.js";\n\nconsole.log(a(1));\n', TICKS)
    assert script.startswith('"use strict";\n(function () {\n')
    assert not MODULE_SYNTAX.search(script)
    # ticks.js runs in a scope of its own; the module sees what it imported, nothing else
    assert "const { a } = (function () {\nfunction a(x) {" in script
    assert "return { a, b };\n})();\n\n\nconsole.log(a(1));" in script


def test_a_multi_line_import_as_prettier_wraps_a_long_one() -> None:
    script = inline_module('import {\n  a,\n  b,\n} from "../ticks.js";\n\nb;\n', TICKS)
    assert "const { a, b } = (function () {" in script and not MODULE_SYNTAX.search(script)


@pytest.mark.parametrize(
    ("module", "error"),
    [
        (
            'import { c } from "../ticks.js";\n',
            "report.js imports c from ticks.js, which exports no such name",
        ),
        ('import { hidden } from "../ticks.js";\n', "imports hidden from ticks.js"),
        ('import { a as c } from "../ticks.js";\n', "imports a as c from ticks.js"),
        ('import { a } from "./util.js";\n', "an import or export statement the report cannot inline"),
        ("export const x = 1;\n", "an import or export statement the report cannot inline"),
    ],
)
def test_what_it_cannot_inline_is_refused(module: str, error: str) -> None:
    with pytest.raises(ReportError, match=re.escape(error)):
        inline_module(module, TICKS)


def test_the_shipped_page_imports_only_what_ticks_js_exports() -> None:
    template, css, script = page_source()  # raises ReportError on a name ticks.js lacks
    assert "function decadeTicks(lo, hi)" in script and "function drawHeat(" in script
    assert not MODULE_SYNTAX.search(script)
    assert "{css}" in template and "{scripts}" in template


def test_render_fills_every_field_and_inlines_the_styles_and_scripts(tmp_path) -> None:
    store = HistoryStore(tmp_path / "h.sqlite")
    run = store.new_run(
        params=[{"name": "0.weight", "shape": [2], "numel": 2, "module": "0"}], modules=["", "0"]
    )
    store.start_writer()
    store.add_hooks(run, 0, [])
    for step in (1, 2, 3):
        store.add_snapshot(
            run,
            {
                "step": step,
                "time": time.time(),
                "loss": 1.0 / step,
                "grad_norm_raw": [0.5],
                "grad_norm": [0.5],
                "grad_absmax_raw": [0.2],
                "grad_absmax": [0.2],
                "update_ratio": [1e-3],
                "total_norm_raw": 0.5,
                "total_norm": 0.5,
                "events": [],
            },
        )
    store.close()
    store = HistoryStore(tmp_path / "h.sqlite", read_only=True)
    try:
        page = report.render(report.collect(store, run), "/* plotly.js */")
    finally:
        store.close()

    template, css, script = page_source()
    assert page.startswith("<!DOCTYPE html>\n")
    assert css in page and f"<script>/* plotly.js */</script>\n<script>{script}</script>" in page
    # outside the inlined styles and scripts, no field of the template is left unfilled
    markup = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", page, flags=re.S)
    assert re.findall(r"\{\w+\}", markup) == []
    assert "default-src 'none'" in markup and "connect-src 'none'" in markup  # the CSP: no fetch
    assert "<h1>Run 1</h1>" in markup and "(step 3)" in markup


def test_missing_page_files_are_reported_before_the_output_file_is_made(
    tmp_path, monkeypatch, capsys
) -> None:
    from server import app, cli

    store = HistoryStore(tmp_path / "h.sqlite")
    store.new_run(params=[{"name": "w", "shape": [1], "numel": 1, "module": ""}], modules=[""])
    store.close()
    broken = tmp_path / "frontend"
    broken.mkdir()
    (broken / "index.html").write_text("<!DOCTYPE html>")  # the dashboard's page, but no report/
    monkeypatch.setattr(app, "frontend_dir", lambda: broken)
    page_source.cache_clear()
    try:
        out = tmp_path / "report.html"
        assert cli.main(["export", str(tmp_path / "h.sqlite"), "--format", "html", "-o", str(out)]) == 2
    finally:
        page_source.cache_clear()
    assert "the report's page files are missing" in capsys.readouterr().err
    assert not out.exists()
