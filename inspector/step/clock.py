"""The step clock: where the run is (completed steps, a step under way, which steps are sampled)
and what the inspector spent during the step under way.

The training thread writes it: the step and its sampling under the Inspector's lock (the
boundary, a forward, a rewind), the time it spends without it (only that thread counts it).
Other threads read it (``insp.step``); ``forget_gap()`` may come from any thread (a lost gap
is all a race costs). A checkpoint saves it with :meth:`state_dict` and a rewind puts it back
with :meth:`load_state_dict`, as Lightning's progress counters are saved and restored.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["StepClock"]


class StepClock:
    """Completed steps, the step under way, the sampling decision and the time between boundaries."""

    def __init__(self) -> None:
        self.step = 0  # completed optimizer steps (the number of the last boundary)
        self.under_way = False  # from a step's first forward with gradients on to its boundary
        self.sampled = True  # the step under way (or the next one) takes the full statistics: step 1 does
        self.sampled_count = 1  # sampled steps so far, that one included
        self._last_boundary: float | None = None  # perf_counter() at the last boundary
        self._spent = 0.0  # seconds inside the inspector during the step under way

    # ------------------------------------------------------------ the step
    def begin(self) -> None:
        """A step is under way."""
        self.under_way = True

    def complete(self) -> tuple[int, bool]:
        """The step under way is complete: ``(its number, whether it was sampled)``."""
        self.step += 1
        self.under_way = False
        return self.step, self.sampled

    def decide_next(self, sampled: bool) -> None:
        """Whether the next step is sampled (the cadence's decision, or the job's under torch.distributed)."""
        self.sampled = sampled
        if sampled:
            self.sampled_count += 1

    # ------------------------------------------------------------ time
    def spend(self, seconds: float) -> None:
        """Count ``seconds`` of the inspector's own work in the step under way."""
        self._spent += seconds

    def take_spent(self) -> float:
        """The inspector's own seconds so far in this step, and start counting again."""
        spent, self._spent = self._spent, 0.0
        return spent

    def wall(self, now: float) -> float | None:
        """Seconds since the last boundary (None: no boundary yet, or the gap was forgotten)."""
        return None if self._last_boundary is None else now - self._last_boundary

    def mark_boundary(self) -> None:
        self._last_boundary = time.perf_counter()

    def forget_gap(self) -> None:
        """The time until the next boundary is no step's: a pause, a comparison run between steps,
        a benchmark's other variant. The cadence then measures no wall time for that step."""
        self._last_boundary = None

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"step", "sampled", "sampled_count"}``: what a rewind puts back."""
        return {"step": self.step, "sampled": self.sampled, "sampled_count": self.sampled_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a saved state, between steps; the time since the last boundary is no step's."""
        self.step = int(state["step"])
        self.sampled = bool(state.get("sampled", True))
        self.sampled_count = int(state.get("sampled_count", self.sampled_count))
        self.under_way = False
        self.forget_gap()
