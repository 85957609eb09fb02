"""SQLite history: runs, snapshots, scalars, events and hook changes.

One file (WAL), many runs: each process start that records adds a run. Writes go
through one background writer thread that owns the write connection:

- snapshots and scalars are batched: a batch is committed at most
  `flush_interval` (0.5 s) after its first row arrived, so history is at most
  about 1 s behind training even when a commit is slow;
- events and hook changes are committed as soon as the writer sees them;
- a hook change a client asked for is recorded as requested (`record_request`, a row of
  `hook_requests`: the requested configuration and the `config_version` it has once applied)
  and the caller waits until that row is committed: the server acknowledges a change only
  then, so a kill -9 right after the reply loses nothing (the applied change is announced by
  the core later, possibly a step later, and recorded as a `hook_changes` row as before).

Thinning rule (long runs grow the file logarithmically, not linearly). With
`L` the newest step of a run and `W` the full window (`full_window`, 1024 steps
for snapshots; 16 * W for scalars), a row at step `s`, of age `a = L - s`, is kept
when `a < W`, or when `s` is a multiple of `2**(k+1)` where
`W * 2**k <= a < W * 2**(k+1)` (where that multiple was never recorded, because the
inspector sampled every N-th step, the first recorded step after it stands in for it). Every octave of age keeps about `W / 2` rows, so
a run of `L` steps keeps about `W * (1 + log2(L / W) / 2)` snapshots. Snapshots
that carry an incident (a non-finite gradient, a skipped step, an error: any event not in
`ROUTINE_EVENTS`) are always kept; routine events (a hook change, a checkpoint, a rewind) keep
no snapshot, or a page (or a rule) making a change every step would stop the thinning (the
events themselves are kept in their own table, whatever happens to the snapshots). The
writer applies the rule each time a run's newest step has moved `THIN_EVERY` (64) steps on,
with `L` the newest step at that pass.

Per-parameter detail. A snapshot's ten per-parameter lists and its group aggregates are stored
packed (packing.py: float32, zlib), in the `detail` and `groups` columns, and the rest of it as
JSON in `data`; reading a row puts it back together (float32 precision for the packed values).
Past the full-resolution window (the newest `detail_window` recorded snapshots of a run, 512 by
default) the per-parameter detail is dropped except on those that carry an incident and on about
every 8th recorded snapshot (`DETAIL_KEEP`): the first recorded row of each aligned bucket of
8 steps (with every step recorded, the multiples of 8; where the inspector samples every k-th
step, buckets of 8 * k steps rounded down to a power of two), which are the rows the thinning
above keeps longest, so the older rows it keeps still have their detail. The others' `detail`
becomes an empty BLOB and the row reads with None for every parameter. Group aggregates and everything else are kept for every step. The writer
does it after its commits, in batches of at most `DETAIL_BATCH` rows a pass, oldest first.

The file stays bounded on a run of any length:

- snapshots are a rowid table (with a unique (run, step) index), whose rows of up to a page are
  stored whole in the table's pages and longer ones fill their overflow pages (a WITHOUT ROWID
  table keeps only about a quarter page in place and begins an overflow page for the rest: the
  `mlp` demo's 1.1 KB snapshot took a 4 KB page of its own; bench/soak.py, 20,000 steps: 18.6 MiB
  of file for 4.0 MiB of rows before, 6.3 MiB now).
  Databases made before keep their layout, which every query here reads alike;
- new databases use `auto_vacuum=INCREMENTAL`: after a thinning pass the free pages past
  `KEEP_FREE_PAGES` (which the next inserts reuse) are handed back to the file system;
- the WAL is checkpointed and truncated (`wal_checkpoint(TRUNCATE)`, waiting at most
  `CHECKPOINT_WAIT` s for readers to move on, so none is held up for long; when one is still
  reading an old snapshot it is tried again after the next write) whenever a write has left
  it past `WAL_LIMIT` (2 MiB); `journal_size_limit` keeps it at most that after any checkpoint
  SQLite makes on its own. (Before, it stayed at its high-water mark: 10 MiB after 20,000
  steps of bench/soak.py.) The writer's transactions are bounded in rows, however many a flush
  interval brought, so the WAL holds at most WAL_LIMIT and one of them: pending rows go one
  run's `COMMIT_SNAPSHOTS` snapshots and `COMMIT_SCALARS` scalars at a time, and the step
  thinning, the detail thinning (`DETAIL_BATCH` rows) and the page reclaiming (`VACUUM_CHUNK`
  pages) each run in a transaction of their own, with a checkpoint after each. (Before, a flush
  interval's rows went in one commit with both thinnings, and a run at 400 steps a second left a
  5 MiB WAL between checkpoints.) Rows, not bytes: 128 snapshots of the `mlp` demo are about
  a quarter of a MiB, of a 10,000-tensor model (its per-tensor detail) tens of MiB; and a
  rewind's branch moves the abandoned rows in one transaction.

When a write fails (disk full, I/O error) training goes on: the writer keeps its
pending rows in memory (bounded; the oldest snapshots go first), reports
`history_paused` once, retries every flush interval, and reports
`history_resumed` when a commit succeeds again.
"""

