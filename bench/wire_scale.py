"""History bytes per sampled step and a live snapshot message's bytes, before and after the compact
formats, at 1,000 and 10,000 parameter tensors.

Synthetic snapshots of the real shape (the ten per-parameter lists, group aggregates, histograms
every 10th step, learning rates, totals; float32 values as the core produces them,
drifting slowly from step to step as training does) go through the real history writer
(`HistoryStore`, packed columns and the detail thinning) and the real wire conversion (the
worst-now ranking, `wire_snapshot`, `message_text`).

- history "before": today's stored row, the snapshot's JSON with every list (what the writer
  stored before the packed columns); "after": the bytes of a row (`data` + `detail` + `groups`),
  averaged over the rows inside the full-resolution window and over the rows past it (steady
  state: per-tensor detail on every 8th step only);
- message "before": the whole snapshot as the websocket sent it; "after": the default view of a
  large run (the detail of the worst-now tensors plus `--subscribed` subscribed ones).

    .venv/bin/python bench/wire_scale.py [--sizes 1000 10000] [--groups 60] [--steps 320] [--window 64]
        [--hist 1] [--real STEPS]

`--real 60` adds the `deep` demo scenario (about 1,000 tensors) trained for real, its snapshots going
through a real `LiveSource` into a real history.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inspector.stats.groups import AGG_KEYS as GROUP_KEYS  # noqa: E402
from server.history.storage import HistoryStore  # noqa: E402
from server.hub import message_text, wire_snapshot  # noqa: E402
from server.live.worst import WorstNow  # noqa: E402
from server.protocol import dumps  # noqa: E402


def f32(a: np.ndarray) -> list[float]:
    """Values as the core hands them over: float32 on the device, Python floats on the host."""
    return a.astype(np.float32).astype(np.float64).tolist()


class Synthetic:
    """Snapshots of a run with `n` tensors in `g` groups, drifting slowly (log-space random walk)."""

    def __init__(self, n: int, g: int, hist: int, seed: int = 0) -> None:
        self.n, self.g, self.hist = n, g, hist
        self.rng = np.random.default_rng(seed)
        self.base = self.rng.normal(-2.5, 1.0, n)  # log10 of each tensor's gradient norm
        self.pnorm = 10 ** self.rng.normal(0.5, 0.5, n)
        self.member = np.sort(self.rng.integers(0, g, n))

    def snapshot(self, step: int) -> dict[str, Any]:
        rng, n = self.rng, self.n
        self.base += rng.normal(0, 0.01, n)
        norm = 10 ** (self.base + rng.normal(0, 0.05, n))
        absmax = norm * 10 ** rng.normal(-0.8, 0.2, n)
        ratio = 10 ** rng.normal(-3, 0.3, n)
        snap: dict[str, Any] = {
            "step": step,
            "time": 1.7e9 + step * 0.1,
            "config_version": 0,
            "loss": float(np.float32(2.0 / (1 + step * 0.01))),
            "scalars": {},
            "lr": [0.0003],
            "grad_norm_raw": f32(norm),
            "grad_norm": f32(norm),
            "grad_mean": f32(rng.normal(0, 1e-5, n)),
            "grad_std": f32(norm / 30),
            "grad_absmax_raw": f32(absmax),
            "grad_absmax": f32(absmax),
            "nan_count": [0] * n,
            "inf_count": [0] * n,
            "param_norm": f32(self.pnorm),
            "update_ratio": f32(ratio),
            "total_norm_raw": float(np.float32(np.sqrt((norm**2).sum()))),
            "total_norm": float(np.float32(np.sqrt((norm**2).sum()))),
            "hook_effects": {},
            "hist": {},
            "modules": {},
            "ranks": None,
            "sampled_every": 1,
            "overhead": 0.02,
            "total_norm_backward": float(np.float32(np.sqrt((norm**2).sum()))),
            "events": [],
        }
        if step % 10 == 1:  # histograms every 10th sampled step
            for i in range(self.hist):
                edges = np.linspace(-absmax[i], absmax[i], 65)
                counts = rng.multinomial(1000, np.ones(64) / 64).tolist()
                snap["hist"][f"layers.{i}.weight"] = {"edges": f32(edges), "raw": counts, "final": counts}
        groups: dict[str, list[Any]] = {}
        sums = np.bincount(self.member, norm**2, self.g)
        for k in GROUP_KEYS:
            if k.endswith("count"):
                groups[k] = [0] * self.g
            elif k.startswith("ratio"):
                groups[k] = f32(10 ** rng.normal(-3, 0.3, self.g))
            else:
                groups[k] = f32(np.sqrt(sums) * 10 ** rng.normal(0, 0.1, self.g))
        snap["groups"] = groups
        return snap


def today_stored(snap: dict[str, Any]) -> str:
    """The row the writer stored before the packed columns: the snapshot's JSON (no groups then)."""
    return dumps({k: v for k, v in snap.items() if k != "groups"})


