"""A shareable report: one self-contained HTML file of a recorded run.

`gradient-inspector export [FILE] [--run ID] --format html [-o OUT]` writes it (default
`run-<id>.html`). The file needs no server and no network: plotly.js is inlined from the
installed `plotly` package, the run's data is embedded as strict JSON, and a
Content-Security-Policy forbids every fetch.

What it shows:

1. loss, and the global gradient norm raw and final, over steps (log y for the norms),
   with a vertical marker (and hover text) at each applied hook change and at each
   NaN/Inf, skipped step, hook error or scenario reset;
2. a heatmap of every parameter's final gradient norm over steps (log10 colour scale);
3. every parameter's final vs raw abs-max at the last recorded step (bars, log axis);
4. a heatmap of every parameter's update-to-parameter ratio over steps (log10);

then the hook-change log and the event list as HTML tables.

The page is made of files in `frontend/report/` (shipped with the dashboard's, linted and
formatted alike): `report.html`, a template whose `{name}` fields `render()` fills,
`report.css`, and `report.js`, an ES module that draws the charts with the dashboard's own
tick helpers, imported from `frontend/ticks.js`. The file must work offline, so the two
modules are inlined as one classic script (`report_assets.inline_module`).

Size: the charts get at most `MAX_POINTS` (2000) steps, evenly spaced over the recorded
ones (plus the steps that carry events), and fewer when the model has so many parameters
that a heatmap would pass `MAX_CELLS` cells; the page says when it downsampled. Numbers
are rounded to 4 significant digits. plotly.js is about 4.8 MB of it: a 50-step demo run
makes a 4.85 MB file, 2000 steps of a 30-tensor model about 5.8 MB, and the data part
stays under about 5 MB whatever the model.

Escaping: table text goes through `html.escape`; the embedded JSON has every `<`, `>`
and `&` written as a `\\u` escape, so no string in the data can close the script element.
The data holds user text (parameter names, marker labels and hover lines) as it is: the
page escapes each string it gives Plotly once, with the dashboard's `plotlyText`
(frontend/ticks.js), as Plotly would otherwise draw `<b>`, `<br>` or `<a href>` in it.
Non-finite numbers travel as "nan", "inf", "-inf" (the wire format); the page draws them
as gaps plus red markers (red cells in the heatmaps).
"""

from __future__ import annotations

import html
import json
import math
import time
from datetime import datetime, timezone
from typing import IO, Any

from ..protocol import jsonsafe
from .queries import pick_even
from .report_assets import ReportError, page_source, plotly_source
from .report_branches import branch_series
from .storage import HistoryStore

MAX_POINTS = 2000  # the most steps a chart gets
MAX_CELLS = 200_000  # the most cells of one heatmap (parameters x steps)
MIN_POINTS = 100  # ... but never fewer steps than this
MAX_EVENT_STEPS = 200  # extra steps kept because they carry an event
MAX_MARKERS = 300  # vertical markers drawn on the step charts
MAX_EVENT_ROWS = 2000  # rows of the event table
MARKER_KINDS = ("nonfinite", "step_skipped", "hook_error", "scenario_reset", "training_error")


