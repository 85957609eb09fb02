"""The control plane under ``torch.distributed``: one hook config and one pause state for the job.

Every rank attaches its own Inspector (the user's script runs on every rank). Rank 0 is
the one that serves the dashboard, so edits from another thread only ever arrive there.
At each step boundary every rank takes part in **one** small ``all_gather`` on a separate
gloo group (CPU tensors, so an NCCL job's GPUs are never synchronised for it). Each row:

    [hold, payload, next_sampled, local_bad, *hist (HIST_SLOTS), *local_norms (sampled steps only)]

- ``hold``, ``payload``, ``next_sampled`` are rank 0's: whether every rank waits at this
  boundary (pause / single step), whether rank 0 has pending edits, rules' decisions or
  checkpoint and rewind requests to broadcast (then a second collective,
  ``broadcast_object_list``, carries them, and every rank applies them before the next step:
  the same change at the same step everywhere), and whether the
  next step is sampled (the statistics' collectives must line up).
- ``local_bad``: the first parameter whose **local** (pre-all-reduce) gradient was not
  finite on this rank, or -1: after the all-reduce every rank has the NaN, so this is how
  the event names the rank where it appeared.
- ``hist``: rank 0's, under FSDP2: the parameters whose histograms the next step takes (-1 in an
  unused slot). A sharded parameter's histogram is a collective, so every rank takes rank 0's
  choice (the page's subscriptions live on rank 0).
- ``local_norms``: on sampled steps, each parameter's local gradient norm (under FSDP2, of this
  rank's shard): rank 0's snapshot reports their spread (``ranks``). Under DDP and FSDP2 with
  the gradient noise scale on, one more column per parameter follows them: this rank's
  small-batch squared norm (:mod:`inspector.stats.noise_scale`), averaged over the ranks by
  every rank.

While paused, rank 0 repeats the exchange every ``HEARTBEAT`` seconds, so the other ranks
wait in a bounded collective (the group's timeout), never in DDP's all-reduce. If a peer
does not answer within the timeout (it raised or exited), the collective fails: the
inspector reports a ``distributed_error`` event, stops coordinating, and training goes on
locally (DDP itself will then fail in its own all-reduce, with its own message).
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ControlPlane", "HEARTBEAT", "HIST_SLOTS", "Rows", "active"]

HEARTBEAT = 0.5  # seconds between exchanges while paused
HIST_SLOTS = 8  # histogram parameters a row carries (histsel.HIST_CAP)


def active() -> bool:
    """Whether this process is one rank of an initialised process group of 2 or more."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ControlPlane:
    def __init__(self, *, timeout: float = 60.0) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # a collective call: every rank creates the group in attach(), in the same order
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.broken: str | None = None

    def exchange(
        self,
        hold: bool,
        payload: bool,
        next_sampled: bool,
        local_bad: int,
        local_norms: list[float] | None,
        hist: list[int] | None = None,
    ) -> Rows:
        """One all_gather of every rank's row (the columns of :class:`Rows`)."""
        row = [0.0] * Rows.NORMS
        slots = (hist or [])[:HIST_SLOTS]
        row[Rows.HIST : Rows.HIST + HIST_SLOTS] = [float(i) for i in slots] + [-1.0] * (
            HIST_SLOTS - len(slots)
        )
        row[Rows.HOLD], row[Rows.PAYLOAD], row[Rows.NEXT_SAMPLED] = (
            float(hold),
            float(payload),
            float(next_sampled),
        )
        row[Rows.LOCAL_BAD] = float(local_bad)
        if local_norms is not None:
            row += local_norms
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        return Rows(torch.stack(rows))

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class Rows:
    """Every rank's row of one exchange, a (world, columns) float64 tensor read by column name."""

    HOLD, PAYLOAD, NEXT_SAMPLED, LOCAL_BAD = 0, 1, 2, 3  # rank 0's decisions, then each rank's finding
    HIST = 4  # rank 0's histogram parameters for the next step (HIST_SLOTS columns, -1: none)
    NORMS = HIST + HIST_SLOTS  # the first of the local norms (sampled steps only): one column per parameter

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows

    @property
    def hold(self) -> bool:
        """Rank 0 holds every rank at this boundary (pause, or a single step done)."""
        return bool(self.rows[0, self.HOLD])

    @property
    def payload(self) -> bool:
        """Rank 0 has pending edits: a broadcast follows."""
        return bool(self.rows[0, self.PAYLOAD])

    @property
    def next_sampled(self) -> bool:
        return bool(self.rows[0, self.NEXT_SAMPLED])

    @property
    def hist(self) -> list[int]:
        """Rank 0's histogram parameters for the next step."""
        return [int(v) for v in self.rows[0, self.HIST : self.HIST + HIST_SLOTS].tolist() if v >= 0]

    def bad_ranks(self) -> list[int]:
        """The ranks whose local gradient had a non-finite parameter."""
        return [r for r in range(self.rows.shape[0]) if self.rows[r, self.LOCAL_BAD] >= 0]

    def local_bad(self, rank: int) -> int:
        """The first parameter whose local gradient was not finite on ``rank`` (or -1)."""
        return int(self.rows[rank, self.LOCAL_BAD])

    def extra_mean(self, n: int) -> list[float]:
        """The columns after the ``n`` local norms (the gradient noise scale's small-batch squared
        norms, :mod:`inspector.stats.noise_scale`), averaged over the ranks (NaN where one had none)."""
        return self.rows[:, self.NORMS + n :].mean(dim=0).tolist()

    def spread(self, n: int, members: list[list[int]] | None = None) -> dict[str, list[Any]]:
        """Per parameter: min and max of the local norms across ranks, and which rank; per rank
        (``rank_norm``, ``rank_nonfinite``): its local gradients' norm over every parameter, and
        the first parameter it found not finite (None: none); per group of ``members`` (the
        parameter indices of each group, :class:`~inspector.stats.groups.Groups`): min and max
        across ranks of each rank's local norm over the group's parameters, and which rank
        (``group_norm_min``, ``group_norm_max``, ``group_argmin``, ``group_argmax``)."""
        norms = self.rows[
            :, self.NORMS : self.NORMS + n
        ]  # (world, n_params); NaN where a rank had no gradient
        finite = torch.where(torch.isnan(norms), torch.full_like(norms, math.inf), norms)
        lo, argmin = finite.min(dim=0)
        finite_hi = torch.where(torch.isnan(norms), torch.full_like(norms, -math.inf), norms)
        hi, argmax = finite_hi.max(dim=0)
        none = torch.isnan(norms).all(dim=0)

        def clean(t: Tensor, idx: bool = False) -> list[Any]:
            vals = t.tolist()
            return [None if none[i] else (int(v) if idx else v) for i, v in enumerate(vals)]

        # per rank (one entry a rank, so their length is the world size): the norm of its local
        # gradients over every parameter it had one for, and the first parameter whose local
        # gradient it found not finite (the check read at this boundary), from the same rows
        sq = torch.where(torch.isnan(norms), torch.zeros_like(norms), norms).pow(2).sum(dim=1)
        seen = ~torch.isnan(norms).all(dim=1)
        rank_norm = [v if ok else None for v, ok in zip(sq.sqrt().tolist(), seen.tolist(), strict=True)]
        bad = [int(v) for v in self.rows[:, self.LOCAL_BAD].tolist()]
        out: dict[str, list[Any]] = {
            "norm_min": clean(lo),
            "norm_max": clean(hi),
            "argmin": clean(argmin, True),
            "argmax": clean(argmax, True),
            "rank_norm": rank_norm,
            "rank_nonfinite": [v if v >= 0 else None for v in bad],
        }
        if members:
            out.update(_group_spread(norms, members))
        return out


