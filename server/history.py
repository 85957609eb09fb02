"""Read queries over the history database (see storage.py for the schema and the writer)."""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

MAX_ROWS = 10_000  # the most rows one history query returns


def pick_even(n: int, points: int) -> list[int]:
    """`points` indices spread evenly over `range(n)`, first and last included."""
    if points >= n:
        return list(range(n))
    if points == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})


def select(steps: list[int], limit: int | None, points: int | None) -> list[int]:
    """The newest `limit` of `steps` (sorted), then `points` of those spread evenly."""
    if limit is not None:
        steps = steps[-limit:] if limit > 0 else []
    if points is not None:
        steps = [steps[i] for i in pick_even(len(steps), points)]
    return steps


def merge_scalars(snap: dict[str, Any], scalars_json: str | None) -> dict[str, Any]:
    """Fill a snapshot's loss and scalars from the late `scalars` message of its step."""
    if scalars_json:
        late = json.loads(scalars_json)
        if snap.get("loss") is None:
            snap["loss"] = late.get("loss")
        if late.get("scalars"):
            snap["scalars"] = {**(snap.get("scalars") or {}), **late["scalars"]}
    return snap


def _chunks(seq: list[int], n: int = 500) -> list[list[int]]:
    return [seq[i : i + n] for i in range(0, len(seq), n)]


class HistoryReader:
    """Thread-safe reads over one connection (WAL: readers never block the writer)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- runs ----------------------------------------------------------------------------------------

    def runs(self, live_run: int | None = None) -> list[dict[str, Any]]:
        """Every run, newest first: `{"id", "started", "scenario", "steps", "params", "live"}`."""
        rows = self._all("SELECT id, started, scenario, last_step, params FROM runs ORDER BY id DESC")
        return [
            {
                "id": i,
                "started": st,
                "scenario": sc,
                "steps": last,
                "params": len(json.loads(p)),
                "live": i == live_run,
            }
            for i, st, sc, last, p in rows
        ]

    def run(self, run_id: int) -> dict[str, Any] | None:
        rows = self._all(
            "SELECT id, started, scenario, params, modules, meta, last_step FROM runs WHERE id = ?", (run_id,)
        )
        if not rows:
            return None
        i, st, sc, params, modules, meta, last = rows[0]
        return {
            "id": i,
            "started": st,
            "scenario": sc,
            "params": json.loads(params),
            "modules": json.loads(modules),
            "meta": json.loads(meta),
            "last_step": last,
        }

    def latest_run_id(self) -> int | None:
        rows = self._all("SELECT MAX(id) FROM runs")
        return rows[0][0] if rows else None

    # -- snapshots and scalars -----------------------------------------------------------------------

    def steps(
        self,
        table: str,
        run: int,
        since: int | None = None,
        before: int | None = None,
        cap: int | None = MAX_ROWS,
    ) -> list[int]:
        """Recorded steps of `table` ("snapshots" or "scalars") in (since, before), oldest first;
        the newest `cap` at most (None: all)."""
        rows = self._all(
            f"SELECT step FROM {table} WHERE run = ? AND step > ? AND step < ? ORDER BY step DESC LIMIT ?",
            (
                run,
                -1 if since is None else since,
                2**62 if before is None else before,
                -1 if cap is None else cap,
            ),
        )
        return [r[0] for r in reversed(rows)]

    def snapshots_at(self, run: int, steps: list[int]) -> list[dict[str, Any]]:
        """The snapshots of these steps, oldest first, loss filled from the scalars table."""
        out: list[dict[str, Any]] = []
        for chunk in _chunks(steps):
            marks = ",".join("?" * len(chunk))
            rows = self._all(
                "SELECT s.data, c.data FROM snapshots s LEFT JOIN scalars c ON c.run = s.run AND c.step = s.step"
                f" WHERE s.run = ? AND s.step IN ({marks}) ORDER BY s.step",
                (run, *chunk),
            )
            out.extend(merge_scalars(json.loads(d), c) for d, c in rows)
        return out

    def scalars_at(self, run: int, steps: list[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for chunk in _chunks(steps):
            marks = ",".join("?" * len(chunk))
            rows = self._all(
                f"SELECT step, data FROM scalars WHERE run = ? AND step IN ({marks}) ORDER BY step",
                (run, *chunk),
            )
            out.extend({"step": s, **json.loads(d)} for s, d in rows)
        return out

    def snapshots(
        self, run: int, *, since: int | None = None, limit: int | None = None, points: int | None = None
    ) -> list[dict[str, Any]]:
        """Snapshots with step > since, oldest first: the newest `limit`, then `points` spread evenly."""
        return self.snapshots_at(run, select(self.steps("snapshots", run, since), limit, points))

    def scalars(
        self, run: int, *, since: int | None = None, limit: int | None = None, points: int | None = None
    ) -> list[dict[str, Any]]:
        """`{"step", "loss", "scalars"}` of recorded steps, selected like `snapshots`."""
        return self.scalars_at(run, select(self.steps("scalars", run, since), limit, points))

    # -- events and hooks ----------------------------------------------------------------------------

    def events(self, run: int, *, since: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Events with seq > since, oldest first: the newest `limit` of them, or without a limit
        the first MAX_ROWS (page forward with `since`)."""
        order, cap = ("DESC", min(limit, MAX_ROWS)) if limit else ("ASC", MAX_ROWS)
        rows = self._all(
            f"SELECT data FROM events WHERE run = ? AND seq > ? ORDER BY seq {order} LIMIT ?",
            (run, -1 if since is None else since, cap),
        )
        data = [json.loads(r[0]) for r in rows]
        return data[::-1] if order == "DESC" else data

    def hooks(self, run: int) -> tuple[int, list[dict[str, Any]]]:
        """The last recorded hook configuration of a run: `(config_version, hooks)`."""
        rows = self._all(
            "SELECT config_version, hooks FROM hook_changes WHERE run = ? ORDER BY config_version DESC LIMIT 1",
            (run,),
        )
        return (rows[0][0], json.loads(rows[0][1])) if rows else (0, [])

    def hook_changes(self, run: int) -> list[dict[str, Any]]:
        """Every recorded hook configuration, oldest first: `{"config_version", "time", "hooks"}`."""
        rows = self._all(
            "SELECT config_version, time, hooks FROM hook_changes WHERE run = ? ORDER BY config_version",
            (run,),
        )
        return [{"config_version": v, "time": t, "hooks": json.loads(h)} for v, t, h in rows]
