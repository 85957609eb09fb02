"""Exports: hooks as Python code, and a recorded run as CSV or JSON Lines.

CSV is tidy ("long"): one row per (step, parameter), with the step's own values
(loss, total norms, config_version) repeated on each of its rows. Non-finite
numbers are written as `nan`, `inf`, `-inf`; "no value" (null) is an empty cell.
A parameter name beginning with `=`, `+`, `-`, `@`, a tab or a carriage return
(`=HYPERLINK(...)`) gets a leading `'`, as OWASP advises against CSV formula
injection: a spreadsheet shows it as text instead of running it.

JSON Lines: one object per line, each with a `type`: first the `run`
(id, started, scenario, params, modules), then every `hooks` change, every
`event`, and every `snapshot` (the wire format), each group in order.
"""

from __future__ import annotations

import csv
import keyword
import math
from collections.abc import Iterator
from typing import IO, Any

from ..protocol import dumps, jsonsafe
from .packing import PER_PARAM
from .storage import HistoryStore

PER_STEP = ("time", "config_version", "loss", "total_norm_raw", "total_norm", "sampled_every", "overhead")


# add_hook's own arguments: a parameter of that name could not be passed as a keyword
_ADD_HOOK_ARGS = {"kind", "target", "point", "enabled", "params"}


def literal(value: Any) -> str:
    """`value` (JSON-like: what a preset holds) as a Python literal that evaluates to it. Strings
    and keys go through `repr`, so nothing read from a preset or a database becomes code;
    non-finite floats are `float('inf')` etc.; anything else is written as its `str`, quoted."""
    if value is None or isinstance(value, bool | int | str):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(str(value))


def _keyword(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and name.isascii()
        and not keyword.iskeyword(name)
        and name not in _ADD_HOOK_ARGS
    )


def python_code(preset: dict[str, Any] | list[dict[str, Any]]) -> str:
    """Python that recreates a preset's hooks on an attached inspector `insp`.

    Everything taken from the preset is written as a quoted literal (`literal`): parameters as
    keywords only when every name is a plain identifier, else as `params={...}`."""
    if isinstance(preset, dict):
        preset = preset.get("hooks") or []
    lines = [
        "# Hooks exported from gradient-inspector. Run after:",
        "#     insp = inspector.attach(model, optimizer)",
    ]
    for spec in preset:
        kind = spec.get("kind")
        if kind == "python":
            params = spec.get("params")
            fn = (params.get("fn") if isinstance(params, dict) else None) or spec.get("fn") or "your function"
            lines.append(  # quoted: a name holding a newline stays inside the comment
                f"# a python hook ({literal(str(fn))}) on target {literal(str(spec.get('target')))}: "
                f"add it yourself with insp.add_hook(fn, target=...)"
            )
            continue
        args = [literal(kind), f"target={literal(spec.get('target', '*'))}"]
        if spec.get("point"):
            args.append(f"point={literal(spec['point'])}")
        if spec.get("enabled") is False:
            args.append("enabled=False")
        params = spec.get("params") or {}
        if not isinstance(params, dict):
            params = {}
        if all(_keyword(k) for k in params):
            args += [f"{k}={literal(v)}" for k, v in params.items()]
        elif params:
            args.append(f"params={literal(params)}")
        lines.append(f"insp.add_hook({', '.join(args)})")
    if not preset:
        lines.append("# (no hooks)")
    return "\n".join(lines) + "\n"


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def text_cell(text: Any) -> Any:
    """A text cell that a spreadsheet would read as a formula, quoted with a leading `'`
    (OWASP's advice on CSV injection); any other value unchanged."""
    if isinstance(text, str) and text.startswith(_FORMULA_START):
        return "'" + text
    return text


def _cell(value: Any) -> Any:
    value = jsonsafe(value)
    return "" if value is None else value  # numbers, or "nan"/"inf"/"-inf": never user text


def _at(values: Any, i: int) -> Any:
    return values[i] if isinstance(values, list) and i < len(values) else None


def _snapshots(store: HistoryStore, run: int, chunk: int = 2000) -> Iterator[dict[str, Any]]:
    steps = store.steps("snapshots", run, cap=None)
    for i in range(0, len(steps), chunk):
        yield from store.snapshots_at(run, steps[i : i + chunk])


def write_csv(store: HistoryStore, run: int, out: IO[str]) -> int:
    """Write a run as tidy CSV; returns the number of snapshots written."""
    info = store.run(run) or {"params": []}
    names = [p["name"] for p in info["params"]]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *PER_STEP, "param", *PER_PARAM])
    n = 0
    for snap in _snapshots(store, run):
        step_cells = [_cell(snap.get(k)) for k in PER_STEP]
        for i, name in enumerate(names):
            writer.writerow(
                [
                    snap.get("step"),
                    *step_cells,
                    text_cell(name),
                    *(_cell(_at(snap.get(k), i)) for k in PER_PARAM),
                ]
            )
        n += 1
    return n


def write_jsonl(store: HistoryStore, run: int, out: IO[str]) -> int:
    """Write a run as JSON Lines (see the module docstring); returns the number of snapshots."""
    info = store.run(run) or {}
    out.write(
        dumps({"type": "run", **{k: info.get(k) for k in ("id", "started", "scenario", "params", "modules")}})
        + "\n"
    )
    for change in store.hook_changes(run):
        out.write(dumps({"type": "hooks", **change}) + "\n")
    since = -1
    while batch := store.events(run, since=since):
        for event in batch:
            out.write(dumps({"type": "event", "data": event}) + "\n")
        since = batch[-1]["seq"]
    n = 0
    for snap in _snapshots(store, run):
        out.write(dumps({"type": "snapshot", "data": snap}) + "\n")
        n += 1
    return n
