"""The step boundary under ``torch.distributed``: the one exchange of every boundary, the hold while
rank 0 is paused, and edits made by the script on every rank (see :mod:`inspector.distributed` for
the rows exchanged). Rank 0's checkpoint and rewind requests from other threads travel with its
pending changes, and every rank carries them out after the exchange that brought them
(:mod:`inspector.whatif.checkpoints`).

:class:`DistributedSync` is built from the job's control plane and the parts it reads and writes:
the pause gate (rank 0's pause holds every rank), the step clock (the job's sampling decision),
the hook registry (rank 0's pending changes travel to every rank) and the non-finite report (a
finding names the ranks). It owns what only the exchange needs: the deferred checks read at this
boundary and, under FSDP2, the histograms rank 0 chose for the next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import distributed
from ..hooks.registry import Registry
from ..hooks.torch_hooks import TorchHooks
from ..stats.deferred import Check
from ..stats.histsel import HistSelection
from ..stats.nonfinite import NonfiniteReport
from ..stats.telemetry import Cadence
from ..wire.errors import describe_error
from .clock import StepClock
from .events import EventLog
from .gate import PauseGate

__all__ = ["DistributedSync"]


class DistributedSync:
    """Every boundary's exchange, the held boundary, and script edits as collectives."""

    def __init__(
        self,
        plane: distributed.ControlPlane,
        *,
        n_params: int,
        sharded: bool,
        gate: PauseGate,
        clock: StepClock,
        reg: Registry,
        cadence: Cadence,
        hooks: TorchHooks,
        hist: HistSelection,
        nonfinite: NonfiniteReport,
        events: EventLog,
        apply_edits: Callable[[], None],
    ) -> None:
        self.plane = plane
        self._n = n_params
        self._sharded = sharded  # FSDP2: every rank takes rank 0's histograms (collectives)
        self._gate = gate
        self._clock = clock
        self._reg = reg
        self._cadence = cadence
        self._hooks = hooks
        self._hist = hist
        self._nonfinite = nonfinite
        self._events = events
        self._apply_edits = apply_edits  # StepLifecycle.apply_edits, the edit rule (lock held), on every rank
        self._checks: list[Check] = []  # checks read at this boundary, reported after the exchange
        self._hist_next: list[int] = []  # FSDP2: the next step's histograms, rank 0's choice
        # the gradient noise scale's columns (one per parameter, after the local norms, on sampled
        # steps with them), and the last such exchange's values averaged over the ranks
        self.noise_cols: Callable[[], list[float]] | None = None
        # the groups' parameter indices (the Inspector sets it): the ranks' spread per group too
        self.group_members: Callable[[], list[list[int]]] | None = None
        self.noise_mean: list[float] | None = None
        # the rules (inspector.rules): rank 0's decisions travel with its pending changes, and every
        # rank receives them at the same exchange (set by the Inspector; None: none)
        self.rules: Any = None
        # the checkpoints (inspector.whatif.checkpoints): rank 0's checkpoint and rewind requests from
        # other threads travel with its pending changes, and every rank carries them out after the
        # exchange that brought them, before the changes apply (set by the lifecycle; None: none)
        self.branches: Any = None

    @property
    def active(self) -> bool:
        """The control collective works (it stops coordinating for good once a call failed)."""
        return not self.plane.broken

    @property
    def hist_next(self) -> list[int]:
        """Under FSDP2, the histograms of the step under way, as every rank takes them."""
        return self._hist_next

    def add_check(self, check: Check) -> None:
        """A deferred check read on this rank: reported after the next exchange, with the ranks."""
        self._checks.append(check)

    def _failed(self, err: BaseException, step: int) -> None:
        plane = self.plane
        plane.broken = describe_error(err)
        self._events.emit(
            "distributed_error",
            step=step,
            rank=plane.rank,
            message=f"the control collective failed ({plane.broken}); this rank stops coordinating "
            "hook edits and pauses with the others",
        )
        if self.branches is not None:
            with self._gate.cond:
                self.branches.plane_failed()  # its waiting checkpoints and rewinds: refused, with why

    def exchange(
        self, step: int, sampled: bool, *, first: bool, local_norms: list[float] | None = None
    ) -> tuple[dict[str, Any] | None, bool]:
        """The one collective of this boundary (see inspector.distributed). Returns (ranks, hold).

        ``local_norms``: this sampled step's per-parameter local norms, from its snapshot's transfer.
        The rows' ``local_bad`` are of the previous step's deferred checks (every rank read them at
        the top of this boundary), whose findings are reported here, naming the ranks."""
        plane, gate = self.plane, self._gate
        rank0 = plane.rank == 0
        with gate.cond:
            hold = rank0 and gate.decide_hold()
            outbox = self.rules.outbox if rank0 and self.rules is not None else []
            requests = self.branches.outbox if rank0 and self.branches is not None else []
            payload = rank0 and (bool(self._reg.pending) or bool(outbox) or bool(requests))
            next_sampled = self._cadence.is_sampled(step + 1)
            if first and rank0 and self._sharded:
                self._hist_next = self._hist.due(self._clock.sampled_count + 1) if next_sampled else []
        checks = list(self._checks) if first else []
        local_bad = min((b for b in (c.local_bad() for c in checks) if b >= 0), default=-1)
        with_norms = first and sampled and self._hooks.per_rank
        norms = None
        if with_norms:
            norms = local_norms if local_norms is not None else [math.nan] * self._n
            if self.noise_cols is not None:
                norms = [*norms, *self.noise_cols()]
        try:
            rows = plane.exchange(
                hold,
                payload,
                next_sampled,
                local_bad,
                norms,
                self._hist_next if rank0 and self._sharded else None,
            )
            changes = None
            fired: list[dict[str, Any]] = []
            sent = None
            if rows.payload:
                with gate.cond:
                    mine = (list(self._reg.pending), list(outbox), self._outgoing()) if rank0 else None
                changes, fired, sent = plane.broadcast(mine)
                if rank0:
                    del outbox[: len(fired)]
        except Exception as e:
            self._failed(e, step)
            return None, False
        with gate.cond:
            # the next step's sampling first: a checkpoint taken below holds it, and a rewind below
            # restores it, nothing deciding again after it (as between steps on one process)
            self._clock.decide_next(rows.next_sampled)
            if fired and self.rules is not None:
                self.rules.receive(fired)
            if sent is not None and self.branches is not None:
                self.branches.receive(sent)  # carried out below, on every rank, before the changes
            if changes is not None:
                if not rank0:
                    self._reg.adopt(changes)
                self._apply_edits()
            elif self.branches is not None and self.branches.queued:
                self._apply_edits()
            if self._sharded:
                self._hist_next = rows.hist
        if first:
            bad_ranks = rows.bad_ranks()
            self._checks = []
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
        if first:
            self.noise_mean = rows.extra_mean(self._n) if with_norms and self.noise_cols is not None else None
        members = self.group_members() if self.group_members is not None else None
        return (rows.spread(self._n, members) if with_norms else None), rows.hold

    def _outgoing(self) -> Any:
        """Rank 0's checkpoint and rewind requests for the other ranks (lock held), or None."""
        return self.branches.outgoing() if self.branches is not None else None

    def sync_edits(self) -> None:
        """A script edit under torch.distributed (every rank makes it at the same point of the
        script): one broadcast of rank 0's pending changes (and its waiting checkpoint requests: a
        change's automatic checkpoint is taken before it), then every rank applies them (lock held)."""
        plane = self.plane
        try:
            changes, sent = plane.broadcast(
                (list(self._reg.pending), self._outgoing()) if plane.rank == 0 else None
            )
        except Exception as e:
            self._failed(e, self._clock.step)
            self._apply_edits()
            return
        if sent is not None and self.branches is not None:
            self.branches.receive(sent)
        if plane.rank != 0:
            self._reg.replace_pending(changes)
        self._apply_edits()

    def hold(self, step: int, hold: bool) -> None:
        """Every rank waits here together while rank 0 is paused (heartbeat exchanges)."""
        plane, gate = self.plane, self._gate
        while hold and not plane.broken and not gate.closed:
            if plane.rank == 0:
                with gate.cond:
                    gate.wait_held(
                        lambda: (
                            bool(self._reg.pending)
                            or (self.branches is not None and bool(self.branches.outbox))
                        ),
                        distributed.HEARTBEAT,
                    )
            _, hold = self.exchange(step, False, first=False)
        gate.release()
