"""Exports: hooks as Python code, and a recorded run as CSV or JSON Lines.

CSV is tidy ("long"): one row per (step, parameter), with the step's own values
(loss, total norms, config_version) repeated on each of its rows. Non-finite
numbers are written as `nan`, `inf`, `-inf`; "no value" (null) is an empty cell.

JSON Lines: one object per line, each with a `type`: first the `run`
(id, started, scenario, params, modules), then every `hooks` change, every
`event`, and every `snapshot` (the wire format), each group in order.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import IO, Any

from .protocol import dumps, jsonsafe
from .storage import HistoryStore

PER_PARAM = (
    "grad_norm_raw",
    "grad_norm",
    "grad_mean",
    "grad_std",
    "grad_absmax_raw",
    "grad_absmax",
    "nan_count",
    "inf_count",
    "param_norm",
    "update_ratio",
)
PER_STEP = ("time", "config_version", "loss", "total_norm_raw", "total_norm", "sampled_every", "overhead")


def python_code(preset: dict[str, Any] | list[dict[str, Any]]) -> str:
    """Python that recreates a preset's hooks on an attached inspector `insp`."""
    if isinstance(preset, dict):
        preset = preset.get("hooks") or []
    lines = [
        "# Hooks exported from gradient-inspector. Run after:",
        "#     insp = inspector.attach(model, optimizer)",
    ]
    for spec in preset:
        kind = spec.get("kind")
        if kind == "python":
            fn = spec.get("params", {}).get("fn") or spec.get("fn") or "your function"
            lines.append(
                f"# a python hook ({fn}) on target {spec.get('target')!r}: add it yourself with "
                f"insp.add_hook(fn, target=...)"
            )
            continue
        args = [repr(kind), f"target={spec.get('target', '*')!r}"]
        if spec.get("point"):
            args.append(f"point={spec['point']!r}")
        if spec.get("enabled") is False:
            args.append("enabled=False")
        args += [f"{k}={v!r}" for k, v in (spec.get("params") or {}).items()]
        lines.append(f"insp.add_hook({', '.join(args)})")
    if not preset:
        lines.append("# (no hooks)")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> Any:
    value = jsonsafe(value)
    return "" if value is None else value


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
                [snap.get("step"), *step_cells, name, *(_cell(_at(snap.get(k), i)) for k in PER_PARAM)]
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