def _group_spread(norms: Tensor, members: list[list[int]]) -> dict[str, list[Any]]:
    """``norms``: (world, parameters), NaN where a rank had no gradient. Per group: each rank's
    norm over the group's parameters it had gradients for; their min and max across the ranks
    that had any, and which rank (None where no rank had one)."""
    world, n = norms.shape
    of = torch.full((n,), len(members), dtype=torch.int64)
    for g, m in enumerate(members):
        of[m] = g
    sq = torch.where(torch.isnan(norms), torch.zeros_like(norms), norms).double().pow(2)
    seen = (~torch.isnan(norms)).double()
    per = torch.zeros(world, len(members) + 1, dtype=torch.float64).index_add_(1, of, sq)[:, :-1].sqrt()
    have = torch.zeros(world, len(members) + 1, dtype=torch.float64).index_add_(1, of, seen)[:, :-1] > 0
    lo, argmin = torch.where(have, per, torch.full_like(per, math.inf)).min(dim=0)
    hi, argmax = torch.where(have, per, torch.full_like(per, -math.inf)).max(dim=0)
    anyone = have.any(dim=0).tolist()

    def clean(t: Tensor, idx: bool = False) -> list[Any]:
        return [(int(v) if idx else v) if ok else None for v, ok in zip(t.tolist(), anyone, strict=True)]

    return {
        "group_norm_min": clean(lo),
        "group_norm_max": clean(hi),
        "group_argmin": clean(argmin, True),
        "group_argmax": clean(argmax, True),
    }
