"""Scalars recorded with ``insp.record(...)``: checked at once, summed per step, averaged when read.

A record made while a step is under way belongs to that step (it travels in the step's
snapshot); one made after a boundary and before the next forward belongs to the step just
completed (a "late" record, sent as its own ``scalars`` message). Tensors stay on their device
until the step's one transfer; several records of one key in one step are averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .errors import HookError, shown

__all__ = ["Records", "accumulate", "check_scalars", "host_means"]

Records = dict[str, list[Any]]  # key -> [sum (float or 0-dim tensor), count]


def check_scalars(scalars: Mapping[str, Any]) -> dict[str, float | Tensor]:
    """Numbers and one-element tensors (detached, float32, 0-dim); anything else raises HookError."""
    vals: dict[str, float | Tensor] = {}
    for k, v in scalars.items():
        if isinstance(v, Tensor):
            if v.numel() != 1:
                raise HookError(
                    ("scalars", k), f"must be a number or a one-element tensor (got shape {tuple(v.shape)})"
                )
            vals[k] = v.detach().reshape(()).float()
        elif isinstance(v, int | float) and not isinstance(v, bool):
            if isinstance(v, int) and abs(v) > 2**1023:  # float(v) would raise OverflowError
                raise HookError(("scalars", k), "must be a number in the float range (got a larger integer)")
            vals[k] = float(v)
        else:
            raise HookError(("scalars", k), f"must be a number or a one-element tensor (got {shown(v)})")
    return vals


def accumulate(dest: Records, vals: Mapping[str, float | Tensor]) -> None:
    for k, v in vals.items():
        acc = dest.get(k)
        if acc is None:
            dest[k] = [v, 1]
        else:
            acc[0] = acc[0] + v
            acc[1] += 1


def host_means(records: Records) -> dict[str, float]:
    """Each key's mean on the host; the tensors among them in one transfer."""
    keys = list(records)
    tens = [records[k][0] for k in keys if isinstance(records[k][0], Tensor)]
    host = torch.stack([t.to(tens[0].device) for t in tens]).tolist() if tens else []
    it = iter(host)
    return {
        k: (next(it) if isinstance(records[k][0], Tensor) else records[k][0]) / records[k][1] for k in keys
    }
