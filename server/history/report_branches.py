"""The branches of a run for the HTML report (report.py): each shadow or abandoned branch's loss and
global gradient norms, drawn dashed over the run's own (what-if)."""

from __future__ import annotations

from typing import Any

from .queries import pick_even

MAX_BRANCHES = 8  # a report shows at most this many branches of its run (the newest)


def _num(v: Any) -> Any:
    return v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None


def branch_series(store: Any, run: int, max_points: int) -> list[dict[str, Any]]:
    """`[{"id", "branch", "branch_step", "label", "loss": {"steps", "values"}, "steps",
    "total_norm_raw", "total_norm"}]` of the run's branches, at most `max_points` points each."""
    out = []
    for b in store.branches_of(run)[-MAX_BRANCHES:]:
        steps = store.steps("snapshots", b["id"], cap=None)
        snaps = store.snapshots_at(b["id"], [steps[i] for i in pick_even(len(steps), max_points)])
        loss_steps = store.steps("scalars", b["id"], cap=None)
        rows = store.scalars_at(b["id"], [loss_steps[i] for i in pick_even(len(loss_steps), max_points)])
        out.append(
            {
                **{k: b[k] for k in ("id", "branch", "branch_step", "label")},
                "loss": {"steps": [r["step"] for r in rows], "values": [_num(r.get("loss")) for r in rows]},
                "steps": [s["step"] for s in snaps],
                "total_norm_raw": [_num(s.get("total_norm_raw")) for s in snaps],
                "total_norm": [_num(s.get("total_norm")) for s in snaps],
            }
        )
    return out
