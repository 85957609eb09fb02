"""Per-step telemetry plumbing: the budgeted cadence, and the one-transfer pack.

:class:`Cadence` decides which steps are sampled. With ``every=N`` it samples steps
1, 1+N, 1+2N, ...; otherwise it keeps the inspector's own measured cost within
``budget`` (a fraction of the wall-clock step): hooks and NaN/Inf detection still run
every step (their cost is ``base``), and the full statistics (cost ``sampled``) run
every k-th step with ``k = ceil(extra / room)``, ``room = budget * step - base`` (``extra``: a
sampled step's cost over ``base`` as our timers see it, or, where larger, as the wall-clock step
feels it: the median sampled step less the median unsampled one)
but at least ``MIN_ROOM`` of ``budget * step``, moved by at
most a doubling at a time and capped so that a snapshot comes about once a second where that
fits in the whole budget (``k`` aims at half of it), else as often as the whole budget allows.

Short runs are shown densely: the first ``DENSE_STEPS`` steps are all sampled (so a run that
short has every step, its last included), and after that ``k`` stays within a tenth of the
steps so far (at least about ten snapshots per decade of steps: a 100-step run has about 35,
the last within its last ten steps), whatever the budget allows.

Nothing latches: each cost is the median of its last ``WINDOW`` measurements, so one slow
step (a warm-up, a garbage collection, an evaluation pass between two steps) is outvoted by
the next ones, and when the budget holds ``k`` at 1 (nothing is measured unsampled then),
every ``PROBE``-th sampled step is followed by one unsampled step, which re-measures ``base``:
a run that can afford sampling less goes back to it.

:class:`Pack` collects 1-D float32 device tensors during a sampled step and moves them
to the host with a single ``.tolist()``, the one sync point of a snapshot.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch
from torch import Tensor

from ..wire.errors import HookError, shown

__all__ = ["Cadence", "Pack", "check_cadence"]

_EMA = 0.2  # the published overhead's average
SAFETY = 0.5  # the share of the budget the cadence aims at (see _choose_k)
MAX_EVERY = 100  # even when the budget cannot be met, a snapshot every 100 steps
DENSE_STEPS = 20  # the first steps, all sampled
DECADE = 10  # after them, k <= step // DECADE
WINDOW = 7  # each cost: the median of its last WINDOW measurements
PROBE = 16  # at k = 1 under the budget, one unsampled step after this many sampled ones
MIN_ROOM = 0.25  # the share of the aimed-at cost the statistics get when the every-step work takes it all


def check_cadence(budget: Any, every: Any, hist_every: Any) -> None:
    """Validate ``attach``'s cadence options (raises HookError naming the option)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1:
        raise HookError(("budget",), f"must be a fraction in (0, 1) (got {shown(budget)})")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise HookError(("every",), f"must be a positive integer or None (got {shown(every)})")
    if isinstance(hist_every, bool) or not isinstance(hist_every, int) or hist_every < 1:
        raise HookError(("hist_every",), f"must be a positive integer (got {shown(hist_every)})")


class _Recent:
    """The median of the last ``WINDOW`` measurements (the lower one of an even count), taken
    when read (it is added to every step, read on sampled steps)."""

    def __init__(self) -> None:
        self._xs: deque[float] = deque(maxlen=WINDOW)

    def add(self, x: float) -> None:
        self._xs.append(x)

    def amend(self, x: float) -> None:
        """Add ``x`` to the last measurement."""
        if self._xs:
            self._xs[-1] += x

    @property
    def value(self) -> float | None:
        return statistics.median_low(self._xs) if self._xs else None