from __future__ import annotations

import itertools
import os
import queue
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..protocol import dumps
from ..settings import DETAIL_WINDOW
from .packing import split
from .queries import HistoryReader
from .schema import BRANCH_COLUMNS, StoreError, connect

__all__ = ["BRANCH_COLUMNS", "DEFAULT_DB", "HistoryStore", "StoreError", "connect"]

DEFAULT_DB = "gradient-inspector.sqlite"
WAL_LIMIT = 2 << 20  # bytes: past this the writer checkpoints and truncates the WAL
CHECKPOINT_WAIT = 0.2  # seconds the checkpoint waits for readers to move on (then tries later)
KEEP_FREE_PAGES = 256  # free pages kept after a thinning pass for the next inserts (1 MiB)
VACUUM_CHUNK = 64  # free pages handed back a transaction (moving a page rewrites it, its parent and its map)
DETAIL_KEEP = 8  # past that window, about one in this many recorded snapshots keeps its detail
DETAIL_BATCH = 128  # rows the writer thins the detail of, at most, in one pass
COMMIT_SNAPSHOTS = 128  # snapshots a transaction commits, at most (_commit)
COMMIT_SCALARS = 1024  # scalars rows a transaction commits, at most
THIN_EVERY = 64  # steps a run's newest step moves on between two passes of the step thinning

# Events that are part of ordinary work: a snapshot that carries only these is thinned like any
# other (`n_events` counts the others: the incidents a snapshot is always kept for)
ROUTINE_EVENTS = frozenset(
    (
        "hook_applied",
        "checkpoint",
        "rewind",
        "shadow_started",
        "shadow_ended",
        "history_paused",
        "history_resumed",
    )
)
StatusCallback = Callable[[str, str], None]  # (kind: "history_paused"|"history_resumed", reason)


