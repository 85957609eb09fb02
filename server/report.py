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

Size: the charts get at most `MAX_POINTS` (2000) steps, evenly spaced over the recorded
ones (plus the steps that carry events), and fewer when the model has so many parameters
that a heatmap would pass `MAX_CELLS` cells; the page says when it downsampled. Numbers
are rounded to 4 significant digits. plotly.js is about 4.8 MB of it: a 50-step demo run
makes a 4.85 MB file, 2000 steps of a 30-tensor model about 5.8 MB, and the data part
stays under about 5 MB whatever the model.

Escaping: table text goes through `html.escape`; the embedded JSON has every `<`, `>`
and `&` written as a `\\u` escape, so no string in the data can close the script element.
Non-finite numbers travel as "nan", "inf", "-inf" (the wire format); the page draws them
as gaps plus red markers (red cells in the heatmaps).
"""

from __future__ import annotations

import html
import json
import math
import time
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from .history import pick_even
from .protocol import sanitize
from .storage import Store

MAX_POINTS = 2000  # the most steps a chart gets
MAX_CELLS = 200_000  # the most cells of one heatmap (parameters x steps)
MIN_POINTS = 100  # ... but never fewer steps than this
MAX_EVENT_STEPS = 200  # extra steps kept because they carry an event
MAX_MARKERS = 300  # vertical markers drawn on the step charts
MAX_EVENT_ROWS = 2000  # rows of the event table
MARKER_KINDS = ("nonfinite", "step_skipped", "hook_error", "scenario_reset", "training_error")


class ReportError(RuntimeError):
    """The report cannot be written (plotly.js missing, unknown run)."""


# ------------------------------------------------------------------------------------------- data
def _num(v: Any) -> Any:
    """A number rounded to 4 significant digits; "nan"/"inf" strings and None as they are."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return sanitize(v)
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
            "step": step, "action": action, "hook_id": ", ".join(str(s.get("id")) for s in a) or "-",
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
        "step": step, "action": action, "hook_id": hook_id if hook_id is not None else spec.get("id", "-"),
        "kind": spec.get("kind", "-"), "target": spec.get("target", "-"), "before": b_text, "after": a_text,
    }