# ------------------------------------------------------------------------------------------- data
def _num(v: Any) -> Any:
    """A number rounded to 4 significant digits; "nan"/"inf" strings and None as they are."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return jsonsafe(v)
        return float(f"{v:.4g}")
    return None


def _at(values: Any, i: int) -> Any:
    return values[i] if isinstance(values, list) and i < len(values) else None


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str):
        return v
    return json.dumps(v)


def _fmt_params(params: Any) -> str:
    if not isinstance(params, dict) or not params:
        return "(none)"
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in params.items())


def _describe_spec(spec: dict[str, Any]) -> str:
    off = "" if spec.get("enabled", True) else " (disabled)"
    return f"{spec.get('kind')} on {spec.get('target')!s} at {spec.get('point')}: {_fmt_params(spec.get('params'))}{off}"


def _change_row(step: Any, action: str, hook_id: Any, before: Any, after: Any) -> dict[str, Any]:
    """One row of the hook-change log."""
    if isinstance(before, list) or isinstance(after, list):  # an import: whole configurations
        b = before if isinstance(before, list) else []
        a = after if isinstance(after, list) else []
        return {
            "step": step,
            "action": action,
            "hook_id": ", ".join(str(s.get("id")) for s in a) or "-",
            "kind": ", ".join(sorted({str(s.get("kind")) for s in a})) or "-",
            "target": ", ".join(sorted({str(s.get("target")) for s in a})) or "-",
            "before": "; ".join(_describe_spec(s) for s in b) or "no hooks",
            "after": "; ".join(_describe_spec(s) for s in a) or "no hooks",
        }
    spec = after if isinstance(after, dict) else before if isinstance(before, dict) else {}
    if isinstance(before, dict) and isinstance(after, dict):
        pb, pa = before.get("params") or {}, after.get("params") or {}
        keys = [k for k in {**pb, **pa} if pb.get(k) != pa.get(k)]
        b_parts = [f"{k}={_fmt_value(pb.get(k))}" for k in keys]
        a_parts = [f"{k}={_fmt_value(pa.get(k))}" for k in keys]
        for field in ("enabled", "target", "point", "position"):
            if before.get(field) != after.get(field):
                b_parts.append(f"{field}={_fmt_value(before.get(field))}")
                a_parts.append(f"{field}={_fmt_value(after.get(field))}")
        b_text, a_text = ", ".join(b_parts) or _fmt_params(pb), ", ".join(a_parts) or _fmt_params(pa)
    else:
        b_text = _fmt_params(before.get("params")) if isinstance(before, dict) else "-"
        a_text = _fmt_params(after.get("params")) if isinstance(after, dict) else "-"
    return {
        "step": step,
        "action": action,
        "hook_id": hook_id if hook_id is not None else spec.get("id", "-"),
        "kind": spec.get("kind", "-"),
        "target": spec.get("target", "-"),
        "before": b_text,
        "after": a_text,
    }


def _diff_configs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for a change between two recorded configurations (when no hook_applied event has it)."""
    rows = []
    by_id = {s.get("id"): s for s in old}
    for s in new:
        prev = by_id.pop(s.get("id"), None)
        if prev is None:
            rows.append(_change_row(s.get("applied_step"), "add", s.get("id"), None, s))
        elif {k: v for k, v in prev.items() if k != "applied_step"} != {
            k: v for k, v in s.items() if k != "applied_step"
        }:
            rows.append(_change_row(s.get("applied_step"), "update", s.get("id"), prev, s))
    for s in by_id.values():
        rows.append(_change_row(None, "remove", s.get("id"), s, None))
    return rows


def _event_detail(ev: dict[str, Any]) -> str:
    kind = ev.get("kind")
    if kind == "nonfinite":
        where = ev.get("param") or (f"module {ev['module']}" if ev.get("module") else "?")
        more = ev.get("n_params")
        text = f"{where}: {ev.get('nan')} NaN, {ev.get('inf')} Inf"
        if isinstance(more, int) and more > 1:
            text += f" ({more} parameters non-finite)"
        text += f"; action {ev.get('action_taken')}"
        if isinstance(ev.get("streak"), int) and ev["streak"] > 1:
            text += f"; streak of {ev['streak']} steps"
        return text
    if kind == "hook_error":
        return f"hook {ev.get('hook_id')} on {ev.get('param')}: {ev.get('message')} (the hook was disabled)"
    if kind == "step_skipped":
        return f"reason: {ev.get('reason')}"
    skip = {"seq", "kind", "time", "step"}
    return ", ".join(f"{k}: {_fmt_value(v)}" for k, v in ev.items() if k not in skip) or "-"


