"""Which parameters get histograms, and which steps: the script's choice and each consumer's, capped.

Histograms cost a pass over each chosen gradient (two with a pre_step hook), so at most
``HIST_CAP`` parameters get them, every ``hist_every``-th sampled step (and on the first sampled
step after the choice changed). A ``pre_step`` hook that edits a gradient in place makes its raw
histogram need a copy of the raw gradient until the final one is taken: those copies stay within
the largest parameter's bytes (at least ``COPY_FLOOR``), and the other edited parameters get
their histograms on the next sampled steps, in turn (:meth:`HistSelection.within_budget`; not
under FSDP2, where each rank copies its shards and every rank takes rank 0's choice). Also
the optimizer's learning rates, which a snapshot carries.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["COPY_FLOOR", "HIST_BINS", "HIST_CAP", "HistSelection", "learning_rates"]

HIST_CAP = 8  # at most this many parameters get histograms
HIST_BINS = 64
COPY_FLOOR = 1 << 20  # bytes of raw copies for histograms always allowed (a small model's: all)


class HistSelection:
    """Which parameters get histograms: the script's choice and each consumer's, capped."""

    def __init__(self, params: list[str], every: int) -> None:
        self._params = params
        self._every = every
        self._user: list[str] = []
        self._subs: dict[str, list[str]] = {}
        self._force = False  # a change: histograms on the next sampled step
        self._carry: list[int] = []  # edited parameters whose histogram the copy budget put off

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
        every ``every`` sampled steps, or the first one after a change; else none. Those the copy
        budget put off last time come first, on this step whether it is due or not."""
        names = self.names
        carry, self._carry = self._carry, []
        if not names:
            return []
        due = self._force or (sampled_count - 1) % self._every == 0
        self._force = False
        chosen = [self._params.index(n) for n in names]
        ahead = [i for i in carry if i in chosen]  # put off last time (and still chosen): first
        return [*ahead, *(i for i in chosen if i not in ahead)] if due else ahead

    def within_budget(self, indices: list[int], edited: set[int], tensors: list[Any]) -> list[int]:
        """Of this step's histograms, those whose raw copies (of the ``edited`` parameters) fit the
        copy budget, in order: the largest parameter's bytes, at least ``COPY_FLOOR``, and always
        the first. The others are put off to the next sampled step (see the module docstring)."""
        budget = max(COPY_FLOOR, max((t.numel() * t.element_size() for t in tensors), default=0))
        kept, used = [], 0
        for i in indices:
            if i in edited and tensors[i].grad is not None:  # (no gradient this step: nothing copied)
                size = tensors[i].numel() * tensors[i].element_size()
                if used and used + size > budget:
                    self._carry.append(i)
                    continue
                used += size
            kept.append(i)
        return kept


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
