"""The files the HTML report inlines: plotly.js and the page in frontend/report/.

`page_source()` reads the page's template, styles and script once; `inline_module` makes the
script, an ES module that imports the dashboard's tick helpers from frontend/ticks.js, into
one classic script that an inline <script> element can hold. See server/history/report.py.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path


class ReportError(RuntimeError):
    """The report cannot be written (plotly.js or the page's files missing, unknown run)."""


@lru_cache(maxsize=1)
def plotly_source() -> str:
    from ..app import plotly_js

    path = plotly_js()
    if path is None:
        raise ReportError("plotly.js not found in the installed plotly package (pip install plotly)")
    text = Path(path).read_text(encoding="utf-8")
    # it holds no "</script" today; make sure no future build can end the element early
    return text.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")


# report.js's imports, and the declarations ticks.js exports
_IMPORT = re.compile(r'^import \{([^}]*)\} from "\.\./ticks\.js";$', re.M)
_EXPORT = re.compile(r"^export ((?:function|const|let|class) (\w+))", re.M)


def inline_module(module: str, ticks: str) -> str:
    """report.js and the ticks.js it imports from, as one classic script for an inline element.

    What a bundler would make of the two ES modules: ticks.js, its `export` keywords dropped, runs
    in a function of its own that returns its exports, and report.js's import becomes a
    destructuring of that; both keep a module's strict mode and scope. Only that shape is
    supported (`import { a, b } from "../ticks.js"`, `export function|const|let|class`): anything
    else raises ReportError, so a change to either file cannot break the report quietly.
    """
    names = [n.strip() for group in _IMPORT.findall(module) for n in group.split(",") if n.strip()]
    exported = [m[1] for m in _EXPORT.findall(ticks)]
    lib, body = _EXPORT.sub(r"\1", ticks), _IMPORT.sub("", module)
    if missing := sorted(set(names) - set(exported)):
        raise ReportError(f"report.js imports {', '.join(missing)} from ticks.js, which exports no such name")
    if re.search(r"^\s*(?:import|export)\b", f"{lib}\n{body}", re.M):
        raise ReportError("ticks.js or report.js has an import or export statement the report cannot inline")
    script = (
        f'"use strict";\n(function () {{\nconst {{ {", ".join(names)} }} = (function () {{\n{lib}\n'
        f"return {{ {', '.join(exported)} }};\n}})();\n{body}\n}})();\n"
    )
    return script.replace("</script", "<\\/script")


@lru_cache(maxsize=1)
def page_source() -> tuple[str, str, str]:
    """(template, css, script) of the report's page, from frontend/report/ and frontend/ticks.js."""
    from ..app import frontend_dir

    root = frontend_dir()
    try:
        if root is None:
            raise FileNotFoundError("frontend/")
        template, css, module, ticks = (
            (root / name).read_text(encoding="utf-8")
            for name in ("report/report.html", "report/report.css", "report/report.js", "ticks.js")
        )
    except OSError as e:
        raise ReportError(
            f"the report's page files are missing ({e}); reinstall gradient-inspector"
        ) from None
    return template, css, inline_module(module, ticks)