def _marker_text(ev: dict[str, Any]) -> tuple[str, list[str]]:
    """(short label, hover lines) of a marker for an event."""
    kind = ev.get("kind")
    step = ev.get("step")
    if kind == "nonfinite":
        label = "NaN" if (ev.get("nan") or 0) else "Inf" if (ev.get("inf") or 0) else "NaN/Inf"
        return label, [f"step {step}: non-finite gradient", _event_detail(ev)]
    label = {
        "step_skipped": "skip",
        "hook_error": "error",
        "scenario_reset": "reset",
        "training_error": "error",
    }.get(str(kind), str(kind))
    return label, [f"step {step}: {kind}", _event_detail(ev)]


def _all_events(store: HistoryStore, run: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    since = -1
    while batch := store.events(run, since=since):
        events.extend(batch)
        since = batch[-1]["seq"]
    return events


def _fmt_time(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def collect(store: HistoryStore, run: int, *, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """Everything the report shows, as plain (strict-JSON-able) data."""
    info = store.run(run)
    if info is None:
        raise ReportError(f"no run {run}")
    names = [p["name"] for p in info["params"]]
    n_params = len(names)

    events = _all_events(store, run)
    # the hook-change log: hook_applied events after the first recorded configuration
    configs = store.hook_changes(run)
    start_version = configs[0]["config_version"] if configs else 0
    start_hooks = configs[0]["hooks"] if configs else []
    end_hooks = configs[-1]["hooks"] if configs else []
    applied = [
        e
        for e in events
        if e.get("kind") == "hook_applied"
        and (e.get("config_version") is None or e["config_version"] > start_version)
    ]
    changes = [
        _change_row(
            e.get("applied_step"), str(e.get("action")), e.get("hook_id"), e.get("before"), e.get("after")
        )
        for e in applied
    ]
    if not applied and len(configs) > 1:  # no events for them: diff the recorded configurations
        for old, new in zip(configs, configs[1:], strict=False):
            changes += _diff_configs(old["hooks"], new["hooks"])

    # the steps to draw
    all_steps = store.steps("snapshots", run, cap=None)
    budget = min(max_points, max(MIN_POINTS, MAX_CELLS // max(1, n_params)))
    chosen = [all_steps[i] for i in pick_even(len(all_steps), budget)] if all_steps else []
    recorded = set(all_steps)
    flagged = sorted(
        {
            e["step"]
            for e in events
            if e.get("kind") in MARKER_KINDS and isinstance(e.get("step"), int) and e["step"] in recorded
        }
        - set(chosen)
    )
    steps = sorted(set(chosen) | set(flagged[:MAX_EVENT_STEPS]))
    snaps = store.snapshots_at(run, steps)
    steps = [int(s["step"]) for s in snaps]

    def per_param(key: str) -> list[list[Any]]:  # rows: parameters; columns: steps
        return [[_num(_at(s.get(key), i)) for s in snaps] for i in range(n_params)]

    last = snaps[-1] if snaps else {}
    # the loss of every step the scalars table kept (also steps the sampler skipped)
    loss_steps_all = store.steps("scalars", run, cap=None)
    loss_rows = store.scalars_at(run, [loss_steps_all[i] for i in pick_even(len(loss_steps_all), max_points)])
    loss = [(r["step"], _num(r.get("loss"))) for r in loss_rows if r.get("loss") is not None]
    if not loss:
        loss = [(s["step"], _num(s.get("loss"))) for s in snaps if s.get("loss") is not None]

    markers: list[dict[str, Any]] = []
    for row, e in zip(changes if applied else [], applied, strict=True):
        if isinstance(e.get("applied_step"), int):
            lines = [
                f"step {e['applied_step']}: hook {row['hook_id']} {row['action']}",
                f"{row['kind']} on {row['target']}",
                f"{row['before']} → {row['after']}",
            ]
            label = row["action"] if row["action"] == "import" else f"{row['action']} {row['kind']}"
            markers.append({"step": e["applied_step"], "type": "hook", "label": label, "lines": lines})
    if not applied:
        for row in changes:
            if isinstance(row["step"], int):
                markers.append(
                    {
                        "step": row["step"],
                        "type": "hook",
                        "label": row["action"],
                        "lines": [f"step {row['step']}: hook {row['hook_id']} {row['action']}"],
                    }
                )
    n_hook_markers = len(markers)
    for e in events:
        if e.get("kind") in MARKER_KINDS and isinstance(e.get("step"), int):
            label, lines = _marker_text(e)
            markers.append({"step": e["step"], "type": "bad", "label": label, "lines": lines})
    markers_dropped = max(0, len(markers) - max(MAX_MARKERS, n_hook_markers))
    if markers_dropped:  # keep every hook change, then the first of the others
        markers = markers[: max(MAX_MARKERS, n_hook_markers)]
    markers.sort(key=lambda m: m["step"])

    listed = [e for e in events if e.get("kind") != "hook_applied"]
    scenario_meta = (info.get("meta") or {}).get("scenario") or {}
    from ..app import version

    return {
        "run": {
            "id": info["id"],
            "scenario": info.get("scenario"),
            "mode": (info.get("meta") or {}).get("mode"),
            "description": scenario_meta.get("description") if isinstance(scenario_meta, dict) else None,
            "started": info.get("started"),
            "last_step": info.get("last_step"),
            "ended": snaps[-1].get("time") if snaps else None,
            "n_tensors": n_params,
            "n_elements": sum(int(p.get("numel") or 0) for p in info["params"]),
            "recorded_snapshots": len(all_steps),
        },
        "made": {"tool": "gradient-inspector export", "version": version(), "time": time.time()},
        "params": names,
        "steps": steps,
        "downsampled": len(steps) < len(all_steps),
        "loss": {"steps": [s for s, _ in loss], "values": [v for _, v in loss]},
        "loss_points_of": len(loss_steps_all),
        "total_norm_raw": [_num(s.get("total_norm_raw")) for s in snaps],
        "total_norm": [_num(s.get("total_norm")) for s in snaps],
        "grad_norm": per_param("grad_norm"),
        "update_ratio": per_param("update_ratio"),
        "last": {
            "step": last.get("step"),
            "absmax_raw": [_num(_at(last.get("grad_absmax_raw"), i)) for i in range(n_params)],
            "absmax": [_num(_at(last.get("grad_absmax"), i)) for i in range(n_params)],
        },
        "markers": markers,
        "markers_dropped": markers_dropped,
        "hooks_start": [_describe_spec(s) for s in start_hooks],
        "hooks_end": [f"{s.get('id')}: {_describe_spec(s)}" for s in end_hooks],
        "changes": changes,
        "events": [
            {
                "seq": e.get("seq"),
                "step": e.get("step"),
                "kind": e.get("kind"),
                "time": e.get("time"),
                "detail": _event_detail(e),
            }
            for e in listed[:MAX_EVENT_ROWS]
        ],
        "events_total": len(listed),
        "branches": branch_series(store, run, max_points),  # what-if: drawn dashed over the run's own
    }


# ------------------------------------------------------------------------------------------- html
def embed_json(obj: Any) -> str:
    """Strict JSON safe inside a <script> element: `<`, `>`, `&` as \\u escapes."""
    text = json.dumps(jsonsafe(obj), allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _e(v: Any) -> str:
    return html.escape("-" if v is None else str(v))


def _table(head: list[str], rows: list[list[Any]], cls: str) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "\n".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>\n{body}\n</tbody></table>'


def render(data: dict[str, Any], plotly_text: str) -> str:
    run = data["run"]
    title = f"Run {run['id']}" + (f" ({run['scenario']})" if run.get("scenario") else "")
    n_steps = len(data["steps"])
    facts = [
        ("Run", _e(run["id"])),
        (
            "Scenario",
            _e(run.get("scenario") or "your own training script")
            + (f'<br><span class="muted">{_e(run["description"])}</span>' if run.get("description") else ""),
        ),
        ("Started", _e(_fmt_time(run.get("started")))),
        ("Last snapshot", _e(_fmt_time(run.get("ended")))),
        ("Steps", f"{_e(run.get('last_step'))} (recorded snapshots: {run['recorded_snapshots']})"),
        ("Parameters", f"{run['n_tensors']} tensors, {run['n_elements']:,} elements"),
        ("Hooks at start", "<br>".join(_e(h) for h in data["hooks_start"]) or "none"),
        ("Hooks at end", "<br>".join(_e(h) for h in data["hooks_end"]) or "none"),
        (
            "Made by",
            f"gradient-inspector export, version {_e(data['made']['version'])}, "
            f"{_e(_fmt_time(data['made']['time']))}",
        ),
    ]
    facts_html = "\n".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    notes = []
    if data["downsampled"]:
        notes.append(
            f"The step charts show {n_steps:,} of the {run['recorded_snapshots']:,} recorded snapshots, "
            "evenly spaced (plus the steps that carry an event), to keep this file small."
        )
    if data["loss_points_of"] > len(data["loss"]["steps"]) and data["loss_points_of"] > MAX_POINTS:
        notes.append(
            f"The loss is shown at {len(data['loss']['steps']):,} of its "
            f"{data['loss_points_of']:,} recorded steps, evenly spaced."
        )
    if data["markers_dropped"]:
        notes.append(
            f"{data['markers_dropped']} event markers are not drawn (too many); the event list below "
            "has them."
        )
    notes_html = "".join(f'<p class="note">{_e(n)}</p>' for n in notes)

    change_rows = [
        [
            _e(c["step"]),
            _e(c["action"]),
            _e(c["hook_id"]),
            _e(c["kind"]),
            f"<code>{_e(c['target'])}</code>",
            f'{_e(c["before"])} <span class="arrow">→</span> {_e(c["after"])}',
        ]
        for c in data["changes"]
    ]
    changes_html = (
        _table(["Step", "Action", "Hook", "Kind", "Target", "Params before → after"], change_rows, "changes")
        if change_rows
        else '<p class="muted">No hook changes during this run.</p>'
    )
    event_rows = [
        [
            _e(e["seq"]),
            _e(e["step"]),
            f'<span class="kind kind-{_e(e["kind"])}">{_e(e["kind"])}</span>',
            _e(_fmt_time(e["time"])),
            _e(e["detail"]),
        ]
        for e in data["events"]
    ]
    events_html = (
        _table(["#", "Step", "Kind", "Time", "Detail"], event_rows, "events")
        if event_rows
        else '<p class="muted">No events (no NaN/Inf, no skipped step, no hook error).</p>'
    )
    if data["events_total"] > len(data["events"]):
        events_html += (
            f'<p class="note">Showing the first {len(data["events"]):,} of {data["events_total"]:,} '
            "events; `gradient-inspector export --format jsonl` has them all.</p>"
        )
    no_data = "" if n_steps else '<p class="note">This run has no recorded snapshots: nothing to chart.</p>'

    template, css, script = page_source()
    return "<!DOCTYPE html>\n" + template.format(
        title=_e(f"gradient-inspector report: {title}"),
        heading=_e(title),
        facts=facts_html,
        notes=notes_html + no_data,
        changes=changes_html,
        events=events_html,
        n_changes=len(data["changes"]),
        n_events=data["events_total"],
        last_step=_e(data["last"]["step"]),
        data=embed_json(data),
        scripts=f"<script>{plotly_text}</script>\n<script>{script}</script>",
        css=css,
    )


def write_html(store: HistoryStore, run: int, out: IO[str], *, max_points: int = MAX_POINTS) -> int:
    """Write a run as one self-contained HTML report; returns the number of snapshots charted."""
    plotly_text = plotly_source()
    data = collect(store, run, max_points=max_points)
    out.write(render(data, plotly_text))
    return len(data["steps"])
