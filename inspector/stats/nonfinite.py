"""Non-finite gradients: which parameters, how many NaN and Inf, and the ``nonfinite`` events.

The findings of a step come from its deferred check (:mod:`inspector.stats.deferred`), examined at a
later boundary without making the host wait (at its own, waited for, where ``checkpoint_every``
takes a checkpoint: inspector/whatif/checkpoints.py): a gradient is non-finite when its probe is (an
abs-max on sampled steps, a 2-norm on the others), with NaN and Inf counts where a ``nan_guard``
took them on the device (a count of -1 is one not taken: the event says null).

:class:`NonfiniteReport` turns a step's findings into events: one per step naming the first
non-finite parameter, and a streak of the same parameter reported on its first step and then
every ``NONFINITE_REPEAT`` steps, so a run stuck at NaN does not flood the event log. What a
``post_accumulate`` ``nan_guard`` found during the step's backwards joins that step's findings
(its point is then ``post_accumulate``), so it is reported at the same rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NONFINITE_REPEAT", "NO_FINDINGS", "Findings", "NonfiniteReport"]

NONFINITE_REPEAT = 100  # a non-finite streak is reported on its first step, then every this many steps


@dataclass
class Findings:
    """One step's non-finite gradients (parameter indices into ``Inspector.params``)."""

    bad: list[int] = field(default_factory=list)  # in params order
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (nan, inf); -1: not counted
    actions: dict[int, str] = field(default_factory=dict)  # index -> what a nan_guard did
    bad_modules: list[str] = field(default_factory=list)  # modules whose grad_output was not finite
    # index -> "post_accumulate" where a guard at that point found it (the event's point; else pre_step)
    points: dict[int, str] = field(default_factory=dict)
    # unsampled steps: an infinite 2-norm no guard counted, which finite values beyond ~1e19 also give
    overflow_possible: list[int] = field(default_factory=list)


NO_FINDINGS = Findings()  # a step whose gradients were all finite (never mutated)


class NonfiniteReport:
    """Files ``nonfinite`` events through ``emit(kind, **fields)``, with the streak rule above."""

    def __init__(self, params: list[str], emit: Callable[..., Any]) -> None:
        self._params = params
        self._emit = emit
        self._last: str | None = None
        self._streak = 0

    def state_dict(self) -> dict[str, Any]:
        """The streak so far (a checkpoint keeps it: a rewound run reports as it did the first time)."""
        return {"last": self._last, "streak": self._streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last, self._streak = state["last"], int(state["streak"])

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
            nan, inf = (None if c < 0 else c for c in found.counts.get(first, (-1, -1)))
            extra: dict[str, Any] = {"ranks": all_ranks} if all_ranks is not None else {}
            if first in found.overflow_possible:
                extra["note"] = (
                    "unsampled step: the float32 norm is inf, from Inf values or from finite values "
                    "above about 1e19 (a nan_guard on it, or a sampled step, tells which)"
                )
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
