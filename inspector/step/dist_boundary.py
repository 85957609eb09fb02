"""The step boundary under ``torch.distributed``: the one exchange of every boundary, the hold while
rank 0 is paused, and edits made by the script on every rank (see :mod:`inspector.distributed` for the
rows exchanged). :class:`DistributedBoundary` is a base of :class:`~inspector.step.boundary.StepBoundary`
(and so of :class:`~inspector.step.lifecycle.StepLifecycle`, which declares and builds the state used here).
"""

from __future__ import annotations

import math
from typing import Any

from .. import distributed
from ..wire.errors import describe_error

__all__ = ["DistributedBoundary"]


class DistributedBoundary:
    """The distributed half of the boundary; every attribute is the Inspector's (lifecycle.py)."""

    _dist: Any
    _cond: Any
    _lock: Any
    _reg: Any
    _cadence: Any
    _stats: Any
    _hooks: Any
    _hist: Any
    _layout: Any
    _nonfinite: Any
    _records: Any
    _dist_checks: Any
    params: list[str]
    _paused: bool
    _credit: int
    _closed: bool
    _waiting: bool
    _sampled: bool
    _sampled_count: int
    _step: int

    def _dist_exchange(
        self, step: int, sampled: bool, *, first: bool, local_norms: list[float] | None = None
    ) -> tuple[dict[str, Any] | None, bool]:
        """The one collective of this boundary (see inspector.distributed). Returns (ranks, hold).

        ``local_norms``: this sampled step's per-parameter local norms, from its snapshot's transfer.
        The rows' ``local_bad`` are of the previous step's deferred checks (every rank read them at
        the top of this boundary), whose findings are reported here, naming the ranks."""
        plane = self._dist
        assert plane is not None
        rank0 = plane.rank == 0
        with self._cond:
            hold = rank0 and self._paused and self._credit == 0 and not self._closed
            if rank0 and self._paused and self._credit > 0:
                self._credit -= 1  # a single step: run one more, hold at its boundary
            payload = rank0 and bool(self._reg.pending)
            next_sampled = self._cadence.is_sampled(step + 1)
            if first and rank0 and self._layout is not None:
                self._hist_next = self._hist.due(self._sampled_count + 1) if next_sampled else []
        checks = list(self._dist_checks) if first else []
        local_bad = min((b for b in (c.local_bad() for c in checks) if b >= 0), default=-1)
        with_norms = first and sampled and self._hooks.per_rank
        norms = None
        if with_norms:
            norms = local_norms if local_norms is not None else [math.nan] * len(self.params)
        try:
            rows = plane.exchange(
                hold,
                payload,
                next_sampled,
                local_bad,
                norms,
                self._hist_next if rank0 and self._layout is not None else None,
            )
            changes = None
            if rows.payload:
                with self._lock:
                    mine = list(self._reg.pending) if rank0 else None
                changes = plane.broadcast(mine)
        except Exception as e:
            plane.broken = describe_error(e)
            self._event(
                "distributed_error",
                step=step,
                rank=plane.rank,
                message=f"the control collective failed ({plane.broken}); this rank stops coordinating "
                "hook edits and pauses with the others",
            )
            return None, False
        with self._cond:
            if changes is not None:
                if not rank0:
                    self._reg.adopt(changes)
                self._drain_locked(torch_ok=True)
            self._sampled = rows.next_sampled
            if self._layout is not None:
                self._hist_next = rows.hist
            if self._sampled:
                self._sampled_count += 1
        if first:
            bad_ranks = rows.bad_ranks()
            self._dist_checks = []
            for k, c in enumerate(checks):
                found = c.findings()
                last = k == len(checks) - 1
                if last and not found.bad and bad_ranks:
                    # non-finite locally, finite after the all-reduce: still worth a word
                    found.bad = [rows.local_bad(bad_ranks[0])]
                ranks_of = bad_ranks if last else []
                self._nonfinite.step(
                    found, c.step, rank=ranks_of[0] if ranks_of else None, all_ranks=ranks_of
                )
        return (rows.spread(len(self.params)) if with_norms else None), rows.hold

    def _dist_sync_edits(self) -> None:
        """A script edit under torch.distributed (every rank makes it at the same point of the
        script): one broadcast of rank 0's pending changes, then every rank applies them (lock held)."""
        plane = self._dist
        assert plane is not None
        try:
            changes = plane.broadcast(list(self._reg.pending) if plane.rank == 0 else None)
        except Exception as e:
            plane.broken = describe_error(e)
            self._event(
                "distributed_error",
                step=self._step,
                rank=plane.rank,
                message=f"the control collective failed ({plane.broken}); this rank stops coordinating "
                "hook edits and pauses with the others",
            )
            self._drain_locked(torch_ok=True)
            return
        if plane.rank != 0:
            self._reg.replace_pending(changes)
        self._drain_locked(torch_ok=True)

    def _dist_hold(self, step: int, hold: bool) -> None:
        """Every rank waits here together while rank 0 is paused (heartbeat exchanges)."""
        plane = self._dist
        assert plane is not None
        while hold and not plane.broken and not self._closed:
            if plane.rank == 0:
                with self._cond:
                    if not self._waiting:
                        self._waiting = True
                        self._cond.notify_all()
                        self._publish_training()
                    self._cond.wait_for(
                        lambda: (
                            bool(self._reg.pending) or not self._paused or self._credit > 0 or self._closed
                        ),
                        timeout=distributed.HEARTBEAT,
                    )
            _, hold = self._dist_exchange(step, False, first=False)
        self._waiting = False
