"""The control plane under ``torch.distributed``: one hook config and one pause state for the job.

Every rank attaches its own Inspector (the user's script runs on every rank). Rank 0 is
the one that serves the dashboard, so edits from another thread only ever arrive there.
At each step boundary every rank takes part in **one** small ``all_gather`` on a separate
gloo group (CPU tensors, so an NCCL job's GPUs are never synchronised for it). Each row:

    [hold, payload, next_sampled, local_bad, *local_norms (sampled steps only)]

- ``hold``, ``payload``, ``next_sampled`` are rank 0's: whether every rank waits at this
  boundary (pause / single step), whether rank 0 has pending edits to broadcast (then a
  second collective, ``broadcast_object_list``, carries them, and every rank applies them
  before the next step: the same change at the same step everywhere), and whether the
  next step is sampled (the statistics' collectives must line up).
- ``local_bad``: the first parameter whose **local** (pre-all-reduce) gradient was not
  finite on this rank, or -1: after the all-reduce every rank has the NaN, so this is how
  the event names the rank where it appeared.
- ``local_norms``: on sampled steps, each parameter's local gradient norm: rank 0's
  snapshot reports their spread (``ranks``).

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

__all__ = ["ControlPlane", "HEARTBEAT", "active"]

HEARTBEAT = 0.5  # seconds between exchanges while paused


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

    def exchange(self, hold: bool, payload: bool, next_sampled: bool, local_bad: int,
                 local_norms: list[float] | None) -> Tensor:
        """One all_gather of every rank's row; returns a (world, len) float64 tensor."""
        row = [float(hold), float(payload), float(next_sampled), float(local_bad)]
        if local_norms is not None:
            row += local_norms
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows)

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    @staticmethod
    def spread(rows: Tensor, start: int, n: int) -> dict[str, list[Any]]:
        """Per parameter: min and max of the local norms across ranks, and which rank."""
        norms = rows[:, start:start + n]  # (world, n_params); NaN where a rank had no gradient
        finite = torch.where(torch.isnan(norms), torch.full_like(norms, math.inf), norms)
        lo, argmin = finite.min(dim=0)
        finite_hi = torch.where(torch.isnan(norms), torch.full_like(norms, -math.inf), norms)
        hi, argmax = finite_hi.max(dim=0)
        none = torch.isnan(norms).all(dim=0)

        def clean(t: Tensor, idx: bool = False) -> list[Any]:
            vals = t.tolist()
            return [None if none[i] else (int(v) if idx else v) for i, v in enumerate(vals)]

        return {"norm_min": clean(lo), "norm_max": clean(hi), "argmin": clean(argmin, True),
                "argmax": clean(argmax, True)}