def incidents(snap: dict[str, Any]) -> int:
    """How many of a snapshot's events are incidents (not `ROUTINE_EVENTS`): its `n_events`."""
    events = snap.get("events") or ()
    return sum(1 for e in events if not (isinstance(e, dict) and e.get("kind") in ROUTINE_EVENTS))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _part(snaps: OrderedDict, scalars: OrderedDict) -> tuple[dict, dict]:
    """The oldest pending rows of one run that one transaction of the writer commits: the run of
    the oldest pending snapshot (else scalars row), at most `COMMIT_SNAPSHOTS` of its snapshots
    and `COMMIT_SCALARS` of its scalars rows (rows arrive in step order), both up to the same
    step where a limit cuts either: the thinning after the part counts ages from its newest step.
    Never empty while something is pending (the row at a cut is in the part)."""
    run = next(iter(snaps))[0] if snaps else next(iter(scalars))[0]
    s_keys = list(itertools.islice((k for k in snaps if k[0] == run), COMMIT_SNAPSHOTS + 1))
    c_keys = list(itertools.islice((k for k in scalars if k[0] == run), COMMIT_SCALARS + 1))
    bound = float("inf")
    if len(s_keys) > COMMIT_SNAPSHOTS:
        bound = s_keys[COMMIT_SNAPSHOTS - 1][1]
    if len(c_keys) > COMMIT_SCALARS:
        bound = min(bound, c_keys[COMMIT_SCALARS - 1][1])
    part_snaps = {k: snaps[k] for k in s_keys[:COMMIT_SNAPSHOTS] if k[1] <= bound}
    part_scalars = {k: scalars[k] for k in c_keys[:COMMIT_SCALARS] if k[1] <= bound}
    return part_snaps, part_scalars