def measure(n: int, g: int, steps: int, window: int, subscribed: int, hist: int) -> dict[str, float]:
    syn = Synthetic(n, g, hist)
    worst = WorstNow()
    tmp = tempfile.mkdtemp(prefix="wire_scale_")
    store = HistoryStore(os.path.join(tmp, "h.sqlite"), detail_window=window, flush_interval=0.05)
    run = store.new_run(params=[{"name": f"p{i}"} for i in range(n)], modules=[])
    store.start_writer()
    before_hist, before_msg, after_msg, wire_ms = [], [], [], []
    subs = list(range(0, n, max(1, n // subscribed)))[:subscribed]
    for step in range(1, steps + 1):
        snap = syn.snapshot(step)
        before_hist.append(len(today_stored(snap)))
        today = {k: v for k, v in snap.items() if k not in ("events", "groups")}
        before_msg.append(len(message_text("snapshot", today, dumps(today))))
        t0 = time.perf_counter()
        ranked = worst.update(snap)
        full = {**snap, "worst": ranked}
        index = sorted({*subs, *(w["param"] for w in ranked)})
        text = message_text("snapshot", full, dumps(wire_snapshot(full, index)))
        wire_ms.append((time.perf_counter() - t0) * 1000)
        after_msg.append(len(text))
        store.add_snapshot(run, full)
        if step % 50 == 0:
            store.flush(60.0)
    store.flush(60.0)
    for _ in range(8):  # the detail thinning goes a batch a commit: let it catch up
        store.add_snapshot(run, {**syn.snapshot(steps + 1), "worst": []})
        store.flush(60.0)
    rows = store._all(
        "SELECT step, length(data) + coalesce(length(detail), 0) + coalesce(length(groups), 0),"
        " length(detail) FROM snapshots WHERE run = ? AND step <= ? ORDER BY step",
        (run, steps),
    )
    store.close()
    past = [b for _, b, _ in rows[: max(0, len(rows) - window)]]
    inside = [b for _, b, _ in rows[-window:]]
    kept = sum(1 for _, _, d in rows[: max(0, len(rows) - window)] if d)
    return {
        "hist_before": float(np.mean(before_hist)),
        "hist_window": float(np.mean(inside)),
        "hist_steady": float(np.mean(past)) if past else float("nan"),
        "kept": kept / max(1, len(past)),
        "msg_before": float(np.mean(before_msg)),
        "msg_after": float(np.mean(after_msg)),
        "msg_after_max": float(np.max(after_msg)),
        "wire_ms": float(np.median(wire_ms)),
    }


def measure_real(steps: int, window: int) -> dict[str, float]:
    """The `deep` scenario (about 1,000 tensors) trained `steps` steps with an Inspector, its
    snapshots through a real `LiveSource` into a real history: bytes per row and per message."""
    import torch

    import inspector
    from inspector.scenarios.deep import Deep
    from server.live.source import LiveSource

    torch.set_num_threads(1)  # as the demo does: a loaded machine's default threads thrash
    sc = Deep(seed=0)
    insp = inspector.attach(sc.model, sc.optimizer, every=1)
    tmp = tempfile.mkdtemp(prefix="wire_scale_real_")
    store = HistoryStore(os.path.join(tmp, "h.sqlite"), detail_window=window, flush_interval=0.05)
    source = LiveSource(insp, mode="user", store=store)
    sizes: list[int] = []
    source.start(lambda kind, payload, text: sizes.append(len(text)) if kind == "snapshot" and text else None)
    insp.set_hist_params([insp.params[0]])  # what the page asks for: one histogram
    for _ in range(steps):
        sc.step()
    insp.flush()
    store.flush(60.0)
    for _ in range(8):
        sc.step()
        insp.flush()
        store.flush(60.0)
    rows = store._all(
        "SELECT length(data) + coalesce(length(detail), 0) + coalesce(length(groups), 0) FROM snapshots"
        " ORDER BY step"
    )
    groups = len(insp.groups["names"])
    source.close()
    insp.close()
    store.close()
    past = [b for (b,) in rows[: max(0, len(rows) - window - 8)]]
    inside = [b for (b,) in rows[-window:]]
    return {
        "tensors": len(insp.params),
        "groups": groups,
        "hist_window": float(np.mean(inside)),
        "hist_steady": float(np.mean(past)) if past else float("nan"),
        "msg_after": float(np.mean(sizes)),
        "msg_after_max": float(np.max(sizes)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--groups", type=int, default=60, help="groups in the partition (the default's cap: 60)")
    ap.add_argument("--steps", type=int, default=320, help="sampled steps written")
    ap.add_argument(
        "--window",
        type=int,
        default=64,
        help="the detail window for the run (smaller than the default 512"
        " to reach the steady state sooner: the bytes per step past it do not depend on it)",
    )
    ap.add_argument("--subscribed", type=int, default=16, help="tensors the default view subscribes to")
    ap.add_argument(
        "--hist",
        type=int,
        default=1,
        help="tensors with histograms (every 10th step; the page asks for 1, the cap is 8)",
    )
    ap.add_argument(
        "--real",
        type=int,
        default=0,
        metavar="STEPS",
        help="also the `deep` scenario (about 1,000 tensors) trained for real this many steps (60: its"
        " loss turns NaN at about 75, by design, and all-NaN statistics pack to almost nothing)",
    )
    args = ap.parse_args()
    print(
        f"{args.groups} groups, {args.steps} sampled steps, detail window {args.window}, "
        f"{args.subscribed} subscribed tensors + worst-now, histograms of {args.hist}; bytes (KB = 1000 bytes)"
    )
    head = (
        f"{'tensors':>8} | {'history before':>14} {'after, window':>13} {'after, steady':>13} {'kept':>5} |"
        f" {'message before':>14} {'after (mean)':>12} {'after (max)':>11} | {'worst+wire ms':>13}"
    )
    print(head)
    print("-" * len(head))
    for n in args.sizes:
        m = measure(n, args.groups, args.steps, args.window, args.subscribed, args.hist)
        print(
            f"{n:>8} | {m['hist_before'] / 1e3:>11.1f} KB {m['hist_window'] / 1e3:>10.1f} KB"
            f" {m['hist_steady'] / 1e3:>10.1f} KB {m['kept']:>5.2f} | {m['msg_before'] / 1e3:>11.1f} KB"
            f" {m['msg_after'] / 1e3:>9.1f} KB {m['msg_after_max'] / 1e3:>8.1f} KB | {m['wire_ms']:>13.1f}"
        )
    if args.real:
        r = measure_real(args.real, min(args.window, args.real // 4))
        print(
            f"deep scenario, {r['tensors']:.0f} tensors in {r['groups']:.0f} groups, trained: history"
            f" {r['hist_window'] / 1e3:.1f} KB a step in the window, {r['hist_steady'] / 1e3:.1f} KB past it;"
            f" message {r['msg_after'] / 1e3:.1f} KB (mean, no page subscribed), {r['msg_after_max'] / 1e3:.1f} KB (max)"
        )


if __name__ == "__main__":
    main()
