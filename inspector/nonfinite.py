"""Non-finite gradients: which parameters, how many NaN and Inf, and the ``nonfinite`` events.

Detection reads nothing but the raw norms the step already moved to the host: a tensor's
norm is finite exactly when it holds no NaN/Inf, barring a float32 overflow of the norm of
finite values (values near 1e20 and up), which :func:`find_nonfinite` tells apart by counting
and then recomputes that norm in float64 (:func:`stats.wide_norm`, rounded to float32 like every
norm); the statistics of the final gradients use the same norm for those parameters. Counts
are taken only for parameters whose norm was not finite.

:class:`NonfiniteReport` turns a step's findings into events: one per step naming the first
non-finite parameter, and a streak of the same parameter reported on its first step and then
every ``NONFINITE_REPEAT`` steps, so a run stuck at NaN does not flood the event log. What a
``post_accumulate`` ``nan_guard`` found during the step's backwards joins that step's findings
(:meth:`Findings.add_post_accumulate`), so it is reported at the same rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .ops import NanFinding, count_nonfinite
from .stats import dense, wide_norm

__all__ = ["NONFINITE_REPEAT", "Findings", "NonfiniteReport", "find_nonfinite"]

NONFINITE_REPEAT = 100  # a non-finite streak is reported on its first step, then every this many steps


@dataclass
class Findings:
    """One step's non-finite gradients (parameter indices into ``Inspector.params``)."""

    bad: list[int] = field(default_factory=list)  # in params order
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (nan, inf)
    # index -> the float64-reduced norm (float32 0-dim, on device) of finite values whose float32
    # norm overflowed; ``raw_norms`` holds its host value
    overflow: dict[int, Tensor] = field(default_factory=dict)
    actions: dict[int, str] = field(default_factory=dict)  # index -> what a nan_guard did
    bad_modules: list[str] = field(default_factory=list)  # modules whose grad_output was not finite
    # index -> "post_accumulate" where a guard at that point found it (the event's point; else pre_step)
    points: dict[int, str] = field(default_factory=dict)

    def add_post_accumulate(self, f: NanFinding, action: str) -> None:
        """What a ``post_accumulate`` ``nan_guard`` found during this step's backwards (it may
        have zeroed the gradient since, so the raw statistics need not see it)."""
        if f.index not in self.bad:
            self.bad = sorted([*self.bad, f.index])
            self.counts[f.index] = (f.nan, f.inf)
        self.actions[f.index] = action
        self.points[f.index] = "post_accumulate"


def find_nonfinite(raw_norms: dict[int, float], grads: dict[int, Tensor]) -> Findings:
    """The parameters whose raw norm is not finite, with their counts; corrects ``raw_norms`` in
    place where only the float32 norm of finite values overflowed. ``grads``: index -> the gradient
    the norm is of (under FSDP2, this rank's shard)."""
    total = sum(raw_norms.values())  # finite exactly when every norm is
    if math.isfinite(total):
        return Findings()
    bad = [i for i, v in raw_norms.items() if not math.isfinite(v)]
    counts = {i: count_nonfinite(dense(grads[i])) for i in bad}
    overflow = {}
    for i in [i for i in bad if counts[i] == (0, 0)]:  # finite values whose float32 norm overflowed
        overflow[i] = wide_norm(dense(grads[i]))
        raw_norms[i] = float(overflow[i])  # a host read, on this rare path only
        bad.remove(i)
        del counts[i]
    return Findings(bad=bad, counts=counts, overflow=overflow)


class NonfiniteReport:
    """Files ``nonfinite`` events through ``emit(kind, **fields)``, with the streak rule above."""

    def __init__(self, params: list[str], emit: Callable[..., Any]) -> None:
        self._params = params
        self._emit = emit
        self._last: str | None = None
        self._streak = 0

    def step(
        self, found: Findings, step: int, *, rank: int | None = 0, all_ranks: list[int] | None = None
    ) -> None:
        """Report one step's findings: module flags, then the first non-finite parameter."""
        for m in found.bad_modules:
            self._emit(
                "nonfinite",
                step=step,
                param=None,
                module=m,
                rank=rank,
                nan=None,
                inf=None,
                action_taken="report",
                point="module",
            )
        if not found.bad:
            self._last, self._streak = None, 0
            return
        first = found.bad[0]
        name = self._params[first]
        if name != self._last or self._streak % NONFINITE_REPEAT == 0:
            nan, inf = found.counts.get(first, (None, None))
            extra = {"ranks": all_ranks} if all_ranks is not None else {}
            self._emit(
                "nonfinite",
                step=step,
                param=name,
                rank=rank,
                nan=nan,
                inf=inf,
                action_taken=found.actions.get(first, "none"),
                point=found.points.get(first, "pre_step"),
                **extra,
                params=[self._params[i] for i in found.bad[:16]],
                n_params=len(found.bad),
                streak=self._streak + 1,
            )
        self._last = name
        self._streak += 1
