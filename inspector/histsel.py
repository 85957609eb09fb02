"""Which parameters get histograms, and which steps: the script's choice and each consumer's, capped.

Histograms cost a pass over each chosen gradient (two with a pre_step hook), so at most
``HIST_CAP`` parameters get them, every ``hist_every``-th sampled step (and on the first sampled
step after the choice changed). Also the optimizer's learning rates, which a snapshot carries.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["HIST_BINS", "HIST_CAP", "HistSelection", "learning_rates"]

HIST_CAP = 8  # at most this many parameters get histograms
HIST_BINS = 64


class HistSelection:
    """Which parameters get histograms: the script's choice and each consumer's, capped."""

    def __init__(self, params: list[str], every: int) -> None:
        self._params = params
        self._every = every
        self._user: list[str] = []
        self._subs: dict[str, list[str]] = {}
        self._force = False  # a change: histograms on the next sampled step

    def set(self, key: str, names: list[str]) -> None:
        """``key`` "" is the script's own list; ``[]`` drops a consumer."""
        if key == "":
            self._user = list(names)
        elif names:
            self._subs[key] = list(names)
        else:
            self._subs.pop(key, None)
        self._force = True

    @property
    def names(self) -> list[str]:
        """The capped union, in the order the parameters were asked for."""
        out: list[str] = []
        for n in [*self._user, *(n for v in self._subs.values() for n in v)]:
            if n not in out:
                out.append(n)
        return out[:HIST_CAP]

    def due(self, sampled_count: int) -> list[int]:
        """The parameter indices that get histograms on this sampled step (the ``sampled_count``-th):
        every ``every`` sampled steps, or the first one after a change; else none."""
        names = self.names
        if not names:
            return []
        due = self._force or (sampled_count - 1) % self._every == 0
        self._force = False
        return [self._params.index(n) for n in names] if due else []


def learning_rates(optimizer: Any) -> list[float]:
    """Each param group's learning rate (NaN where it is not a number)."""
    lr = []
    if optimizer is not None:
        for g in optimizer.param_groups:
            try:
                lr.append(float(g.get("lr", math.nan)))
            except (TypeError, ValueError):
                lr.append(math.nan)
    return lr