def _diff_configs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for a change between two recorded configurations (when no hook_applied event has it)."""
    rows = []
    by_id = {s.get("id"): s for s in old}
    for s in new:
        prev = by_id.pop(s.get("id"), None)
        if prev is None:
            rows.append(_change_row(s.get("applied_step"), "add", s.get("id"), None, s))
        elif {k: v for k, v in prev.items() if k != "applied_step"} != {k: v for k, v in s.items()
                                                                           if k != "applied_step"}:
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


def _marker_text(ev: dict[str, Any]) -> tuple[str, str]:
    """(short label, hover text) of a marker for an event."""
    kind = ev.get("kind")
    step = ev.get("step")
    if kind == "nonfinite":
        label = "NaN" if (ev.get("nan") or 0) else "Inf" if (ev.get("inf") or 0) else "NaN/Inf"
        return label, f"step {step}: non-finite gradient<br>{html.escape(_event_detail(ev))}"
    label = {"step_skipped": "skip", "hook_error": "error", "scenario_reset": "reset",
             "training_error": "error"}.get(str(kind), str(kind))
    return label, f"step {step}: {html.escape(str(kind))}<br>{html.escape(_event_detail(ev))}"


def _all_events(store: Store, run: int) -> list[dict[str, Any]]:
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


def collect(store: Store, run: int, *, max_points: int = MAX_POINTS) -> dict[str, Any]:
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
    applied = [e for e in events if e.get("kind") == "hook_applied"
               and (e.get("config_version") is None or e["config_version"] > start_version)]
    changes = [_change_row(e.get("applied_step"), str(e.get("action")), e.get("hook_id"), e.get("before"),
                           e.get("after")) for e in applied]
    if not applied and len(configs) > 1:  # no events for them: diff the recorded configurations
        for old, new in zip(configs, configs[1:], strict=False):
            changes += _diff_configs(old["hooks"], new["hooks"])

    # the steps to draw
    all_steps = store.steps("snapshots", run, cap=None)
    budget = min(max_points, max(MIN_POINTS, MAX_CELLS // max(1, n_params)))
    chosen = [all_steps[i] for i in pick_even(len(all_steps), budget)] if all_steps else []
    recorded = set(all_steps)
    flagged = sorted({e["step"] for e in events if e.get("kind") in MARKER_KINDS
                      and isinstance(e.get("step"), int) and e["step"] in recorded} - set(chosen))
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
            text = (f"step {e['applied_step']}: hook {html.escape(str(row['hook_id']))} {html.escape(row['action'])}"
                    f"<br>{html.escape(str(row['kind']))} on {html.escape(str(row['target']))}"
                    f"<br>{html.escape(row['before'])} → {html.escape(row['after'])}")
            label = row["action"] if row["action"] == "import" else f"{row['action']} {row['kind']}"
            markers.append({"step": e["applied_step"], "type": "hook", "label": label, "text": text})
    if not applied:
        for row in changes:
            if isinstance(row["step"], int):
                markers.append({"step": row["step"], "type": "hook", "label": row["action"],
                                "text": html.escape(f"step {row['step']}: hook {row['hook_id']} {row['action']}")})
    n_hook_markers = len(markers)
    for e in events:
        if e.get("kind") in MARKER_KINDS and isinstance(e.get("step"), int):
            label, text = _marker_text(e)
            markers.append({"step": e["step"], "type": "bad", "label": label, "text": text})
    markers_dropped = max(0, len(markers) - max(MAX_MARKERS, n_hook_markers))
    if markers_dropped:  # keep every hook change, then the first of the others
        markers = markers[:max(MAX_MARKERS, n_hook_markers)]
    markers.sort(key=lambda m: m["step"])

    listed = [e for e in events if e.get("kind") != "hook_applied"]
    scenario_meta = (info.get("meta") or {}).get("scenario") or {}
    from .app import version

    return {
        "run": {
            "id": info["id"], "scenario": info.get("scenario"), "mode": (info.get("meta") or {}).get("mode"),
            "description": scenario_meta.get("description") if isinstance(scenario_meta, dict) else None,
            "started": info.get("started"), "last_step": info.get("last_step"),
            "ended": snaps[-1].get("time") if snaps else None,
            "n_tensors": n_params, "n_elements": sum(int(p.get("numel") or 0) for p in info["params"]),
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
        "events": [{"seq": e.get("seq"), "step": e.get("step"), "kind": e.get("kind"), "time": e.get("time"),
                    "detail": _event_detail(e)} for e in listed[:MAX_EVENT_ROWS]],
        "events_total": len(listed),
    }


# ------------------------------------------------------------------------------------------- html
def embed_json(obj: Any) -> str:
    """Strict JSON safe inside a <script> element: `<`, `>`, `&` as \\u escapes."""
    text = json.dumps(sanitize(obj), allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


@lru_cache(maxsize=1)
def plotly_source() -> str:
    from .app import plotly_js

    path = plotly_js()
    if path is None:
        raise ReportError("plotly.js not found in the installed plotly package (pip install plotly)")
    text = Path(path).read_text(encoding="utf-8")
    # it holds no "</script" today; make sure no future build can end the element early
    return text.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")


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
        ("Scenario", _e(run.get("scenario") or "your own training script")
         + (f'<br><span class="muted">{_e(run["description"])}</span>' if run.get("description") else "")),
        ("Started", _e(_fmt_time(run.get("started")))),
        ("Last snapshot", _e(_fmt_time(run.get("ended")))),
        ("Steps", f"{_e(run.get('last_step'))} (recorded snapshots: {run['recorded_snapshots']})"),
        ("Parameters", f"{run['n_tensors']} tensors, {run['n_elements']:,} elements"),
        ("Hooks at start", "<br>".join(_e(h) for h in data["hooks_start"]) or "none"),
        ("Hooks at end", "<br>".join(_e(h) for h in data["hooks_end"]) or "none"),
        ("Made by", f"gradient-inspector export, version {_e(data['made']['version'])}, "
                    f"{_e(_fmt_time(data['made']['time']))}"),
    ]
    facts_html = "\n".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    notes = []
    if data["downsampled"]:
        notes.append(f"The step charts show {n_steps:,} of the {run['recorded_snapshots']:,} recorded snapshots, "
                     "evenly spaced (plus the steps that carry an event), to keep this file small.")
    if data["loss_points_of"] > len(data["loss"]["steps"]) and data["loss_points_of"] > MAX_POINTS:
        notes.append(f"The loss is shown at {len(data['loss']['steps']):,} of its "
                     f"{data['loss_points_of']:,} recorded steps, evenly spaced.")
    if data["markers_dropped"]:
        notes.append(f"{data['markers_dropped']} event markers are not drawn (too many); the event list below "
                     "has them.")
    notes_html = "".join(f'<p class="note">{_e(n)}</p>' for n in notes)

    change_rows = [[_e(c["step"]), _e(c["action"]), _e(c["hook_id"]), _e(c["kind"]), f"<code>{_e(c['target'])}</code>",
                    f'{_e(c["before"])} <span class="arrow">→</span> {_e(c["after"])}'] for c in data["changes"]]
    changes_html = (_table(["Step", "Action", "Hook", "Kind", "Target", "Params before → after"], change_rows,
                           "changes") if change_rows else '<p class="muted">No hook changes during this run.</p>')
    event_rows = [[_e(e["seq"]), _e(e["step"]), f'<span class="kind kind-{_e(e["kind"])}">{_e(e["kind"])}</span>',
                   _e(_fmt_time(e["time"])), _e(e["detail"])] for e in data["events"]]
    events_html = (_table(["#", "Step", "Kind", "Time", "Detail"], event_rows, "events")
                   if event_rows else '<p class="muted">No events (no NaN/Inf, no skipped step, no hook error).</p>')
    if data["events_total"] > len(data["events"]):
        events_html += (f'<p class="note">Showing the first {len(data["events"]):,} of {data["events_total"]:,} '
                        "events; `gradient-inspector export --format jsonl` has them all.</p>")
    no_data = "" if n_steps else '<p class="note">This run has no recorded snapshots: nothing to chart.</p>'

    return _PAGE.format(
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
        plotly=plotly_text,
        script=_SCRIPT,
        css=_CSS,
        csp=_CSP,
    )


def write_html(store: Store, run: int, out: IO[str], *, max_points: int = MAX_POINTS) -> int:
    """Write a run as one self-contained HTML report; returns the number of snapshots charted."""
    plotly_text = plotly_source()
    data = collect(store, run, max_points=max_points)
    out.write(render(data, plotly_text))
    return len(data["steps"])


# ------------------------------------------------------------------------------------------ page
_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'")

_CSS = """
:root { --raw: #1f6fd1; --final: #e8710a; --hook: #8250df; --bad: #d1242f; --muted: #57606a;
        --line: #d0d7de; --bg: #ffffff; --panel: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: #1f2328;
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
main { max-width: 1280px; margin: 0 auto; padding: 20px 28px 48px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 32px 0 4px; padding-top: 12px; border-top: 1px solid var(--line); }
.sub { color: var(--muted); margin: 0 0 16px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 0;
           background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
dl.facts dt { font-weight: 600; color: var(--muted); }
dl.facts dd { margin: 0; }
.muted { color: var(--muted); }
.note { background: #fff8c5; border: 1px solid #eed888; border-radius: 6px; padding: 6px 10px; margin: 10px 0; }
.explain { background: var(--panel); border-left: 4px solid var(--raw); padding: 8px 12px; margin: 14px 0; }
.raw { color: var(--raw); font-weight: 600; } .final { color: var(--final); font-weight: 600; }
.hookc { color: var(--hook); font-weight: 600; } .badc { color: var(--bad); font-weight: 600; }
.caption { color: var(--muted); margin: 0 0 6px; max-width: 980px; }
.chart { width: 100%; min-height: 300px; }
table { border-collapse: collapse; width: 100%; font-size: 14px; margin-top: 8px; }
th, td { text-align: left; vertical-align: top; padding: 5px 10px; border-bottom: 1px solid var(--line); }
th { background: var(--panel); position: sticky; top: 0; }
td code { font-size: 13px; }
.arrow { color: var(--hook); font-weight: 700; }
.kind { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; }
.kind-nonfinite, .kind-hook_error, .kind-training_error { color: var(--bad); font-weight: 600; }
footer { color: var(--muted); margin-top: 32px; font-size: 13px; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="gradient-inspector">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<main>
<h1>{heading}</h1>
<p class="sub">A gradient-inspector report: every number below was recorded while the run trained.
It opens without a server or a network connection.</p>
<dl class="facts">
{facts}
</dl>
<div class="explain"><b>Raw and final.</b> <span class="raw">Raw</span> is the gradient as backward
produced it, before the inspector's <code>pre_step</code> hooks (clipping, scaling, ...);
<span class="final">final</span> is what the optimizer actually used, after every hook.
Where the two differ, a hook changed the gradient. Norms are L2 norms.
Markers: <span class="hookc">purple dashed lines</span> are applied hook changes (the first step they affected),
<span class="badc">red dotted lines</span> are non-finite gradients (NaN/Inf), skipped steps, hook errors
and resets. Hover a marker's label at the top of a chart for details; drag to zoom, double-click to reset.</div>
{notes}

<h2>Loss and global gradient norm</h2>
<p class="caption">Top: the training loss. Bottom: the norm of all gradients together,
<span class="raw">raw</span> and <span class="final">final</span>, on a log scale. Gaps are non-finite values.</p>
<div id="chart-norms" class="chart"></div>

<h2>Final gradient norm per parameter</h2>
<p class="caption">One row per parameter tensor, one column per step; colour is log<sub>10</sub> of the
final gradient's L2 norm. Red cells: NaN/Inf. Grey: no gradient (frozen or unused).</p>
<div id="chart-heatmap" class="chart"></div>

<h2>Gradient abs-max per parameter at the last step (step {last_step})</h2>
<p class="caption">The largest absolute gradient element of each parameter tensor, <span class="raw">raw</span>
and <span class="final">final</span>, log scale. Final below raw means a hook shrank that gradient.</p>
<div id="chart-absmax" class="chart"></div>

<h2>Update-to-parameter ratio per parameter</h2>
<p class="caption">‖Δθ‖ / ‖θ‖ of each step's optimizer update, per parameter tensor, colour log<sub>10</sub>.
Around 10<sup>-3</sup> is the usual healthy range; much larger means the step rewrites the weights.</p>
<div id="chart-ratio" class="chart"></div>

<h2 id="hook-changes">Hook changes ({n_changes})</h2>
{changes}

<h2 id="events">Events ({n_events})</h2>
{events}

<footer>Made with gradient-inspector (<code>gradient-inspector export --format html</code>).
Charts drawn by plotly.js, included in this file.</footer>
</main>
<script type="application/json" id="report-data">{data}</script>
<script>{plotly}</script>
<script>{script}</script>
</body>
</html>
"""

_SCRIPT = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  const C = { raw: "#1f6fd1", final: "#e8710a", loss: "#1a7f37", hook: "#8250df", bad: "#d1242f",
              grid: "#e6e9ed", text: "#1f2328", muted: "#57606a" };
  const FONT = { family: 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif', size: 13, color: C.text };
  const CONFIG = { responsive: true, displaylogo: false, scrollZoom: false };
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const bad = (v) => typeof v === "string"; // "nan", "inf", "-inf"
  const pos = (v) => (typeof v === "number" && v > 0 ? v : null);
  const fmt = (v) => (v === null || v === undefined ? "no gradient" : typeof v === "string" ? v : v.toPrecision(3));
  const steps = D.steps;
  const names = D.params;
  // long names shortened in the middle; with many parameters only every k-th is labelled (hover has all)
  const short = (n) => (n.length <= 34 ? n : n.slice(0, 14) + "…" + n.slice(-19));
  function paramTicks(plotHeight) {
    const k = Math.max(1, Math.ceil((names.length * 14) / Math.max(plotHeight, 100)));
    const vals = names.filter((_, i) => i % k === 0);
    return { tickmode: "array", tickvals: vals, ticktext: vals.map(short) };
  }

  function axis(extra) {
    return Object.assign({ gridcolor: C.grid, zerolinecolor: C.grid, linecolor: "#8c959f", showline: true,
                           ticks: "outside", tickcolor: "#8c959f", automargin: true,
                           title: { font: { size: 13, color: C.muted } } }, extra || {});
  }
  function layout(extra) {
    return Object.assign({ font: FONT, paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff",
                           margin: { l: 70, r: 30, t: TOP, b: 50 }, hovermode: "closest",
                           legend: { orientation: "h", x: 0, y: -0.1, xanchor: "left", yanchor: "top" } },
                         extra);
  }

  // vertical markers: a line (shape) per event and a hoverable label (annotation) at the top
  function markerShapes() {
    return D.markers.map((m) => ({
      type: "line", xref: "x", yref: "paper", x0: m.step, x1: m.step, y0: 0, y1: 1, layer: "above",
      line: m.type === "hook" ? { color: C.hook, width: 1.5, dash: "dash" } : { color: C.bad, width: 1, dash: "dot" },
    }));
  }
  // labels close together go on up to three rows above the plot
  const MANY = D.markers.length > 24;
  const ROWS = (function () {
    const span = steps.length ? Math.max(1, steps[steps.length - 1] - steps[0]) : 1;
    const gap = span * (MANY ? 0.012 : 0.075);
    const last = [];
    return D.markers.map((m) => {
      let r = 0;
      while (r < 2 && last[r] !== undefined && m.step - last[r] < gap) r++;
      last[r] = m.step;
      return r;
    });
  })();
  const TOP = 34 + 15 * (ROWS.length ? Math.max(...ROWS) : 0);
  function markerNotes() {
    const many = MANY;
    return D.markers.map((m, i) => ({
      xref: "x", yref: "paper", x: m.step, y: 1, yanchor: "bottom", yshift: 2 + 15 * ROWS[i], showarrow: false,
      text: many ? (m.type === "hook" ? "◆" : "▼") : (m.type === "hook" ? "◆ " : "▼ ") + m.label,
      font: { size: 11, color: m.type === "hook" ? C.hook : C.bad },
      hovertext: m.text, hoverlabel: { bgcolor: "#ffffff", bordercolor: m.type === "hook" ? C.hook : C.bad,
                                      font: { color: C.text, size: 12 } },
    }));
  }

  // ticks of a log10-valued colour bar: powers of ten (and 2x, 5x when the span is narrow)
  function logTicks(lo, hi) {
    const span = hi - lo;
    const mult = span >= 3 ? [1] : span >= 1 ? [1, 2, 5] : [1, 2, 3, 4, 5, 6, 7, 8, 9];
    const stride = Math.max(1, Math.ceil(span / 8));
    const vals = [], text = [];
    for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
      if (mult.length === 1 && (e - Math.floor(lo)) % stride) continue;
      for (const m of mult) {
        const v = e + Math.log10(m);
        if (v < lo - 1e-9 || v > hi + 1e-9) continue;
        vals.push(v);
        text.push(m === 1 ? `10<sup>${e}</sup>` : `${m}·10<sup>${e}</sup>`);
      }
    }
    if (vals.length === 0) { vals.push((lo + hi) / 2); text.push(Math.pow(10, (lo + hi) / 2).toPrecision(2)); }
    return { vals, text };
  }

  // explicit ticks for a log axis spanning few decades (Plotly would label 0.2..0.9 as bare digits)
  function logAxisTicks(values) {
    const v = values.filter((x) => typeof x === "number" && x > 0);
    if (!v.length) return {};
    let lo = v[0], hi = v[0];
    for (const x of v) { if (x < lo) lo = x; if (x > hi) hi = x; }
    const decades = Math.log10(hi / lo);
    if (decades >= 2.5) return { exponentformat: "power" };
    const mult = decades < 1 ? [1, 2, 3, 5] : [1, 2, 5];
    const vals = [];
    for (let e = Math.floor(Math.log10(lo)) - 1; e <= Math.ceil(Math.log10(hi)); e++) {
      for (const m of mult) {
        const t = m * Math.pow(10, e);
        if (t >= lo / 1.5 && t <= hi * 1.5) vals.push(Number(t.toPrecision(3)));
      }
    }
    return { tickmode: "array", tickvals: vals, ticktext: vals.map((t) => String(t)) };
  }

  // 1. loss (top) and the global gradient norm raw/final (bottom, log y)
  function drawNorms() {
    const lossVals = D.loss.values.map(num);
    const finiteLoss = lossVals.filter((v) => v !== null);
    const lossLog = finiteLoss.length > 0 && finiteLoss.every((v) => v > 0)
      && Math.max(...finiteLoss) > 10 * Math.min(...finiteLoss);
    const traces = [
      { x: steps, y: D.total_norm_raw.map(pos), name: "global grad norm, raw", type: "scatter", mode: "lines",
        line: { color: C.raw, width: 3 }, xaxis: "x", yaxis: "y",
        hovertemplate: "step %{x}<br>raw ‖g‖ %{y:.4g}<extra></extra>" },
      { x: steps, y: D.total_norm.map(pos), name: "global grad norm, final", type: "scatter", mode: "lines",
        line: { color: C.final, width: 1.6 }, xaxis: "x", yaxis: "y",
        hovertemplate: "step %{x}<br>final ‖g‖ %{y:.4g}<extra></extra>" },
      { x: D.loss.steps, y: lossVals, name: "loss", type: "scatter", mode: "lines",
        line: { color: C.loss, width: 1.6 }, xaxis: "x", yaxis: "y2",
        hovertemplate: "step %{x}<br>loss %{y:.4g}<extra></extra>" },
    ];
    // non-finite global norms: red crosses along the bottom of the norm panel
    const nfSteps = steps.filter((s, i) => bad(D.total_norm_raw[i]) || bad(D.total_norm[i]));
    if (nfSteps.length) {
      traces.push({ x: nfSteps, y: nfSteps.map(() => 0), yaxis: "y3", xaxis: "x", type: "scatter", mode: "markers",
                    name: "non-finite norm", marker: { color: C.bad, symbol: "x-thin-open", size: 8 },
                    hovertemplate: "step %{x}: non-finite global norm<extra></extra>" });
    }
    const lay = layout({
      height: 600,
      legend: { orientation: "h", x: 0, y: -0.16, xanchor: "left", yanchor: "top" },
      xaxis: axis({ title: { text: "step (optimizer steps)" }, anchor: "y" }),
      yaxis: axis(Object.assign({ type: "log", domain: [0, 0.56], title: { text: "global ‖g‖ (L2, log)" } },
                                logAxisTicks(traces[0].y.concat(traces[1].y)))),
      yaxis2: axis(Object.assign({ type: lossLog ? "log" : "linear", domain: [0.66, 1], anchor: "x",
                                   title: { text: lossLog ? "loss (log)" : "loss" } },
                                 lossLog ? logAxisTicks(lossVals) : {})),
      yaxis3: { domain: [0, 0.56], range: [0, 1], visible: false, anchor: "x", overlaying: "y", fixedrange: true },
      shapes: markerShapes(),
      annotations: markerNotes(),
    });
    Plotly.newPlot("chart-norms", traces, lay, CONFIG);
  }

  // heatmap of a per-parameter series: colour log10(value); red for non-finite; grey for no value
  function drawHeat(id, rows, label, unit) {
    const logs = [];
    for (const row of rows) for (const v of row) if (typeof v === "number" && v > 0) logs.push(Math.log10(v));
    let lo = logs.length ? Math.min(...logs.slice(0, 1e5)) : -3;
    let hi = logs.length ? Math.max(...logs.slice(0, 1e5)) : 0;
    for (let i = 1e5; i < logs.length; i++) { lo = Math.min(lo, logs[i]); hi = Math.max(hi, logs[i]); }
    if (hi - lo < 1e-6) { lo -= 0.5; hi += 0.5; }
    const z = rows.map((row) => row.map((v) => (typeof v === "number" ? (v > 0 ? Math.log10(v) : lo) : null)));
    const text = rows.map((row) => row.map(fmt));
    const nf = rows.map((row) => row.map((v) => (bad(v) ? 1 : null)));
    const ticks = logTicks(lo, hi);
    const h = Math.max(340, Math.min(900, 120 + 18 * names.length));
    const traces = [
      { type: "heatmap", x: steps, y: names, z: z, text: text, zmin: lo, zmax: hi, colorscale: "Viridis",
        hoverongaps: false, xgap: 0, ygap: steps.length < 150 ? 1 : 0,
        hovertemplate: `%{y}<br>step %{x}<br>${label} %{text}<extra></extra>`,
        colorbar: { title: { text: unit, side: "right" }, tickvals: ticks.vals, ticktext: ticks.text,
                    thickness: 16, len: 1, outlinewidth: 0 } },
    ];
    if (nf.some((row) => row.some((v) => v !== null))) {
      traces.push({ type: "heatmap", x: steps, y: names, z: nf, text: text, showscale: false, hoverongaps: false,
                    colorscale: [[0, C.bad], [1, C.bad]], zmin: 0, zmax: 1, name: "non-finite",
                    hovertemplate: `%{y}<br>step %{x}<br>${label} %{text} (non-finite)<extra></extra>` });
    }
    const lay = layout({
      height: h,
      plot_bgcolor: "#d0d4d9",
      xaxis: axis({ title: { text: "step (optimizer steps)" }, showgrid: false }),
      yaxis: axis(Object.assign({ title: { text: "parameter" }, autorange: "reversed", type: "category",
                                  showgrid: false, tickfont: { size: names.length > 40 ? 10 : 12 } },
                                paramTicks(h - 120))),
      shapes: markerShapes(),
      annotations: markerNotes(),
    });
    Plotly.newPlot(id, traces, lay, CONFIG);
  }

  // 3. abs-max raw vs final at the last step, horizontal bars, log x
  function drawAbsmax() {
    const raw = D.last.absmax_raw, fin = D.last.absmax;
    const h = Math.max(320, Math.min(1400, 110 + 26 * names.length));
    const bar = (vals, name, color) => ({
      type: "bar", orientation: "h", y: names, x: vals.map(pos), name: name, marker: { color: color },
      text: vals.map(fmt), textposition: "none",
      hovertemplate: `%{y}<br>${name}: %{text}<extra></extra>`,
    });
    const traces = [bar(raw, "abs-max, raw", C.raw), bar(fin, "abs-max, final", C.final)];
    const nf = names.filter((_, i) => bad(raw[i]) || bad(fin[i]));
    const lay = layout({
      height: h, barmode: "group", bargap: 0.25, margin: { l: 70, r: 30, t: 34, b: 50 },
      legend: { orientation: "h", x: 0, y: 1, xanchor: "left", yanchor: "bottom" },
      xaxis: axis(Object.assign({ type: "log", title: { text: "max |gradient element| (log)" } },
                                logAxisTicks(raw.map(pos).concat(fin.map(pos))))),
      yaxis: axis(Object.assign({ autorange: "reversed", type: "category", title: { text: "parameter" } },
                                paramTicks(h - 90))),
      annotations: nf.length ? [{ xref: "paper", yref: "paper", x: 1, y: 1, yanchor: "bottom", xanchor: "right",
                                  showarrow: false, font: { color: C.bad },
                                  text: `non-finite at this step: ${nf.length} parameter(s)` }] : [],
    });
    Plotly.newPlot("chart-absmax", traces, lay, CONFIG);
  }

  if (steps.length) {
    drawNorms();
    drawHeat("chart-heatmap", D.grad_norm, "final ‖g‖", "final ‖g‖ (log scale)");
    drawAbsmax();
    drawHeat("chart-ratio", D.update_ratio, "‖Δθ‖/‖θ‖", "update ratio (log scale)");
  } else {
    for (const el of document.querySelectorAll(".chart")) el.style.display = "none";
  }
  document.body.dataset.drawn = "true";
})();
"""
