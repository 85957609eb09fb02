"""Where published records go: bounded ring buffers, and subscribers fed off the hot path.

The training thread calls :meth:`Feed.publish`, which appends to a deque and notifies a
condition: O(1), never blocks on a consumer. A daemon dispatcher thread converts each
record to its wire dict once and calls every subscriber with it. Hooks and events are never
dropped. Snapshots and scalars are dropped (counted in ``dropped``) for an ordinary subscriber
once ``max_queue`` of them wait, so a slow consumer costs bounded memory; a **lossless**
subscriber (the server's history writer, which must record every step) still gets each of
them, late: its lag is bounded only by its own speed, so a lossless callback must be quick
(the server's hands the record to its writer and to its per-client queues, which coalesce for
slow browsers).
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from .wire.errors import describe_error, shown
from .wire.records import Snapshot

__all__ = ["Feed", "Callback", "approx_bytes", "MAX_RING_BYTES"]

Callback = Callable[[str, Any], None]
_DATA_KINDS = ("snapshot", "scalars")
MAX_RING_BYTES = 64 << 20  # the snapshot ring's host memory, at most (accounted: approx_bytes)
_PER_PARAM = tuple(
    f.name for f in fields(Snapshot) if f.type == "list[float | None]" or f.type == "list[int | None]"
)
_NESTED = (
    "lr",
    "hook_effects",
    "hist",
    "modules",
    "ranks",
    "groups",
    "noise_scale",
    "optim",
    "events",
    "scalars",
)
_NUMBER = 40  # a float object (24), its pointer in the snapshot's list (8) and in the wire dict's (8)
_CONTAINER = 176  # a list or dict, twice (the snapshot's and the wire dict's), and its key
_FIXED = 2048  # the dataclass, the wire dict, their scalar fields


def _held(x: Any) -> tuple[int, int]:
    """(numbers, containers) in ``x``: a list's length where its first item is no container (the
    per-tensor lists: no pass over their values), else its items' counts."""
    if isinstance(x, dict):
        n = c = 0
        for v in x.values():
            vn, vc = _held(v)
            n, c = n + vn, c + vc
        return n + len(x), c + 1
    if isinstance(x, list | tuple):
        if not x or not isinstance(x[0], dict | list | tuple):
            return len(x), 1
        n = c = 0
        for v in x:
            vn, vc = _held(v)
            n, c = n + vn, c + vc
        return n, c + 1
    return 0, 0


def approx_bytes(snap: Snapshot) -> int:
    """The host memory ``snap`` holds in the ring, from its lengths alone (no pass over the
    per-tensor values): ``_NUMBER`` bytes a value (a float object and its pointers in the
    snapshot's list and in the wire dict's, which every reader of the ring and the server's
    subscriber make: ``Snapshot.to_dict`` caches it and shares the floats), ``_CONTAINER`` a list or
    dict, and a fixed part; every list of the snapshot counted (the per-tensor statistics, the
    optimizer's per-tensor lists, the group aggregates, histograms, events). Never below what
    the ring holds, at most 1.6 times it (a null or a small count is no float object): at 300
    tensors, 247 KB accounted a snapshot, 163 KB (SGD, its optimizer lists null) to 199 KB (Adam)
    freed when the ring is emptied (tracemalloc: ``bench/ring_memory.py``, ``tests/unit/test_run_trust.py``)."""
    n = sum(len(getattr(snap, name)) for name in _PER_PARAM)
    c = len(_PER_PARAM)
    for name in _NESTED:
        vn, vc = _held(getattr(snap, name))
        n, c = n + vn, c + vc
    return _NUMBER * n + _CONTAINER * c + _FIXED


