"""Read queries over the history database (see storage.py for the schema and the writer).

A snapshot row is put back together from its JSON and its packed columns (packing.py): the
per-parameter lists in float32 precision, None for every parameter on a step whose detail was
thinned; a row from before the packed columns has its lists in its JSON and reads as it is.

A row whose JSON cannot be read (a crash mid-write, a disk error, a file edited by hand) is
skipped, with one warning naming it (table, run, step or seq), and everything else is served:
replay, export and the report go on without it. A run whose own row cannot be read (its
parameter list) cannot be shown at all: `run()` raises a `StoreError` that says so in one line.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

from .optim import cut_optim
from .packing import PER_PARAM, PackError, Read, join, read, unpack_many
from .schema import StoreError

log = logging.getLogger("gradient_inspector.server")
MAX_REPORTED = 1000  # bad rows warned about once each, per reader (more are skipped silently)

MAX_ROWS = 10_000  # the most rows one history query returns
MAX_BUCKETS = 2_000  # a `buckets` query keeps at most 4 rows a bucket (2 values, min and max), and 2 more


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


# The values a downsampled query (`buckets`) keeps the extremes of, per table: the global
# gradient norms of a snapshot (its spikes are what the time charts must show), the loss of a step.
VALUE_KEYS: dict[str, tuple[str, ...]] = {"snapshots": ("total_norm_raw", "total_norm"), "scalars": ("loss",)}


def values_of(table: str, step: int, item: dict[str, Any]) -> tuple[Any, ...]:
    """`(step, value, ...)` of a snapshot or scalars dict, as `HistoryReader.values` reads them."""
    return (step, *(item.get(k) for k in VALUE_KEYS[table]))


def select_buckets(rows: list[tuple[Any, ...]], limit: int | None, buckets: int) -> list[int]:
    """The newest `limit` of `rows` (`(step, value, ...)`, sorted), then `bucket_extremes` of those."""
    if limit is not None:
        rows = rows[-limit:] if limit > 0 else []
    return bucket_extremes(rows, buckets)


def _extreme_key(v: Any) -> float | None:
    """A value to rank in a bucket: a wire number, "nan"/"inf" ranked above every finite value
    (a non-finite spike is the one point a downsampled chart must keep), "-inf" below; None for no value."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("nan", "inf"):
        return math.inf
    if v == "-inf":
        return -math.inf
    return None


def bucket_extremes(rows: list[tuple[Any, ...]], buckets: int) -> list[int]:
    """The steps to keep of `rows` (`(step, value, ...)`, ascending step) so that a chart of
    `buckets` columns loses no spike: the steps are cut into `buckets` ranges of equal width, and
    of each range the step of the smallest and of the largest value of every value column are
    kept (a non-finite value counts as the largest), the range's first step when it holds no
    value at all; the first and last step always. At most `2 * columns * buckets + 2` steps; all
    of them when there are no more than `buckets`."""
    if len(rows) <= buckets:
        return [r[0] for r in rows]
    lo, hi = rows[0][0], rows[-1][0]
    width = hi - lo + 1
    keep = {lo, hi}
    best: dict[
        tuple[int, int], tuple[float, int, float, int]
    ] = {}  # (bucket, column) -> min, its step, max, its step
    first: dict[int, int] = {}
    for row in rows:
        step = row[0]
        b = (step - lo) * buckets // width
        first.setdefault(b, step)
        for c, v in enumerate(row[1:]):
            k = _extreme_key(v)
            if k is None:
                continue
            cur = best.get((b, c))
            if cur is None:
                best[(b, c)] = (k, step, k, step)
            else:
                mn, smn, mx, smx = cur
                best[(b, c)] = (k, step, mx, smx) if k < mn else (mn, smn, k, step) if k > mx else cur
    have = {b for b, _ in best}
    for (_, _), (_, smn, _, smx) in best.items():
        keep.update((smn, smx))
    keep.update(s for b, s in first.items() if b not in have)
    return sorted(keep)