class HistoryStore(HistoryReader):
    """A database file: reads (`HistoryReader`) from any thread, writes through the writer.

    Args:
        path: the SQLite file; created when missing unless `read_only`.
        read_only: open for reading only (replay, export): nothing is ever written.
        flush_interval: the longest a snapshot waits in memory before its batch commits.
        full_window: steps kept in full before thinning starts (see the module docstring).
        max_pending: snapshots (and scalars rows) kept in memory at most while writes fail.
        detail_window: recorded snapshots of a run whose per-parameter detail is all kept (see
            the module docstring).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        read_only: bool = False,
        flush_interval: float = 0.5,
        full_window: int = 1024,
        max_pending: int = 5000,
        detail_window: int = DETAIL_WINDOW,
    ) -> None:
        if detail_window < 1:
            raise ValueError(f"detail_window: at least 1, got {detail_window}")
        self.path = os.fspath(path)
        self.detail_window = detail_window
        self.read_only = read_only
        self.flush_interval = flush_interval
        self.full_window = full_window
        self.max_pending = max_pending
        conn = connect(self.path, create=not read_only)
        if read_only:
            conn.execute("PRAGMA query_only=ON")
        super().__init__(conn)
        # A hook for fault-injection tests: called before every commit; raising sqlite3.Error there
        # is handled exactly like a failing disk.
        self.fault: Callable[[], None] | None = None
        self.paused_reason: str | None = None
        self.dropped = 0  # snapshots dropped from memory while writes failed
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._on_status: StatusCallback | None = None
        self._closed = False
        self._detail_done: dict[int, tuple[int, int]] = {}  # run -> (newest step decided, bucket span)

    # -- runs ----------------------------------------------------------------------------------------

    def new_run(
        self,
        *,
        params: list[dict[str, Any]],
        modules: list[str],
        scenario: str | None = None,
        meta: dict[str, Any] | None = None,
        parent_run: int | None = None,
        branch_step: int | None = None,
        branch: str | None = None,
        label: str | None = None,
    ) -> int:
        """Add a run (committed at once) and return its id. A branch names its `parent_run`, the
        `branch_step` of the parent it starts after, its kind (`branch`) and a `label`."""
        if self.read_only:
            raise StoreError("this database is open read-only")
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO runs (started, scenario, params, modules, meta, updated, parent_run, branch_step,"
                " branch, label) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    time.time(),
                    scenario,
                    dumps(params),
                    dumps(modules),
                    dumps(meta or {}),
                    time.time(),
                    parent_run,
                    branch_step,
                    branch,
                    label,
                ),
            )
            return int(cur.lastrowid or 0)

    def set_label(self, run: int, label: str) -> None:
        """A branch's label changed (the shadow's difference from the main run grew)."""
        self._queue.put(("label", run, label))

    def move_branch(
        self, run: int, to_run: int, after_step: int, seqs: tuple[int, int], config_version: int
    ) -> None:
        """A rewind of `run` to `after_step`: its snapshots and scalars past that step, and its
        events with `seqs[0] < seq <= seqs[1]`, move to the branch run `to_run` (in order with the
        rows queued before); `to_run` gets a copy of the hook changes before `config_version`."""
        self._queue.put(("branch", run, to_run, after_step, seqs, config_version))

    # -- writes (any thread; cheap: a queue put) -----------------------------------------------------

    def start_writer(self, on_status: StatusCallback | None = None) -> None:
        if self.read_only or self._writer is not None:
            return
        self._on_status = on_status
        self._writer = threading.Thread(target=self._run_writer, name="gradient-inspector-store", daemon=True)
        self._writer.start()

    def add_snapshot(self, run: int, snap: dict[str, Any]) -> None:
        """Queue a snapshot (a wire dict, not changed here); the writer thread packs it."""
        self._queue.put(("snapshot", run, snap))

    def add_scalars(self, run: int, payload: dict[str, Any]) -> None:
        self._queue.put(("scalars", run, payload))

    def add_event(self, run: int, event: dict[str, Any]) -> None:
        """Queue an event; its strings are cut to `MAX_EVENT_STRING` characters (the core's events
        already are: this holds for any other writer too)."""
        from inspector.wire.records import event_fields  # here: replay and export never import torch

        self._queue.put(("event", run, event_fields(event)))

    def add_flight(self, run: int, rows: list[dict[str, Any]]) -> None:
        """Queue a flight-recorder dump's rows (idempotent by step: a step dumped again replaces
        its row)."""
        self._queue.put(("flight", run, {"rows": rows}))

    def add_hooks(self, run: int, config_version: int, hooks: list[dict[str, Any]]) -> None:
        self._queue.put(
            ("hooks", run, {"config_version": config_version, "hooks": hooks, "time": time.time()})
        )

    def record_request(
        self,
        run: int,
        seq: int,
        *,
        action: str,
        hook_id: str | None,
        config_version: int,
        hooks: list[dict[str, Any]],
        timeout: float = 5.0,
    ) -> bool:
        """Record a requested hook change (the `hook_requests` row `seq` of `run`) and wait until it
        is committed, at most `timeout` s: True once it is. False when the writer cannot commit it
        now (history paused: the row stays queued and is written when writes succeed again) or is
        not running."""
        if self._writer is None or not self._writer.is_alive():
            return False
        ack: list[Any] = [threading.Event(), False]  # [committed or given up, committed]
        row = {"seq": seq, "action": action, "hook_id": hook_id, "config_version": config_version}
        self._queue.put(("request", run, {**row, "hooks": hooks, "time": time.time()}, ack))
        return bool(ack[0].wait(timeout) and ack[1])

    def flush(self, timeout: float = 5.0) -> bool:
        """Block until everything queued so far is committed (or the writer gave up this round)."""
        if self._writer is None or not self._writer.is_alive():
            return False
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self) -> None:
        """Flush, stop the writer and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(("stop",))
            self._writer.join(timeout=10.0)
        with self._lock:
            self._conn.close()

    # -- the writer thread ---------------------------------------------------------------------------

    def _run_writer(self) -> None:
        conn = connect(self.path, create=True)
        conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
        snaps: OrderedDict[tuple[int, int], tuple[str, float | None, int, bytes | None, bytes | None]] = (
            OrderedDict()
        )
        scalars: OrderedDict[tuple[int, int], tuple[str, float | None, Any]] = OrderedDict()
        urgent: list[tuple[str, int, dict[str, Any]]] = []  # events and hook changes, in order
        oldest: float | None = None  # when the oldest pending row arrived
        last_thin: dict[int, int] = {}
        waiters: list[threading.Event] = []
        acks: list[list[Any]] = []  # of hook requests, released once their commit is done
        stopping = False
        while not stopping:
            timeout = None if oldest is None else max(0.0, oldest + self.flush_interval - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            while item is not None:
                kind = item[0]
                if kind == "stop":
                    stopping = True
                elif kind == "flush":
                    waiters.append(item[1])
                elif kind in ("branch", "label"):
                    # rows queued before it belong where they were: commit them first
                    if self._commit(conn, snaps, scalars, urgent, last_thin):
                        oldest = None
                    if not urgent:  # the requests went with the first part: durable now
                        for ack in acks:
                            ack[1] = True
                            ack[0].set()
                        acks.clear()
                    self._branch(conn, item)
                    self._bound_wal(conn)
                elif kind == "snapshot":
                    _, run, snap = item
                    step = int(snap.get("step", 0))
                    rest, detail, groups = split(snap)
                    snaps[(run, step)] = (dumps(rest), snap.get("time"), incidents(snap), detail, groups)
                    oldest = oldest if oldest is not None else time.monotonic()
                elif kind == "scalars":
                    _, run, p = item
                    step = int(p.get("step", 0))
                    loss = p.get("loss")
                    loss = loss if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
                    data = dumps({"loss": p.get("loss"), "scalars": p.get("scalars") or {}})
                    scalars[(run, step)] = (data, time.time(), loss)
                    oldest = oldest if oldest is not None else time.monotonic()
                else:  # event, hooks, request: commit without waiting for the batch
                    if kind == "request":
                        acks.append(item[3])
                        item = item[:3]
                    urgent.append(item)  # type: ignore[arg-type]
                    oldest = time.monotonic() - self.flush_interval
                try:
                    item = self._queue.get_nowait()  # drain what is there: committed together (_commit)
                except queue.Empty:
                    item = None
            due = oldest is not None and time.monotonic() >= oldest + self.flush_interval
            if due or stopping or waiters:
                committed = self._commit(conn, snaps, scalars, urgent, last_thin)
                if committed:
                    oldest = None
                else:
                    oldest = time.monotonic()  # retry one interval later
                    self._bound(snaps, scalars)
                for ack in acks:
                    ack[1] = not urgent  # the requests went with the first part: durable if it was
                    ack[0].set()
                acks.clear()
                for w in waiters:
                    w.set()
                waiters.clear()
        conn.close()

    def _commit(
        self,
        conn: sqlite3.Connection,
        snaps: OrderedDict,
        scalars: OrderedDict,
        urgent: list,
        last_thin: dict[int, int],
    ) -> bool:
        """Commit what is pending in parts of at most `COMMIT_SNAPSHOTS` snapshots and
        `COMMIT_SCALARS` scalars (the events, hook changes and requests in the first), oldest
        first, each followed by its WAL checkpoint and its thinning (`_maintain`): what one
        transaction writes, and so the WAL, stays bounded however many rows a flush interval
        brought (at 400 steps a second, one commit of all of them with its thinning pass wrote
        more than 3 MiB to the WAL). Each committed part is removed from `snaps`, `scalars` and
        `urgent`; False when a part failed (it and the rest stay pending). A part ends at a step:
        the thinning after it counts ages from its newest step, so no later row may go with it."""
        while True:
            part_snaps, part_scalars = _part(snaps, scalars) if snaps or scalars else ({}, {})
            newest = self._commit_part(conn, part_snaps, part_scalars, urgent)
            if newest is None:
                return False
            for k in part_snaps:
                del snaps[k]
            for k in part_scalars:
                del scalars[k]
            urgent.clear()
            self._bound_wal(conn)
            self._maintain(conn, newest, {r for r, _ in part_snaps}, last_thin)
            if not snaps and not scalars:
                return True

    def _commit_part(
        self, conn: sqlite3.Connection, snaps: dict, scalars: dict, urgent: list
    ) -> dict[int, int] | None:
        """One transaction of `_commit`: the rows, the urgent items and each run's newest step.
        Returns the newest step committed per run, None when the transaction failed (rolled back,
        `history_paused` reported once)."""
        try:
            if self.fault is not None:
                self.fault()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT OR REPLACE INTO snapshots (run, step, time, n_events, data, detail, groups)"
                " VALUES (?,?,?,?,?,?,?)",
                [(r, s, t, n, d, det, g) for (r, s), (d, t, n, det, g) in snaps.items()],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO scalars (run, step, time, loss, data) VALUES (?,?,?,?,?)",
                [(r, s, t, loss, d) for (r, s), (d, t, loss) in scalars.items()],
            )
            for kind, run, p in urgent:
                if kind == "event":
                    conn.execute(
                        "INSERT OR REPLACE INTO events (run, seq, kind, time, step, data) VALUES (?,?,?,?,?,?)",
                        (run, int(p.get("seq", 0)), p.get("kind"), p.get("time"), p.get("step"), dumps(p)),
                    )
                elif kind == "flight":
                    conn.executemany(
                        "INSERT OR REPLACE INTO flight (run, step, data) VALUES (?,?,?)",
                        [(run, int(r["step"]), dumps(r)) for r in p["rows"]],
                    )
                elif kind == "request":
                    conn.execute(
                        "INSERT OR REPLACE INTO hook_requests (run, seq, time, action, hook_id, config_version,"
                        " hooks) VALUES (?,?,?,?,?,?,?)",
                        (
                            run,
                            p["seq"],
                            p["time"],
                            p["action"],
                            p["hook_id"],
                            p["config_version"],
                            dumps(p["hooks"]),
                        ),
                    )
                else:
                    conn.execute(
                        "INSERT OR REPLACE INTO hook_changes (run, config_version, time, hooks) VALUES (?,?,?,?)",
                        (run, int(p["config_version"]), p["time"], dumps(p["hooks"])),
                    )
            newest: dict[int, int] = {}
            for r, s in list(snaps) + list(scalars):
                newest[r] = max(newest.get(r, 0), s)
            for r, s in newest.items():
                conn.execute(
                    "UPDATE runs SET last_step = MAX(last_step, ?), updated = ? WHERE id = ?",
                    (s, time.time(), r),
                )
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if self.paused_reason is None:
                self.paused_reason = f"cannot write {self.path}: {e}"
                self._status("history_paused", self.paused_reason)
            return None
        if self.paused_reason is not None:
            self.paused_reason = None
            self._status("history_resumed", f"writing {self.path} again")
        return newest

    def _maintain(
        self,
        conn: sqlite3.Connection,
        newest: dict[int, int],
        with_snaps: set[int],
        last_thin: dict[int, int],
    ) -> None:
        """After a part's commit, each in a transaction of its own (`_write`): the step thinning of
        each run whose newest step moved `THIN_EVERY` steps on since its last pass (`_thin`), the
        detail thinning of each run that got snapshots (`_thin_detail`), and after a step thinning
        the free pages past KEEP_FREE_PAGES handed back to the file system, `VACUUM_CHUNK` a
        transaction (a no-op on a database made without auto_vacuum). The WAL is checkpointed after
        each write, so it never holds more than WAL_LIMIT and one of them: a thinning pass rewrites
        pages all over the tables, as much as a commit of new rows or more (bench/soak.py).
        Nothing here is needed for what was committed to be safe: a failed pass is rolled back and
        tried again after the next commit."""
        due = {r: s for r, s in newest.items() if s - last_thin.get(r, 0) >= THIN_EVERY}

        def thin() -> None:
            for r, s in due.items():
                self._thin(conn, r, s)

        if due and self._write(conn, thin):
            last_thin.update(due)
        decided: dict[int, tuple[int, int] | None] = {}

        def thin_detail() -> None:
            decided.update({r: self._thin_detail(conn, r) for r in with_snaps})

        if with_snaps and self._write(conn, thin_detail):
            self._detail_done.update({r: d for r, d in decided.items() if d is not None})
        if not due:
            return
        try:
            free = conn.execute("PRAGMA freelist_count").fetchone()[0]
            while free > KEEP_FREE_PAGES:
                # executescript: it steps the pragma to its end (execute() frees one page only)
                conn.executescript(f"PRAGMA incremental_vacuum({min(VACUUM_CHUNK, free - KEEP_FREE_PAGES)});")
                self._bound_wal(conn)
                left = conn.execute("PRAGMA freelist_count").fetchone()[0]
                free = left if left < free else 0  # no progress: tried again after the next pass
        except sqlite3.Error:
            pass

    def _write(self, conn: sqlite3.Connection, work: Callable[[], Any]) -> bool:
        """`work` in a transaction of its own, then the WAL checkpointed (`_bound_wal`); False,
        rolled back, when it failed."""
        try:
            if self.fault is not None:
                self.fault()
            conn.execute("BEGIN IMMEDIATE")
            work()
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError):
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            return False
        self._bound_wal(conn)
        return True

    def _bound_wal(self, conn: sqlite3.Connection) -> None:
        """The WAL checkpointed and truncated once it has grown past WAL_LIMIT. What is committed
        is safe either way: when a reader holds the checkpoint off past CHECKPOINT_WAIT it is tried
        again after the next write."""
        try:
            if _size(f"{self.path}-wal") > WAL_LIMIT:
                conn.execute(f"PRAGMA busy_timeout={int(CHECKPOINT_WAIT * 1000)}")
                try:
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                finally:
                    conn.execute("PRAGMA busy_timeout=10000")
        except (sqlite3.Error, OSError):
            pass

    def _branch(self, conn: sqlite3.Connection, item: tuple[Any, ...]) -> None:
        try:
            if self.fault is not None:
                self.fault()
            conn.execute("BEGIN IMMEDIATE")
            if item[0] == "label":
                conn.execute("UPDATE runs SET label = ? WHERE id = ?", (item[2], item[1]))
            else:
                _, run, to_run, step, (seq_lo, seq_hi), version = item
                for table in ("snapshots", "scalars", "flight"):
                    conn.execute(
                        f"UPDATE {table} SET run = ? WHERE run = ? AND step > ?", (to_run, run, step)
                    )
                conn.execute(
                    "UPDATE events SET run = ? WHERE run = ? AND seq > ? AND seq <= ?",
                    (to_run, run, seq_lo, seq_hi),
                )
                conn.execute(  # the branch's session shows the hooks it ran with
                    "INSERT OR REPLACE INTO hook_changes (run, config_version, time, hooks)"
                    " SELECT ?, config_version, time, hooks FROM hook_changes WHERE run = ? AND config_version < ?",
                    (to_run, run, version),
                )
                conn.execute(
                    "UPDATE runs SET last_step = (SELECT last_step FROM runs WHERE id = ?) WHERE id = ?",
                    (run, to_run),
                )
                conn.execute("UPDATE runs SET last_step = ? WHERE id = ?", (step, run))
                done, span = self._detail_done.get(run, (-1, 0))
                if done > step:  # the run goes on from `step`: its new rows are yet to be decided
                    self._detail_done[run] = (step, span)
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self._status("history_paused", f"cannot record the branch in {self.path}: {e}")

    def _thin(self, conn: sqlite3.Connection, run: int, latest: int) -> None:
        for table, window, keep_events in (
            ("snapshots", self.full_window, " AND n_events = 0"),
            ("scalars", 16 * self.full_window, ""),
        ):
            k = 0
            while window * 2**k <= latest:
                lo, hi, stride = latest - window * 2 ** (k + 1), latest - window * 2**k, 2 ** (k + 1)
                # Not a multiple of the stride: deleted, unless it is the first row of its stride-aligned
                # bucket and that bucket starts inside this octave (a step the sampler left out: every=N,
                # or the budget's cadence). With every step recorded, exactly the multiples stay.
                conn.execute(
                    f"DELETE FROM {table} AS t WHERE run = ? AND step > ? AND step <= ? AND step % ? != 0{keep_events}"
                    f" AND NOT (step / ? * ? > ? AND NOT EXISTS (SELECT 1 FROM {table} AS o WHERE o.run = t.run"
                    f" AND o.step >= t.step / ? * ? AND o.step < t.step))",
                    (run, lo, hi, stride, stride, stride, lo, stride, stride),
                )
                k += 1

    def _thin_detail(self, conn: sqlite3.Connection, run: int) -> tuple[int, int] | None:
        """Drop the per-parameter detail of `run`'s snapshots past its newest `detail_window`,
        except on those with an incident and on the first recorded row of each `span`-aligned
        bucket of steps (`_detail_span`): at most `DETAIL_BATCH` rows, oldest first, from where
        the last pass stopped (in a transaction of its own: `_maintain`). The buckets are the ones `_thin` keeps
        the first row of (with every step recorded, the multiples of `span`), so the rows that
        keep their detail are the rows the step thinning keeps longest: each of its passes with a
        stride up to `span` keeps them all, and every row a wider one keeps has its detail.
        Returns where this pass stopped (the newest step decided, the span used), to keep once
        committed."""
        edge = conn.execute(
            "SELECT step FROM snapshots WHERE run = ? ORDER BY step DESC LIMIT 1 OFFSET ?",
            (run, self.detail_window),
        ).fetchone()
        if edge is None:
            return None
        done, span = self._detail_done.get(run, (-1, 0))
        rows = conn.execute(
            "SELECT step, n_events FROM snapshots WHERE run = ? AND step > ? AND step <= ? ORDER BY step LIMIT ?",
            (run, done, edge[0], DETAIL_BATCH),
        ).fetchall()
        if not rows:
            return done, span
        span = span or self._detail_span(conn, run)
        (prev,) = conn.execute(  # the row before the batch, if the step thinning left it
            "SELECT MAX(step) FROM snapshots WHERE run = ? AND step < ?", (run, rows[0][0])
        ).fetchone()
        drop = []
        for step, n_events in rows:
            first = prev is None or prev < step // span * span  # the first row of its bucket
            if not first and not n_events:
                drop.append((run, step))
            prev = done = step
        conn.executemany(
            "UPDATE snapshots SET detail = x'' WHERE run = ? AND step = ? AND detail IS NOT NULL", drop
        )
        return done, span

    def _detail_span(self, conn: sqlite3.Connection, run: int) -> int:
        """The steps of a bucket that keeps one row's detail: `DETAIL_KEEP` recorded snapshots'
        worth at the run's sampling cadence (the median gap between its newest recorded steps, which
        the step thinning has not touched yet), rounded down to a power of two so that the buckets
        line up with `_thin`'s strides; `DETAIL_KEEP` with every step recorded."""
        steps = [
            r[0]
            for r in conn.execute(
                "SELECT step FROM snapshots WHERE run = ? ORDER BY step DESC LIMIT 17", (run,)
            ).fetchall()
        ]
        gaps = sorted(a - b for a, b in zip(steps, steps[1:], strict=False))
        cadence = max(1, gaps[len(gaps) // 2]) if gaps else 1
        span = DETAIL_KEEP
        while span * 2 <= DETAIL_KEEP * cadence:
            span *= 2
        return span

    def _bound(self, snaps: OrderedDict, scalars: OrderedDict) -> None:
        # While writes fail, memory stays bounded: the oldest snapshots and scalars go first.
        for pending in (snaps, scalars):
            while len(pending) > self.max_pending:
                pending.popitem(last=False)
                self.dropped += 1

    def _status(self, kind: str, reason: str) -> None:
        if self._on_status is not None:
            try:
                self._on_status(kind, reason)
            except Exception:  # noqa: BLE001 - a failing reporter must not kill the writer
                pass