class Cadence:
    """Which steps are sampled (see the module docstring): ``is_sampled(step)`` before a step,
    ``observe(...)`` at its boundary."""

    def __init__(self, budget: float, every: int | None) -> None:
        self.budget = budget
        self.every = every
        self.k = every or 1
        self.next_sampled = 1
        self.last_step: int | None = None  # the run's last step, when the loop said (always sampled)
        self._sampled = _Recent()  # our time on a sampled step (s)
        self._base = _Recent()  # our time on an unsampled step (s)
        self._walls = _Recent()  # the wall-clock step (s)
        self._walls_sampled = _Recent()  # the same, of sampled steps
        self._walls_base = _Recent()  # the same, of unsampled steps
        self._walled = False  # whether the step observed last had a wall-clock time
        self._ours: float | None = None  # EMA of our time per step, all steps (s)
        self._at_one = 0  # sampled steps in a row that the budget left at k = 1

    @property
    def _sampled_cost(self) -> float | None:
        return self._sampled.value

    @property
    def _base_cost(self) -> float | None:
        return self._base.value

    @property
    def _wall(self) -> float | None:
        return self._walls.value

    def state_dict(self) -> dict[str, int]:
        """Which step is sampled next and the interval (a checkpoint keeps them: a rewound run is
        sampled on the same steps as the first time)."""
        return {"next_sampled": self.next_sampled, "k": self.k}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_sampled, self.k = state["next_sampled"], state["k"]

    def restart_at(self, step: int) -> None:
        """Sample ``step`` and go on from there (a shadow branch's first step)."""
        self.next_sampled = step

    def is_sampled(self, step: int) -> bool:
        return step >= self.next_sampled or step == self.last_step

    @staticmethod
    def _ema(old: float | None, x: float) -> float:
        return x if old is None else old + _EMA * (x - old)

    def observe(self, step: int, sampled: bool, ours: float, wall: float | None) -> None:
        """Account one finished step: ``ours`` seconds inside the inspector, ``wall`` seconds
        since the previous boundary (None for the first step or after a pause)."""
        self._ours = self._ema(self._ours, ours)
        self._walled = wall is not None and wall > 0
        if wall is not None and wall > 0:
            self._walls.add(wall)  # a gap in the loop (evaluation, a checkpoint) is outvoted by the median
            (self._walls_sampled if sampled else self._walls_base).add(wall)
        (self._sampled if sampled else self._base).add(ours)
        if not sampled:
            return
        if self.every is not None:
            self.k = self.every
        elif step < DENSE_STEPS:
            self.k = 1
        else:
            k = min(self._choose_k(), max(1, step // DECADE))
            self._at_one = self._at_one + 1 if k == 1 else 0
            if self._at_one >= PROBE:  # nothing unsampled is measured at k = 1: measure one now
                self._at_one, k = 0, 2
            self.k = k
        self.next_sampled = step + self.k

    def observe_late(self, sampled: bool, seconds: float) -> None:
        """Count ``seconds`` of the inspector's work at the same boundary after :meth:`observe`
        (a sampled step's snapshot, built once the next step's sampling is decided) in the step
        observed last: its cost and its wall-clock time."""
        if self._ours is not None:
            self._ours += _EMA * seconds
        (self._sampled if sampled else self._base).amend(seconds)
        if self._walled:
            self._walls.amend(seconds)
            (self._walls_sampled if sampled else self._walls_base).amend(seconds)

    def _extra(self) -> float | None:
        """What a sampled step costs more than an unsampled one: what our timers saw, or, where
        larger, what the step felt, the median wall-clock sampled step less the median unsampled
        one (our timers miss what our passes cost the training step around them: the caches
        they evict, the memory they allocate; on a CPU at a thousand tensors that was a third
        again). None before a sampled step is measured."""
        if self._sampled_cost is None:
            return None
        timed = max(self._sampled_cost - (self._base_cost or 0.0), 0.0)
        ws, wb = self._walls_sampled.value, self._walls_base.value
        return timed if ws is None or wb is None else max(timed, ws - wb)

    def _choose_k(self) -> int:
        """The next sampling interval (see the module docstring), moved gradually.

        When the every-step work alone already takes (nearly) all of the share aimed at (a tiny
        model, a large one on the CPU, where the NaN/Inf probe is a pass over every gradient),
        sampling less cannot fix that: the interval then keeps the statistics' own extra cost
        within ``MIN_ROOM`` of that share, on top of it (it once gave them the whole share again,
        doubling the cost of such a run). It at most doubles from one sampled step to the next, and stays
        short enough for about one snapshot a second, so the dashboard never goes quiet, as long as
        that fits in the whole budget; past that the budget wins (the loss and the flight recorder's
        every-step values still come every step)."""
        extra = self._extra()
        if self._wall is None or extra is None:
            return 1
        base = self._base_cost if self._base_cost is not None else 0.0
        if extra <= 0:
            return 1
        # aim at half the budget: our timers see our own work, not what it costs the training step
        # around it (caches evicted by our passes over the gradients and parameters), which the
        # benchmark (bench/overhead.py) measures at about as much again; a sampled step's share
        # of that is in `extra` (its wall-clock step against an unsampled one), the every-step
        # work's cannot be measured (no step runs without it)
        target = SAFETY * self.budget * self._wall
        room = max(target - base, MIN_ROOM * target)
        k = math.ceil(extra / room)
        # about a snapshot a second where that fits in the whole budget (the interval above aims at
        # half of it); where it does not (a large model's statistics on a CPU: 90 ms and more a
        # sampled step), as often as the whole budget allows: the budget is what `attach` promises
        whole = self.budget * self._wall
        k_whole = math.ceil(extra / max(whole - base, MIN_ROOM * whole))
        k = min(k, max(int(1.0 / self._wall), k_whole), 2 * self.k)
        return max(1, min(MAX_EVERY, k))

    @property
    def costs(self) -> dict[str, float | None]:
        """Recent medians in seconds: the wall-clock step, the inspector's time on a sampled and on
        an unsampled step."""
        return {"step_s": self._wall, "sampled_s": self._sampled_cost, "unsampled_s": self._base_cost}

    @property
    def overhead(self) -> float | None:
        """Measured fraction of the wall-clock step spent inside the inspector (recent medians)."""
        if self._ours is None or not self._wall:
            return None
        base = self._base_cost if self._base_cost is not None else self._ours
        extra = self._extra()
        per_step = base + (extra or 0.0) / self.k  # what this cadence costs per step
        return per_step / self._wall


class Pack:
    """Named 1-D float32 segments gathered on device, moved to the host in one transfer."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._parts: list[Tensor] = []

    def add(self, name: str, values: Tensor | list[Tensor]) -> None:
        if isinstance(values, list):
            if not values:
                return
            try:  # the common case (0-dim norms, counts on one device): one op
                values = torch.stack(values)
            except RuntimeError:  # mixed devices or shapes of one element
                dev = values[0].device
                values = torch.stack([v.reshape(()).to(dev, torch.float32) for v in values])
        if values.dim() != 1:
            values = values.reshape(-1)
        part = values if values.dtype == torch.float32 else values.float()
        # a name only with its part: a conversion that raises leaves the pack as it was
        self._names.append(name)
        self._parts.append(part)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def flat(self) -> Tensor | None:
        """Every segment in one 1-D float32 tensor on the first segment's device (None: empty)."""
        if not self._parts:
            return None
        parts = self._parts
        if len(parts) == 1:
            return parts[0]
        try:
            return torch.cat(parts)
        except RuntimeError:  # on several devices: gathered on the first one's (no host read)
            dev = parts[0].device
            return torch.cat([p.to(dev) for p in parts])

    def unflatten(self, host: list[float]) -> dict[str, list[float]]:
        """The host values of :meth:`flat`, split back into the named segments."""
        out, i = {}, 0
        for name, part in zip(self._names, self._parts, strict=True):
            n = part.numel()
            out[name] = host[i : i + n]
            i += n
        return out

    def transfer(self) -> dict[str, list[float]]:
        """Move every segment to the host in one ``.tolist()``: the one sync point of a snapshot."""
        flat = self.flat()
        return {} if flat is None else self.unflatten(flat.tolist())
