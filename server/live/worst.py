"""Worst now: the tensors whose current statistics are furthest from their own recent history.

Every snapshot (small and large runs) carries `worst`, the top `TOP` tensors ranked by a robust
z-score of `log10(value)` of their raw gradient norm and of their update ratio against the last
`WINDOW` sampled values of the same tensor and statistic:

    z = (log10(value) - median) / (1.4826 * max(MAD, MAD_FLOOR))

with the median and the median absolute deviation (MAD) of that tensor's recent log values, the
MAD floored at `MAD_FLOOR` decades so that a flat history does not divide by about 0. A tensor
with fewer than `MIN_VALUES` values in its history is not ranked; a value that is not finite
(NaN, inf) ranks first, with `z` "inf", whatever the history; a value that is None (no gradient)
or not positive (a zero norm: no logarithm) is not ranked and not added to the history. A tensor
appears once, with the statistic of the larger |z|.

`WorstNow.update` takes the full wire snapshot (before the server cuts it down for the wire),
vectorised over tensors with numpy: about a millisecond at 10,000 tensors. It runs on the
thread that converts the core's snapshots for the server (the core's dispatcher thread), never
on the training thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["MAD_FLOOR", "MIN_VALUES", "STATS", "TOP", "WINDOW", "WorstNow", "worst_of"]

WINDOW = 32  # the recent sampled values each tensor is compared with
MIN_VALUES = 8  # fewer values than this: not ranked
MAD_FLOOR = 0.02  # decades
TOP = 10
STATS = ("grad_norm_raw", "update_ratio")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _values(raw: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """`(values, nonfinite)`: the wire values as float64 (None and non-positive as NaN), and where
    a value is a real NaN or infinity."""
    try:
        arr = np.array(raw, dtype=np.float64)  # None -> nan; "nan", "inf", "-inf" parse
    except (TypeError, ValueError, OverflowError):
        arr = np.array([_NONFINITE.get(v, v) if isinstance(v, str) else v for v in raw], dtype=np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        for i in np.flatnonzero(bad).tolist():
            if raw[i] is None:
                bad[i] = False
    return arr, bad


def _median(sorted_: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per column, the median of the first `count` values of each column of `sorted_` (NaN when none)."""
    lo = np.clip((count - 1) // 2, 0, None)[None, :]
    hi = np.clip(count // 2, 0, None)[None, :]
    hi = np.minimum(hi, sorted_.shape[0] - 1)
    a = np.take_along_axis(sorted_, lo, axis=0)[0]
    b = np.take_along_axis(sorted_, hi, axis=0)[0]
    out = 0.5 * (a + b)
    out[count == 0] = np.nan
    return out


class WorstNow:
    """The recent log values of every tensor's `STATS`, and the ranking of each new snapshot.

    Args:
        window: recent sampled values kept per tensor and statistic.
        top: entries returned.
    """

    def __init__(self, window: int = WINDOW, top: int = TOP) -> None:
        self.window = window
        self.top = top
        self._hist: dict[str, np.ndarray] = {}  # stat -> [window, params], log10 values, NaN: none
        self._next: dict[str, int] = {}  # stat -> the row the next value goes to

    def reset(self) -> None:
        """Forget every history (the run went back: a rewind)."""
        self._hist.clear()
        self._next.clear()

    def update(self, snap: dict[str, Any], *, remember: bool = True) -> list[dict[str, Any]]:
        """Rank `snap` against the history, then add its values to it (unless `remember` is false);
        the `worst` list: `[{"param", "stat", "z", "value", "median"}, ...]`, by |z| descending
        (see the module docstring). Not thread-safe: one caller at a time."""
        best_score: np.ndarray | None = None
        entries: dict[int, dict[str, Any]] = {}
        for stat in STATS:
            raw = snap.get(stat)
            if not isinstance(raw, list) or not raw:
                continue
            try:
                arr, bad = _values(raw)
            except (TypeError, ValueError, OverflowError):  # not a list of wire numbers: not ranked
                continue
            n = arr.shape[0]
            hist = self._hist.get(stat)
            if hist is None or hist.shape[1] != n:
                hist = self._hist[stat] = np.full((self.window, n), np.nan)
                self._next[stat] = 0
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.where(np.isfinite(arr) & (arr > 0), np.log10(np.where(arr > 0, arr, 1.0)), np.nan)
            count = np.sum(~np.isnan(hist), axis=0)
            med = _median(np.sort(hist, axis=0), count)
            mad = _median(np.sort(np.abs(hist - med[None, :]), axis=0), count)
            z = (logs - med) / (1.4826 * np.maximum(mad, MAD_FLOOR))
            z[count < MIN_VALUES] = np.nan
            score = np.where(bad, np.inf, np.abs(z))
            score = np.where(np.isnan(score), -1.0, score)
            if best_score is None or best_score.shape != score.shape:
                best_score = np.full(n, -1.0)
            better = score > best_score
            candidates = np.flatnonzero(better)
            if candidates.size > self.top:  # only what can make the list
                keep = np.argpartition(-score[candidates], self.top - 1)[: self.top]
                candidates = candidates[keep]
            for i in candidates.tolist():
                entries[i] = {
                    "param": i,
                    "stat": stat,
                    "z": "inf" if bad[i] else round(float(z[i]), 3),
                    "value": raw[i],
                    "median": None if count[i] == 0 else float(10.0 ** med[i]),
                    "_score": float(score[i]),
                }
            best_score = np.maximum(best_score, score)
            if remember:
                row = self._next[stat]
                hist[row] = logs
                self._next[stat] = (row + 1) % self.window
        # a tensor keeps the statistic of its larger |z| (an entry a later statistic beat is stale)
        ranked = [e for i, e in entries.items() if best_score is not None and e["_score"] == best_score[i]]
        ranked.sort(key=lambda e: (-e["_score"], e["param"]))
        out = []
        for e in ranked[: self.top]:
            del e["_score"]
            out.append(e)
        return out


def worst_of(snapshots: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `worst` of the last of `snapshots` (oldest first; each with the `STATS` lists), ranked
    against those before it: a stored run's, from its last `WINDOW` + 1 rows."""
    tracker = WorstNow()
    out: list[dict[str, Any]] = []
    for snap in snapshots:
        out = tracker.update(snap)
    return out