class Feed:
    """The core's record feed: what an Inspector published, kept in rings and handed to subscribers."""

    def __init__(
        self,
        *,
        max_snapshots: int = 2000,
        max_bytes: int = MAX_RING_BYTES,
        max_events: int = 10000,
        max_queue: int = 256,
    ) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # the newest snapshots: at most max_snapshots, and at most max_bytes of them (approx_bytes;
        # a model with thousands of tensors keeps fewer), the newest one always
        self.snapshots: deque[Snapshot] = deque(maxlen=max_snapshots)
        self._sizes: deque[int] = deque()  # approx_bytes of each snapshot in the ring, in step
        self.max_bytes = max_bytes
        self.ring_bytes = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._queue: deque[tuple[str, Any, bool]] = deque()  # (kind, payload, for lossless subscribers only)
        self._queued_data = 0  # snapshot/scalars messages queued for every subscriber
        self._max_queue = max_queue
        self._subscribers: list[tuple[Callback, bool]] = []  # (callback, lossless)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0  # snapshot/scalars messages dropped because subscribers lagged
        self.callback_errors = 0
        self._warned = False

    # ------------------------------------------------------------ producer side
    def publish(self, kind: str, payload: Any) -> None:
        """Record ``payload`` and queue it for subscribers. Never blocks."""
        with self._cond:
            if kind == "snapshot":
                if len(self.snapshots) == self.snapshots.maxlen:
                    self.ring_bytes -= self._sizes.popleft()
                size = approx_bytes(payload)
                self.snapshots.append(payload)
                self._sizes.append(size)
                self.ring_bytes += size
                while self.ring_bytes > self.max_bytes and len(self.snapshots) > 1:
                    self.snapshots.popleft()
                    self.ring_bytes -= self._sizes.popleft()
            elif kind == "event":
                self.events.append(payload)
            if not self._subscribers or self._closed:
                return
            lossless_only = False
            if kind in _DATA_KINDS:
                if self._queued_data >= self._max_queue:
                    self.dropped += 1  # for the ordinary subscribers
                    if not any(lossless for _, lossless in self._subscribers):
                        return
                    lossless_only = True
                else:
                    self._queued_data += 1
            self._queue.append((kind, payload, lossless_only))
            self._cond.notify()

    def replace_snapshot(self, snap: Snapshot) -> None:
        """Swap in an updated snapshot of the same step (late scalars)."""
        with self._lock:
            for i in range(len(self.snapshots) - 1, -1, -1):
                if self.snapshots[i].step == snap.step:
                    # (late scalars merged in: the per-parameter lists, the size, stay the same)
                    self.snapshots[i] = snap
                    return

    def drop_after(self, step: int, seqs: tuple[int, int]) -> None:
        """Forget the ring's snapshots past ``step`` and its events with ``seqs[0] < seq <= seqs[1]``
        (a rewind: they belong to the abandoned branch)."""
        with self._lock:
            kept = [(s, n) for s, n in zip(self.snapshots, self._sizes, strict=True) if s.step <= step]
            self.snapshots.clear()
            self.snapshots.extend(s for s, _ in kept)
            self._sizes = deque(n for _, n in kept)
            self.ring_bytes = sum(self._sizes)
            events = [e for e in self.events if not seqs[0] < e["seq"] <= seqs[1]]
            self.events.clear()
            self.events.extend(events)

    # ------------------------------------------------------------ reading the rings
    def snapshots_since(self, since: int | None = None) -> list[Snapshot]:
        """The ring's snapshots with ``step > since`` (all for None), oldest first."""
        with self._lock:
            return [s for s in self.snapshots if since is None or s.step > since]

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self.snapshots[-1] if self.snapshots else None

    def find(self, step: int) -> Snapshot | None:
        """The ring's snapshot of ``step``, or None."""
        with self._lock:
            return next((s for s in reversed(self.snapshots) if s.step == step), None)

    def events_since(self, since: int | None = None) -> list[dict[str, Any]]:
        """The ring's events with ``seq > since`` (all for None)."""
        with self._lock:
            return [e for e in self.events if since is None or e["seq"] > since]

    # ------------------------------------------------------------ consumer side
    def subscribe(self, callback: Callback, *, lossless: bool = False) -> Callable[[], None]:
        """Call ``callback(kind, payload)`` on the dispatcher thread; see the module docstring."""
        entry = (callback, lossless)
        with self._cond:
            self._subscribers.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="inspector-feed", daemon=True)
                self._thread.start()

        def unsubscribe() -> None:
            with self._cond:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

        return unsubscribe

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                kind, payload, lossless_only = self._queue.popleft()
                if kind in _DATA_KINDS and not lossless_only:
                    self._queued_data -= 1
                subs = [cb for cb, lossless in self._subscribers if lossless or not lossless_only]
            if kind == "_flush":
                payload.set()
                continue
            wire = payload.to_dict() if isinstance(payload, Snapshot) else payload  # one conversion for all
            for cb in subs:
                try:
                    cb(kind, wire)
                except Exception as e:  # a consumer's bug never reaches training
                    self.callback_errors += 1
                    if not self._warned:
                        self._warned = True
                        warnings.warn(
                            f"inspector subscriber {shown(cb)} raised {describe_error(e)}; further errors are counted "
                            "in Feed.callback_errors",
                            RuntimeWarning,
                            stacklevel=1,
                        )

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the dispatcher has delivered everything queued so far (tests, close)."""
        done = threading.Event()
        with self._cond:
            if self._thread is None or self._closed:
                return True
            self._queue.append(("_flush", done, False))
            self._cond.notify()
        return done.wait(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)