def decode(text: Any) -> tuple[dict[str, Any] | None, str | None]:
    """`(value, None)` for a stored JSON object, `(None, why)` for anything else."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:
        return None, f"not valid JSON ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(value, dict):
        return None, f"a JSON {type(value).__name__}, not an object"
    return value, None


def merge_scalars(snap: dict[str, Any], late: dict[str, Any] | None) -> dict[str, Any]:
    """A snapshot's loss and scalars as its step's `scalars` row has them: that row is the step's
    last word (records made after `step()` are averaged in there, after the snapshot was
    stored), so replay and exports show what the live page showed."""
    if late:
        if late.get("loss") is not None:
            snap["loss"] = late["loss"]
        if late.get("scalars"):
            snap["scalars"] = {**(snap.get("scalars") or {}), **late["scalars"]}
    return snap


def _in_order(prev: list[Any], new: list[Any]) -> set[Any]:
    """The ids in both lists that keep their order relative to every other id in both (the same
    of them before it), as the core's registry keeps a hook's `applied_step` (no torch here)."""
    common = set(prev) & set(new)
    a, b = [i for i in prev if i in common], [i for i in new if i in common]
    kept: set[Any] = set()
    diff: set[Any] = set()  # the symmetric difference of a[:k] and b[:k]
    for x, y in zip(a, b, strict=False):  # (a damaged record may repeat an id)
        if x == y and not diff:
            kept.add(x)
        diff ^= {x}
        diff ^= {y}
    return kept


@dataclass(frozen=True)
class HistoryQuery:
    """Which recorded steps a `snapshots` or `scalars` query returns: those with since < step <=
    until, oldest first; of them the newest `limit`, then `points` spread evenly, or with `buckets`
    the steps of each bucket's extremes (`bucket_extremes`). Built once from the request (the
    routes check the bounds, and that `points` and `buckets` are not both given) and passed
    through to the source and the reader."""

    since: int | None = None
    until: int | None = None
    limit: int | None = None
    points: int | None = None
    buckets: int | None = None

    def covers(self, step: int) -> bool:
        """since < step <= until."""
        return (self.since is None or step > self.since) and (self.until is None or step <= self.until)

    def choose(
        self,
        table: str,
        reader: HistoryReader | None,
        run: int,
        recent: dict[int, dict[str, Any]] | None = None,
    ) -> list[int]:
        """The steps of `table` ("snapshots" or "scalars") this query returns: `run`'s stored in
        `reader` (none without one) before the oldest of `recent`, then those of `recent` (steps
        still held in memory, all of them `covers`ed, their snapshot or scalars dicts)."""
        recent = recent or {}
        before = min(recent) if recent else None
        if self.buckets is not None:
            stored = [] if reader is None else reader.values(table, run, self.since, before, self.until)
            rows = stored + [values_of(table, s, recent[s]) for s in sorted(recent)]
            return select_buckets(rows, self.limit, self.buckets)
        steps = [] if reader is None else reader.steps(table, run, self.since, before, until=self.until)
        return select(steps + sorted(recent), self.limit, self.points)


ALL_STEPS = HistoryQuery()  # every recorded step (up to MAX_ROWS)


def _thinned(det: Any) -> bool:
    """Whether a row's `detail` is the empty BLOB of a step whose per-parameter detail was
    thinned (storage.py); anything else not NULL is unpacked (or skipped, damaged)."""
    return isinstance(det, (bytes, str)) and len(det) == 0


def _chunks(seq: list[int], n: int = 500) -> list[list[int]]:
    return [seq[i : i + n] for i in range(0, len(seq), n)]


class HistoryReader:
    """Thread-safe reads over one connection (WAL: readers never block the writer)."""

    path: str

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._reported: set[tuple[str, int, Any]] = set()

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _decode(self, table: str, run: int, key: str, value: Any, text: Any) -> dict[str, Any] | None:
        """A row's JSON object, or None (skipped, with one warning naming the row)."""
        data, why = decode(text)
        if why is not None:
            self._warn(table, run, key, value, why)
        return data

    def _warn(self, table: str, run: int, key: str, value: Any, why: str) -> None:
        row = (table, run, value)
        with self._lock:
            if row in self._reported or len(self._reported) >= MAX_REPORTED:
                return
            self._reported.add(row)
        log.warning(
            "gradient-inspector: %s: skipped the %s row of run %s at %s %s: %s",
            getattr(self, "path", "history"),
            table,
            run,
            key,
            value,
            why,
        )

    # -- runs ----------------------------------------------------------------------------------------

    def _branch_cols(self) -> str:
        """The branch columns of `runs`, NULL where a database from before them lacks them."""
        have = {r[1] for r in self._all("PRAGMA table_info(runs)")}
        return ", ".join(
            c if c in have else f"NULL AS {c}" for c in ("parent_run", "branch_step", "branch", "label")
        )

    def runs(self, live_run: int | None = None) -> list[dict[str, Any]]:
        """Every run of its own, newest first: `{"id", "started", "scenario", "steps", "params", "live",
        "branches"}`; `branches` lists the runs that branched from it (oldest first), each
        `{"id", "started", "steps", "branch", "branch_step", "label", "live"}` with its own
        `branches` (a branch of a branch)."""
        rows = self._all(
            f"SELECT id, started, scenario, last_step, params, {self._branch_cols()} FROM runs ORDER BY id DESC"
        )
        children: dict[int, list[dict[str, Any]]] = {}
        out: list[dict[str, Any]] = []
        known = {r[0] for r in rows}
        for i, st, sc, last, p, parent, bstep, kind, label in reversed(rows):  # oldest first
            try:
                params = json.loads(p)
            except (TypeError, ValueError, RecursionError):
                params = None  # listed, with no count: opening it says why it cannot be read
            item: dict[str, Any] = {
                "id": i,
                "started": st,
                "scenario": sc,
                "steps": last,
                "params": len(params) if isinstance(params, list) else None,
                "live": i == live_run,
                "branches": children.setdefault(i, []),
            }
            if parent is not None and parent in known:
                children.setdefault(parent, []).append(
                    {**item, "branch": kind, "branch_step": bstep, "label": label, "parent_run": parent}
                )
            else:
                out.append(item)
        return out[::-1]

    def run(self, run_id: int) -> dict[str, Any] | None:
        rows = self._all(
            f"SELECT id, started, scenario, params, modules, meta, last_step, {self._branch_cols()}"
            " FROM runs WHERE id = ?",
            (run_id,),
        )
        if not rows:
            return None
        i, st, sc, params, modules, meta, last, parent, bstep, kind, label = rows[0]
        try:
            names, mods = json.loads(params), json.loads(modules)
        except (TypeError, ValueError, RecursionError) as e:
            names = mods = e
        if not (isinstance(names, list) and isinstance(mods, list)):
            raise StoreError(
                f"{getattr(self, 'path', 'history')}: run {i} cannot be read: its list of parameters or"
                " modules is not valid JSON"
            )
        info, _ = decode(meta)
        return {
            "id": i,
            "started": st,
            "scenario": sc,
            "params": names,
            "modules": mods,
            "meta": info or {},
            "last_step": last,
            "parent_run": parent,
            "branch_step": bstep,
            "branch": kind,
            "label": label,
        }

    def branches_of(self, run_id: int) -> list[dict[str, Any]]:
        """The runs that branched from `run_id`, oldest first: `{"id", "branch", "branch_step", "label", "steps"}`."""
        if "parent_run" not in {r[1] for r in self._all("PRAGMA table_info(runs)")}:
            return []
        rows = self._all(
            "SELECT id, branch, branch_step, label, last_step FROM runs WHERE parent_run = ? ORDER BY id",
            (run_id,),
        )
        return [{"id": i, "branch": k, "branch_step": b, "label": lb, "steps": s} for i, k, b, lb, s in rows]

    def latest_run_id(self) -> int | None:
        """The newest run of its own (a branch, `parent_run` set, belongs to its run)."""
        branches = "parent_run" in {r[1] for r in self._all("PRAGMA table_info(runs)")}
        rows = self._all("SELECT MAX(id) FROM runs" + (" WHERE parent_run IS NULL" if branches else ""))
        return rows[0][0] if rows else None

    # -- snapshots and scalars -----------------------------------------------------------------------

    def steps(
        self,
        table: str,
        run: int,
        since: int | None = None,
        before: int | None = None,
        cap: int | None = MAX_ROWS,
        until: int | None = None,
    ) -> list[int]:
        """Recorded steps of `table` ("snapshots" or "scalars") in (since, before) and <= until,
        oldest first; the newest `cap` at most (None: all)."""
        rows = self._all(
            f"SELECT step FROM {table} WHERE run = ? AND step > ? AND step < ? AND step <= ?"
            " ORDER BY step DESC LIMIT ?",
            (
                run,
                -1 if since is None else since,
                2**62 if before is None else before,
                2**63 - 1 if until is None else until,
                -1 if cap is None else cap,
            ),
        )
        return [r[0] for r in reversed(rows)]

    def values(
        self,
        table: str,
        run: int,
        since: int | None = None,
        before: int | None = None,
        until: int | None = None,
    ) -> list[tuple[Any, ...]]:
        """`(step, value, ...)` of every recorded step of `table` in (since, before) and <= until,
        oldest first, the values being `VALUE_KEYS[table]` read in SQL (`json_extract`, the
        strings "nan"/"inf" as stored). Uncapped: the history is thinned, so a run's rows grow
        with the logarithm of its length (storage.py)."""
        cols = ", ".join(f"json_extract(data, '$.{k}')" for k in VALUE_KEYS[table])
        # json_valid: json_extract raises on a row that is not JSON (those are skipped, as by
        # snapshots_at, which warns about them)
        return self._all(
            f"SELECT step, {cols} FROM {table} WHERE run = ? AND step > ? AND step < ? AND step <= ?"
            " AND json_valid(data) ORDER BY step",
            (
                run,
                -1 if since is None else since,
                2**62 if before is None else before,
                2**63 - 1 if until is None else until,
            ),
        )

    def _packed_cols(self, prefix: str = "") -> str:
        """The packed columns of `snapshots`, NULL where a database from before them lacks them."""
        have = {r[1] for r in self._all("PRAGMA table_info(snapshots)")}
        return ", ".join(f"{prefix}{c}" if c in have else f"NULL AS {c}" for c in ("detail", "groups"))

    def _unpack(self, run: int, step: int, blob: Any, keys: Any = None, index: Any = None) -> Read | None:
        """A packed column set `read` (its floats written by `unpack_many`, many rows' at once), or
        None (skipped, with one warning naming the row) when damaged."""
        try:
            return read(blob, keys, index)
        except PackError as e:
            self._warn("snapshots", run, "step", step, str(e))
            return None
        except IndexError:
            self._warn(
                "snapshots", run, "step", step, "a packed column set of fewer parameters than the run's"
            )
            return None
        except (TypeError, ValueError, struct.error, zlib.error) as e:  # a hand-edited row
            self._warn("snapshots", run, "step", step, f"a damaged packed column set: {e}")
            return None

    def _n_params(self, run: int) -> int:
        rows = self._all(
            "SELECT json_array_length(params) FROM runs WHERE id = ? AND json_valid(params)", (run,)
        )
        return int(rows[0][0] or 0) if rows else 0

    def snapshots_at(self, run: int, steps: list[int], *, detail: bool = True) -> list[dict[str, Any]]:
        """The snapshots of these steps, oldest first, loss filled from the scalars table. With
        `detail` false, without the ten per-parameter lists: each has `"detail": {"index": [], ...}`
        with an empty list for each of them instead (the websocket's form of a large run's snapshot,
        PROTOCOL.md), and nothing packed is unpacked but the group aggregates."""
        out: list[dict[str, Any]] = []
        n_params: int | None = None
        cols = self._packed_cols("s.")
        for chunk in _chunks(steps):
            marks = ",".join("?" * len(chunk))
            rows = self._all(
                f"SELECT s.step, s.data, {cols}, c.data FROM snapshots s LEFT JOIN scalars c ON c.run = s.run"
                f" AND c.step = s.step WHERE s.run = ? AND s.step IN ({marks}) ORDER BY s.step",
                (run, *chunk),
            )
            read_rows: list[tuple[int, dict[str, Any], Read | None, Read | None, bool, Any]] = []
            for step, d, det, grp, c in rows:
                snap = self._decode("snapshots", run, "step", step, d)
                if snap is None:
                    continue
                groups = self._unpack(run, step, grp) if grp is not None else None
                thinned = detail and _thinned(det)
                lists = self._unpack(run, step, det) if detail and not thinned and det is not None else None
                read_rows.append((step, snap, lists, groups, thinned, c))
            blobs = [r for row in read_rows for r in row[2:4] if r is not None]
            unpack_many(blobs)  # (every float column of the chunk's rows written in one pass)
            for step, snap, lists, groups, thinned, c in read_rows:
                group_cols = groups[0] if groups is not None else None
                if not detail:
                    snap = {k: v for k, v in snap.items() if k not in PER_PARAM}
                    snap["detail"] = {"index": [], **{k: [] for k in PER_PARAM}}
                    if "optim" in snap:  # its per-parameter lists too (server/history/optim.py)
                        snap["optim"] = cut_optim(snap["optim"], [])
                    snap = join(snap, None, group_cols)
                elif thinned:  # None for every parameter
                    if n_params is None:
                        n_params = self._n_params(run)
                    snap = join(snap, None, group_cols, n_params)
                else:
                    snap = join(snap, lists[0] if lists is not None else None, group_cols)
                late = self._decode("scalars", run, "step", step, c) if c is not None else None
                out.append(merge_scalars(snap, late))
        return out

    def detail(
        self,
        run: int,
        index: list[int] | None,
        keys: tuple[str, ...] = PER_PARAM,
        *,
        since: int | None = None,
        before: int | None = None,
        limit: int = 600,
    ) -> tuple[list[int], dict[str, list[list[Any]]]]:
        """The per-parameter statistics `keys` of the parameters `index` (None: all) over the newest
        `limit` recorded steps in (since, before), oldest first: `(steps, {key: [[value per step]
        per parameter]})`; None where a step has no value (its detail thinned, or a row that
        cannot be read)."""
        cols = self._packed_cols()
        rows = self._all(
            f"SELECT step, data, {cols} FROM snapshots WHERE run = ? AND step > ? AND step < ?"
            " ORDER BY step DESC LIMIT ?",
            (run, -1 if since is None else since, 2**62 if before is None else before, max(0, limit)),
        )
        rows.reverse()
        width = len(index) if index is not None else None
        steps: list[int] = []
        per_step: list[dict[str, list[Any]] | None] = []
        blobs: list[Read] = []
        for step, d, det, _ in rows:
            steps.append(step)
            lists: dict[str, list[Any]] | None = None
            if det is not None and not _thinned(det):  # a damaged one is skipped, with a warning
                got = self._unpack(run, step, det, keys, index)
                if got is not None:
                    blobs.append(got)
                    lists = got[0]  # (its float columns written below, all rows' at once)
            elif det is None:  # a row from before the packed columns: its lists are in its JSON
                snap = self._decode("snapshots", run, "step", step, d)
                if snap is not None:
                    lists = {}
                    for k in keys:
                        v = snap.get(k)
                        if isinstance(v, list):
                            lists[k] = v if index is None else [v[i] if i < len(v) else None for i in index]
            per_step.append(lists)
        unpack_many(blobs)
        for lists in per_step:
            if width is None and lists:
                width = max((len(v) for v in lists.values()), default=0)
        width = width or 0
        stats: dict[str, list[list[Any]]] = {}
        for k in keys:
            cols_k = [(lists.get(k) if lists is not None else None) or [None] * width for lists in per_step]
            stats[k] = [[col[p] if p < len(col) else None for col in cols_k] for p in range(width)]
        return steps, stats

    def scalars_at(self, run: int, steps: list[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for chunk in _chunks(steps):
            marks = ",".join("?" * len(chunk))
            rows = self._all(
                f"SELECT step, data FROM scalars WHERE run = ? AND step IN ({marks}) ORDER BY step",
                (run, *chunk),
            )
            for step, d in rows:
                data = self._decode("scalars", run, "step", step, d)
                if data is not None:
                    out.append({"step": step, **data})
        return out

    def snapshots(
        self, run: int, query: HistoryQuery = ALL_STEPS, *, detail: bool = True
    ) -> list[dict[str, Any]]:
        """The snapshots of the steps `query` chooses (`HistoryQuery`), oldest first (`detail`: as
        for `snapshots_at`)."""
        return self.snapshots_at(run, query.choose("snapshots", self, run), detail=detail)

    def scalars(self, run: int, query: HistoryQuery = ALL_STEPS) -> list[dict[str, Any]]:
        """`{"step", "loss", "scalars"}` of the recorded steps `query` chooses, oldest first."""
        return self.scalars_at(run, query.choose("scalars", self, run))

    # -- events and hooks ----------------------------------------------------------------------------

    def events(self, run: int, *, since: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Events with seq > since, oldest first: the newest `limit` of them, or without a limit
        the first MAX_ROWS (page forward with `since`)."""
        order, cap = ("DESC", min(limit, MAX_ROWS)) if limit else ("ASC", MAX_ROWS)
        rows = self._all(
            f"SELECT seq, data FROM events WHERE run = ? AND seq > ? ORDER BY seq {order} LIMIT ?",
            (run, -1 if since is None else since, cap),
        )
        data = [e for seq, d in rows if (e := self._decode("events", run, "seq", seq, d)) is not None]
        return data[::-1] if order == "DESC" else data

    def flight(
        self, run: int, *, since: int | None = None, until: int | None = None, tensors: bool = False
    ) -> list[dict[str, Any]]:
        """The flight recorder's dumped steps of a run (`since < step <= until`), oldest first, at
        most MAX_ROWS; without `tensors` each row without its per-tensor `raw` and `final` lists.
        A database older than the `flight` table has none."""
        try:
            rows = self._all(
                "SELECT step, data FROM flight WHERE run = ? AND step > ? AND step <= ? ORDER BY step LIMIT ?",
                (run, -1 if since is None else since, 2**62 if until is None else until, MAX_ROWS),
            )
        except sqlite3.OperationalError:
            return []
        out = []
        for step, d in rows:
            row = self._decode("flight", run, "step", step, d)
            if row is None:
                continue
            if not tensors:
                row.pop("raw", None)
                row.pop("final", None)
            out.append(row)
        return out

    def hooks(self, run: int) -> tuple[int, list[dict[str, Any]]]:
        """A run's hook configuration as last requested, `(config_version, hooks)`, as the live
        `GET /api/hooks` shows it: `config_version` counts the applied changes; when the last
        acknowledged request (`hook_requests`) was not applied yet where the record ends (the
        process was killed, say), `hooks` is that requested configuration, each hook with the
        `applied_step` of the same hook in force, null while a change of its configuration or of
        its order relative to the others is pending (a pending removal is gone; another hook's
        removal before it only shifts its `position`)."""
        rows = self._all(
            "SELECT config_version, hooks FROM hook_changes WHERE run = ? ORDER BY config_version DESC LIMIT 1",
            (run,),
        )
        version, applied = (rows[0][0], self._hooks_of("hook_changes", run, rows[0])) if rows else (0, [])
        try:
            asked = self._all(
                "SELECT config_version, hooks FROM hook_requests WHERE run = ? ORDER BY seq DESC LIMIT 1",
                (run,),
            )
        except sqlite3.OperationalError:  # a database made before hook_requests, opened read-only
            asked = []
        if not asked or asked[0][0] <= version:
            return version, applied

        def content(h: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in h.items() if k not in ("applied_step", "position")}

        in_force = {h.get("id"): h for h in applied}
        asked_hooks = self._hooks_of("hook_requests", run, asked[0])
        kept = _in_order([h.get("id") for h in applied], [h.get("id") for h in asked_hooks])
        requested = []
        for h in asked_hooks:
            a = in_force.get(h.get("id"))
            same = a is not None and h.get("id") in kept and content(a) == content(h)
            requested.append({**h, "applied_step": a.get("applied_step") if same else None})
        return version, requested

    def hook_requests(self, run: int) -> list[dict[str, Any]]:
        """Every recorded hook request, oldest first: `{"seq", "time", "action", "hook_id",
        "config_version", "hooks"}` (none in a database made before them)."""
        try:
            rows = self._all(
                "SELECT seq, time, action, hook_id, config_version, hooks FROM hook_requests WHERE run = ?"
                " ORDER BY seq",
                (run,),
            )
        except sqlite3.OperationalError:
            return []
        keys = ("seq", "time", "action", "hook_id", "config_version")
        return [
            {
                **dict(zip(keys, r[:5], strict=True)),
                "hooks": self._hooks_of("hook_requests", run, (r[0], r[5])),
            }
            for r in rows
        ]

    def hook_changes(self, run: int) -> list[dict[str, Any]]:
        """Every recorded hook configuration, oldest first: `{"config_version", "time", "hooks"}`."""
        rows = self._all(
            "SELECT config_version, time, hooks FROM hook_changes WHERE run = ? ORDER BY config_version",
            (run,),
        )
        return [
            {"config_version": v, "time": t, "hooks": self._hooks_of("hook_changes", run, (v, h))}
            for v, t, h in rows
        ]

    def _hooks_of(self, table: str, run: int, row: tuple[Any, ...]) -> list[dict[str, Any]]:
        """A stored hook list (`row`: its key first, its JSON last); [] with one warning when unreadable."""
        try:
            hooks = json.loads(row[-1])
        except (TypeError, ValueError, RecursionError) as e:
            why = f"not valid JSON ({type(e).__name__}: {str(e)[:200]})"
        else:
            if isinstance(hooks, list) and all(isinstance(h, dict) for h in hooks):
                return hooks
            why = "not a list of hooks"
        self._warn(table, run, "config_version" if table == "hook_changes" else "seq", row[0], why)
        return []
